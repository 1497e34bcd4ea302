"""The per-rank work order and the step matching of transfers (pure Python, no ranks)."""

import itertools

import pytest

from teratron.pipeline_parallel.schedule_plan import Action, microbatch_order, plan_pipeline, rank_actions


def in_flight_peak(actions) -> int:
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def test_1f1b_order():
    F = lambda m: Action("F", 0, m)  # noqa: E731
    B = lambda m: Action("B", 0, m)  # noqa: E731
    # pp = 4, 6 microbatches: rank 0 warms up with 3 forwards, rank 3 (last) with none.
    assert rank_actions(0, 4, 1, 6, 4, False) == [F(0), F(1), F(2), F(3), B(0), F(4), B(1), F(5), B(2), B(3), B(4), B(5)]
    assert rank_actions(3, 4, 1, 6, 4, False) == [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3), F(4), B(4), F(5), B(5)]
    # Fewer microbatches than stages: all forwards first.
    assert rank_actions(0, 4, 1, 2, 4, False) == [F(0), F(1), B(0), B(1)]
    for pp, m in itertools.product([2, 4, 8], [1, 3, 8, 16]):
        assert in_flight_peak(rank_actions(0, pp, 1, m, pp, False)) == min(pp, m)


def test_interleaved_order():
    # Groups of pp microbatches visit chunk 0, then chunk 1; backwards visit chunk 1 first.
    assert microbatch_order(4, 2, 2) == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    actions = rank_actions(1, 2, 2, 4, 2, False)  # last rank: warm-up (vpp - 1) * pp = 2
    assert actions[:4] == [Action("F", 0, 0), Action("F", 0, 1), Action("F", 1, 0), Action("B", 1, 0)]
    assert [a for a in actions if a.kind == "B"] == [Action("B", c, m) for c, m in
                                                     [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]]


@pytest.mark.parametrize("pp, vpp", [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (3, 3), (4, 4)])
def test_plans_are_complete_and_matched(pp, vpp):
    for m, forward_only in itertools.product([1, pp, 2 * pp, 3 * pp], [False, True]):
        plans = plan_pipeline(pp, vpp, m, pp, forward_only)
        for rank, steps in enumerate(plans):
            done = [s.action for s in steps if s.action]
            assert sorted(done) == sorted(rank_actions(rank, pp, vpp, m, pp, forward_only))
        # Both ends of every transfer are in the same global step, so the batches pair up.
        sent, received = [], []
        for rank, steps in enumerate(plans):
            for s in steps:
                for direction in s.sends:
                    peer = (rank + (1 if direction == "next" else -1)) % pp
                    sent.append((s.index, rank, peer, s.action.kind, s.action.microbatch))
                for direction, feeds in s.recvs:
                    peer = (rank + (-1 if direction == "prev" else 1)) % pp
                    received.append((s.index, peer, rank, feeds.kind, feeds.microbatch))
        assert sorted(sent) == sorted(received)
        assert len({(index, src, dst) for index, src, dst, _, _ in sent}) == len(sent)  # one per pair and step
        expected = (2 if not forward_only else 1) * m * (pp * vpp - 1)
        assert len(sent) == expected


def test_unschedulable_interleaving():
    with pytest.raises(ValueError, match=r"num_microbatches=5 over pipeline_model_parallel_size=4 x 3 virtual"):
        plan_pipeline(4, 3, 5, 4, False)
