"""`gpu_paged_attention.kernel_blocks`: how the Triton paged attention cuts a slot's pages (the
kernel itself: tests/sampling/test_continuous.py, in Pallas' interpreter and, marked gpu, on a chip)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl4llm.sampling.gpu_paged_attention import GRID_TARGET, PAGES_PER_BLOCK, kernel_blocks


@given(st.integers(1, 300), st.integers(1, 256), st.integers(1, 16), st.integers(1, 16),
       st.one_of(st.none(), st.integers(1, 64)))
def test_the_padded_table_holds_every_page_in_whole_blocks_and_partitions(pages, slots, kv_heads, per_block, splits):
    block, k, padded = kernel_blocks(pages, slots, kv_heads, per_block, splits)
    assert block == min(per_block, pages) and (splits is None or k == splits)
    assert padded % (block * k) == 0 and pages <= padded < pages + block * k  # the least padding
    if splits is None:  # the default: about GRID_TARGET programs, never a partition without a block
        blocks = -(-pages // block)
        assert 1 <= k <= blocks and (k == blocks or slots * kv_heads * k <= max(GRID_TARGET, slots * kv_heads))


def test_a_prime_page_count_still_splits():
    """A table of 69 pages (69 = 3 x 23) used to find no split (blocks had to divide the table): a
    slot's longest row ran in one program. The table is now padded to whole blocks and partitions."""
    assert kernel_blocks(69, 64, 8) == (PAGES_PER_BLOCK, GRID_TARGET // (64 * 8), 80)  # 4 partitions of 20 pages
    with pytest.raises(ValueError, match="k_splits=0"):
        kernel_blocks(69, 64, 8, k_splits=0)
