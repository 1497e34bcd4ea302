"""Multi-latent attention and YaRN against formulas written out here.

The module's output and every gradient equal a plain-PyTorch MLA computed from the same weights
(with and without query compression, rope and YaRN, the latent norms, a bias); YaRN's frequencies,
correction range and scales equal the numbers the YaRN/DeepSeek formulas give for DeepSeek-V3's
settings; recomputing the up projections ('mla_up_proj', with and without 'core_attn') changes no
value or gradient and frees q, k, v; the flash backend's padded heads change nothing; a GPT model
of MLA layers under TP 2 (with and without sequence parallelism) equals the single process,
parameters, gradients and logits; under FP8 every MLA linear runs FP8 GEMMs, the duplicated down
projections scaled by the whole sequence's amax under SP.
"""

import math

import pytest
import torch
import torch.distributed as dist

from dist import run_distributed
from teratron.distributed import finalize_model_grads
from teratron.models.gpt import GPTModel
from teratron.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_mla_module_spec
from teratron.process_groups import ProcessGroupCollection
from teratron.tensor_parallel import gather_shards
from teratron.transformer.multi_latent_attention import mla_rotary_embedding
from teratron.transformer.rope import yarn_concentration_factor, yarn_inv_freq, yarn_mscale
from teratron.transformer.spec_utils import build_module
from teratron.transformer.transformer_config import MLATransformerConfig, TransformerConfig

H, HEADS, S, B = 32, 4, 9, 2


def make_config(**overrides):
    kwargs = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, q_lora_rank=12, kv_lora_rank=10,
                  qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5, rope_type="yarn", rotary_scaling_factor=4.0,
                  original_max_position_embeddings=8, beta_fast=4.0, beta_slow=1.0, mscale=0.9, mscale_all_dim=0.6,
                  qk_layernorm=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                  ffn_hidden_size=48, use_cpu_initialization=True)
    kwargs.update(overrides)
    return MLATransformerConfig(**kwargs)


def build_attention(config, layer_number=1):
    spec = get_mla_module_spec(config.qk_layernorm)
    torch.manual_seed(0)
    return build_module(spec, config=config, layer_number=layer_number)


# ---------------------------------------------------------------------------------------------
# The math written out.

def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_frequencies(config):
    """Per rotated pair i: base^(-2i/d) for rope (over rotary_percent of d_r); YaRN's blend for yarn."""
    d = config.qk_pos_emb_head_dim
    if config.rope_type == "rope":
        rot = int(d * config.rotary_percent)
        return torch.tensor([config.rotary_base ** (-2 * i / rot) for i in range(rot // 2)], dtype=torch.float64)
    base, s, length = config.rotary_base, config.rotary_scaling_factor, config.original_max_position_embeddings

    def pair_turning(rotations):  # the pair index whose wavelength 2 pi base^(2i/d) fits `rotations` times
        return d * math.log(length / (2 * math.pi * rotations)) / (2 * math.log(base))
    low = max(math.floor(pair_turning(config.beta_fast)), 0)
    high = min(math.ceil(pair_turning(config.beta_slow)), d - 1)
    out = []
    for i in range(d // 2):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep the frequency, 1: divide it by s
        theta = base ** (-2 * i / d)
        out.append(theta / s * ramp + theta * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


def rotate_pairs(t, positions, freqs, factor):
    """Channels (2i, 2i + 1) of t [s, b, n, d] turn by position * freqs[i]; the rest pass; times factor."""
    rot = 2 * len(freqs)
    angle = positions.t().double()[..., None] * freqs.to(positions.device)  # [s, b, rot/2]
    cos, sin = angle.cos()[:, :, None].to(t.dtype), angle.sin()[:, :, None].to(t.dtype)
    even, odd = t[..., 0:rot:2], t[..., 1:rot:2]
    turned = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([turned * factor, t[..., rot:] * factor], dim=-1) if factor != 1.0 else \
        torch.cat([turned, t[..., rot:]], dim=-1)


def reference_mla(x, w, config, positions, with_rope=True):
    """x [s, b, h], w: the module's state dict -> [s, b, h] (bias included), causal."""
    s, b, _ = x.shape
    n, dn, dr, dv = HEADS, config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    eps = config.layernorm_epsilon
    if config.q_lora_rank is None:
        q = x @ w["linear_q_proj.weight"].t()
    else:
        c_q = x @ w["linear_q_down_proj.weight"].t()
        if config.qk_layernorm:
            c_q = rms_norm(c_q, w["q_layernorm.weight"], eps)
        q = c_q @ w["linear_q_up_proj.weight"].t()
    q = q.view(s, b, n, dn + dr)
    kv_combined = x @ w["linear_kv_down_proj.weight"].t()
    c_kv, k_r = kv_combined[..., :config.kv_lora_rank], kv_combined[..., config.kv_lora_rank:]
    if config.qk_layernorm:
        c_kv = rms_norm(c_kv, w["kv_layernorm.weight"], eps)
    kv = (c_kv @ w["linear_kv_up_proj.weight"].t()).view(s, b, n, dn + dv)
    k_n, v = kv[..., :dn], kv[..., dn:]
    q_n, q_r = q[..., :dn], q[..., dn:]
    k_r = k_r[:, :, None, :].expand(s, b, n, dr)
    if with_rope:
        freqs = reference_frequencies(config)
        factor = 1.0
        if config.rope_type == "yarn":
            m = lambda scale: 0.1 * scale * math.log(config.rotary_scaling_factor) + 1  # noqa: E731
            factor = m(config.mscale) / m(config.mscale_all_dim)
        q_r, k_r = rotate_pairs(q_r, positions, freqs, factor), rotate_pairs(k_r, positions, freqs, factor)
    query, key = torch.cat([q_n, q_r], -1), torch.cat([k_n, k_r], -1)
    mscale = 0.1 * config.mscale_all_dim * math.log(config.rotary_scaling_factor) + 1
    scale = mscale * mscale / math.sqrt(dn + dr)
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    context = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(s, b, n * dv)
    out = context @ w["linear_proj.weight"].t()
    return out + w["linear_proj.bias"] if "linear_proj.bias" in w else out


def run_module(attention, x, positions, rotary=None):
    """Output (bias added) and the gradients of x and of every parameter for a fixed weighting."""
    x = x.clone().requires_grad_(True)
    rotary = mla_rotary_embedding(attention.config)(positions) if rotary is None else rotary
    out, bias = attention(x, rotary_pos_emb=rotary)
    out = out if bias is None else out + bias
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    (out * weights).sum().backward()
    module = getattr(attention, "_orig_mod", attention)  # the module inside torch.compile's wrapper
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return out.detach(), x.grad, grads


def run_reference(attention, x, positions, with_rope=True):
    w = {name: p.detach().clone().requires_grad_(True) for name, p in attention.named_parameters()}
    x = x.clone().requires_grad_(True)
    out = reference_mla(x, w, attention.config, positions, with_rope)
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), x.grad, {name: t.grad for name, t in w.items()}


def positions_of(s=S, b=B):
    # Two samples with different positions (a reset inside the second).
    return torch.stack([torch.arange(s), torch.cat([torch.arange(4), torch.arange(s - 4)])])


MODULE_CASES = {
    "yarn, compressed queries, latent norms": {},
    "rope, uncompressed queries, no norms, bias": dict(q_lora_rank=None, rope_type="rope", qk_layernorm=False,
                                                       add_bias_linear=True),
    "rope on half the positional channels": dict(rope_type="rope", rotary_percent=0.5, qk_pos_emb_head_dim=8),
    "yarn, equal mscales (DeepSeek-V3 style), v wider than q": dict(mscale=1.0, mscale_all_dim=1.0,
                                                                     v_head_dim=12),
}


@pytest.mark.parametrize("case", MODULE_CASES)
def test_module_equals_the_math_written_out(case):
    config = make_config(**MODULE_CASES[case])
    attention = build_attention(config)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    positions = positions_of()
    out, x_grad, grads = run_module(attention, x, positions)
    ref_out, ref_x_grad, ref_grads = run_reference(attention, x, positions)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_grad, ref_x_grad, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_parameters_have_megatrons_names_and_shapes():
    attention = build_attention(make_config())
    shapes = {name: tuple(p.shape) for name, p in attention.named_parameters()}
    assert shapes == {
        "linear_q_down_proj.weight": (12, H), "linear_q_up_proj.weight": (HEADS * 10, 12),
        "q_layernorm.weight": (12,), "linear_kv_down_proj.weight": (10 + 4, H),
        "linear_kv_up_proj.weight": (HEADS * (6 + 5), 10), "kv_layernorm.weight": (10,),
        "linear_proj.weight": (H, HEADS * 5),
    }
    plain = build_attention(make_config(q_lora_rank=None, qk_layernorm=False))
    assert {n for n, _ in plain.named_parameters()} == {
        "linear_q_proj.weight", "linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "linear_proj.weight"}


# ---------------------------------------------------------------------------------------------
# YaRN.

def test_yarn_frequencies_for_deepseek_v3():
    """d_r 64, base 10000, factor 40 over 4096 positions, beta 32/1: the correction range is pairs
    10..23 (64 ln(4096 / (2 pi 32)) / (2 ln 10000) = 10.47 rounded down, 64 ln(4096 / (2 pi)) /
    (2 ln 10000) = 22.51 rounded up)."""
    d, base = 64, 10000.0
    assert math.floor(d * math.log(4096 / (2 * math.pi * 32)) / (2 * math.log(base))) == 10
    assert math.ceil(d * math.log(4096 / (2 * math.pi)) / (2 * math.log(base))) == 23
    freqs = yarn_inv_freq(d, base, 40.0, 4096, 32.0, 1.0).double()
    theta = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    torch.testing.assert_close(freqs[:11], theta[:11], rtol=1e-6, atol=0)  # short wavelengths kept
    torch.testing.assert_close(freqs[23:], theta[23:] / 40, rtol=1e-6, atol=0)  # long ones interpolated
    for i in range(11, 23):
        ramp = (i - 10) / 13
        assert freqs[i].item() == pytest.approx(theta[i].item() * (1 - ramp) + theta[i].item() / 40 * ramp, rel=1e-6)
    config = MLATransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, qk_pos_emb_head_dim=64)
    angles = mla_rotary_embedding(config)(torch.tensor([[0, 3]]))  # [s=2, b=1, 1, 64], pairs side by side
    torch.testing.assert_close(angles[1, 0, 0, 0::2].double(), 3 * freqs, rtol=1e-6, atol=0)
    torch.testing.assert_close(angles[1, 0, 0, 1::2].double(), 3 * freqs, rtol=1e-6, atol=0)


def test_yarn_scales():
    # DeepSeek-V3: mscale = mscale_all_dim = 1: the rotation is not rescaled and the softmax
    # scale grows by (0.1 ln 40 + 1)^2.
    assert yarn_mscale(40, 1.0) == pytest.approx(1.3688879454113936)
    assert yarn_mscale(1.0, 1.0) == 1.0 and yarn_mscale(0.5, 3.0) == 1.0  # no scaling: no change
    assert yarn_concentration_factor(40, 1.0, 1.0) == 1.0
    # DeepSeek-V2 Lite style mscale 0.707 over mscale_all_dim 0.707 and an unequal pair.
    assert yarn_concentration_factor(40, 1.0, 0.5) == pytest.approx(1.3688879454113936 / 1.1844439727056968)
    attention = build_attention(make_config(qk_head_dim=128, qk_pos_emb_head_dim=64, rotary_scaling_factor=40.0,
                                            mscale=1.0, mscale_all_dim=1.0))
    assert attention.softmax_scale == pytest.approx(1.3688879454113936 ** 2 / math.sqrt(192))
    assert attention.rope_concentration == 1.0
    # rope_type 'rope' keeps Megatron's softmax correction (mscale_all_dim 0 by default: none).
    rope = build_attention(make_config(rope_type="rope", mscale_all_dim=0.0))
    assert rope.softmax_scale == pytest.approx(1 / math.sqrt(10)) and rope.rope_concentration == 1.0


# ---------------------------------------------------------------------------------------------
# Recompute, padded heads, errors.

def _saved_storage_bytes(attention, x, positions):
    """Bytes of the storages autograd keeps after the forward (parameters excluded), then backward."""
    import weakref

    saved = []
    rotary = mla_rotary_embedding(attention.config)(positions)
    x = x.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(weakref.ref(t)) or t, lambda t: t):
        out, _ = attention(x, rotary_pos_emb=rotary)
    params = {p.untyped_storage().data_ptr() for p in attention.parameters()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (r() for r in saved)
                if t is not None}
    out.sum().backward()
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("modules", [["mla_up_proj"], ["mla_up_proj", "core_attn"]])
def test_recomputing_the_up_projections_changes_nothing_but_memory(modules):
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    positions = positions_of()
    plain = build_attention(make_config())
    recomputed = build_attention(make_config(recompute_granularity="selective", recompute_modules=modules))
    expected, actual = run_module(plain, x, positions), run_module(recomputed, x, positions)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    for name in expected[2]:
        assert torch.equal(actual[2][name], expected[2][name]), name
    # The value (d_v per head and token) core attention keeps is freed until backward. (CPU's SDPA
    # math kernel, taken for unequal head sizes, keeps its own scaled copies of q and k; GPU
    # kernels keep q and k themselves, which are freed too.)
    value_bytes = 4 * S * B * HEADS * 5
    saved_plain = _saved_storage_bytes(build_attention(make_config()), x, positions)
    saved_recomputed = _saved_storage_bytes(recomputed, x, positions)
    assert saved_plain - saved_recomputed >= value_bytes


def test_flash_backend_pads_heads_to_one_size_and_changes_nothing():
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(3))
    positions = positions_of()
    auto = run_module(build_attention(make_config()), x, positions)
    padded = build_attention(make_config(attention_backend="flash"))
    assert padded.pad_heads and padded.hn == 10
    flash = run_module(padded, x, positions)
    torch.testing.assert_close(flash[0], auto[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(flash[1], auto[1], rtol=1e-6, atol=1e-7)


def test_config_errors():
    with pytest.raises(ValueError, match="needs an MLATransformerConfig"):
        build_module(get_mla_module_spec(), config=TransformerConfig(
            num_layers=1, hidden_size=32, num_attention_heads=4, multi_latent_attention=True), layer_number=1)
    errors = [
        (dict(q_lora_rank=0), "q_lora_rank must be a positive integer or None"),
        (dict(kv_lora_rank=None), "kv_lora_rank must be a positive integer"),
        (dict(qk_pos_emb_head_dim=5), "qk_pos_emb_head_dim .5. must be even"),
        (dict(rotary_scaling_factor=0.0), "rotary_scaling_factor must be positive"),
        (dict(rope_type="ntk"), "rope_type='ntk' is not valid"),
    ]
    for overrides, message in errors:
        with pytest.raises(ValueError, match=message):
            make_config(**overrides)
    with pytest.raises(ValueError, match="'mla_up_proj' but multi_latent_attention is False"):
        TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, recompute_granularity="selective",
                          recompute_modules=["mla_up_proj"])


# ---------------------------------------------------------------------------------------------
# Tensor and sequence parallelism (GPT model of MLA layers).

VOCAB = 64
TP_CASES = [dict(sequence_parallel=False), dict(sequence_parallel=True),
            dict(sequence_parallel=True, q_lora_rank=None, rope_type="rope", qk_layernorm=False,
                 add_bias_linear=True, recompute_granularity="selective",
                 recompute_modules=["mla_up_proj", "core_attn"])]


def build_gpt(tp, pg_collection=None, **overrides):
    config = make_config(tensor_model_parallel_size=tp, **overrides)
    torch.manual_seed(5)
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, multi_latent_attention=True,
                                    normalization="RMSNorm")
    return GPTModel(config, spec, VOCAB, 16, position_embedding_type="rope",
                    pg_collection=pg_collection or ProcessGroupCollection())


def gpt_forward_backward(model, pg_collection=None):
    g = torch.Generator().manual_seed(9)
    ids, labels = torch.randint(0, VOCAB, (2, 12), generator=g), torch.randint(0, VOCAB, (2, 12), generator=g)
    positions = positions_of(12)
    loss = model(ids, positions, labels=labels)
    (loss * torch.rand(loss.shape, generator=g)).sum().backward()
    finalize_model_grads([model], pg_collection=pg_collection or ProcessGroupCollection())
    params = {name: (p.detach().clone(), p.grad.clone(), getattr(p, "tensor_model_parallel", False),
                     getattr(p, "partition_dim", -1)) for name, p in model.named_parameters()}
    return loss.detach(), params


def _tp2_ranks(cases):
    pg = ProcessGroupCollection(tp=dist.new_group([0, 1]))
    return [gpt_forward_backward(build_gpt(2, pg, **case), pg) for case in cases]


def test_tensor_and_sequence_parallel_equal_the_single_process():
    per_rank = run_distributed(_tp2_ranks, 2, TP_CASES)
    for i, case in enumerate(TP_CASES):
        reference_loss, reference = gpt_forward_backward(build_gpt(1, **case))
        ranks = [per_rank[r][i] for r in range(2)]
        for loss, _ in ranks:
            torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)
        for name, (value, grad, *_) in reference.items():
            _, _, sharded, dim = ranks[0][1][name]
            for which, index, expected in (("value", 0, value), ("grad", 1, grad)):
                if sharded:
                    actual = [gather_shards([params[name][index] for _, params in ranks], dim, 1)]
                else:  # replicated (down projections, norms): equal on both ranks
                    actual = [params[name][index] for _, params in ranks]
                for tensor in actual:
                    torch.testing.assert_close(tensor, expected, rtol=1e-5, atol=1e-6,
                                               msg=f"{case} {name} {which}")


# ---------------------------------------------------------------------------------------------
# FP8: every linear of MLA, the duplicated down projections included, runs FP8 GEMMs.

FP8 = dict(hidden_size=64, ffn_hidden_size=64, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
           qk_pos_emb_head_dim=16, v_head_dim=16, bf16=True, params_dtype=torch.bfloat16, fp8="hybrid",
           fp8_recipe="delayed")


def fp8_forward_backward(tp, sp, pg_collection=None):
    config = make_config(tensor_model_parallel_size=tp, sequence_parallel=sp, **FP8)
    torch.manual_seed(5)
    model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=True, multi_latent_attention=True,
                                                      normalization="RMSNorm"),
                     VOCAB, 16, position_embedding_type="rope", pg_collection=pg_collection or ProcessGroupCollection())
    g = torch.Generator().manual_seed(9)
    ids, labels = torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)
    loss = model(ids, None, labels=labels)
    loss.float().mean().backward()
    fp8_layers = sorted(name for name, m in model.named_modules() if getattr(m, "fp8", None) is not None)
    amaxes = {name: m.amax_history[0].item() for name, m in model.named_modules()
              if name.endswith("_scaler") and hasattr(m, "amax_history")}
    return {"loss": loss.detach().float(), "fp8_layers": fp8_layers, "amaxes": amaxes}


def _fp8_ranks():
    pg = ProcessGroupCollection(tp=dist.group.WORLD)
    return {sp: fp8_forward_backward(2, sp, pg) for sp in (False, True)}


def test_fp8_linears_under_tp_and_sp():
    reference = fp8_forward_backward(1, False)
    linears = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    assert reference["fp8_layers"] == sorted(f"decoder.layers.{i}.{part}" for i in (0, 1) for part in (
        [f"self_attention.{name}" for name in linears] + ["mlp.linear_fc1", "mlp.linear_fc2"]))
    for sp, result in zip((False, True), [r for r in run_distributed(_fp8_ranks, 2)[0].values()]):
        # The down projections' input and weight scales equal TP 1's: under SP each rank's slice
        # of the sequence is quantised with the amax of the whole sequence (reduced over TP).
        for part in ("linear_q_down_proj", "linear_kv_down_proj"):
            for scaler in ("input_scaler", "weight_scaler"):
                name = f"decoder.layers.0.self_attention.{part}.fp8.{scaler}"
                assert result["amaxes"][name] == reference["amaxes"][name], (sp, name)
        loss = result["loss"]  # within e4m3's rounding error per token, bf16's on the mean
        assert ((loss - reference["loss"]).abs() <= 2**-4 * reference["loss"].abs()).all(), sp
        assert abs(loss.mean() - reference["loss"].mean()) <= 2**-8 * reference["loss"].mean(), sp


# ---------------------------------------------------------------------------------------------
# On a GPU: DeepSeek's head sizes (q, k 128 + 64, v 128) through SDPA's own choice, the padded
# flash kernel and torch.compile, bf16, against the math written out in fp32.

def _relative_error(actual, expected):
    return ((actual.float() - expected).norm() / expected.norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend,compiled", [("auto", False), ("flash", False), ("auto", True)])
def test_gpu_deepseek_head_sizes_in_bf16_equal_the_math_in_fp32(backend, compiled):
    check_deepseek_head_sizes(backend, compiled, "cuda", torch.bfloat16)


def check_deepseek_head_sizes(backend, compiled, device, dtype):
    config = make_config(hidden_size=256, q_lora_rank=64, kv_lora_rank=64, qk_head_dim=128, qk_pos_emb_head_dim=64,
                         v_head_dim=128, original_max_position_embeddings=64, attention_backend=backend)
    attention = build_attention(config).to(device, dtype)
    s, b = 256, 2
    x = torch.randn(s, b, 256, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    positions = positions_of(s, b).to(device)
    rotary = mla_rotary_embedding(config)(positions)
    module = torch.compile(attention) if compiled else attention
    out, x_grad, grads = run_module(module, x, positions, rotary)
    w = {name: p.detach().float().requires_grad_(True) for name, p in attention.named_parameters()}
    x_ref = x.float().requires_grad_(True)
    ref = reference_mla(x_ref, w, config, positions)
    (ref * torch.linspace(-1, 1, ref.numel(), device=device).view_as(ref)).sum().backward()
    # bf16 inputs and outputs with fp32 accumulation: a few bf16 roundings (2^-8 each) in the norm.
    assert _relative_error(out, ref.detach()) < 2e-2
    assert _relative_error(x_grad, x_ref.grad) < 2e-2
    for name, grad in grads.items():
        assert _relative_error(grad, w[name].grad) < 2e-2, name
