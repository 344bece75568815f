"""The pure ZeRO-3 planner: reuse distances, prefetch within budgets, trace signatures, each knob alone, the
predicted order of gradient reductions."""

from __future__ import annotations

from infinity.zero.schedule import (
    BACKWARD,
    FORWARD,
    Event,
    Knobs,
    Trace,
    keep_after_use,
    order_signature,
    plan_prefetch,
    plan_swap_in,
    reduce_order,
    used_between,
)

# Four modules, one unit each (sizes 10, 20, 30, 40): forward 0..3 then backward 3..0.
EVENTS = [Event(m, FORWARD) for m in range(4)] + [Event(m, BACKWARD) for m in reversed(range(4))]
USES = [(m,) for m in range(4)] + [(m,) for m in reversed(range(4))]
NUMEL = (10, 20, 30, 40)
TRACE = Trace.build(EVENTS, USES, NUMEL)
BIG = 10**9


def knobs(live=BIG, prefetch=BIG, reuse=BIG) -> Knobs:
    return Knobs(max_live_numel=live, prefetch_numel=prefetch, max_reuse_distance=reuse)


def test_reuse_distance_counts_the_traffic_in_between():
    assert TRACE.reuse_distance(3, 3) == 0  # unit 3: forward at 3, backward at 4, nothing between
    assert TRACE.reuse_distance(2, 2) == 80  # unit 3's forward and backward uses (40 each) lie between
    assert TRACE.reuse_distance(0, 0) == 20 + 30 + 40 + 40 + 30 + 20
    assert TRACE.reuse_distance(7, 0) is None  # last use


def test_keep_after_use_follows_max_reuse_distance():
    assert keep_after_use(TRACE, 2, 2, knobs(reuse=80))
    assert not keep_after_use(TRACE, 2, 2, knobs(reuse=79))
    assert not keep_after_use(TRACE, 7, 0, knobs())


def test_prefetch_goes_as_deep_as_the_budgets_allow():
    assert plan_prefetch(TRACE, -1, resident=set(), live_numel=0, prefetched_numel=0, knobs=knobs()) == (
        [0, 1, 2, 3],
        None,
    )
    # The prefetch budget (60) takes units 0, 1, 2 (60) and stops at 3: no reordering past a unit that does not fit.
    plan = plan_prefetch(TRACE, -1, resident=set(), live_numel=0, prefetched_numel=0, knobs=knobs(prefetch=60))
    assert plan == ([0, 1, 2], None)
    plan = plan_prefetch(TRACE, -1, resident=set(), live_numel=0, prefetched_numel=50, knobs=knobs(prefetch=60))
    assert plan == ([0], None)


def test_live_budget_blocks_and_reports_where():
    plan = plan_prefetch(TRACE, 0, resident={0}, live_numel=10, prefetched_numel=0, knobs=knobs(live=60))
    assert plan == ([1, 2], 3)  # unit 3 (at position 3) does not fit
    assert plan_prefetch(TRACE, 0, resident={0}, live_numel=10, prefetched_numel=0, knobs=knobs(live=40)) == ([1], 2)


def test_resident_units_are_skipped_and_zero_disables():
    plan = plan_prefetch(TRACE, 3, resident={3, 2}, live_numel=70, prefetched_numel=0, knobs=knobs())
    assert plan == ([1, 0], None)
    assert plan_prefetch(TRACE, -1, resident=set(), live_numel=0, prefetched_numel=0, knobs=knobs(prefetch=0)) == (
        [],
        None,
    )


def test_used_between_and_signature():
    assert used_between(TRACE, 2, 4) == {2, 3}
    same = Trace.build(EVENTS, USES, NUMEL)
    assert same.signature() == TRACE.signature()
    other = Trace.build(EVENTS[:-1], USES[:-1], NUMEL)
    assert other.signature() != TRACE.signature()
    more_units = Trace.build(EVENTS, [USES[0] + (1,)] + USES[1:], NUMEL)
    assert more_units.signature() != TRACE.signature()


def test_a_zero_prefetch_budget_turns_off_prefetch_only():
    """stage3_prefetch_bucket_size 0: nothing is gathered ahead, but the reuse decisions and the read-ahead of
    offloaded pieces along the trace are those of any other budget."""
    off, on = knobs(prefetch=0), knobs(prefetch=BIG)
    assert plan_prefetch(TRACE, 0, resident={0}, live_numel=10, prefetched_numel=0, knobs=off) == ([], None)
    assert plan_prefetch(TRACE, 0, resident={0}, live_numel=10, prefetched_numel=0, knobs=on)[0] == [1, 2, 3]
    for position in range(len(TRACE)):
        for unit in TRACE.uses[position]:
            assert keep_after_use(TRACE, position, unit, off) == keep_after_use(TRACE, position, unit, on)
    assert plan_swap_in(TRACE, 0, resident={0}, limit=2) == [1, 2]  # no knob in it at all


def test_each_knob_moves_only_its_own_decision():
    # max_reuse_distance: which units stay gathered, whatever the prefetch and live budgets
    assert [keep_after_use(TRACE, 2, 2, knobs(reuse=r, prefetch=p)) for r in (79, 80) for p in (0, BIG)] == [
        False, False, True, True,
    ]  # fmt: skip
    # max_live_parameters: how deep the prefetch goes, whatever the reuse distance
    for reuse in (0, BIG):
        assert plan_prefetch(TRACE, -1, resident=set(), live_numel=0, prefetched_numel=0,
                             knobs=knobs(live=30, reuse=reuse)) == ([0, 1], 2)  # fmt: skip


def test_reductions_follow_the_forward_backwards():
    """Units complete in backward in the reverse order of their first forward use: a model registered in
    another order than it runs (unit 2 runs first here), a unit used twice (0: complete only after its first
    use's backward), and the units no forward event uses (the persistent unit 0 of a model, an unused one)
    last, last unit first."""
    assert reduce_order([(2,), (0,), (3,), (0,)], 4) == [3, 0, 2, 1]
    assert reduce_order([(4, 1), (2,)], 5) == [2, 1, 4, 3, 0]
    assert reduce_order([], 3) == [2, 1, 0]  # the fallback: the fixed order


def test_order_signature_tells_orders_apart():
    assert order_signature([3, 0, 2, 1]) == order_signature(reduce_order([(2,), (0,), (3,)], 4))
    assert order_signature([3, 0, 2, 1]) != order_signature([3, 0, 1, 2])
    assert all(0 <= order_signature(order) < 1 << 62 for order in ([], [0], list(range(100))))
