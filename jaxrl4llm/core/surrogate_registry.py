"""The surrogate table: `Recipe.surrogate` names a row, `policy_loss` and the train step's clip flags
call it.

A row is one function and, optionally, the recipe checks that belong to it:

    loss_fn(recipe, logp, old_logp, advantages, mask) -> SurrogateOutput(loss [B, T], stats, clipped [B, T])
    check(recipe) -> list[str]        the recipe's problems with this surrogate ([] when none)

`loss_fn` reads its knobs from the recipe (a frozen `core.recipes.Recipe`; or closes over its own
constants). `register_surrogate(name, loss_fn, check=check)` adds a row, from a notebook as well as
from here; `Recipe` then accepts `surrogate=name` and runs `check` when it is built. The lookup is
by name when a loss is traced, so the recipe stays a hashable static argument of the jitted step;
a jitted function already traced for a recipe keeps the function it found then.

Built in:
  "ppo"    ppo_clip_loss: PPO clip, Clip-Higher, dual clip, GSPO / GSPO-token
           (recipe.eps_low, eps_high, dual_clip, ratio_level)
  "cispo"  cispo_loss: clipped, detached IS weight (recipe.eps_low, eps_high, cispo_cap_mode)
  "sapo"   sapo_loss: soft sigmoid gate (recipe.sapo_tau_pos, sapo_tau_neg)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import chex

from jaxrl4llm.core.surrogate import (
    CISPO_CAP_MODES, SurrogateOutput, SurrogateStats, cispo_loss, ppo_clip_loss, sapo_loss,
)

# (recipe, logp [B, T], old_logp [B, T], advantages [B] or [B, T], mask [B, T]) -> SurrogateOutput
SurrogateFn = Callable[[Any, chex.Array, chex.Array, chex.Array, chex.Array], SurrogateOutput]
# recipe -> its problems with the surrogate (Recipe's validation lists them)
RecipeCheck = Callable[[Any], list[str]]


class RegisteredSurrogate(NamedTuple):
    """One row of the table: the surrogate's name, its loss function and its recipe check (or None)."""

    name: str
    loss_fn: SurrogateFn
    check: RecipeCheck | None = None


_TABLE: dict[str, RegisteredSurrogate] = {}


def register_surrogate(name: str, loss_fn: SurrogateFn, *, check: RecipeCheck | None = None,
                       replace: bool = False) -> RegisteredSurrogate:
    """Adds `name` -> (loss_fn, check) to the table, so that `Recipe(surrogate=name)` trains with it.

    Args:
      name: the value of Recipe.surrogate that selects it.
      loss_fn: (recipe, logp, old_logp, advantages, mask) -> SurrogateOutput; arrays [B, T]
        (advantages [B] or [B, T]); mask already holds the recipe's row weights.
      check: recipe -> list of problems (strings such as "eps_high=0.1 must exceed ..."), run
        when a Recipe naming this surrogate is built; None: no checks.
      replace: allow replacing a registered name (a jitted function that already traced the old
        one keeps it: make a new one).

    Returns:
      the RegisteredSurrogate row.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a surrogate's name is a non-empty string, got {name!r}.")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn of surrogate {name!r} must be callable, got {loss_fn!r}.")
    if name in _TABLE and not replace:
        raise ValueError(f"a surrogate named {name!r} is registered already; pass replace=True to replace it.")
    row = RegisteredSurrogate(name, loss_fn, check)
    _TABLE[name] = row
    return row


def surrogate_names() -> tuple[str, ...]:
    """The registered names, in registration order (the built-in ones first)."""
    return tuple(_TABLE)


def registered_surrogate(name: str) -> RegisteredSurrogate:
    """The row registered under `name`; an unknown name is a ValueError that lists the registered ones."""
    if name not in _TABLE:
        raise ValueError(f"unknown surrogate {name!r} (registered: {', '.join(_TABLE)}); "
                         "add one with core.register_surrogate(name, loss_fn).")
    return _TABLE[name]


def surrogate_problems(recipe: Any) -> list[str]:
    """What is wrong with `recipe.surrogate` for this recipe: an unknown name, or its row's check."""
    if recipe.surrogate not in _TABLE:
        return [f"surrogate={recipe.surrogate!r} (valid: {', '.join(_TABLE)})"]
    check = _TABLE[recipe.surrogate].check
    return [] if check is None else list(check(recipe))


def apply_surrogate(recipe: Any, logp: chex.Array, old_logp: chex.Array, advantages: chex.Array,
                    mask: chex.Array) -> SurrogateOutput:
    """S(r, A) of recipe.surrogate, looked up by name: its per-token loss, statistics and clip flags.

    Args:
      recipe: a Recipe (static); recipe.surrogate names a registered surrogate.
      logp, old_logp: [B, T] current / behaviour-policy log-probs of the sampled tokens.
      advantages: [B] or [B, T].
      mask: [B, T] counted tokens (row weights applied).

    Returns:
      SurrogateOutput(loss [B, T] float32, SurrogateStats, clipped [B, T] bool), checked.
    """
    row = registered_surrogate(recipe.surrogate)
    out = row.loss_fn(recipe, logp, old_logp, advantages, mask)
    if not isinstance(out, SurrogateOutput) or not isinstance(out.stats, SurrogateStats):
        raise TypeError(f"surrogate {row.name!r} must return SurrogateOutput(loss, SurrogateStats, clipped), "
                        f"got {type(out).__name__}.")
    chex.assert_equal_shape([out.loss, out.clipped, logp])
    return out


# ----------------------------------------------------------------------------- built-in rows


def _ppo_from_recipe(recipe, logp, old_logp, advantages, mask) -> SurrogateOutput:
    return ppo_clip_loss(logp, old_logp, advantages, mask, eps_low=recipe.eps_low, eps_high=recipe.eps_high,
                         dual_clip=recipe.dual_clip, ratio_level=recipe.ratio_level)


def _cispo_from_recipe(recipe, logp, old_logp, advantages, mask) -> SurrogateOutput:
    return cispo_loss(logp, old_logp, advantages, mask, eps_low=recipe.eps_low, eps_high=recipe.eps_high,
                      cap_mode=recipe.cispo_cap_mode)


def _sapo_from_recipe(recipe, logp, old_logp, advantages, mask) -> SurrogateOutput:
    return sapo_loss(logp, old_logp, advantages, mask, tau_pos=recipe.sapo_tau_pos, tau_neg=recipe.sapo_tau_neg)


def _token_level_problems(recipe) -> list[str]:
    """CISPO and SAPO use the token ratio and no dual clip: ratio_level and dual_clip are PPO's knobs."""
    problems = []
    if recipe.ratio_level != "token":
        problems.append(f"ratio_level={recipe.ratio_level!r} needs surrogate='ppo' "
                        f"(surrogate={recipe.surrogate!r} is token-level)")
    if recipe.dual_clip is not None:
        problems.append(f"dual_clip={recipe.dual_clip} needs surrogate='ppo' (got surrogate={recipe.surrogate!r})")
    return problems


def _cispo_problems(recipe) -> list[str]:
    problems = _token_level_problems(recipe)
    if recipe.cispo_cap_mode not in CISPO_CAP_MODES:
        problems.append(f"cispo_cap_mode={recipe.cispo_cap_mode!r} (valid: {', '.join(CISPO_CAP_MODES)})")
    hi = 1.0 + recipe.eps_high if recipe.cispo_cap_mode == "relative" else recipe.eps_high
    if hi <= max(1.0 - recipe.eps_low, 0.0):
        problems.append(
            f"eps_high={recipe.eps_high} with cispo_cap_mode={recipe.cispo_cap_mode!r} gives an IS-weight cap {hi} "
            f"not above the lower bound {max(1.0 - recipe.eps_low, 0.0)}"
        )
    return problems


def _sapo_problems(recipe) -> list[str]:
    problems = _token_level_problems(recipe)
    if recipe.sapo_tau_pos <= 0 or recipe.sapo_tau_neg <= 0:
        problems.append(f"sapo_tau_pos/sapo_tau_neg must be > 0, got {recipe.sapo_tau_pos}/{recipe.sapo_tau_neg}")
    return problems


register_surrogate("ppo", _ppo_from_recipe)
register_surrogate("cispo", _cispo_from_recipe, check=_cispo_problems)
register_surrogate("sapo", _sapo_from_recipe, check=_sapo_problems)
