"""Single-process optimizer checks against references written from the formulas."""

import pytest
import torch
import torch.nn.functional as F

from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.optimizer import OptimizerConfig, get_megatron_optimizer
from teratron.optimizer.muon import newton_schulz

STEPS = 3


class _Config:
    calculate_per_token_loss = False


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 5)).to(dtype)


def _batches(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g).to(dtype), torch.randn(4, 5, generator=g).to(dtype))
            for _ in range(STEPS)]


def _loss(model, x, y):
    return F.mse_loss(model(x).float(), y.float())


def _train(model, optimizer, batches, ddp=None):
    for x, y in batches:
        if ddp is not None:
            ddp.zero_grad_buffer()
        optimizer.zero_grad()
        optimizer.scale_loss(_loss(ddp or model, x, y)).backward()
        if ddp is not None:
            finalize_model_grads([ddp])
        ok, _, _ = optimizer.step()
        assert ok
    return [p.detach().clone() for p in model.parameters()]


def _train_reference(model, step_fn, batches):
    """step_fn(param, grad, state, is_matrix) updates param in place."""
    states = {}
    for x, y in batches:
        model.zero_grad()
        _loss(model, x, y).backward()
        with torch.no_grad():
            for p in model.parameters():
                step_fn(p, p.grad, states.setdefault(p, {}), p.dim() == 2)
    return [p.detach().clone() for p in model.parameters()]


def _adamw_step(lr, wd, beta1=0.9, beta2=0.999, eps=1e-8):
    def step(p, g, state, decay):
        t = state["t"] = state.get("t", 0) + 1
        m = state["m"] = beta1 * state.get("m", torch.zeros_like(p)) + (1 - beta1) * g
        v = state["v"] = beta2 * state.get("v", torch.zeros_like(p)) + (1 - beta2) * g * g
        p.mul_(1 - lr * (wd if decay else 0.0))
        p.sub_(lr * (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + eps))
    return step


def test_lion_matches_formula():
    lr, wd, b1, b2 = 0.01, 0.1, 0.9, 0.99

    def lion(p, g, state, decay):
        m = state.get("m", torch.zeros_like(p))
        update = torch.sign(b1 * m + (1 - b1) * g)
        p.mul_(1 - lr * (wd if decay else 0.0)).sub_(lr * update)
        state["m"] = b2 * m + (1 - b2) * g

    ref = _train_reference(_model(), lion, _batches())
    model = _model()
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="lion", lr=lr, weight_decay=wd, lion_beta1=b1,
                                                 lion_beta2=b2, clip_grad=0.0), [model])
    for p, r in zip(_train(model, opt, _batches()), ref):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def _reference_ns(x, steps=5):
    """Quintic Newton-Schulz written from the published recurrence X <- aX + (bA + cA^2) X, A = X X^T."""
    coeffs = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
              (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
    tall = x.shape[0] > x.shape[1]
    X = x.T if tall else x
    X = X / (X.norm() + 1e-7)
    for a, b, c in coeffs[:steps]:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def test_newton_schulz_orthogonalises():
    g = torch.randn(12, 6, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(g, matmul_precision="highest")
    torch.testing.assert_close(out, _reference_ns(g), rtol=1e-5, atol=1e-6)
    singular = torch.linalg.svdvals(out)
    assert singular.min() > 0.6 and singular.max() < 1.25     # quintic NS: singular values near 1


@pytest.mark.parametrize("nesterov", [False, True])
def test_muon_matches_formula(nesterov):
    lr, wd, beta = 0.02, 0.1, 0.9
    adam = _adamw_step(lr, wd)

    def muon(p, g, state, is_matrix):
        if not is_matrix:          # 1-D params go to the scalar optimizer (AdamW)
            return adam(p, g, state, False)
        m = state["m"] = beta * state.get("m", torch.zeros_like(p)) + (1 - beta) * g
        update = (1 - beta) * g + beta * m if nesterov else m
        p.mul_(1 - lr * wd)
        p.sub_(lr * max(p.shape) ** 0.5 * _reference_ns(update))

    ref = _train_reference(_model(), muon, _batches())
    model = _model()
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=lr, weight_decay=wd, muon_momentum=beta,
                                                 muon_nesterov=nesterov, muon_fp32_matmul_prec="highest",
                                                 clip_grad=0.0), [model])
    for p, r in zip(_train(model, opt, _batches()), ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gated", [False, True])
def test_muon_splits_fused_qkv(gated):
    """A weight named linear_qkv with layout [groups, (heads/group + 2) * head_dim, h] is
    orthogonalised per Q, K and V; with attention_output_gate, [groups, (2 heads/group + 2) *
    head_dim, h] per Q, gates, K and V."""
    heads, groups, head_dim, hidden = 4, 2, 2, 8
    per_group_heads = [heads // groups] * (2 if gated else 1) + [1, 1]

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_qkv = torch.nn.Linear(hidden, groups * sum(per_group_heads) * head_dim, bias=False)

    class Model(torch.nn.Module):
        config = type("C", (), dict(num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim,
                                    hidden_size=hidden, attention_output_gate=gated))()

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.self_attention = Attention()

    model = Model()
    w0 = model.self_attention.linear_qkv.weight.detach().clone()
    grad = torch.randn_like(w0)
    model.self_attention.linear_qkv.weight.grad = grad.clone()
    lr = 0.1
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=lr, weight_decay=0.0, muon_momentum=0.0,
                                                 muon_fp32_matmul_prec="highest", clip_grad=0.0), [model])
    opt.step()
    per_group = grad.view(groups, sum(per_group_heads), head_dim, hidden)
    bounds = [sum(per_group_heads[:i]) for i in range(len(per_group_heads) + 1)]
    parts = [per_group[:, start:end] for start, end in zip(bounds, bounds[1:])]
    expected = []
    for part in parts:
        flat = part.reshape(-1, hidden)
        expected.append((_reference_ns(flat) * max(flat.shape) ** 0.5).view(part.shape))
    update = torch.cat(expected, dim=1).view_as(w0)
    torch.testing.assert_close(model.self_attention.linear_qkv.weight.detach(), w0 - lr * update,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wrap_in_ddp", [False, True])
def test_bf16_params_with_fp32_master_weights(wrap_in_ddp):
    lr, wd = 0.01, 0.1
    # Reference: plain torch AdamW on fp32 masters fed the bf16 grads, rounded back into the model.
    model = _model(torch.bfloat16)
    masters = [p.detach().float() for p in model.parameters()]
    adamw = torch.optim.AdamW([{"params": [m for m in masters if m.dim() == 2], "weight_decay": wd},
                               {"params": [m for m in masters if m.dim() == 1], "weight_decay": 0.0}], lr=lr)
    for x, y in _batches(torch.bfloat16):
        model.zero_grad()
        _loss(model, x, y).backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
        adamw.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
    ref = [p.detach().clone() for p in model.parameters()]

    model = _model(torch.bfloat16)
    ddp = None
    if wrap_in_ddp:
        ddp = DistributedDataParallel(_Config(), DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(lr=lr, weight_decay=wd, bf16=True, params_dtype=torch.bfloat16,
                                                 clip_grad=0.0), [ddp or model])
    out = _train(model, opt, _batches(torch.bfloat16), ddp)
    for p, r in zip(out, ref):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p, r, rtol=0, atol=0)


@pytest.mark.parametrize("clip_grad", [0.05, 100.0])
def test_clip_inside_fused_adam_equals_clip_before_the_step(clip_grad):
    """With torch's fused AdamW the clip factor reaches the kernel as a device tensor (no host
    sync before the update): same params and grad norms as clipping the grads first."""

    def run(in_kernel):
        model = _model()
        opt = get_megatron_optimizer(OptimizerConfig(lr=0.01, weight_decay=0.1, clip_grad=clip_grad), [model])
        for group in opt.optimizer.param_groups:
            group["fused"] = True  # CPU fused AdamW: the kernel the GPU path uses
        if not in_kernel:
            opt._clips_in_kernel = lambda: False
        assert opt._clips_in_kernel() == in_kernel
        norms = []
        for x, y in _batches():
            opt.zero_grad()
            _loss(model, x, y).backward()
            ok, norm, _ = opt.step()
            assert ok and getattr(opt.optimizer, "grad_scale", None) is None
            norms.append(norm)
        return [p.detach().clone() for p in model.parameters()], norms

    params, norms = run(in_kernel=True)
    ref_params, ref_norms = run(in_kernel=False)
    assert norms == ref_norms
    assert (max(norms) > clip_grad) == (clip_grad < 1.0)  # the small clip really clips
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r)


def test_fp16_loss_scaling_skips_overflow_and_recovers():
    model = _model(torch.float16)
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.01, fp16=True, params_dtype=torch.float16,
                                                 initial_loss_scale=1024.0, hysteresis=2, loss_scale_window=2,
                                                 clip_grad=0.0), [model])
    x, y = _batches(torch.float16)[0]

    def step(inject_inf=False):
        opt.zero_grad()
        loss = _loss(model, x, y)
        opt.scale_loss(loss).backward()
        if inject_inf:
            model[0].weight.grad[0, 0] = float("inf")
        return opt.step()

    # The reported grad norm is that of the unscaled loss (fp32 reference on an fp32 copy).
    ref = _model(torch.float32)
    with torch.no_grad():
        for r, p in zip(ref.parameters(), model.parameters()):
            r.copy_(p.float())
    _loss(ref, x.float(), y.float()).backward()
    ref_norm = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm().item()
    ok, grad_norm, _ = step()
    assert ok and grad_norm == pytest.approx(ref_norm, rel=2e-3)
    assert opt.get_loss_scale().item() == 1024.0

    before = [p.detach().clone() for p in model.parameters()]
    assert step(inject_inf=True) == (False, None, None)
    assert opt.get_loss_scale().item() == 1024.0           # hysteresis 2: first overflow tolerated
    assert step(inject_inf=True) == (False, None, None)
    assert opt.get_loss_scale().item() == 512.0            # second overflow halves the scale
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)                           # skipped steps change nothing

    assert step()[0] and step()[0]                         # training recovers...
    assert opt.get_loss_scale().item() == 1024.0           # ...and 2 clean steps (window) double the scale
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_state_dict_round_trip(precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    config = OptimizerConfig(lr=0.01, bf16=precision == "bf16", clip_grad=1.0)
    batches = _batches(dtype)

    model = _model(dtype)
    opt = get_megatron_optimizer(config, [model])
    full = _train(model, opt, batches)

    model = _model(dtype)
    opt = get_megatron_optimizer(config, [model])
    _train(model, opt, batches[:2])
    state, model_state = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    model = _model(dtype)
    model.load_state_dict(model_state)
    resumed = get_megatron_optimizer(config, [model])
    resumed.load_state_dict(state)
    for p, r in zip(_train(model, resumed, batches[2:]), full):
        torch.testing.assert_close(p, r, rtol=0, atol=0)


def test_cpu_offload_equals_on_device():
    model = _model()
    ref = _train(model, get_megatron_optimizer(OptimizerConfig(lr=0.01), [model]), _batches())
    model = _model()
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.01, optimizer_cpu_offload=True,
                                                 optimizer_offload_fraction=0.5), [model])
    masters = opt.get_parameters()
    # The first params covering half the elements got host masters; the rest step in place.
    model_params = list(model.parameters())
    offloaded = [m for m, p in zip(masters, model_params) if m is not p]
    assert offloaded and len(offloaded) < len(model_params)
    assert all(m.device.type == "cpu" for m in offloaded)
    for p, r in zip(_train(model, opt, _batches()), ref):
        torch.testing.assert_close(p, r, rtol=0, atol=0)


def test_bad_config_raises():
    with pytest.raises(ValueError, match="optimizer"):
        OptimizerConfig(optimizer="adagrad")
    with pytest.raises(ValueError, match="lr"):
        get_megatron_optimizer(OptimizerConfig(), [_model()])
    sharded = DistributedDataParallel(_Config(), DistributedDataParallelConfig(use_distributed_optimizer=True),
                                      _model())
    with pytest.raises(ValueError, match="disagree on how they shard the optimizer"):
        get_megatron_optimizer(OptimizerConfig(lr=1.0), [sharded, _model()])


@pytest.mark.parametrize("name", ["adam", "sgd", "lion", "muon"])
def test_init_state_creates_states_without_moving_params(name):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer=name, lr=0.1, muon_fp32_matmul_prec="highest"), [model])
    opt.init_state()
    assert len(opt.state) == len(before)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_offload_uses_this_process_share_of_the_cores(monkeypatch):
    """torchrun's OMP_NUM_THREADS=1 would step the host optimizer on one core."""
    from teratron.optimizer.cpu_offload import use_host_cores

    threads = torch.get_num_threads()
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    try:
        torch.set_num_threads(1)
        assert use_host_cores() == 4
        torch.set_num_threads(3)    # a thread count someone chose stays
        assert use_host_cores() == 3
        torch.set_num_threads(1)    # not under torchrun (e.g. forked test ranks): left alone
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        assert use_host_cores() == 1
    finally:
        torch.set_num_threads(threads)
