"""--deterministic-mode: two runs (DP = 1, dropout on; on the CPU and, bf16, on one GPU) give bit-identical per-iteration losses
and final weights; its environment (NCCL ring, cuBLAS workspace) is filled in and a
non-deterministic value is refused in one line."""

import pytest
import torch

from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.initialize import apply_deterministic_env
from teratron.training.training import pretrain

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "0",
        "--num-workers", "0", "--no-progress-bar", "--train-iters", "5", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1", "--deterministic-mode"]


def _run(extra=()):
    weights = {}

    def keep_weights(trainer):
        weights.update({k: v.detach().clone() for k, v in trainer.model[0].state_dict().items()
                        if isinstance(v, torch.Tensor)})
    state = pretrain(build_run_config(parse_train_args(TINY + list(extra)), 1), after_training=keep_weights)
    return state.loss_history, weights


@pytest.mark.parametrize("extra", [[], pytest.param(["--bf16"], id="cuda-bf16", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_two_runs_are_bit_identical(monkeypatch, extra):
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    losses_a, weights_a = _run(extra)
    losses_b, weights_b = _run(extra)
    assert len(losses_a) == 5 and losses_a == losses_b  # floats compared exactly
    assert weights_a.keys() == weights_b.keys() and weights_a
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    assert torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)


def test_environment_is_filled_in_and_a_non_deterministic_value_refused():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    apply_deterministic_env(env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring"}
    with pytest.raises(ValueError, match=r"^--deterministic-mode with NCCL_ALGO=Tree: not a deterministic setting; "
                                         r"unset it or use Ring$"):
        apply_deterministic_env({"NCCL_ALGO": "Tree"})
