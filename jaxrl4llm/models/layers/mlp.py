"""SwiGLU feed-forward block: y = (silu(x W_gate) * (x W_up)) W_down (Shazeer 2020, arXiv 2002.05202)."""

from __future__ import annotations

import jax
from flax import nnx

from jaxrl4llm.models.layers.linear import Linear, LoraSettings


def swiglu_gate(g: jax.Array, u: jax.Array) -> jax.Array:
    """silu(g) * u, elementwise."""
    return jax.nn.silu(g) * u


class MLP(nnx.Module):
    """gate_proj, up_proj [D, F] ("embed", "mlp"); down_proj [F, D] ("mlp", "embed")."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, param_dtype, rngs: nnx.Rngs,
                 lora: LoraSettings | None = None, exact: bool = False):
        def linear(name, spec, shape, axes):
            adapter = lora if lora is not None and name in lora.targets else None
            return Linear(spec, shape, axes, dtype=dtype, param_dtype=param_dtype, rngs=rngs, lora=adapter, name=name,
                          exact=exact)

        self.gate_proj = linear("gate_proj", "btd,df->btf", (hidden, intermediate), ("embed", "mlp"))
        self.up_proj = linear("up_proj", "btd,df->btf", (hidden, intermediate), ("embed", "mlp"))
        self.down_proj = linear("down_proj", "btf,fd->btd", (intermediate, hidden), ("mlp", "embed"))

    def gate_up(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        """h [B, T, D] -> (h W_gate, h W_up), each [B, T, F] float32."""
        return self.gate_proj(h), self.up_proj(h)

    def down(self, a: jax.Array) -> jax.Array:
        """a [B, T, F] -> a W_down [B, T, D] float32."""
        return self.down_proj(a)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.down(swiglu_gate(*self.gate_up(h)))
