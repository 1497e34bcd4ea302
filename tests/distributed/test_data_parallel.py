"""DDP and the distributed optimizer equal single-process training with the same global batch.

The reference is plain PyTorch: an nn.Module on the full batch, torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_, written independently of teratron's optimizer code.
"""

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist import run_distributed
from teratron import parallel_state
from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.optimizer import OptimizerConfig, get_megatron_optimizer

HIDDEN, GLOBAL_BATCH, STEPS, LR, WD, CLIP = 32, 8, 4, 1e-2, 0.1, 0.5


class _Config:
    calculate_per_token_loss = False


class _PerTokenConfig:
    calculate_per_token_loss = True


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 8, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 4, generator=g)


def _reference():
    """Single process, full batch, plain AdamW; biases (1-D) without weight decay."""
    model = _model()
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR)
    x, y = _data()
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = F.mse_loss(model(x[step]), y[step])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _state_bytes(optimizer):
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _train_ddp(ddp_config, micro_batches=1, per_token=False):
    """per_token: sum the squared errors and let finalize_model_grads divide by the global
    element count (Megatron's calculate_per_token_loss); the mean-loss math is unchanged."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    ddp = DistributedDataParallel(_PerTokenConfig() if per_token else _Config(), ddp_config, _model())
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP), [ddp])
    x, y = _data()
    local = GLOBAL_BATCH // dp
    losses = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        xs = x[step][rank * local:(rank + 1) * local].chunk(micro_batches)
        ys = y[step][rank * local:(rank + 1) * local].chunk(micro_batches)
        total = torch.zeros(())
        for i, (xb, yb) in enumerate(zip(xs, ys)):
            last = i == micro_batches - 1
            with ddp.no_sync() if not last else torch.enable_grad():
                if per_token:
                    loss = F.mse_loss(ddp(xb), yb, reduction="sum")
                else:
                    loss = F.mse_loss(ddp(xb), yb) / micro_batches
                loss.backward()
            total += loss.detach()
        buckets = ddp._all_buckets()
        assert len(buckets) == (1 if ddp_config.bucket_size is None else 3), len(buckets)
        # With overlap the backward hooks have already launched every bucket's reduction.
        assert all(b.grad_reduce_started for b in buckets) == ddp_config.overlap_grad_reduce
        num_tokens = torch.tensor(float(ys[0].numel() * micro_batches)) if per_token else None
        finalize_model_grads([ddp], num_tokens=num_tokens)
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm > 0
        # The step itself launches the param all-gathers: left in flight for the next forward's
        # pre-hooks with overlap_param_gather, waited for inside the step without it.
        in_flight = [b.param_gather_handle is not None for b in buckets]
        assert in_flight == [ddp_config.overlap_param_gather] * len(buckets), in_flight
        dist.all_reduce(total)
        losses.append(total.item() / (GLOBAL_BATCH * 4) if per_token else total.item() / dp)
    ddp.start_param_sync(force_sync=True)  # overlap_param_gather leaves the last gathers in flight
    return losses, [p.detach().clone() for p in ddp.module.parameters()], _state_bytes(opt)


def _shard_layout():
    """This rank's slices: of the bucket, of each param (the buffer's) and of each main param."""
    parallel_state.initialize_model_parallel()
    ddp = DistributedDataParallel(_Config(), DistributedDataParallelConfig(use_distributed_optimizer=True),
                                  torch.nn.Linear(16, 20))
    (buffer,) = ddp.buffers
    (bucket,) = buffer.buckets
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR), [ddp])
    names = {ddp.module.weight: "weight", ddp.module.bias: "bias"}
    ranges = {names[p]: buffer.param_shard_range(p) for p in names}
    mains = {names[s.model_param]: (s.flat_range, s.main_param.numel()) for s in opt.main_param_shards()}
    return bucket.shard_range(), ranges, mains


def test_distributed_optimizer_slices_of_three_ranks():
    """One bucket: the bias at [0, 20), the weight at [20, 340), padded to lcm(3, 128) = 384;
    rank r owns [128 r, 128 (r + 1)): the weight straddles both slice boundaries."""
    expected = [((0, 128), {"weight": (0, 108), "bias": (0, 20)}),
                ((128, 256), {"weight": (108, 236), "bias": (0, 0)}),
                ((256, 384), {"weight": (236, 320), "bias": (0, 0)})]
    for (bucket_range, ranges, mains), (want_bucket, want_ranges) in zip(run_distributed(_shard_layout, 3),
                                                                         expected):
        assert bucket_range == want_bucket and ranges == want_ranges
        assert mains == {name: (rng, rng[1] - rng[0]) for name, rng in want_ranges.items()}


def _check_layouts():
    parallel_state.initialize_model_parallel()
    results = {}
    # broadcast_params: every replica ends with DP rank 0's (different) initial values.
    torch.manual_seed(dist.get_rank())
    ddp = DistributedDataParallel(_Config(), DistributedDataParallelConfig(), torch.nn.Linear(3, 2))
    ddp.broadcast_params()
    rank0 = [p.detach().clone() for p in ddp.module.parameters()]
    for p in rank0:
        dist.broadcast(p, src=0)
    assert all(torch.equal(p, r) for p, r in zip(ddp.module.parameters(), rank0))
    for dist_opt, overlap_grad, bucket_size in itertools.product((False, True), (False, True), (None, 300)):
        if bucket_size is not None and not overlap_grad:
            continue  # without overlap every buffer is a single bucket
        for overlap_param in ((False, True) if dist_opt else (False,)):
            ddp_config = DistributedDataParallelConfig(
                use_distributed_optimizer=dist_opt, overlap_grad_reduce=overlap_grad,
                overlap_param_gather=overlap_param, bucket_size=bucket_size)
            results[(dist_opt, overlap_grad, bucket_size, overlap_param)] = _train_ddp(ddp_config)
    # Gradient accumulation over two microbatches with no_sync, average_in_collective.
    results["accumulate"] = _train_ddp(DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=300, average_in_collective=True),
        micro_batches=2)
    results["per_token"] = _train_ddp(DistributedDataParallelConfig(use_distributed_optimizer=True),
                                      micro_batches=2, per_token=True)
    return results


def _assert_matches_reference(results):
    ref_losses, ref_params = _reference()
    for key, (losses, params, _) in results.items():
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{key}: {m}")
        for p, ref in zip(params, ref_params):
            torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def _reference_state_bytes():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model(torch.zeros(1, 8)).sum().backward()
    opt.step()
    return _state_bytes(opt)


def test_dp2_and_dp4_equal_single_process():
    full_bytes = _reference_state_bytes()
    for world_size in (2, 4):
        per_rank = run_distributed(_check_layouts, world_size)
        for results in per_rank:
            _assert_matches_reference(results)
        for key in per_rank[0]:
            state_bytes = [results[key][2] for results in per_rank]
            if key in ("accumulate", "per_token") or key[0]:   # distributed optimizer: states split over ranks
                assert sum(state_bytes) == full_bytes, (key, state_bytes, full_bytes)
                if isinstance(key, tuple) and key[2] is None:
                    # One bucket (4228 elements, padded to 4352): each rank's 1/DP share.
                    assert max(state_bytes) <= full_bytes / world_size * 1.05, (key, state_bytes, full_bytes)
            else:
                assert state_bytes == [full_bytes] * world_size, (key, state_bytes)


def _bf16_reference():
    """One process, two half-batch microbatches: bf16 grads summed in fp32 and averaged, plain
    AdamW on fp32 masters, rounded back into the bf16 model (what DP=2 with fp32 reduction does)."""
    model = _model().to(torch.bfloat16)
    masters = [p.detach().float() for p in model.parameters()]
    adamw = torch.optim.AdamW([{"params": [m for m in masters if m.dim() == 2], "weight_decay": WD},
                               {"params": [m for m in masters if m.dim() == 1], "weight_decay": 0.0}], lr=LR)
    x, y = _data()
    for step in range(STEPS):
        grads = [torch.zeros_like(m) for m in masters]
        for xb, yb in zip(x[step].chunk(2), y[step].chunk(2)):
            model.zero_grad()
            F.mse_loss(model(xb.bfloat16()).float(), yb).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad.float()
        for m, g in zip(masters, grads):
            m.grad = g / 2
        adamw.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
    return [p.detach().clone() for p in model.parameters()]


def _train_mixed(dtype, dist_opt, offload=0.0, inject_inf_at=None, steps=STEPS, **opt_kwargs):
    rank = dist.get_rank()
    ddp = DistributedDataParallel(_Config(), DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=True), _model().to(dtype))
    opt = get_megatron_optimizer(OptimizerConfig(
        lr=LR, weight_decay=WD, clip_grad=0.0, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        params_dtype=dtype, optimizer_cpu_offload=offload > 0,
        optimizer_offload_fraction=offload, **opt_kwargs), [ddp])
    x, y = _data()
    results = []
    for step in range(steps):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        xb, yb = x[step][rank * 4:(rank + 1) * 4], y[step][rank * 4:(rank + 1) * 4]
        opt.scale_loss(F.mse_loss(ddp(xb.to(dtype)).float(), yb)).backward()
        if inject_inf_at == (step, rank):
            # The first buffer element: after the reduce-scatter only DP rank 0's shard holds it.
            ddp.buffers[0].grad_data[0] = float("inf")
        finalize_model_grads([ddp])
        results.append((opt.step()[0], opt.get_loss_scale().item()))
    return results, [p.detach().clone() for p in ddp.module.parameters()]


def _check_precision_and_offload():
    parallel_state.initialize_model_parallel()
    out = {}
    for dist_opt in (False, True):
        out[("bf16", dist_opt)] = _train_mixed(torch.bfloat16, dist_opt)[1]
        out[("fp32", dist_opt)] = _train_mixed(torch.float32, dist_opt)[1]
        out[("offload", dist_opt)] = _train_mixed(torch.float32, dist_opt, offload=0.5)[1]
        out[("bf16-offload", dist_opt)] = _train_mixed(torch.bfloat16, dist_opt, offload=1.0)[1]
        # fp16: an inf on rank 1 lands in rank 0's shard; every rank must skip that step.
        out[("fp16", dist_opt)] = _train_mixed(torch.float16, dist_opt, inject_inf_at=(1, 1), steps=4,
                                               initial_loss_scale=4096.0, hysteresis=1)[0]
    return out


def test_mixed_precision_and_cpu_offload_dp2():
    bf16_ref = _bf16_reference()
    for out in run_distributed(_check_precision_and_offload, 2):
        for dist_opt in (False, True):
            for p, r in zip(out[("bf16", dist_opt)], bf16_ref):
                torch.testing.assert_close(p, r, rtol=0, atol=0)
            for p, r in zip(out[("bf16-offload", dist_opt)], bf16_ref):
                torch.testing.assert_close(p, r, rtol=0, atol=0)
            for p, r in zip(out[("offload", dist_opt)], out[("fp32", dist_opt)]):
                torch.testing.assert_close(p, r, rtol=0, atol=0)
            assert out[("fp16", dist_opt)] == [(True, 4096.0), (False, 2048.0), (True, 2048.0), (True, 2048.0)]
