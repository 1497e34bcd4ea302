import pytest
import torch
import torch.distributed as dist

from dist import run_distributed


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t


def test_runs_on_every_rank_and_returns_tensors():
    results = run_distributed(_all_reduce_rank, 3)
    assert [r.item() for r in results] == [3.0, 3.0, 3.0]


def test_rank_error_is_raised_with_its_traceback():
    def fail_on_rank_one():
        if dist.get_rank() == 1:
            raise ValueError("boom on one")
        return 0

    with pytest.raises(RuntimeError, match="boom on one"):
        run_distributed(fail_on_rank_one, 2)


def test_failure_does_not_wait_for_peers_blocked_in_a_collective():
    def fail_while_peer_waits():
        if dist.get_rank() == 1:
            raise ValueError("early failure")
        dist.barrier()  # never completes: rank 1 is gone

    with pytest.raises(RuntimeError, match="early failure"):
        run_distributed(fail_while_peer_waits, 2, timeout=60)
