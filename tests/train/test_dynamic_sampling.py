"""Dynamic sampling (DAPO): a redraw takes only as many prompts as the missing groups need."""

from hypothesis import given, settings, strategies as st

from jaxrl4llm.train.loop import prompts_to_draw


@settings(max_examples=100, deadline=None)
@given(P=st.integers(1, 64), data=st.data())
def test_a_dynamic_sampling_redraw_takes_what_the_missing_groups_need(P, data):
    drawn = data.draw(st.integers(1, 4 * P))
    mixed = data.draw(st.integers(0, drawn))
    missing = data.draw(st.integers(1, P))
    n = prompts_to_draw(P, missing, mixed, drawn)
    assert 1 <= n <= P and (n == P or n & (n - 1) == 0)  # a power of two: few sampler programs
    assert n >= min(P, missing)  # never fewer prompts than missing groups
    if mixed == 0:
        assert n == P  # nothing to go by: a whole batch, as DAPO
    if mixed == drawn:
        assert n == min(P, 1 << (missing - 1).bit_length())
    assert prompts_to_draw(P, max(missing - 1, 1), mixed, drawn) <= n  # fewer missing, no more prompts
