"""What the GPU kernel tests (`@pytest.mark.gpu`, run on a GPU by `pytest -m gpu`) share: whether
Pallas runs a kernel in its interpreter, the bf16 tolerances, and the float64 numpy references.

On a GPU backend the Triton kernels run for real (bf16 at Qwen3 shapes: head_dim 128, 16-row dots);
on any other backend Pallas' interpreter runs the same kernel body (slowly: shapes stay small).
"""

import functools

import jax
import numpy as np

# bf16 tolerance of a kernel or the XLA path against a float64 reference on the same bf16-rounded
# inputs: bf16 keeps 8 significant bits (relative rounding 2^-8 = 0.4%); the probabilities (and, in
# the backward, dS) are rounded to bf16 before their matmuls, and the outputs are bf16. The absolute
# part is relative to the largest reference magnitude: |got - ref| <= ATOL max|ref| + RTOL |ref|.
BF16_RTOL = 2e-2
BF16_ATOL = 2e-2


def pallas_interpret() -> bool:
    """Whether a Pallas GPU (Triton) kernel must run in the interpreter: everywhere but on a GPU."""
    return jax.default_backend() != "gpu"


def assert_close_bf16(got, ref, what: str = ""):
    """got == ref to bf16 rounding (`BF16_RTOL`, `BF16_ATOL` of max|ref|)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    np.testing.assert_allclose(got, ref, rtol=BF16_RTOL, atol=BF16_ATOL * max(np.abs(ref).max(), 1e-30),
                               err_msg=what)


def bf16_normal(rng: np.random.Generator, shape) -> np.ndarray:
    """Standard normal values rounded to bf16, as float64 (the inputs both the kernel and the reference see)."""
    return np.asarray(jax.numpy.asarray(rng.standard_normal(shape), jax.numpy.bfloat16), np.float64)


def segment_attention_reference(q, k, v, segment_ids, d_out):
    """float64 causal attention within segments and its gradients, numpy:

        O = softmax(Q K^T / sqrt(Dh) ; s <= t, same segment) V;  for L = sum(O * dO):
        dV = P^T dO,  dS = P (dO V^T - rowsum(dO O)),  dQ = dS K / sqrt(Dh),  dK = dS^T Q / sqrt(Dh)
    (summed over the G query heads of a kv head). q, d_out [B, T, H, Dh]; k, v [B, T, KVH, Dh];
    segment_ids [B, T]. Returns (O, dQ, dK, dV) float64.
    """
    q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
    b, t, h, dh = q.shape
    kvh = k.shape[2]
    g = h // kvh
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scale = dh**-0.5
    ids = np.asarray(segment_ids)
    allowed = np.tril(np.ones((t, t), bool))[None] & (ids[:, :, None] == ids[:, None, :])  # [B, T, S]
    s = np.einsum("bthd,bshd->bhts", q, kr) * scale
    s = np.where(allowed[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshd->bthd", p, vr)
    dv = np.einsum("bhts,bthd->bshd", p, d_out)
    dp = np.einsum("bthd,bshd->bhts", d_out, vr)
    ds = p * (dp - np.einsum("bthd,bthd->bht", d_out, out)[..., None])
    dq = np.einsum("bhts,bshd->bthd", ds, kr) * scale
    dk = np.einsum("bhts,bthd->bshd", ds, q) * scale
    fold = lambda x: x.reshape(b, t, kvh, g, dh).sum(3)
    return out, dq, fold(dk), fold(dv)


def paged_attention_reference(q, pool, table, lengths):
    """float64 decode attention of each slot over its first `lengths` tokens, read from the pages of
    its `table` row: out = softmax(q K^T / sqrt(Dh)) V (0 for an idle slot).

    q [S, KVH, G, Dh]; pool [pages, page, 2 KVH, Dh] (key of head h at column 2h, value at 2h + 1);
    table [S, W]; lengths [S]. Returns [S, KVH, G, Dh] float64.
    """
    q, pool = np.asarray(q, np.float64), np.asarray(pool, np.float64)
    s, kvh, g, dh = q.shape
    out = np.zeros(q.shape)
    for i in range(s):
        n = int(lengths[i])
        if n == 0:
            continue
        tokens = pool[np.asarray(table[i])].reshape(-1, kvh, 2, dh)[:n]  # [n, KVH, k|v, Dh]
        scores = np.einsum("khe,nke->khn", q[i], tokens[:, :, 0]) * dh**-0.5
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[i] = np.einsum("khn,nke->khe", probs, tokens[:, :, 1])
    return out


@functools.cache
def abstract_h100():
    """One abstract H100 (jax's CUDA plugin, no GPU needed), the same device object for every argument
    of a program (each topology built anew has devices of its own, which one jit refuses to mix)."""
    from jaxrl4llm.plan.gpu import gpu_topology_devices

    return gpu_topology_devices("h100:1")[0]


def h100_spec(shape, dtype=np.float32):
    """An abstract argument on an abstract H100 (no GPU needed): for `compile_for_h100`."""
    from jax.sharding import SingleDeviceSharding

    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(abstract_h100()))


def compile_for_h100(fn, *args) -> None:
    """Lower `fn(*args)` (args from `h100_spec`) through Pallas' Triton lowering and compile it for
    sm_90a on this CPU with jax's CUDA plugin: what Triton takes that the interpreter does not check
    (no slice of a loaded value, power-of-two tiles). Needs the `gpu` or `gpu13` extra."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    kind = abstract_h100().device_kind
    h100 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind=kind, num_cores=None, platform="cuda"))
    with use_abstract_mesh(h100):  # Pallas' Triton lowering reads the GPU's kind from it
        lowered = jax.jit(fn).trace(*args).lower()
    assert "__gpu$xla.gpu.triton" in lowered.as_text(), "no Triton kernel in the lowered program"
    lowered.compile()
