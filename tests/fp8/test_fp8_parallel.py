"""FP8 under tensor (and sequence) parallelism equals the single-process FP8 model.

The amaxes of tensors sharded over TP are all-reduced, so every rank quantises its shard with
the scale of the whole tensor: an MLP's FP8 products are then bit-identical to TP = 1's, and
only the all-reduced outputs (the sum of bf16 partial results) differ, by bf16 rounding.

In a whole GPT the bf16 rounding of those sums feeds the next layers' FP8 quantisation, which
re-rounds every value to 3 (e4m3) or 2 (e5m2) mantissa bits: a value moved by one bf16 ulp
may land on the other side of an FP8 rounding boundary. There the check is what the reduction
guarantees exactly (every weight amax, the first layer's input amax) and that TP = 2 stays
within one FP8 rounding step of TP = 1.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist import run_distributed
from teratron.distributed import finalize_model_grads
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.process_groups import ProcessGroupCollection
from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear, gather_shards
from teratron.transformer.mlp import MLP, MLPSubmodules
from teratron.transformer.transformer_block import apply_fp8
from teratron.transformer.transformer_config import TransformerConfig

SEQ, BATCH, VOCAB = 16, 2, 128


def make_config(tp, sp, **overrides):
    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=64,
                  hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                  sequence_parallel=sp, use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
                  fp8="hybrid", fp8_recipe="tensorwise", gated_linear_unit=True, activation_func=F.silu,
                  normalization="RMSNorm")
    return TransformerConfig(**{**kwargs, **overrides})


# ----- one MLP: bit-identical FP8 products ----------------------------------------------------

def run_mlp(tp, sp, group=None, rank=0):
    config = make_config(tp, sp, add_bias_linear=True)
    torch.manual_seed(0)
    mlp = MLP(config, MLPSubmodules(ColumnParallelLinear, RowParallelLinear), tp_group=group)
    apply_fp8(mlp, config, layer_number=1)
    g = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(24, BATCH, 64, generator=g).bfloat16() for _ in range(2))
    if sp:
        x, dy = x.chunk(tp)[rank], dy.chunk(tp)[rank]
    x = x.clone().requires_grad_()
    seen = {}
    mlp.linear_fc1.register_forward_hook(lambda module, args, out: seen.update(fc1=out[0].detach()))
    y, bias = mlp(x)
    (y + bias).backward(dy)
    return {"fc1": seen["fc1"], "y": (y + bias).detach(), "dx": x.grad,
            "fc1.weight": mlp.linear_fc1.weight.grad, "fc2.weight": mlp.linear_fc2.weight.grad}


def _mlp_on_ranks():
    return {sp: run_mlp(2, sp, dist.group.WORLD, dist.get_rank()) for sp in (False, True)}


def test_mlp_fp8_products_are_identical_under_tp_and_sp():
    ref = run_mlp(1, False)
    ranks = run_distributed(_mlp_on_ranks, 2)
    for sp in (False, True):
        res = [r[sp] for r in ranks]
        assert torch.equal(gather_shards([r["fc1"] for r in res], -1, 2), ref["fc1"])  # SwiGLU: stride 2
        assert torch.equal(gather_shards([r["fc1.weight"] for r in res], 0, 2), ref["fc1.weight"])
        assert torch.equal(torch.cat([r["fc2.weight"] for r in res], 1), ref["fc2.weight"])
        for name in ("y", "dx"):  # sums of two bf16 partial results: two extra roundings at most
            got = torch.cat([r[name] for r in res]) if sp else res[0][name]
            err = (got.float() - ref[name].float()).abs().max()
            assert err <= 2**-7 * ref[name].float().abs().max(), (sp, name, err)


# ----- a GPT model -------------------------------------------------------------------------------

def build_gpt(tp, sp, pg_collection=None, **overrides):
    config = make_config(tp, sp, **overrides)
    torch.manual_seed(1234)
    return GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, position_embedding_type="rope",
                    pg_collection=pg_collection or ProcessGroupCollection())


def gpt_forward_backward(model, pg_collection=None):
    g = torch.Generator().manual_seed(7)
    ids, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    loss = model(ids, positions, None, labels=labels)
    loss.float().mean().backward()
    finalize_model_grads([model], pg_collection=pg_collection or ProcessGroupCollection())
    amaxes = {name: module.amax_history[0].item() for name, module in model.named_modules()
              if name.endswith("_scaler") and hasattr(module, "amax_history")}
    grads = {name: (p.grad.float(), getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", -1),
                    getattr(p, "partition_stride", 1)) for name, p in model.named_parameters()}
    return {"loss": loss.detach().float(), "amaxes": amaxes, "grads": grads}


def _gpt_on_ranks(recipe):
    pgc = ProcessGroupCollection(tp=dist.group.WORLD)
    return {sp: gpt_forward_backward(build_gpt(2, sp, pgc, fp8_recipe=recipe), pgc) for sp in (False, True)}


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_gpt_fp8_tp2_equals_tp1():
    # 'delayed' keeps each amax in its history (its first step scales like 'tensorwise').
    for recipe in ("delayed", "tensorwise"):
        ref = gpt_forward_backward(build_gpt(1, False, fp8_recipe=recipe))
        ranks = run_distributed(_gpt_on_ranks, 2, recipe)
        for sp in (False, True):
            res = [r[sp] for r in ranks]
            for name, amax in ref["amaxes"].items():
                assert all(r["amaxes"][name] == res[0]["amaxes"][name] for r in res), name  # TP ranks agree
                if "weight_scaler" in name or name == "decoder.layers.0.self_attention.linear_qkv.fp8.input_scaler":
                    assert res[0]["amaxes"][name] == amax, (sp, name)
                else:  # downstream of bf16-rounded sums: within one e4m3 step (2**-3)
                    assert abs(res[0]["amaxes"][name] - amax) <= 2**-3 * amax, (sp, name)
            # Per token within e4m3's rounding error (2**-4); the mean, over many tokens, to bf16
            # precision (2**-8).
            loss = res[0]["loss"]  # [b, s], whole on every rank
            assert ((loss - ref["loss"]).abs() <= 2**-4 * ref["loss"].abs()).all(), (recipe, sp)
            assert abs(loss.mean() - ref["loss"].mean()) <= 2**-8 * ref["loss"].mean(), (recipe, sp)
            for name, (grad, sharded, dim, stride) in ref["grads"].items():
                full = gather_shards([r["grads"][name][0] for r in res], dim, stride) if sharded else res[0]["grads"][name][0]
                # Gradients pass e5m2 GEMMs: within e5m2's rounding error (2**-3) in norm.
                assert relative(full, grad) <= 2**-3, (recipe, sp, name, relative(full, grad))


# ----- context parallelism: every activation is a sequence shard -----------------------------------

def _gpt_on_cp_ranks(recipe):
    """CP = 2 (p2p): each rank runs its two chunks of the sequence (get_batch_on_this_cp_rank)."""
    from teratron.training.gpt_step import get_batch_on_this_cp_rank

    world = dist.group.WORLD
    pgc = ProcessGroupCollection(cp=world, dp_cp=world)
    model = build_gpt(1, False, pgc, fp8_recipe=recipe, context_parallel_size=2)
    g = torch.Generator().manual_seed(7)
    ids, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    batch = get_batch_on_this_cp_rank({"tokens": ids, "labels": labels, "position_ids": positions}, world)
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s / cp]
    (loss.float().sum() / loss.new_tensor(BATCH * SEQ).float()).backward()
    amaxes = {name: module.amax_history[0].item() for name, module in model.named_modules()
              if name.endswith("_scaler") and hasattr(module, "amax_history")}
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad, group=world)  # the CP ranks' shares of the whole sequence's gradient
    return {"loss_sum": loss.detach().float().sum(), "amaxes": amaxes, "grads": grads}


def test_gpt_fp8_cp2_equals_cp1():
    """Under CP every linear's input and output gradient are sequence shards: their amaxes are
    reduced over CP, so each rank scales as the one process does. Without that reduction a rank
    scales its half by that half's own amax (smaller than the whole's on one of the ranks)."""
    for recipe in ("delayed", "tensorwise"):
        ref = gpt_forward_backward(build_gpt(1, False, fp8_recipe=recipe))
        ranks = run_distributed(_gpt_on_cp_ranks, 2, recipe)
        for name, amax in ref["amaxes"].items():
            assert ranks[0]["amaxes"][name] == ranks[1]["amaxes"][name], name  # CP ranks agree
            if "weight_scaler" in name or name == "decoder.layers.0.self_attention.linear_qkv.fp8.input_scaler":
                assert ranks[0]["amaxes"][name] == amax, name  # the layer norm's output: exact per token
            else:  # downstream of attention merged by log-sum-exp: within one e4m3 step (2**-3)
                assert abs(ranks[0]["amaxes"][name] - amax) <= 2**-3 * amax, name
        loss = sum(r["loss_sum"] for r in ranks) / (BATCH * SEQ)
        assert abs(loss - ref["loss"].mean()) <= 2**-8 * ref["loss"].mean(), recipe
        for name, (grad, *_) in ref["grads"].items():
            assert relative(ranks[0]["grads"][name], grad) <= 2**-3, (recipe, name)
