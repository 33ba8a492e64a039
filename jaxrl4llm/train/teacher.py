"""On-policy distillation's teacher: a frozen model of the student's tokenizer that scores the
student's sampled tokens in the trainer's log-prob pass (`teacher` section, train/config.py).

    teacher = load_teacher(cfg, mesh, student_tokenizer)     # None without teacher.model
    programs = trainer_programs(..., teacher=teacher)        # programs.teacher_pass
    batch = batch._replace(teacher_logp=programs.teacher_pass(teacher.params, batch) * batch.loss_mask)

The teacher is any size (more layers, wider) of any architecture `models.load_pretrained` reads;
its own graphdef, its parameters in `teacher.dtype` sharded on the trainer's mesh by the same rules
as the student's, no optimizer state. Its tokenizer must give every token the student's id
(`check_same_vocabulary`: ids compared, not names): d_t = log pi(y_t) - log pi_T(y_t) compares two
models' probabilities of one token id.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from flax import nnx

from jaxrl4llm.models import load_pretrained, load_tokenizer
from jaxrl4llm.models.hub import HubFilesMissing, resolve_model
from jaxrl4llm.train.config import ConfigError, RunConfig
from jaxrl4llm.train.policy import make_logprob_fn


@dataclasses.dataclass(frozen=True)
class Teacher:
    """A loaded teacher: its ModelConfig, graphdef and frozen parameters (nnx.State on the trainer's
    mesh, or ShapeDtypeStructs with shardings for `plan`), and how its pass scores."""

    config: Any  # jaxrl4llm.models.ModelConfig
    graphdef: Any
    params: Any
    temperature: float = 1.0
    chunk_size: int = 64

    @property
    def logprob_fn(self):
        """(params, inputs, targets, positions, attention_mask, last=None, group=1, segment_ids=None)
        -> (logp, entropy) [B, L] of the teacher at `temperature` (`train.policy.make_logprob_fn`)."""
        return make_logprob_fn(self.graphdef, self.temperature, self.chunk_size)


def check_teacher_needed(cfg: RunConfig) -> None:
    """A recipe that distills (distill_coef > 0) without `teacher.model`: a one-line ConfigError naming the fix."""
    recipe = cfg.recipe()
    if recipe.distills and not cfg.teacher.model:
        raise ConfigError(f"algorithm.preset={cfg.algorithm.preset!r} distills from a teacher "
                          f"(distill_coef={recipe.distill_coef}) but teacher.model is not set; set teacher.model "
                          f"to a folder or Hub id of the student's tokenizer, or algorithm.overrides.distill_coef=0.")


def teacher_folder(cfg: RunConfig) -> Path:
    """The local folder of `teacher.model` (a gs:// copy or the Hub cache's snapshot); a missing one
    is a one-line ConfigError naming the fix."""
    name = cfg.teacher.model
    try:
        path = resolve_model(name)
    except HubFilesMissing as e:
        raise ConfigError(f"teacher.model={name!r}: {e}") from None
    if not Path(path).is_dir():
        raise ConfigError(f"teacher.model={name!r} is not a folder; point it at a Hugging Face checkpoint folder "
                          f"(config.json + *.safetensors + tokenizer, local or gs://) or a Hub id "
                          f"(org/name[@revision]), or set teacher.model=null (no distillation).")
    return Path(path)


def check_same_vocabulary(student_tokenizer, teacher_tokenizer, student_name: str, teacher_name: str) -> None:
    """ConfigError (one line, naming both) unless every token has the same id in both tokenizers."""
    student, teacher = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    differ = sorted(t for t in student.keys() | teacher.keys() if student.get(t) != teacher.get(t))
    if differ:
        token = differ[0]
        raise ConfigError(
            f"teacher.model={teacher_name!r} has another tokenizer than the student's ({student_name!r}): "
            f"{len(differ)} of {len(student)} token ids differ (e.g. {token!r}: {student.get(token)} for the student, "
            f"{teacher.get(token)} for the teacher); distill from a teacher of the student's tokenizer (its family), "
            f"or set teacher.model=null.")


def load_teacher(cfg: RunConfig, mesh, student_tokenizer) -> Teacher | None:
    """`teacher.model` loaded frozen in `teacher.dtype` (weights and compute) onto `mesh`, after its
    tokenizer is checked against the student's (`check_same_vocabulary`); None without a teacher."""
    check_teacher_needed(cfg)
    t = cfg.teacher
    if not t.model:
        return None
    path = teacher_folder(cfg)
    try:
        teacher_tokenizer = load_tokenizer(path)
    except FileNotFoundError:
        raise ConfigError(f"teacher.model={t.model!r} holds no tokenizer files; its token ids are compared with the "
                          f"student's: copy the teacher's tokenizer files into {path}.") from None
    check_same_vocabulary(student_tokenizer, teacher_tokenizer, cfg.model.tokenizer or cfg.model.path or "?", t.model)
    model = load_pretrained(path, dtype=t.dtype, param_dtype=t.dtype, mesh=mesh, attention_impl=cfg.model.attention_impl)
    graphdef, params = nnx.split(model)
    return Teacher(config=model.config, graphdef=graphdef, params=params, temperature=t.temperature,
                   chunk_size=t.logprob_chunk_size)
