"""`gpu_paged_attention`'s rules: how the Triton paged attention cuts a slot's pages
(`kernel_blocks`) and lays out its grid (`kernel_layout`, `program_shape`, `dot_rows`); its kernel
body against JAX's, and its compile for an H100 (the kernel's values: tests/sampling/test_continuous.py,
in Pallas' interpreter and, marked gpu, on a chip)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.plan.gpu import missing_gpu_packages
from jaxrl4llm.sampling.gpu_paged_attention import (GRID_TARGET, LAYOUTS, PAGES_PER_BLOCK, SPLIT_RULES,
                                                     combine_partitions, dot_rows, kernel_blocks, kernel_layout,
                                                     partition_pages, program_shape)
from tests.gpu_kernels import compile_for_h100, h100_spec


@given(st.integers(1, 300), st.integers(1, 256), st.integers(1, 16), st.sampled_from([1, 2, 4, 8, 16]),
       st.one_of(st.none(), st.integers(1, 64)))
def test_the_padded_table_holds_every_page_in_whole_blocks_and_partitions(pages, slots, kv_heads, per_block, splits):
    block, k, padded = kernel_blocks(pages, slots, kv_heads, per_block, splits)
    assert block & (block - 1) == 0 and block <= min(per_block, pages) < 2 * block  # Triton's power of two
    assert block == per_block or block > pages // 2
    assert splits is None or k == splits
    assert padded % (block * k) == 0 and pages <= padded < pages + block * k  # the least padding
    if splits is None:  # the default: about GRID_TARGET programs, never a partition without a block
        blocks = -(-pages // block)
        assert 1 <= k <= blocks and (k == blocks or slots * kv_heads * k <= max(GRID_TARGET, slots * kv_heads))


def test_a_three_page_table_reads_two_pages_a_step():
    """A slot's table of 3 pages (prompt and response within 48 tokens) made a 3-page block, a
    48-token Triton block the GPU refuses to compile (powers of two only); now 2 pages a step, and a
    block size that is no power of two is an error naming the rule."""
    assert kernel_blocks(3, 8, 8)[0] == 2 and kernel_blocks(3, 8, 8, k_splits=1) == (2, 1, 4)
    with pytest.raises(ValueError, match="pages_per_block=3: a power of two"):
        kernel_blocks(64, 8, 8, 3)


def test_a_prime_page_count_still_splits():
    """A table of 69 pages (69 = 3 x 23) used to find no split (blocks had to divide the table): a
    slot's longest row ran in one program. The table is now padded to whole blocks and partitions."""
    assert kernel_blocks(69, 64, 8) == (PAGES_PER_BLOCK, GRID_TARGET // (64 * 8), 80)  # 4 partitions of 20 pages
    with pytest.raises(ValueError, match="k_splits=0"):
        kernel_blocks(69, 64, 8, k_splits=0)


@given(st.integers(1, 16), st.integers(1, 16), st.sampled_from(LAYOUTS))
def test_a_layout_covers_every_query_head_in_power_of_two_programs(kv_heads, group, layout):
    """Every layout's programs hold all KVH x group query heads in rows of a power of two >= 16
    (Triton's dots); per_slot runs where its key rows are a power of two (KVH) and its rows at most
    128, otherwise per_kv_head; the dots' rows a kv token meets (plan's FLOPs) count the padding."""
    ran = kernel_layout(kv_heads, group, layout)
    programs, rows = program_shape(kv_heads, group, layout)
    assert rows >= 16 and rows & (rows - 1) == 0 and programs * rows >= kv_heads * group
    if ran == "per_slot":
        assert layout == "per_slot" and kv_heads & (kv_heads - 1) == 0 and programs == 1 and rows < 2 * max(16, kv_heads * group)
        assert dot_rows(kv_heads, group, layout) == rows * kv_heads
    else:
        assert layout == "per_kv_head" or kv_heads & (kv_heads - 1) or kv_heads * group > 128
        assert programs == kv_heads * -(-group // 16) and dot_rows(kv_heads, group, layout) == programs * 16


def test_an_unknown_layout_is_an_error_that_lists_them():
    with pytest.raises(ValueError, match="'per_head'.*per_kv_head, per_slot"):
        kernel_layout(8, 2, "per_head")
    assert program_shape(8, 2, "per_slot") == (1, 16) and program_shape(8, 2, "per_kv_head") == (8, 16)  # Qwen3 16:8
    assert program_shape(8, 4, "per_slot") == (1, 32) and kernel_layout(6, 2, "per_slot") == "per_kv_head"


def test_the_kernel_body_equals_jax_s_deprecated_one_bit_for_bit():
    """`partition_kernel` is the algorithm of JAX's `pallas.ops.gpu.paged_attention` kernel body
    (deprecated in jax 0.12, so no longer imported at run time): under the same `pallas_call`, in
    Pallas' interpreter, both give the same bits: o, l and m of every partition, an idle slot, lengths
    ending inside a page and a partition past a slot's length included. Where a jax release has
    removed that module the test says so and the XLA-path tests in test_continuous.py remain."""
    import functools
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl

    from jaxrl4llm.sampling import gpu_paged_attention as gpa

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            from jax.experimental.pallas.ops.gpu import paged_attention as upstream
        except ImportError:
            pytest.skip(f"jax {jax.__version__} has no pallas.ops.gpu.paged_attention to compare with")
    rng = np.random.default_rng(0)
    slots, block_h, dh, page, pages, per_block, splits, per_split = 3, 16, 16, 4, 20, 2, 2, 4
    q = jnp.asarray(rng.normal(size=(slots, block_h, dh)), jnp.bfloat16)
    keys = jnp.asarray(rng.normal(size=(pages, page, dh)), jnp.bfloat16)
    values = jnp.asarray(rng.normal(size=(pages, page, dh)), jnp.bfloat16)
    table = jnp.asarray(np.stack([rng.permutation(np.arange(1, pages))[:splits * per_split] for _ in range(slots)]),
                        jnp.int32).reshape(slots, splits, per_split)
    lengths = jnp.asarray([0, 7, 13], jnp.int32)  # idle; inside partition 0's second page; partition 1 empty

    def run(kernel, with_scales):  # JAX's body takes k, v [pages, page, Dh] and scales and its partition's
        # table; ours k, v [pages, page, KVH, Dh], the slot's whole table and its pages a partition
        none = [None] if with_scales else []
        kv = (pages, page, dh) if with_scales else (pages, page, 1, dh)
        tables = [pl.BlockSpec((None, None, per_split), lambda b, g, k: (b, k, 0))] if with_scales else \
            [pl.BlockSpec((None, splits * per_split), lambda b, g, k: (b, 0))]
        return pl.pallas_call(
            kernel, grid=(slots, 1, splits),
            in_specs=[pl.BlockSpec((None, block_h, dh), lambda b, g, k: (b, 0, 0)),
                      pl.BlockSpec(kv, lambda b, g, k: (0,) * len(kv)), *none,
                      pl.BlockSpec(kv, lambda b, g, k: (0,) * len(kv)), *none, *tables,
                      pl.BlockSpec((1,), lambda b, g, k: (b,)),
                      *([] if with_scales else [pl.BlockSpec((1,), lambda b, g, k: (b,))])],
            out_specs=[pl.BlockSpec((None, None, block_h, dh), lambda b, g, k: (k, b, 0, 0)),
                       pl.BlockSpec((None, None, block_h), lambda b, g, k: (k, b, 0)),
                       pl.BlockSpec((None, None, block_h), lambda b, g, k: (k, b, 0))],
            out_shape=[jax.ShapeDtypeStruct((splits, slots, block_h, dh), jnp.float32),
                       jax.ShapeDtypeStruct((splits, slots, block_h), jnp.float32),
                       jax.ShapeDtypeStruct((splits, slots, block_h), jnp.float32)],
            interpret=True,
        )(q, *((keys, *none, values, *none, table) if with_scales else
               (keys[:, :, None], values[:, :, None], table.reshape(slots, -1))), lengths,
          *([] if with_scales else [jnp.full((slots,), per_split, jnp.int32)]))

    ours = run(functools.partial(gpa.partition_kernel, pages_per_block=per_block, group=block_h), False)
    theirs = run(functools.partial(upstream.paged_attention_kernel, num_heads=block_h,
                                   pages_per_compute_block=per_block, mask_value=upstream.DEFAULT_MASK_VALUE,
                                   attn_logits_soft_cap=None), True)
    for name, a, b in zip("olm", ours, theirs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert float(jnp.abs(ours[0][:, 0]).max()) == 0.0 and float(ours[1][1, 1].max()) == 0.0  # idle; past the length
    assert gpa.MASK_VALUE == upstream.DEFAULT_MASK_VALUE


@settings(deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=6), st.integers(1, 8), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 12), st.sampled_from(SPLIT_RULES))
def test_each_split_rule_covers_a_slot_s_live_pages_within_the_padded_table(lengths, page, per_block, splits, rule):
    """`partition_pages`: K partitions of P_s pages cover each slot's live pages, start at whole loop
    steps and read no table entry past the padding; "table" cuts every slot alike (the table's width /
    K), "length" by the slot's own live pages (the fewest whole loop steps by which K partitions cover
    them: a partition is at most one loop step longer than its live pages / K)."""
    import numpy as np

    width = max(1, -(-max(lengths) // page))
    block, splits, padded = kernel_blocks(width, len(lengths), 1, per_block, splits)
    got = np.asarray(partition_pages(np.asarray(lengths, np.int32), page, padded, block, splits, rule))
    live = -(-np.asarray(lengths) // page)
    assert got.dtype == np.int32 and (got % block == 0).all() and (got >= block).all()
    assert (splits * got >= live).all()  # every live page in some partition
    last_read = np.minimum(live, splits * got)  # a partition reads whole steps from its start up to its last live page
    assert (-(-last_read // block) * block <= padded).all()
    if rule == "table":
        assert (got == padded // splits).all()
    else:
        assert (got == np.maximum(1, -(-live // (splits * block))) * block).all()
        assert ((got == block) | (splits * (got - block) < live)).all()  # the fewest whole steps that cover


def test_an_unknown_split_rule_or_store_is_an_error_that_lists_them():
    import jax.numpy as jnp

    from jaxrl4llm.sampling.gpu_paged_attention import gpu_paged_attention_one_shard

    with pytest.raises(ValueError, match="'rows'.*table, length"):
        partition_pages(jnp.zeros(2, jnp.int32), 4, 8, 1, 2, "rows")
    q, pool = jnp.zeros((2, 1, 2, 16)), jnp.zeros((5, 4, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="'some'.*all, live"):
        gpu_paged_attention_one_shard(q, pool, jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32), store="some",
                                      interpret=True)


@settings(deadline=None, max_examples=40)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_the_combine_reads_only_written_partitions(splits, tokens, seed):
    """`combine_partitions` of K partitions' (o, l, m) equals float64 softmax attention over the
    tokens of the written partitions, whatever an unwritten one holds (NaN here: what Pallas'
    interpreter puts in an output buffer no program wrote); nothing written gives 0."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(splits, tokens)) * 4
    values = rng.normal(size=(splits, tokens, 3))
    written = rng.random(splits) < 0.6
    m = scores.max(-1)
    p = np.exp(scores - m[:, None])
    o, l = np.einsum("kt,ktd->kd", p, values), p.sum(-1)
    poison = lambda x, w: np.where(w, x, np.nan)
    got = np.asarray(combine_partitions(jnp.asarray(poison(o, written[:, None]), jnp.float32),
                                        jnp.asarray(poison(l, written), jnp.float32),
                                        jnp.asarray(poison(m, written), jnp.float32), jnp.asarray(written)))
    if not written.any():
        np.testing.assert_array_equal(got, 0.0)
        return
    s, v = scores[written].ravel(), values[written].reshape(-1, 3)
    want = np.exp(s - s.max()) @ v / np.exp(s - s.max()).sum()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_live_stores_write_only_real_rows_of_non_empty_partitions():
    """STORE "live": a program writes its partials only where its partition holds a live page, and only
    its real query rows (masked stores); Pallas' interpreter poisons every output buffer with NaN, so
    what no program wrote stays NaN, and what one wrote equals STORE "all"'s bits. End to end
    (`gpu_paged_attention_one_shard`, both layouts, both split rules) the output is finite and equals
    STORE "all"'s bit for bit: the combine reads only the written partitions."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl

    from jaxrl4llm.sampling import gpu_paged_attention as gpa

    rng = np.random.default_rng(1)
    slots, rows, real, dh, page, pages, splits, per_split = 3, 16, 3, 16, 4, 20, 2, 2
    q = jnp.asarray(rng.normal(size=(slots, rows, dh)), jnp.bfloat16)
    keys, values = (jnp.asarray(rng.normal(size=(pages, page, 1, dh)), jnp.bfloat16) for _ in range(2))
    table = jnp.asarray(np.stack([rng.permutation(np.arange(1, pages))[:splits * per_split] for _ in range(slots)]),
                        jnp.int32)
    lengths = jnp.asarray([0, 7, 13], jnp.int32)  # idle; partition 0 only; both partitions

    def run(live_rows):
        kernel = functools.partial(gpa.partition_kernel, pages_per_block=1, group=rows, live_rows=live_rows)
        return pl.pallas_call(
            kernel, grid=(slots, 1, splits),
            in_specs=[pl.BlockSpec((None, None, rows, dh), lambda b, g, k: (b, g, 0, 0)),
                      pl.BlockSpec((pages, page, 1, dh), lambda b, g, k: (0, 0, 0, 0)),
                      pl.BlockSpec((pages, page, 1, dh), lambda b, g, k: (0, 0, 0, 0)),
                      pl.BlockSpec((None, splits * per_split), lambda b, g, k: (b, 0)),
                      pl.BlockSpec((1,), lambda b, g, k: (b,)), pl.BlockSpec((1,), lambda b, g, k: (b,))],
            out_specs=[pl.BlockSpec((None, None, None, rows, dh), lambda b, g, k: (k, b, g, 0, 0)),
                       pl.BlockSpec((None, None, None, rows), lambda b, g, k: (k, b, g, 0)),
                       pl.BlockSpec((None, None, None, rows), lambda b, g, k: (k, b, g, 0))],
            out_shape=[jax.ShapeDtypeStruct((splits, slots, 1, rows, dh), jnp.float32),
                       jax.ShapeDtypeStruct((splits, slots, 1, rows), jnp.float32),
                       jax.ShapeDtypeStruct((splits, slots, 1, rows), jnp.float32)],
            interpret=True,
        )(q[:, None], keys, values, table, lengths, jnp.full((slots,), per_split, jnp.int32))

    every, live = run(None), run((real, 1))
    written = np.array([[False, True, True], [False, False, True]])  # [K, S]
    for name, a, b in zip("olm", every, live):
        a, b = np.asarray(a)[:, :, 0], np.asarray(b)[:, :, 0]
        assert not np.isnan(a).any(), name
        np.testing.assert_array_equal(b[written][:, :real], a[written][:, :real], err_msg=name)
        assert np.isnan(b[written][:, real:]).all() and np.isnan(b[~written]).all(), name  # never written

    kvh, group = 2, 3
    pool = jnp.asarray(rng.normal(size=(pages, page, 2 * kvh, dh)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(size=(slots, kvh, group, dh)), jnp.float32)
    for layout in LAYOUTS:
        for rule in SPLIT_RULES:
            one = functools.partial(gpa.gpu_paged_attention_one_shard, q, pool, table, lengths, layout=layout,
                                    pages_per_block=1, k_splits=splits, split_rule=rule, interpret=True)
            every, live = np.asarray(one(store="all")), np.asarray(one(store="live"))
            assert np.isfinite(live).all() and (live[0] == 0).all(), (layout, rule)  # slot 0 idle
            np.testing.assert_array_equal(live, every, err_msg=f"{layout}, {rule}")


@pytest.mark.skipif(bool(missing_gpu_packages()),
                    reason="XLA's CUDA compiler is not installed (opt-in): pip install -e .[gpu] (or .[gpu13])")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_heads, group, split_rule, store", [(8, 2, "table", "all"), (8, 4, "table", "all"),
                                                                (8, 2, "length", "live"), (8, 4, "table", "live")])
def test_the_kernel_compiles_for_an_h100_at_qwen3_shapes(kv_heads, group, split_rule, store, layout):
    """What the interpreter does not check (Triton's own rules, shared memory) at the rollout's shapes:
    head_dim 128, GQA 16:8 and 32:8, 16-token pages of a bf16 pool, 64 slots of 64 pages (and of 3), each layout
    with its default blocks and k-split, each split rule and store (`SPLIT_RULES`, `STORES`: the masked
    stores of "live"): the kernel lowers to Triton and compiles for sm_90a on this CPU (jax's CUDA
    plugin, an abstract H100). On a chip: `scripts/gpu_check` (kernels, attention and decode phases)."""
    import functools

    import jax.numpy as jnp

    from jaxrl4llm.sampling.gpu_paged_attention import gpu_paged_attention

    slots, dh, page = 64, 128, 16
    for width in (64, 3):  # a long slot's table; a 3-page one (two pages a loop step, `kernel_blocks`)
        compile_for_h100(functools.partial(gpu_paged_attention, layout=layout, split_rule=split_rule, store=store),
                         h100_spec((1, slots, kv_heads, group, dh), jnp.float32),
                         h100_spec((1, slots * width + 1, page, 2 * kv_heads, dh), jnp.bfloat16),
                         h100_spec((1, slots, width), jnp.int32), h100_spec((1, slots), jnp.int32))
