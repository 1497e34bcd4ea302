"""A checkpoint saved under one layout loads into another with exactly the saved values.

Each saving run trains a small GPT (SwiGLU, GQA, qk-norm, QKV bias, tied embeddings) two Adam
steps, so the optimizer state is real, and saves. Each loading run builds the model from another
seed and loads. Both report their live tensors (model params; Adam states and fp32 masters,
from the optimizer's own structures) and the test assembles the global tensors itself —
TP shards with `gather_shards`, distributed-optimizer slices by their flat ranges — then
requires the loaded ones to equal the saved ones bit for bit.
"""


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist import run_distributed
from teratron import parallel_state as ps
from teratron.dist_checkpointing import load_checkpoint, save_checkpoint, storage
from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.optimizer import OptimizerConfig, get_megatron_optimizer
from teratron.pipeline_parallel import get_forward_backward_func
from teratron.pipeline_parallel.layout import get_transformer_layer_offset
from teratron.process_groups import ProcessGroupCollection
from teratron.tensor_parallel import gather_shards
from teratron.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, MBS, MICROBATCHES = 64, 8, 2, 2
TIED = "embedding.word_embeddings.weight"


def make_config(tp=1, pp=1, vpp=None, **kw):
    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=48, gated_linear_unit=True, activation_func=F.silu,
                             normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False, add_qkv_bias=True,
                             hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, **kw)


def build(layout, seed, vocab=VOCAB):
    """This rank's DDP-wrapped chunks and optimizer under `layout` (parallel_state set up)."""
    tp, pp, vpp, dist_opt = layout["tp"], layout["pp"], layout.get("vpp"), layout.get("dist_opt", False)
    bf16 = layout.get("bf16", False)
    if dist.is_initialized():
        ps.initialize_model_parallel(tp, pp, vpp)
    config = make_config(tp, pp, vpp, finalize_model_grads_func=finalize_model_grads, bf16=bf16,
                         params_dtype=torch.bfloat16 if bf16 else torch.float32)
    torch.manual_seed(seed)
    chunks = []
    for v in range(vpp or 1):
        vp_stage = v if vpp else None
        pre = ps.is_pipeline_first_stage(vp_stage=vp_stage) if dist.is_initialized() else True
        post = ps.is_pipeline_last_stage(vp_stage=vp_stage) if dist.is_initialized() else True
        model = GPTModel(config, get_gpt_layer_local_spec(qk_layernorm=True), vocab, SEQ, pre_process=pre,
                         post_process=post, share_embeddings_and_output_weights=True, position_embedding_type="rope",
                         vp_stage=vp_stage, pg_collection=None if dist.is_initialized() else ProcessGroupCollection())
        chunks.append(model)
    if dist.is_initialized():
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt)
        chunks = [DistributedDataParallel(config, ddp, c, disable_bucketing=i > 0) for i, c in enumerate(chunks)]
        config.no_sync_func = chunks[0].no_sync if len(chunks) == 1 else [c.no_sync for c in chunks]
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0, bf16=bf16), chunks)
    return chunks, optimizer


def train(chunks, optimizer, steps=2):
    data = torch.randint(0, VOCAB, (steps, MICROBATCHES * 4, MBS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    dp = ps.get_data_parallel_rank() if dist.is_initialized() else 0

    device = next(chunks[0].parameters()).device

    def step_func(it, model):
        tokens = next(it).to(device)
        ids = tokens[:, :-1]
        loss = model(ids, torch.arange(SEQ, device=device).expand(ids.shape), labels=tokens[:, 1:])
        return loss, lambda t: (t.mean(), {"lm loss": t.mean().detach()})

    for step in range(steps):
        for c in chunks:
            c.zero_grad_buffer()
        optimizer.zero_grad()
        mine = data[step, dp * MICROBATCHES:(dp + 1) * MICROBATCHES]
        get_forward_backward_func()(forward_step_func=step_func, data_iterator=[iter(mine) for _ in chunks],
                                    model=chunks, num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS)
        optimizer.step()


def _global_name(chunk, name, param):
    model = getattr(chunk, "module", chunk)
    if getattr(param, "shared_embedding", False):
        return TIED
    if name.startswith("decoder.layers."):
        parts = name.split(".")
        parts[2] = str(int(parts[2]) + get_transformer_layer_offset(model.config, model.vp_stage))
        return ".".join(parts)
    return name


def report(chunks, optimizer) -> list:
    """[(global name, what, tp rank, dp rank, dim, stride, flat range or None, local shape, tensor)]."""
    tp_rank = ps.get_tensor_model_parallel_rank() if dist.is_initialized() else 0
    dp_rank = ps.get_data_parallel_rank() if dist.is_initialized() else 0
    names = {}
    for chunk in chunks:
        model = getattr(chunk, "module", chunk)
        for name, p in model.named_parameters():
            names[p] = _global_name(chunk, name, p)
    out = []

    def add(p, what, tensor, flat=None):
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        out.append((names[p], what, tp_rank, dp_rank, dim, getattr(p, "partition_stride", 1), flat,
                    tuple(p.shape), tensor.detach().clone()))

    for p in names:
        add(p, "param", p)
    for opt in optimizer.chained_optimizers:
        for p, main, flat in opt.main_param_shards():
            if main is not p or flat is not None:  # fp32 masters, or the fp32 param buffer's slice
                add(p, "fp32_param", main, flat)
            for what, t in opt.state[main].items():
                add(p, what, t, None if what == "step" else flat)
    return out


def assemble(reports) -> dict:
    """(global name, what) -> the global tensor, from every rank's report."""
    pieces = {}
    for rank_report in reports:
        for name, what, tp, dp, dim, stride, flat, shape, t in rank_report:
            pieces.setdefault((name, what), {}).setdefault(tp, {})[dp if flat else 0] = (dim, stride, flat, shape, t)
    out = {}
    for key, by_tp in pieces.items():
        shards = []
        for tp in sorted(by_tp):
            by_dp = by_tp[tp]
            dim, stride, flat, shape, t = by_dp[min(by_dp)]
            if key[1] == "step":
                out[key] = t
                break
            if flat is not None:
                t = torch.cat([by_dp[d][4] for d in sorted(by_dp, key=lambda d: by_dp[d][2][0])]).view(shape)
            shards.append(t)
        if key[1] != "step":
            out[key] = shards[0] if dim is None else gather_shards(shards, dim, stride)
    return out


LAYOUTS = {
    "tp2": dict(tp=2, pp=1),
    "tp1pp2": dict(tp=1, pp=2),
    "pp2vpp2": dict(tp=1, pp=2, vpp=2),
    "dp2_distopt": dict(tp=1, pp=1, dist_opt=True),
    "dp2_distopt_bf16": dict(tp=1, pp=1, dist_opt=True, bf16=True),
    "tp2_bf16": dict(tp=2, pp=1, bf16=True),
}


def save_run(root, layouts):
    reports = []
    for name in layouts:
        chunks, optimizer = build(LAYOUTS[name], seed=1)
        train(chunks, optimizer)
        save_checkpoint(f"{root}/{name}", 2, chunks, optimizer)
        reports.append(report(chunks, optimizer))
        ps.destroy_model_parallel()
    return reports


def load_run(root, pairs):
    reports = []
    for source, target in pairs:
        chunks, optimizer = build(LAYOUTS[target], seed=2)
        load_checkpoint(storage.resolve_checkpoint_dir(f"{root}/{source}"), chunks, optimizer)
        reports.append(report(chunks, optimizer))
        ps.destroy_model_parallel()
    return reports


def assert_same(saved: dict, loaded: dict, label: str, masters: bool = False):
    """Equal global tensors; fp32 masters only compared when both runs keep them (`masters`)."""
    saved = {k: v for k, v in saved.items() if masters or k[1] != "fp32_param"}
    loaded = {k: v for k, v in loaded.items() if masters or k[1] != "fp32_param"}
    assert set(saved) == set(loaded), f"{label}: {sorted(set(saved) ^ set(loaded))[:4]}"
    for key in saved:
        assert torch.equal(saved[key], loaded[key]), f"{label}: {key} differs"


def test_reshard_tp_pp_vpp_dp_and_distributed_optimizer(tmp_path):
    sources = ["tp2", "pp2vpp2", "dp2_distopt", "dp2_distopt_bf16"]
    pairs = [("tp2", "tp1pp2"), ("pp2vpp2", "tp2"), ("dp2_distopt", "tp1pp2"), ("dp2_distopt_bf16", "tp2_bf16")]
    saved = run_distributed(save_run, 2, str(tmp_path), sources, timeout=240)
    loaded = run_distributed(load_run, 2, str(tmp_path), pairs, timeout=240)
    saved_global = {name: assemble([r[i] for r in saved]) for i, name in enumerate(sources)}
    for i, (source, target) in enumerate(pairs):
        got = assemble([r[i] for r in loaded])
        assert_same(saved_global[source], got, f"{source} -> {target}", masters=source.endswith("bf16"))
    # The masters of an fp32 run are its params; a bf16 run's params are its rounded masters.
    for (name, what), t in saved_global["dp2_distopt"].items():
        if what == "fp32_param":
            assert torch.equal(t, saved_global["dp2_distopt"][(name, "param")])
    for (name, what), t in saved_global["dp2_distopt_bf16"].items():
        if what == "fp32_param":
            assert t.dtype == torch.float32
            assert torch.equal(t.to(torch.bfloat16), saved_global["dp2_distopt_bf16"][(name, "param")])
    # DP2 + distributed optimizer -> one process, no DDP, plain optimizer.
    chunks, optimizer = build(dict(tp=1, pp=1), seed=3)
    load_checkpoint(storage.resolve_checkpoint_dir(str(tmp_path / "dp2_distopt")), chunks, optimizer)
    assert_same(saved_global["dp2_distopt"], assemble([report(chunks, optimizer)]), "dp2_distopt -> one process")


def moe_build(tp, ep, grouped, seed):
    """A 2-layer MoE GPT (4 experts, top-2, SwiGLU) and an Adam optimizer with one step taken
    on the same data everywhere (so replicated tensors agree across ranks)."""
    if dist.is_initialized():
        ps.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                               num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2, gated_linear_unit=True,
                               activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
                               hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                               expert_model_parallel_size=ep, moe_grouped_gemm=grouped)
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=grouped)
    model = GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope",
                     pg_collection=None if dist.is_initialized() else ProcessGroupCollection())
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    model(ids[:, :-1], torch.arange(SEQ).expand(2, SEQ), labels=ids[:, 1:]).mean().backward()
    optimizer.step()
    return model, optimizer


def moe_report(model, optimizer) -> list:
    """[(global name, what, first expert of a stacked tensor or None, tp rank, dim, stride, tensor)]."""
    out = []
    state = optimizer.chained_optimizers
    for name, p in model.named_parameters():
        first, tp_rank = None, (ps.get_tensor_model_parallel_rank() if dist.is_initialized() else 0)
        if ".experts." in name:
            prefix = name.split(".experts.")[0]
            indices = model.get_submodule(prefix).local_expert_indices
            tp_rank = ps.get_expert_tensor_parallel_rank() if dist.is_initialized() else 0
            if ".local_experts." in name:
                local, tail = name.split(".local_experts.")[1].split(".", 1)
                name = f"{prefix}.experts.local_experts.{indices[int(local)]}.{tail}"
            else:
                first = indices[0]
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        stride = getattr(p, "partition_stride", 1)
        out.append((name, "param", first, tp_rank, dim, stride, p.detach().clone()))
        for opt in state:
            for what, t in opt.optimizer.state.get(p, {}).items():
                if t.dim():
                    out.append((name, what, first, tp_rank, dim, stride, t.clone()))
    return out


def moe_assemble(reports) -> dict:
    pieces = {}
    for rank_report in reports:
        for name, what, first, tp, dim, stride, t in rank_report:
            pieces.setdefault((name, what), {}).setdefault(first, {})[tp] = (dim, stride, t)
    out = {}
    for key, by_expert in pieces.items():
        blocks = []
        for first in sorted(by_expert, key=lambda f: -1 if f is None else f):
            by_tp = by_expert[first]
            dim, stride, _ = by_tp[0]
            shards = [by_tp[t][2] for t in sorted(by_tp)]
            blocks.append(shards[0] if dim is None else gather_shards(shards, dim, stride))
        out[key] = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return out


def moe_save_and_load(root, grouped):
    """EP = 2 saves; TP = 2 (expert-TP 2, EP 1) loads."""
    model, optimizer = moe_build(tp=1, ep=2, grouped=grouped, seed=1)
    save_checkpoint(root, 1, [model], optimizer)
    saved = moe_report(model, optimizer)
    ps.destroy_model_parallel()
    model, optimizer = moe_build(tp=2, ep=1, grouped=grouped, seed=2)
    load_checkpoint(storage.resolve_checkpoint_dir(root), [model], optimizer)
    return saved, moe_report(model, optimizer)


@pytest.mark.parametrize("grouped", [False, True])
def test_reshard_expert_parallel(tmp_path, grouped):
    results = run_distributed(moe_save_and_load, 2, str(tmp_path), grouped)
    saved = moe_assemble([r[0] for r in results])
    assert any(".experts." in name for name, _ in saved)
    assert_same(saved, moe_assemble([r[1] for r in results]), "EP 2 -> TP 2")
    model, optimizer = moe_build(tp=1, ep=1, grouped=grouped, seed=3)
    load_checkpoint(storage.resolve_checkpoint_dir(str(tmp_path)), [model], optimizer)
    assert_same(saved, moe_assemble([moe_report(model, optimizer)]), "EP 2 -> one process")
