"""GPTModel under tensor, sequence and pipeline parallelism equals the single-process model.

Every parallel run builds its model from the same seed as a TP=1 reference built in the test
process; logits, per-token losses, every parameter and every gradient (shards gathered to full
with `gather_shards`, sequence-parallel norm grads after `finalize_model_grads`) must match.
With `unpadded_vocab_size` the layouts may even pad the vocabulary differently (Megatron's
divisor 128 x TP): each must equal the unpadded single-process model.
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist import run_distributed
from teratron.distributed import finalize_model_grads
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.process_groups import ProcessGroupCollection
from teratron.tensor_parallel import gather_shards, pad_vocab_size
from teratron.transformer.transformer_config import TransformerConfig

VOCAB = 101  # real tokens; not divisible by any TP size
PADDED_VOCAB = pad_vocab_size(VOCAB, 2, 4)  # one padded size for every layout compared
SEQ, BATCH, SEED = 16, 2, 1234


@dataclasses.dataclass(frozen=True)
class Case:
    tp: int
    sp: bool
    groups: int  # num_query_groups (8 = MHA)
    position: str = "learned_absolute"
    normalization: str = "LayerNorm"
    swiglu: bool = False
    bias: bool = True
    qkv_bias: bool = False
    qk_layernorm: bool = False
    tied: bool = False
    parallel_output: bool = True
    explicit_mask: bool = False
    rotary_interleaved: bool = False
    rotary_percent: float = 1.0


TP_CASES = [
    Case(2, False, 8),
    Case(2, False, 2, position="rope", normalization="RMSNorm", swiglu=True, bias=False,
         qk_layernorm=True, tied=True, parallel_output=False, explicit_mask=True),
    Case(2, True, 8, position="rope", normalization="RMSNorm", swiglu=True, tied=True,
         rotary_interleaved=True, rotary_percent=0.5),
    Case(2, True, 2, bias=False, qkv_bias=True, qk_layernorm=True, parallel_output=False,
         explicit_mask=True),
    Case(4, False, 8, position="rope", swiglu=True, tied=True, explicit_mask=True),
    Case(4, False, 4, normalization="RMSNorm", qk_layernorm=True, parallel_output=False),
    Case(4, True, 8, normalization="RMSNorm", bias=False, qk_layernorm=True, tied=True,
         parallel_output=False, explicit_mask=True),
    Case(4, True, 4, position="rope", swiglu=True, qkv_bias=True, rotary_percent=0.5),
]


def make_config(case: Case, tp: int, **overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=case.groups,
        ffn_hidden_size=96, hidden_dropout=0.0, attention_dropout=0.0,
        normalization=case.normalization, gated_linear_unit=case.swiglu,
        activation_func=F.silu if case.swiglu else F.gelu, add_bias_linear=case.bias,
        add_qkv_bias=case.qkv_bias, qk_layernorm=case.qk_layernorm,
        rotary_interleaved=case.rotary_interleaved, tensor_model_parallel_size=tp,
        sequence_parallel=case.sp and tp > 1, use_cpu_initialization=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model(case: Case, tp: int, pg_collection=None, seed=SEED, vocab=PADDED_VOCAB,
                unpadded_vocab_size=None, **config_overrides) -> GPTModel:
    config = make_config(case, tp, **config_overrides)
    torch.manual_seed(seed)
    return GPTModel(
        config, get_gpt_layer_local_spec(qk_layernorm=case.qk_layernorm), vocab, SEQ,
        parallel_output=case.parallel_output, share_embeddings_and_output_weights=case.tied,
        position_embedding_type=case.position, rotary_percent=case.rotary_percent,
        pg_collection=pg_collection or ProcessGroupCollection(), unpadded_vocab_size=unpadded_vocab_size,
    )


def make_batch(case: Case):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = None
    if case.explicit_mask:
        # --reset-attention-mask style: two documents per sample, causal inside each.
        doc = (torch.arange(SEQ) >= SEQ // 2 - 3).long()
        same_doc = doc[:, None] == doc[None, :]
        mask = ~(same_doc & torch.ones(SEQ, SEQ, dtype=torch.bool).tril())
        mask = mask.expand(BATCH, 1, SEQ, SEQ)
        position_ids = torch.where(doc.bool(), torch.arange(SEQ) - (SEQ // 2 - 3), torch.arange(SEQ))
        position_ids = position_ids.expand(BATCH, SEQ)
    loss_weights = torch.rand(BATCH, SEQ, generator=g)
    return ids, position_ids, mask, labels, loss_weights


def forward_backward(model, case, pg_collection=None):
    """Per-token loss, logits, and (param, grad) per name after backward of a weighted loss."""
    ids, position_ids, mask, labels, weights = make_batch(case)
    loss = model(ids, position_ids, mask, labels=labels)
    (loss * weights).sum().backward()
    finalize_model_grads([model], pg_collection=pg_collection or ProcessGroupCollection())
    with torch.no_grad():
        logits = model(ids, position_ids, mask)
    params = {
        name: (p.detach().clone(), p.grad.clone(), getattr(p, "tensor_model_parallel", False),
               getattr(p, "partition_dim", -1), getattr(p, "partition_stride", 1))
        for name, p in model.named_parameters()
    }
    return {"loss": loss.detach(), "logits": logits, "params": params,
            "state_dict_keys": sorted(model.state_dict())}


def assert_close(actual, expected, what):
    """Max error within 1e-5 of the tensor's largest magnitude. The 1e-7 floor is for gradients
    that are zero in exact math (a LayerNorm bias on keys: softmax ignores a per-row shift), where
    both sides hold only float32 rounding noise."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs().max()
    tolerance = max(1e-5 * expected.abs().max().item(), 1e-7)
    assert err <= tolerance, f"{what}: max error {err:.2e} > {tolerance:.2e}"


def check_against_reference(case, ranks_results, reference):
    """ranks_results: the per-rank results of one TP group, in TP-rank order."""
    tp = len(ranks_results)
    for r, result in enumerate(ranks_results):
        assert_close(result["loss"], reference["loss"], f"{case} loss on tp rank {r}")
        assert result["state_dict_keys"] == reference["state_dict_keys"], f"{case} state dict keys"
    if case.parallel_output:
        logits = torch.cat([r["logits"] for r in ranks_results], dim=-1)
        assert ranks_results[0]["logits"].shape[-1] == PADDED_VOCAB // tp
    else:
        logits = ranks_results[0]["logits"]
    assert_close(logits, reference["logits"], f"{case} logits")
    for name, (ref_value, ref_grad, *_) in reference["params"].items():
        _, _, sharded, dim, stride = ranks_results[0]["params"][name]
        for which, index, ref in (("value", 0, ref_value), ("grad", 1, ref_grad)):
            if sharded:
                full = gather_shards([r["params"][name][index] for r in ranks_results], dim, stride)
                assert_close(full, ref, f"{case} {name} {which} (gathered)")
            else:
                for r, result in enumerate(ranks_results):
                    assert_close(result["params"][name][index], ref, f"{case} {name} {which} on tp rank {r}")


def _tp_cases_on_ranks(cases):
    rank = dist.get_rank()
    tp4 = dist.new_group([0, 1, 2, 3])
    tp2 = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    results = []
    for case in cases:
        pgc = ProcessGroupCollection(tp=tp4 if case.tp == 4 else tp2)
        model = build_model(case, case.tp, pgc)
        results.append(forward_backward(model, case, pgc))
    return results


def test_tensor_and_sequence_parallel_gpt_equals_single_process():
    per_rank = run_distributed(_tp_cases_on_ranks, 4, TP_CASES)
    for i, case in enumerate(TP_CASES):
        reference = forward_backward(build_model(case, 1), case)
        check_against_reference(case, [per_rank[r][i] for r in range(case.tp)], reference)
        if case.tp == 2:  # the second TP=2 group ran the same case
            check_against_reference(case, [per_rank[r][i] for r in (2, 3)], reference)


COMPILED_CASE = Case(2, True, 2, position="rope", normalization="RMSNorm", swiglu=True, bias=False)


def _compiled_tp2_sp():
    import torch._inductor.config

    from teratron.transformer.torch_compile import compile_transformer_layers

    torch._inductor.config.compile_threads = 1  # no compile-worker pool in forked ranks
    pgc = ProcessGroupCollection(tp=dist.group.WORLD)
    model = build_model(COMPILED_CASE, 2, pgc)
    assert compile_transformer_layers(model) == 2
    return forward_backward(model, COMPILED_CASE, pgc)


def test_compiled_layers_under_tensor_and_sequence_parallel_equal_the_eager_single_process():
    """--torch-compile with the TP collectives inside the compiled layers (graph breaks there)."""
    reference = forward_backward(build_model(COMPILED_CASE, 1), COMPILED_CASE)
    check_against_reference(COMPILED_CASE, run_distributed(_compiled_tp2_sp, 2, timeout=240), reference)


# ----- vocabulary padding: every layout pads differently, all equal the unpadded model -----------

VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")
PADDING_CASES = [
    Case(1, False, 8),
    Case(2, False, 8),
    Case(2, True, 2, position="rope", normalization="RMSNorm", swiglu=True, bias=False, tied=True,
         parallel_output=False),
    Case(4, False, 4, position="rope", tied=True, explicit_mask=True),  # TP ranks 1-3 hold only padding
    Case(4, True, 8, normalization="RMSNorm", parallel_output=False),
]


def _megatron_padded(tp):
    return pad_vocab_size(VOCAB, 128, tp)  # Megatron's default make_vocab_size_divisible_by


def _padding_cases_on_ranks(cases):
    rank = dist.get_rank()
    groups = {1: None, 2: [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2],
              4: dist.new_group([0, 1, 2, 3])}  # None: a group of one
    results = []
    for case in cases:
        pgc = ProcessGroupCollection(tp=groups[case.tp])
        model = build_model(case, case.tp, pgc, vocab=_megatron_padded(case.tp), unpadded_vocab_size=VOCAB)
        results.append(forward_backward(model, case, pgc))
    return results


def check_padded_against_unpadded(case, ranks_results, reference):
    """ranks_results: one TP group's results (TP-rank order) of a model padded to
    _megatron_padded(tp); reference: the unpadded (VOCAB-token) single-process model."""
    padded = _megatron_padded(len(ranks_results))
    for r, result in enumerate(ranks_results):
        assert_close(result["loss"], reference["loss"], f"{case} loss on tp rank {r}")
    logits = torch.cat([r["logits"] for r in ranks_results], dim=-1) if case.parallel_output \
        else ranks_results[0]["logits"]
    assert logits.shape[-1] == padded
    assert torch.all(logits[..., VOCAB:] == float("-inf")), f"{case} padding logits"
    assert_close(logits[..., :VOCAB], reference["logits"], f"{case} logits")
    for name, (ref_value, ref_grad, *_) in reference["params"].items():
        _, _, sharded, dim, stride = ranks_results[0]["params"][name]
        for which, index, ref in (("value", 0, ref_value), ("grad", 1, ref_grad)):
            values = [r["params"][name][index] for r in ranks_results]
            full = gather_shards(values, dim, stride) if sharded else values[0]
            if name in VOCAB_ROWS:
                assert full.shape[0] == padded
                assert torch.all(full[VOCAB:] == 0), f"{case} {name} padding rows' {which}"
                full = full[:VOCAB]
            assert_close(full, ref, f"{case} {name} {which}")


def test_layouts_padding_the_vocabulary_differently_equal_the_unpadded_model():
    per_rank = run_distributed(_padding_cases_on_ranks, 4, PADDING_CASES)
    for i, case in enumerate(PADDING_CASES):
        reference = forward_backward(build_model(case, 1, vocab=VOCAB), case)
        tp_groups = [range(r, r + case.tp) for r in range(0, 4, case.tp)]
        for group in tp_groups:
            check_padded_against_unpadded(case, [per_rank[r][i] for r in group], reference)


# ----- training: the "done when" ---------------------------------------------------------

TRAIN_CASE = Case(2, True, 2, position="rope", normalization="RMSNorm", swiglu=True, bias=False,
                  tied=True)
TRAIN_STEPS = 30


def train_losses(model, pg_collection=None):
    ids, position_ids, mask, labels, _ = make_batch(TRAIN_CASE)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(TRAIN_STEPS):
        optimizer.zero_grad()
        loss = model(ids, position_ids, mask, labels=labels).mean()
        loss.backward()
        finalize_model_grads([model], pg_collection=pg_collection or ProcessGroupCollection())
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


def _train_tp2():
    pgc = ProcessGroupCollection(tp=dist.group.WORLD)
    return train_losses(build_model(TRAIN_CASE, 2, pgc), pgc)


def test_tp2_training_loss_falls_and_equals_tp1_step_for_step():
    reference = train_losses(build_model(TRAIN_CASE, 1))
    assert reference[-1] < 0.5 * reference[0], f"loss did not fall: {reference.tolist()}"
    for losses in run_distributed(_train_tp2, 2):
        rel = ((losses - reference).abs() / reference.abs()).max()
        assert rel <= 1e-4, f"TP=2 losses drift from TP=1 by {rel:.2e}: {losses.tolist()} vs {reference.tolist()}"


# ----- pipeline readiness -------------------------------------------------------------------------

PP_CASE = Case(1, False, 8, position="rope", tied=True, explicit_mask=True)


def _stage_name(name: str, offset: int) -> str:
    """A stage's parameter name with its local layer index made global."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def _two_stage_run():
    """Stage r of a 2-stage pipeline (pp group = world); p2p done by hand with send/recv."""
    rank = dist.get_rank()
    pgc = ProcessGroupCollection(pp=dist.group.WORLD, embd=dist.group.WORLD)
    config = make_config(PP_CASE, 1, num_layers=4, pipeline_model_parallel_size=2)
    torch.manual_seed(SEED)
    model = GPTModel(config, get_gpt_layer_local_spec(), PADDED_VOCAB, SEQ, pre_process=rank == 0,
                     post_process=rank == 1, share_embeddings_and_output_weights=True,
                     position_embedding_type=PP_CASE.position, pg_collection=pgc)
    initial = {_stage_name(n, 2 * rank): p.detach().clone() for n, p in model.named_parameters()}
    ids, position_ids, mask, labels, weights = make_batch(PP_CASE)
    hidden_shape = (SEQ, BATCH, config.hidden_size)
    loss = None
    if rank == 0:
        hidden = model(ids, position_ids, mask)
        dist.send(hidden.detach(), 1)
        grad = torch.empty(hidden_shape)
        dist.recv(grad, 1)
        hidden.backward(grad)
    else:
        received = torch.empty(hidden_shape)
        dist.recv(received, 0)
        received.requires_grad_()
        model.set_input_tensor(received)
        loss = model(None, position_ids, mask, labels=labels)
        (loss * weights).sum().backward()
        dist.send(received.grad, 0)
    finalize_model_grads([model], pg_collection=pgc)
    grads = {_stage_name(n, 2 * rank): p.grad.clone() for n, p in model.named_parameters()}
    shared = {n for n, p in model.named_parameters() if getattr(p, "shared_embedding", False)}
    return initial, grads, shared, None if loss is None else loss.detach()


def test_two_pipeline_stages_hold_and_train_exactly_the_single_model():
    first, last = run_distributed(_two_stage_run, 2)
    reference = build_model(PP_CASE, 1, num_layers=4)
    ids, position_ids, mask, labels, weights = make_batch(PP_CASE)
    ref_loss = reference(ids, position_ids, mask, labels=labels)
    (ref_loss * weights).sum().backward()
    ref = dict(reference.named_parameters())
    tied = "embedding.word_embeddings.weight"

    assert last[2] == {"output_layer.weight"}  # the last stage's copy of the tied weight
    stage_names = set(first[0]) | set(last[0])
    assert stage_names == set(ref) | {"output_layer.weight"}
    assert set(first[0]).isdisjoint(last[0])
    for initial, grads, *_ in (first, last):
        for name, value in initial.items():
            target = ref[tied if name == "output_layer.weight" else name]
            assert torch.equal(value, target.detach()), f"{name} differs from the single model"
            assert_close(grads[name], target.grad, f"{name} grad")
    assert_close(last[3], ref_loss.detach(), "pipeline loss")


# ----- recompute with dropout under sequence parallelism -----------------------------------------

SP_DROPOUT_CASE = Case(2, True, 2, position="rope", swiglu=True)
RECOMPUTE_VARIANTS = [
    {},
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"]),
]


def _sp_dropout_runs():
    from teratron.tensor_parallel import model_parallel_cuda_manual_seed

    pgc = ProcessGroupCollection(tp=dist.group.WORLD)
    results = []
    for recompute in RECOMPUTE_VARIANTS:
        model = build_model(SP_DROPOUT_CASE, 2, pgc, hidden_dropout=0.2, attention_dropout=0.2, **recompute)
        model_parallel_cuda_manual_seed(9, tp_rank=dist.get_rank())
        results.append(forward_backward(model, SP_DROPOUT_CASE, pgc))
    return results


def test_recompute_with_dropout_under_sequence_parallel_matches_no_recompute():
    for rank_results in run_distributed(_sp_dropout_runs, 2):
        baseline, *variants = rank_results
        for recompute, result in zip(RECOMPUTE_VARIANTS[1:], variants):
            assert_close(result["loss"], baseline["loss"], f"{recompute} loss")
            for name, (_, grad, *_) in baseline["params"].items():
                assert_close(result["params"][name][1], grad, f"{recompute} {name} grad")
