"""The policy a run trains: model config + parameters + tokenizer + mesh, and the three things the
loop asks of it (sample, score tokens, export). Parameters are the train state's pytree: the
sampler reads them as they are, with no host round trip or format conversion.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from jaxrl4llm.train.config import ConfigError, RunConfig


@dataclasses.dataclass(frozen=True)
class Policy:
    config: Any  # jaxrl4llm.models.ModelConfig
    params: Any
    tokenizer: Any
    mesh: Mesh | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    temperature: float
    chunk_size: int
    cpu_kernels: bool | None = None  # generate(cpu_kernels=): None = auto

    def with_params(self, params) -> "Policy":
        return dataclasses.replace(self, params=params)

    @property
    def logprob_fn(self):
        """(params, inputs, targets, positions, attention_mask) -> (logp, entropy) [B, L], at the
        rollout temperature (the distribution the sampler drew from, before top-k/top-p)."""
        from jaxrl4llm.models import token_logprobs

        return functools.partial(_logprobs, token_logprobs, self.config, self.temperature, self.chunk_size)

    def generate(self, prompts, *, num_samples, max_new_tokens, temperature, top_p, top_k, rng, greedy=False):
        from jaxrl4llm.sampling import generate

        return generate(
            self.params, self.config, prompts, num_samples=num_samples, max_new_tokens=max_new_tokens,
            temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=top_k,
            eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id, rng=rng, mesh=self.mesh,
            greedy=greedy or temperature <= 0, cpu_kernels=self.cpu_kernels,
        )

    def decode(self, rollout) -> list[str]:
        from jaxrl4llm.sampling import decode_responses

        return decode_responses(rollout, self.tokenizer)

    def decode_ids(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def export(self, path: str | Path) -> Path:
        """Writes an HF folder (config.json, safetensors, tokenizer) loadable by transformers/vLLM."""
        from jaxrl4llm.models import save_pretrained

        path = Path(path)
        save_pretrained(self.config, self.params, path)
        self.tokenizer.save_pretrained(str(path))
        return path


def _logprobs(token_logprobs, config, temperature, chunk_size, params, inputs, targets, positions, attention_mask):
    return token_logprobs(params, config, inputs, targets, positions=positions, attention_mask=attention_mask,
                          temperature=temperature if temperature > 0 else 1.0, chunk_size=chunk_size)


def _eos_ids(tokenizer, model_config) -> tuple[int, ...]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(model_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(tok) if tok in tokenizer.get_vocab() else None
        if tid is not None:
            ids.add(int(tid))
    if not ids:
        raise ConfigError("The tokenizer defines no EOS token: set eos_token in its tokenizer_config.json.")
    return tuple(sorted(ids))


def load_policy(cfg: RunConfig, mesh: Mesh | None) -> Policy:
    """From `model.path` (an HF folder) or a random model of the configured size + `model.tokenizer`."""
    from jaxrl4llm.models import ModelConfig, init_params, load_pretrained, load_tokenizer, param_shardings

    m = cfg.model
    if m.path:
        if not Path(m.path).is_dir():
            raise ConfigError(f"model.path={m.path!r} is not a folder; point it at a local Hugging Face checkpoint (config.json + *.safetensors).")
        model_config, params = load_pretrained(m.path, dtype=m.dtype, param_dtype=m.param_dtype, mesh=mesh)
        tokenizer = load_tokenizer(m.tokenizer or m.path)
    else:
        if not m.tokenizer:
            raise ConfigError("Set model.path (an HF checkpoint folder) or, for a random model, model.tokenizer (a tokenizer folder).")
        tokenizer = load_tokenizer(m.tokenizer)
        model_config = ModelConfig(
            architecture=m.architecture, vocab_size=len(tokenizer), hidden_size=m.hidden_size,
            intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
            num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, qk_norm=m.architecture == "qwen3",
            attention_bias=m.architecture == "qwen2", tie_word_embeddings=True, max_position_embeddings=4096,
            rope_theta=10000.0, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        params = init_params(model_config, jax.random.PRNGKey(cfg.trainer.seed))
        if mesh is not None:
            params = jax.device_put(params, param_shardings(model_config, mesh))
    if m.remat and not model_config.remat:
        model_config = model_config.replace(remat=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Policy(
        config=model_config, params=params, tokenizer=tokenizer, mesh=mesh, eos_token_ids=_eos_ids(tokenizer, model_config),
        pad_token_id=int(pad), temperature=cfg.rollout.temperature, chunk_size=m.logprob_chunk_size,
        cpu_kernels=None if cfg.rollout.cpu_kernels == "auto" else bool(cfg.rollout.cpu_kernels),
    )

