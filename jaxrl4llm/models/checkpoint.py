"""Hugging Face checkpoint folders (config.json + safetensors) in and out, without torch.

`load_pretrained` memory-maps the safetensors files and builds every parameter directly with
its target sharding (`jax.make_array_from_callback`): each device shard is filled from the
HF tensors of the layers it holds, one layer at a time, so the full model never exists as a
second host copy. A mixture-of-experts layer's experts are read one (layer, expert) HF tensor at a
time (or a slice of transformers 5's fused tensors) into the stacked [L, E, ...] parameter, and
written back one tensor per expert. `save_pretrained` writes HF names and layouts (torch metadata
{"format": "pt"}) that `transformers.AutoModelForCausalLM.from_pretrained` and vLLM read.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from flax import nnx

from jaxrl4llm.models.causal_lm import CausalLM, abstract_model, merge
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.hf_layout import TensorMap, tensor_maps
from jaxrl4llm.models.lora import merge_lora
from jaxrl4llm.models.sharding import DEFAULT_RULES, flat_state, param_shardings

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder that does not hold the weights its config.json describes."""


# ---------------------------------------------------------------------------- helpers
def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file (absolute path) for a single or sharded checkpoint."""
    index = os.path.join(path, INDEX_FILE)
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.isfile(file):
                raise CheckpointError(f"{index} lists {os.path.basename(file)!r}, which is missing from {path!r}")
        return files
    candidates = [single] if os.path.isfile(single) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not candidates:
        raise CheckpointError(
            f"no safetensors weights in {path!r} (expected {SINGLE_FILE} or {INDEX_FILE}; "
            "PyTorch .bin checkpoints are not supported: re-save them with safe_serialization=True)")
    files = {}
    for file in candidates:
        with safe_open(file, framework="flax") as f:
            files.update({name: file for name in f.keys()})
    return files


def _parse_size(size: int | str) -> int:
    """5_000_000_000 | "5GB" | "500MB" | "2GiB" -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B\s*", size.upper().replace("IB", "iB"))
    if not m:
        raise ValueError(f"max_shard_size {size!r}: expected an int or a string like '5GB'")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


# ---------------------------------------------------------------------------- load
def load_pretrained(path: str | os.PathLike, *, dtype="bfloat16", param_dtype="float32",
                    mesh: Mesh | None = None, rules=None, remat: bool = False,
                    remat_policy: str = "full", attention_impl: str = "auto", numerics: str = "default",
                    expert_form: str = "auto") -> CausalLM:
    """Load a local Hugging Face checkpoint folder (Qwen2/2.5, Qwen3, Llama 3, Qwen3-MoE) as an NNX model.

    Args:
      path: folder with config.json and model.safetensors or model.safetensors.index.json.
      dtype: compute dtype (matmul inputs); param_dtype: storage dtype of the parameters. Each
        a string ("bfloat16") or a dtype (jnp.bfloat16).
      mesh, rules: place each parameter with `param_shardings(state, mesh, rules)` (rules
        default DEFAULT_RULES, axes from the parameters' metadata); without a mesh, on the
        default device.
      remat, remat_policy: rematerialise each layer in training, keeping what the policy names
        (`ModelConfig`, models/remat.py). attention_impl: the training forward's attention
        backend (`ModelConfig.attention_impl`). numerics: "default" | "exact" (`ModelConfig.numerics`).
        expert_form: a mixture of experts' expert form (`ModelConfig.expert_form`).
    Returns: the `CausalLM` module of the checkpoint's family (`model.config` is its
      ModelConfig); `graphdef, state = nnx.split(model)` for the functional API.
    Raises: FileNotFoundError (folder / config.json), ConfigError (unsupported config),
      CheckpointError (missing files or tensors, wrong shapes), each naming the file and tensor.
    """
    path = os.fspath(path)
    config = ModelConfig.from_pretrained_dir(path, dtype=dtype, param_dtype=param_dtype, remat=remat,
                                             remat_policy=remat_policy, attention_impl=attention_impl,
                                             numerics=numerics, expert_form=expert_form)
    files = _weight_files(path)
    graphdef, abstract = abstract_model(config)
    if mesh is not None:
        shardings = flat_state(param_shardings(abstract, mesh, rules or DEFAULT_RULES))
    else:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = {key: v.replace(device) for key, v in flat_state(abstract).items()}
    target = np.dtype(jnp.dtype(config.param_dtype))
    cpu = jax.devices("cpu")[0]
    expected = flat_state(abstract)

    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="flax")) for file in sorted(set(files.values()))}

        def source(tm: TensorMap, i: int, e: int) -> tuple[str, tuple[int, int] | None, tuple[int, ...]]:
            """(the tensor holding layer i's (expert e's) HF tensor, its (expert, row start) in a
            fused tensor or None, the shape that tensor must have)."""
            name = tm.hf.format(i=i, e=e)
            if name not in files and tm.fused is not None and tm.fused.hf.format(i=i) in files:
                return tm.fused.hf.format(i=i), (e, tm.fused.start), tm.fused.shape
            return name, None, tm.hf_shape

        def check(tm: TensorMap, i: int, e: int):
            name, _, shape = source(tm, i, e)
            if name not in files:
                fix = "" if not tm.experts else (
                    "; a mixture-of-experts checkpoint holds one tensor per expert "
                    "(model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight) or transformers 5's fused "
                    "model.layers.{i}.mlp.experts.gate_up_proj and .down_proj: re-save it with transformers' "
                    "save_pretrained")
                raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {path!r} "
                                      f"(needed for {tm.ours} of a {config.architecture} model){fix}")
            found = tuple(handles[files[name]].get_slice(name).get_shape())
            if found != shape:
                raise CheckpointError(
                    f"{os.path.basename(files[name])}: tensor {name!r} has shape {found}, expected {shape} "
                    f"from config.json")

        def read(tm: TensorMap, i: int = 0, e: int = 0) -> np.ndarray:
            name, fused, _ = source(tm, i, e)
            with jax.default_device(cpu):
                if fused is None:
                    hf = np.asarray(handles[files[name]].get_tensor(name))
                else:  # expert e's rows of the fused [E, rows, cols] tensor
                    start = fused[1]
                    hf = np.asarray(handles[files[name]].get_slice(name)[e:e + 1, start:start + tm.hf_shape[0]])[0]
            return tm.to_ours(hf).astype(target, copy=False)

        maps = {tm.ours: tm for tm in tensor_maps(config)}
        if set(maps) != set(expected):  # the HF table must cover the module exactly (a bug here, not in the folder)
            raise RuntimeError(f"hf_layout and the {config.architecture} module disagree on "
                               f"{sorted(set(maps) ^ set(expected))}")
        for tm in maps.values():  # validate everything before allocating anything
            for i in range(config.num_layers if tm.stacked else 1):
                for e in range(max(tm.experts, 1)):
                    check(tm, i, e)

        def build(key: str):
            tm = maps[key]

            def shard(index):
                if not tm.stacked:
                    return read(tm)[index]
                layers = range(config.num_layers)[index[0]]
                if tm.experts:  # [L, E, ...]: this shard's layers x experts, one HF tensor each
                    experts = range(tm.experts)[index[1]]
                    return np.stack([np.stack([read(tm, i, e)[index[2:]] for e in experts]) for i in layers])
                return np.stack([read(tm, i)[index[1:]] for i in layers])

            return jax.make_array_from_callback(tuple(expected[key].shape), shardings[key].get_value(), shard)

        state = nnx.from_flat_state([(path_key, v.replace(build("/".join(map(str, path_key)))))
                                     for path_key, v in nnx.to_flat_state(abstract)])
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------- save
def _host_array(x: jax.Array) -> jax.Array:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return multihost_utils.process_allgather(x, tiled=True)
    return x


def save_pretrained(model: nnx.Module, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                    dtype=None) -> None:
    """Write a Hugging Face checkpoint folder: config.json + safetensors (HF names and layouts).

    Args:
      model: a `CausalLM` (LoRA adapters are merged into the weights first: the folder is a
        plain model), or its (graphdef, state) pair. path: output folder (created).
      max_shard_size: bytes per safetensors file (int or "5GB"); more than one file adds
        model.safetensors.index.json. dtype: saved dtype (default: config.param_dtype).
    In multi-process runs every process must call this; process 0 writes.
    """
    if isinstance(model, tuple):
        model = merge(*model)
    if not isinstance(model, CausalLM):
        raise TypeError(f"save_pretrained writes jaxrl4llm CausalLM models, got {type(model).__name__}")
    config = model.config
    graphdef, state = nnx.split(model)
    if model.lora_settings is not None:
        graphdef, state = jax.jit(merge_lora, static_argnums=0)(graphdef, state)
    params = flat_state(state)
    path = os.fspath(path)
    dtype = jnp.dtype(dtype or config.param_dtype).name
    np_dtype = np.dtype(jnp.dtype(dtype))
    limit = _parse_size(max_shard_size)
    maps = tensor_maps(config)
    expected = flat_state(abstract_model(config)[1])

    entries = []  # (hf name, TensorMap, (layer, expert) index into ours (() when not stacked), nbytes)
    for tm in maps:
        nbytes = math.prod(tm.hf_shape) * np_dtype.itemsize
        found = tuple(params[tm.ours].shape)
        if found != tuple(expected[tm.ours].shape):
            raise CheckpointError(f"{tm.ours} has shape {found}, expected {tuple(expected[tm.ours].shape)} "
                                  f"from the config")
        for i in range(config.num_layers if tm.stacked else 1):
            for e in range(max(tm.experts, 1)):
                at = ((i, e) if tm.experts else (i,)) if tm.stacked else ()
                entries.append((tm.hf.format(i=i, e=e), tm, at, nbytes))

    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry[3] > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry[3]

    writer = jax.process_index() == 0
    if writer:
        os.makedirs(path, exist_ok=True)
    hosted = {tm.ours: _host_array(params[tm.ours].get_value()) for tm in maps}
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for file, shard in zip(names, shards):
        tensors = {}
        for name, tm, at, _ in shard:
            value = hosted[tm.ours][at]
            tensors[name] = np.ascontiguousarray(tm.to_hf(np.asarray(jax.device_get(value))).astype(np_dtype))
            weight_map[name] = file
        if writer:
            save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
    if not writer:
        return
    if len(shards) > 1:
        total = sum(e[3] for e in entries)
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf_config = config.to_hf_dict(torch_dtype=dtype)
    hf_config["dtype"] = dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
