"""Muon under TP=2 (full-matrix modes) and under the distributed optimizer (DP=2) equals Muon on
one process. The reference is written in the test from the formulas (AdamW for 1-D params)."""

import itertools

import torch
import torch.nn.functional as F

from dist import run_distributed
from teratron import parallel_state
from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.model_parallel_config import ModelParallelConfig
from teratron.optimizer import OptimizerConfig, get_megatron_optimizer
from teratron.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from teratron.tensor_parallel.utils import shard_tensor

H, FFN, SEQ, BATCH, STEPS, LR, WD, BETA = 8, 16, 4, 4, 3, 0.02, 0.1, 0.9


class _Config:
    calculate_per_token_loss = False


class _MLP(torch.nn.Module):
    """Two column->row blocks; output [s, b, h]."""

    def __init__(self, tp_size):
        super().__init__()
        torch.manual_seed(0)
        config = ModelParallelConfig(tensor_model_parallel_size=tp_size)
        init = lambda w: torch.nn.init.normal_(w, std=0.3)  # noqa: E731
        self.layers = torch.nn.ModuleList()
        for _ in range(2):
            self.layers.append(ColumnParallelLinear(H, FFN, config=config, init_method=init, bias=True))
            self.layers.append(RowParallelLinear(FFN, H, config=config, init_method=init, bias=True,
                                                 input_is_parallel=True, skip_bias_add=False))

    def forward(self, x):
        for i in range(0, len(self.layers), 2):
            x = self.layers[i + 1](torch.tanh(self.layers[i](x)[0]))[0]
        return x


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, SEQ, BATCH, H, generator=g), torch.randn(STEPS, SEQ, BATCH, H, generator=g)


def _reference_ns(x):
    coeffs = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
              (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
    tall = x.shape[0] > x.shape[1]
    X = x.T if tall else x
    X = X / (X.norm() + 1e-7)
    for a, b, c in coeffs:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def _reference():
    model = _MLP(tp_size=1)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() == 1]
    adam = torch.optim.AdamW(vectors, lr=LR, weight_decay=0.0)
    momentum = {p: torch.zeros_like(p) for p in matrices}
    x, y = _data()
    for step in range(STEPS):
        model.zero_grad()
        F.mse_loss(model(x[step]), y[step]).backward()
        adam.step()
        with torch.no_grad():
            for p in matrices:
                momentum[p] = BETA * momentum[p] + (1 - BETA) * p.grad
                p.mul_(1 - LR * WD).sub_(LR * max(p.shape) ** 0.5 * _reference_ns(momentum[p]))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _train(tp_mode, dist_opt):
    model = _MLP(tp_size=2)
    ddp = DistributedDataParallel(_Config(), DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=100), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="muon", lr=LR, weight_decay=WD, muon_momentum=BETA, muon_tp_mode=tp_mode,
        muon_fp32_matmul_prec="highest", clip_grad=0.0), [ddp])
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    x, y = _data()
    local = BATCH // dp_size
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        xb, yb = (t[step][:, dp_rank * local:(dp_rank + 1) * local] for t in (x, y))
        F.mse_loss(ddp(xb), yb).backward()
        finalize_model_grads([ddp])
        assert opt.step()[0]
    return {name: (p.detach().clone(), getattr(p, "partition_dim", -1) if getattr(p, "tensor_model_parallel", False)
                   else None) for name, p in model.named_parameters()}


def _run():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    out = {key: _train(*key) for key in itertools.product(("duplicated", "distributed"), (False, True))}
    return parallel_state.get_tensor_model_parallel_rank(), out


def test_muon_tp2_and_distributed_optimizer_equal_single_process():
    ref = _reference()
    for tp_rank, per_config in run_distributed(_run, 4):
        for key, params in per_config.items():
            for name, (local, dim) in params.items():
                expected = ref[name] if dim is None else shard_tensor(ref[name], dim, 1, tp_rank, 2)
                torch.testing.assert_close(local, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key} {name}: {m}")
