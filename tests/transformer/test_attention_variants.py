"""Sliding windows, attention sinks, NoPE layers and the clamped GLU against plain formulas written
out here: a per-query softmax loop over the keys a window lets through, with the sink's logit
added to the denominator; the MLP's equation from its weights. CPU runs the reference kernel in
training and FlexAttention (forward) directly; the GPU test checks the compiled FlexAttention
path, forward and backward."""

import math

import pytest
import torch
import torch.nn.functional as F

from teratron.models.gpt import get_gpt_layer_local_spec
from teratron.transformer import cudnn_window_attention
from teratron.transformer.dot_product_attention import (DotProductAttention, block_mask_for,
                                                        flex_attention_with_sink, is_layer_window_attention)
from teratron.transformer.enums import AttnMaskType
from teratron.transformer.mlp import MLP, MLPSubmodules, quick_gelu
from teratron.transformer.moe.experts import GroupedMLP
from teratron.transformer.rope import RotaryEmbedding, yarn_inv_freq
from teratron.transformer.spec_utils import build_module
from teratron.transformer.transformer_config import TransformerConfig
from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def make_config(**overrides):
    kwargs = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0,
                  hidden_dropout=0.0, use_cpu_initialization=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def looped_attention(q, k, v, scale, window=None, causal=True, sink=None, masked=None):
    """q [sq, b, n, hn], k and v [sk, b, g, hn] -> [sq, b, n * hn] in float64, one query at a time:
    query i sees key j when j <= i (causal), i - j <= left and j - i <= right (window, -1 no bound)
    and masked[b, 0, i, j] is False; its weights are exp(s_j) / (exp(sink[n]) + sum exp(s_k))."""
    q, k, v = q.double(), k.double(), v.double()
    sq, b, n, hn = q.shape
    per_group = n // k.shape[2]
    left, right = window if window is not None else (-1, -1)
    out = torch.zeros(sq, b, n, hn, dtype=torch.float64)
    for i in range(sq):
        keys = [j for j in range(k.shape[0]) if (not causal or j <= i) and (left < 0 or i - j <= left)
                and (right < 0 or j - i <= right)]
        for bi in range(b):
            seen = [j for j in keys if masked is None or not masked[bi, 0, i, j]]
            if not seen:
                continue  # a query that sees nothing gets a zero context
            for h in range(n):
                g = h // per_group
                logits = torch.stack([q[i, bi, h] @ k[j, bi, g] * scale for j in seen])
                extra = [] if sink is None else [sink[h].double()]
                shift = torch.stack(list(logits) + extra).max()
                weights = torch.exp(logits - shift)
                denominator = weights.sum() + sum(torch.exp(e - shift) for e in extra)
                out[i, bi, h] = sum(w * v[j, bi, g] for w, j in zip(weights / denominator, seen))
    return out.reshape(sq, b, n * hn)


SOFTMAX_TYPES = ["vanilla", "off-by-one", "learnable"]


def _attention(softmax_type, window, backend="auto", mask_type=AttnMaskType.causal):
    config = make_config(softmax_type=softmax_type, window_size=window, attention_backend=backend)
    attn = DotProductAttention(config, layer_number=1, attn_mask_type=mask_type)
    if softmax_type == "learnable":
        with torch.no_grad():
            attn.softmax_offset.copy_(torch.tensor([1.5, -2.0, 0.3, 3.0]))
    return attn


def _sink(attn):
    return None if attn.softmax_offset is None else attn.softmax_offset.detach()


def _qkv(s=9, b=2, seed=0):
    torch.manual_seed(seed)
    return torch.randn(s, b, 4, 8), torch.randn(s, b, 2, 8), torch.randn(s, b, 2, 8)


@pytest.mark.parametrize("softmax_type", SOFTMAX_TYPES)
@pytest.mark.parametrize("window", [None, (3, 0), (2, -1), (0, 0)])
def test_window_and_sink_equal_the_looped_formula_on_every_path(softmax_type, window):
    """The reference kernel (CPU training, unfused backend) and FlexAttention (run directly,
    forward) give the loop's output; GQA, causal."""
    q, k, v = _qkv()
    for backend in ("auto", "unfused"):
        attn = _attention(softmax_type, window, backend)
        expected = looped_attention(q, k, v, 1 / math.sqrt(8), window, sink=_sink(attn))
        torch.testing.assert_close(attn(q, k, v).double(), expected, rtol=1e-5, atol=1e-6)
    flex_out = _flex(attn, q, k, v, causal=True)
    torch.testing.assert_close(flex_out.double(), expected, rtol=1e-5, atol=1e-6)


def _flex(attn, q, k, v, causal, attention_mask=None):
    """DotProductAttention's FlexAttention path on CPU tensors (forward only: no CPU backward)."""
    with torch.no_grad():
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        block_mask = block_mask_for(q.shape[0], k.shape[0], causal, attn.window_size, "cpu", attention_mask)
        out = flex_attention_with_sink(qb, kb, vb, block_mask, attn.softmax_scale, attn.softmax_offset)
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_two_sided_window_without_causal_mask_and_with_an_explicit_mask(softmax_type):
    """A non-causal layer keeps both sides of the window; an explicit mask is hidden on top of it
    (one query sees nothing: zero context)."""
    q, k, v = _qkv(seed=1)
    attn = _attention(softmax_type, (2, 1), mask_type=AttnMaskType.no_mask)
    expected = looped_attention(q, k, v, 1 / math.sqrt(8), (2, 1), causal=False, sink=_sink(attn))
    torch.testing.assert_close(attn(q, k, v).double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_flex(attn, q, k, v, causal=False).double(), expected, rtol=1e-5, atol=1e-6)
    masked = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(3)) < 0.3
    masked[1, 0, 4] = True
    expected = looped_attention(q, k, v, 1 / math.sqrt(8), (2, 1), causal=False, sink=_sink(attn), masked=masked)
    assert torch.equal(expected[4, 1], torch.zeros(32, dtype=torch.float64))
    torch.testing.assert_close(attn(q, k, v, masked).double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_flex(attn, q, k, v, False, masked).double(), expected, rtol=1e-5, atol=1e-6)


def test_gradients_reach_queries_keys_values_and_the_learned_sink():
    """Backward of the reference kernel equals the loop's autograd, the sink logits included."""
    q, k, v = (t.requires_grad_() for t in _qkv(s=6, b=1, seed=2))
    attn = _attention("learnable", (2, 0))
    upstream = torch.randn(6, 1, 32, dtype=torch.float64)
    (attn(q, k, v).double() * upstream).sum().backward()
    sink = attn.softmax_offset.detach().double().requires_grad_()
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    (looped_attention(*leaves, 1 / math.sqrt(8), (2, 0), sink=sink) * upstream).sum().backward()
    for ours, theirs in zip((q, k, v, attn.softmax_offset), (*leaves, sink)):
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=1e-5, atol=1e-6)
    assert attn.softmax_offset.grad.abs().min() > 0


def test_which_layers_use_the_window():
    """Megatron's rule: every layer; all but every N-th; the layers a 0/1 list marks 1."""
    window = (4, 0)
    assert [is_layer_window_attention(window, None, n) for n in range(1, 5)] == [True] * 4
    assert [is_layer_window_attention(window, 4, n) for n in range(1, 9)] == [True] * 3 + [False] + [True] * 3 + [False]
    assert [is_layer_window_attention(window, [1, 0, 0, 1], n) for n in range(1, 5)] == [True, False, False, True]
    assert not is_layer_window_attention(None, 2, 1)
    config = make_config(window_size=[4, 0], window_attn_skip_freq=2)
    assert config.window_size == (4, 0)
    assert [DotProductAttention(config, n).window_size for n in (1, 2, 3, 4)] == [(4, 0), None, (4, 0), None]


def test_sink_logits_per_rank_heads_and_off_by_one_is_a_zero_buffer():
    attn = DotProductAttention(make_config(softmax_type="learnable"), 1)
    offset = attn.softmax_offset
    assert isinstance(offset, torch.nn.Parameter) and offset.shape == (4,)
    assert (offset.tensor_model_parallel, offset.partition_dim) == (True, 0)
    assert "softmax_offset" in attn.state_dict()
    attn = DotProductAttention(make_config(softmax_type="off-by-one"), 1)
    assert torch.equal(attn.softmax_offset, torch.zeros(4)) and not list(attn.parameters())
    assert "softmax_offset" not in attn.state_dict()
    assert DotProductAttention(make_config(), 1).softmax_offset is None


def test_nope_layers_leave_queries_and_keys_unrotated():
    """On a layer no_rope_freq marks, self-attention with RoPE angles equals self-attention without
    them; on the other layers the angles change the output."""
    config = make_config(no_rope_freq=2)
    assert config.no_rope_freq == [0, 1, 0, 1]
    assert make_config(no_rope_freq=[0, 0, 1, 0]).no_rope_freq == [0, 0, 1, 0]
    torch.manual_seed(4)
    x = torch.randn(6, 2, 32)
    angles = RotaryEmbedding(8)(torch.arange(6).expand(2, 6))
    for layer_number, nope in ((1, False), (2, True)):
        layer = build_module(get_gpt_layer_local_spec(), config=config, layer_number=layer_number)
        rotated, _ = layer.self_attention(x, rotary_pos_emb=angles)
        plain, _ = layer.self_attention(x, rotary_pos_emb=None)
        assert torch.equal(rotated, plain) == nope, layer_number


def _clamped_glu(x, w1, w2, limit, offset=0.0, act=F.silu):
    gate, up = (x @ w1.t()).chunk(2, dim=-1)
    return (act(gate.clamp(max=limit)) * (up.clamp(-limit, limit) + offset)) @ w2.t()


def test_clamped_swiglu_in_the_mlp_and_the_experts():
    """act(min(gate, L)) * (clamp(up, -L, L) + offset), with values beyond L on both sides."""
    config = make_config(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                         activation_func_clamp_value=0.5, init_method_std=0.5, ffn_hidden_size=16)
    torch.manual_seed(5)
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    x = torch.randn(5, 2, 32)
    fc1 = x @ mlp.linear_fc1.weight.t()
    assert (fc1 > 0.5).any() and (fc1 < -0.5).any()
    out, _ = mlp(x)
    torch.testing.assert_close(out, _clamped_glu(x, mlp.linear_fc1.weight, mlp.linear_fc2.weight, 0.5))
    unclamped = F.silu(fc1.chunk(2, -1)[0]) * fc1.chunk(2, -1)[1] @ mlp.linear_fc2.weight.t()
    assert not torch.allclose(out, unclamped)
    offset = make_config(gated_linear_unit=True, activation_func=F.gelu, add_bias_linear=False, glu_linear_offset=1.0,
                         activation_func_clamp_value=0.5, init_method_std=0.5, ffn_hidden_size=16)
    mlp = MLP(offset, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    torch.testing.assert_close(mlp(x)[0], _clamped_glu(x, mlp.linear_fc1.weight, mlp.linear_fc2.weight, 0.5,
                                                       offset=1.0, act=F.gelu))

    # gpt-oss's experts: quick GELU of min(gate, L), times clamp(up, -L, L) + 1.
    quick = make_config(gated_linear_unit=True, activation_func=quick_gelu, add_bias_linear=False,
                        glu_linear_offset=1.0, activation_func_clamp_value=0.5, init_method_std=0.5, ffn_hidden_size=16)
    mlp = MLP(quick, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    torch.testing.assert_close(mlp(x)[0], _clamped_glu(x, mlp.linear_fc1.weight, mlp.linear_fc2.weight, 0.5,
                                                       offset=1.0, act=lambda g: g * torch.sigmoid(1.702 * g)))

    moe = make_config(gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, num_moe_experts=2,
                      moe_ffn_hidden_size=16, activation_func_clamp_value=0.5, init_method_std=0.5)
    experts = GroupedMLP(2, moe)
    tokens, probs = torch.randn(7, 32), torch.rand(7)
    out = experts(tokens, [3, 4], probs)
    expected = torch.cat([_clamped_glu(chunk, experts.weight1[e].t(), experts.weight2[e].t(), 0.5)
                          for e, chunk in enumerate(tokens.split([3, 4]))]) * probs[:, None]
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("fields, message", [
    (dict(window_size=(4,)), r"^window_size=\(4,\) must be two ints \(left, right\)"),
    (dict(window_size=(-2, 0)), r"^window_size=\(-2, 0\) must be two ints"),
    (dict(window_attn_skip_freq=2), r"^window_attn_skip_freq is set but window_size is None"),
    (dict(window_size=(4, 0), window_attn_skip_freq=[1, 0]), r"^window_attn_skip_freq=\[1, 0\] must be an int"),
    (dict(window_size=(4, 0), window_attn_skip_freq=0), r"^window_attn_skip_freq=0 must be >= 1"),
    (dict(no_rope_freq=3), r"^no_rope_freq=3 must divide num_layers \(4\)"),
    (dict(no_rope_freq=[0, 2, 0, 0]), r"^no_rope_freq=\[0, 2, 0, 0\] must be an int >= 1 or a list of 0/1"),
    (dict(softmax_type="sink"), r"^softmax_type='sink' is not valid"),
    (dict(activation_func_clamp_value=1.0), r"^activation_func_clamp_value clamps a gated MLP"),
    (dict(gated_linear_unit=True, activation_func_clamp_value=0.0), r"^activation_func_clamp_value=0.0 must be"),
    (dict(gated_linear_unit=True, activation_func_clamp_value=float("inf")), r"^activation_func_clamp_value=inf"),
])
def test_bad_values_are_refused_with_one_line_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        make_config(**fields)
    assert "\n" not in str(error.value)


def test_flags_parse_and_errors_name_the_flags():
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import run_config_from_args

    base = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--swiglu",
            "--position-embedding-type", "rope"]

    def run(*argv):
        return run_config_from_args(parse_train_args(base + list(argv)), 1, vocab_size=64, cuda=False)

    t = run("--window-size", "(128,0)", "--window-attn-skip-freq", "([1]*3+[0])", "--softmax-type", "learnable",
            "--no-rope-freq", "2", "--activation-func-clamp-value", "7").transformer
    assert (t.window_size, t.window_attn_skip_freq, t.softmax_type) == ((128, 0), [1, 1, 1, 0], "learnable")
    assert (t.no_rope_freq, t.activation_func_clamp_value) == ([0, 1, 0, 1], 7.0)
    assert run("--window-size", "[64, 0]").transformer.window_size == (64, 0)
    for argv, message in [
        (["--window-size", "4"], r"^--window-size=\(4,\) must be two ints"),
        (["--window-size", "a,b"], r"^argument --window-size: 'a,b' is not two ints such as '4096,0'"),
        (["--no-rope-freq", "3"], r"^--no-rope-freq=3 must divide --num-layers \(4\)"),
        (["--window-attn-skip-freq", "2"], r"^--window-attn-skip-freq is set but --window-size is None"),
        (["--no-rope-freq", "2", "--position-embedding-type", "learned_absolute"],
         r"^--no-rope-freq picks layers that skip RoPE, but --position-embedding-type='learned_absolute'"),
        (["--activation-func-clamp-value", "-1"], r"^--activation-func-clamp-value=-1.0 must be a finite number"),
        (["--softmax-type", "sink"], r"^argument --softmax-type: invalid choice: 'sink'"),
    ]:
        with pytest.raises(ValueError, match=message):
            run(*argv)


def test_quick_geglu_flags_and_the_checkpoint_record():
    """--quick-geglu --glu-linear-offset 1 (gpt-oss's experts): gated quick GELU in the config, and
    the model args a checkpoint records rebuild it; --swiglu with it is refused."""
    from teratron.dist_checkpointing.model_args import gpt_config_from_model_args, model_args_from_config
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import run_config_from_args

    base = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
            "--position-embedding-type", "rope", "--quick-geglu", "--glu-linear-offset", "1"]
    run = run_config_from_args(parse_train_args(base), 1, vocab_size=64, cuda=False)
    t = run.transformer
    assert (t.gated_linear_unit, t.activation_func, t.glu_linear_offset, t.ffn_hidden_size) == (
        True, quick_gelu, 1.0, 128)
    record = model_args_from_config(run.model)
    assert (record["quick_geglu"], record["swiglu"], record["glu_linear_offset"]) == (True, False, 1.0)
    rebuilt = gpt_config_from_model_args(record).transformer
    assert (rebuilt.gated_linear_unit, rebuilt.activation_func, rebuilt.glu_linear_offset) == (True, quick_gelu, 1.0)
    with pytest.raises(ValueError, match=r"^--quick-geglu and --swiglu each choose"):
        run_config_from_args(parse_train_args(base + ["--swiglu"]), 1, vocab_size=64, cuda=False)


def test_yarn_frequencies_with_fractional_bounds():
    """gpt-oss's YaRN (head 64, base 150000, factor 32 over 4096 positions, beta 32/1, truncate
    False): the ramp runs between the unrounded correction dims 8.09 and 17.40."""
    d, base = 64, 150000.0
    low = d * math.log(4096 / (2 * math.pi * 32)) / (2 * math.log(base))
    high = d * math.log(4096 / (2 * math.pi)) / (2 * math.log(base))
    assert (round(low, 2), round(high, 2)) == (8.09, 17.4)
    freqs = yarn_inv_freq(d, base, 32.0, 4096, 32.0, 1.0, round_to_int=False).double()
    for i in range(d // 2):
        theta = base ** (-2 * i / d)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        assert freqs[i].item() == pytest.approx(theta * (1 - ramp) + theta / 32 * ramp, rel=1e-6), i
    assert not torch.equal(freqs, yarn_inv_freq(d, base, 32.0, 4096, 32.0, 1.0).double())  # rounded: 8..18


def _yarn_model(position_embedding_type, **transformer):
    from teratron.models.gpt.builder import build_gpt_model
    from teratron.models.gpt.gpt_config import GPTModelConfig

    config = make_config(num_layers=2, add_bias_linear=False, **transformer)
    torch.manual_seed(3)
    return build_gpt_model(GPTModelConfig(config, vocab_size=64, max_position_embeddings=32,
                                          position_embedding_type=position_embedding_type, rotary_base=500,
                                          make_vocab_size_divisible_by=1))


def test_yarn_of_plain_attention_scales_queries_and_keys_by_the_concentration_factor():
    """position_embedding_type 'yarn': YaRN's frequencies, and the rotated q and k each times
    m = mscale(4, 1) / mscale(4, 0.5), i.e. the logits times m^2: equal to RoPE with those
    frequencies and softmax_scale m^2 / sqrt(hn)."""
    yarn = dict(yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=8, yarn_mscale=1.0,
                yarn_mscale_all_dim=0.5, yarn_correction_range_round_to_int=False)
    model = _yarn_model("yarn", **yarn)
    m = (0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1)
    rope = _yarn_model("rope", softmax_scale=m * m / math.sqrt(8))
    rope.load_state_dict(model.state_dict())
    rope.rotary_pos_emb.inv_freq.copy_(yarn_inv_freq(8, 500.0, 4.0, 8, 32.0, 1.0, round_to_int=False))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, None), rope(ids, None))
        assert not torch.allclose(model(ids, None), _yarn_model("rope")(ids, None))
    from teratron.dist_checkpointing.model_args import gpt_config_from_model_args, model_args_from_config
    from teratron.models.gpt.gpt_config import GPTModelConfig

    record = model_args_from_config(GPTModelConfig(make_config(**yarn), vocab_size=64, max_position_embeddings=32,
                                                   position_embedding_type="yarn"))
    assert (record["rotary_scaling_factor"], record["yarn_correction_range_round_to_int"]) == (4.0, False)
    rebuilt = gpt_config_from_model_args(record).transformer
    assert {k: getattr(rebuilt, k) for k in yarn} == yarn
    with pytest.raises(ValueError, match=r"^yarn_rotary_scaling_factor=4.0 is set but position_embedding_type='rope'"):
        _yarn_model("rope", yarn_rotary_scaling_factor=4.0)


def test_yarn_flags_of_plain_attention():
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import run_config_from_args

    base = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"]

    def run(*argv):
        return run_config_from_args(parse_train_args(base + list(argv)), 1, vocab_size=64, cuda=False)

    t = run("--position-embedding-type", "yarn", "--rotary-scaling-factor", "32", "--mscale-all-dim", "0.5",
            "--yarn-original-max-position-embeddings", "4096", "--yarn-beta-fast", "16",
            "--no-yarn-correction-range-round-to-int").transformer
    assert (t.yarn_rotary_scaling_factor, t.yarn_mscale, t.yarn_mscale_all_dim, t.yarn_beta_fast, t.yarn_beta_slow,
            t.yarn_original_max_position_embeddings, t.yarn_correction_range_round_to_int) == (
        32.0, 1.0, 0.5, 16.0, 1.0, 4096, False)
    assert run("--position-embedding-type", "yarn").transformer.yarn_correction_range_round_to_int
    for argv, message in [
        (["--position-embedding-type", "rope", "--rotary-scaling-factor", "4"],
         r"^--rotary-scaling-factor set without --multi-latent-attention \(or --position-embedding-type yarn\)"),
        (["--position-embedding-type", "yarn", "--q-lora-rank", "4"], r"^--q-lora-rank set without --multi-latent"),
        (["--position-embedding-type", "rope", "--no-yarn-correction-range-round-to-int"],
         r"^--yarn-correction-range-round-to-int applies to --position-embedding-type yarn"),
        (["--position-embedding-type", "yarn", "--rotary-percent", "0.5"],
         r"^--position-embedding-type=.yarn. rotates every channel; --rotary-percent 0.5 must be 1.0"),
    ]:
        with pytest.raises(ValueError, match=message):
            run(*argv)


def needs_cuda(test):
    """A GPU test: skipped without CUDA, and marked `gpu` so conftest.py leaves CUDA visible."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softmax_type", SOFTMAX_TYPES)
def test_gpu_flex_attention_matches_the_reference_forward_and_backward(dtype, softmax_type, monkeypatch):
    """Compiled FlexAttention (auto backend) against the reference kernel (unfused) on the GPU:
    outputs and the gradients of q, k, v and the learned sink; windowed (cached block mask) and
    full layers, causal, GQA, a sequence that is not a multiple of the block size. cuDNN's native
    window is kept off, so the vanilla bf16 window runs FlexAttention too."""
    monkeypatch.setattr(cudnn_window_attention, "available", lambda *args: False)
    torch.manual_seed(0)
    s, b, n, g, hn = 300, 2, 8, 2, 64
    tolerance = dict(rtol=3e-2, atol=3e-2) if dtype == torch.bfloat16 else dict(rtol=2e-4, atol=2e-4)
    for window in ((37, 0), None):
        q = torch.randn(s, b, n, hn, device="cuda", dtype=dtype)
        k, v = (torch.randn(s, b, g, hn, device="cuda", dtype=dtype) for _ in range(2))
        upstream = torch.randn(s, b, n * hn, device="cuda", dtype=dtype)
        results = []
        for backend in ("auto", "unfused"):
            config = make_config(num_attention_heads=n, hidden_size=n * hn, num_query_groups=g, window_size=window,
                                 softmax_type=softmax_type, attention_backend=backend, params_dtype=dtype,
                                 use_cpu_initialization=False)
            attn = DotProductAttention(config, layer_number=1)
            if softmax_type == "learnable":
                with torch.no_grad():
                    attn.softmax_offset.copy_(torch.linspace(-3, 3, n))
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = attn(*leaves)
            (out * upstream).sum().backward()
            sink_grad = [attn.softmax_offset.grad] if softmax_type == "learnable" else []
            results.append([out] + [t.grad for t in leaves] + sink_grad)
        for ours, reference in zip(*results):
            torch.testing.assert_close(ours.float(), reference.float(), **tolerance)
    if softmax_type == "vanilla":
        assert block_mask_for(s, s, True, (37, 0), "cuda") is block_mask_for(s, s, True, (37, 0), "cuda")


def _gated_attention(pg_collection=None, **fields):
    from teratron.transformer.attention import SelfAttention

    torch.manual_seed(11)
    config = make_config(attention_output_gate=True, add_bias_linear=False, **fields)
    spec = get_gpt_layer_local_spec().submodules.self_attention
    return SelfAttention(config, spec.submodules, 1, pg_collection=pg_collection)


def test_output_gate_multiplies_each_head_by_sigmoid_of_its_gate_rows():
    """linear_qkv's rows per group are [its 2 query heads, their 2 gates, key, value] (Megatron's
    layout); the output is linear_proj(attention * sigmoid(gate)), written out here."""
    attention = _gated_attention()
    hn, heads, groups = 8, 4, 2
    assert attention.linear_qkv.weight.shape == (groups * (2 * 2 + 2) * hn, 32)
    torch.manual_seed(12)
    x = torch.randn(6, 2, 32)
    rows = attention.linear_qkv.weight.view(groups, 6, hn, 32)  # per group: q0 q1 g0 g1 k v
    project = lambda w: torch.einsum("sbh,gnch->sbgnc", x, w)  # noqa: E731
    q, gate = project(rows[:, 0:2]).flatten(2, 3), project(rows[:, 2:4]).flatten(2, 3)
    k, v = project(rows[:, 4:5]).flatten(2, 3), project(rows[:, 5:6]).flatten(2, 3)
    context = looped_attention(q, k, v, 1 / math.sqrt(hn)).float()
    expected = (context * torch.sigmoid(gate.flatten(2))) @ attention.linear_proj.weight.t()
    out, _ = attention(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    ungated = attention.linear_proj(context)[0]
    assert not torch.allclose(out, ungated, atol=1e-3)
    with pytest.raises(NotImplementedError, match="^attention_output_gate with multi_latent_attention") as error:
        make_config(attention_output_gate=True, multi_latent_attention=True)
    assert "\n" not in str(error.value)


def test_output_gate_under_tensor_parallelism_equals_one_process():
    """The gate rows split with their group: TP 2 (each rank one group) gives one process's output."""
    import torch.distributed as dist

    from dist import run_distributed
    from teratron.process_groups import ProcessGroupCollection

    torch.manual_seed(13)
    x = torch.randn(5, 2, 32)
    expected, _ = _gated_attention()(x)

    def body():
        attention = _gated_attention(ProcessGroupCollection(tp=dist.group.WORLD), tensor_model_parallel_size=2)
        out, _ = attention(x)
        return attention.linear_qkv.weight.shape[0], out

    for rows, out in run_distributed(body, 2):
        assert rows == (2 * 2 + 2) * 8
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_attention_output_gate_flag_and_checkpoint_record():
    from teratron.dist_checkpointing.model_args import gpt_config_from_model_args, model_args_from_config
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import run_config_from_args

    flags = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
             "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3", "--swiglu",
             "--attention-output-gate", "--apply-layernorm-1p"]
    model = run_config_from_args(parse_train_args(flags), 1, vocab_size=64, cuda=False).model
    assert model.transformer.attention_output_gate and model.transformer.layernorm_zero_centered_gamma
    record = model_args_from_config(model)
    assert record["attention_output_gate"] and record["layernorm_zero_centered_gamma"]
    rebuilt = gpt_config_from_model_args(record).transformer
    assert rebuilt.attention_output_gate and rebuilt.layernorm_zero_centered_gamma
