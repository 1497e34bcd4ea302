"""Pipelined training equals the PP = 1 run: loss curve and gradients over several SGD steps.

The reference is a plain single-process loop in the test process (full model, no schedule): the
mean of the microbatch losses, one backward, SGD. Each pipelined run builds its stages from the
same seed (initialisation is layout-invariant), trains with get_forward_backward_func() and
returns every stage's gradients under their global names, TP shards gathered in the test.
"""

import functools
import weakref

import pytest
import torch
from torch.testing import assert_close

from dist import run_distributed
from teratron import parallel_state as ps
from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.pipeline_parallel import get_forward_backward_func
from teratron.pipeline_parallel.layout import get_transformer_layer_offset
from teratron.pipeline_parallel.schedules import (forward_backward_no_pipelining,
                                                  forward_backward_pipelining_with_interleaving)
from teratron.process_groups import ProcessGroupCollection
from teratron.tensor_parallel import gather_shards
from teratron.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, MBS, NUM_MICROBATCHES, ITERS, LR, SEED = 64, 16, 2, 4, 3, 0.5, 1234
TIED_NAME = "embedding.word_embeddings.weight"


def make_config(**kwargs) -> TransformerConfig:
    defaults = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                    hidden_dropout=0.0, attention_dropout=0.0)
    return TransformerConfig(**{**defaults, **kwargs})


def make_data(num_microbatches: int) -> torch.Tensor:
    """Token ids [iters, microbatches, b, s + 1]."""
    return torch.randint(0, VOCAB, (ITERS, num_microbatches, MBS, SEQ + 1), generator=torch.Generator().manual_seed(7))


def run_model(model, tokens):
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    return model(ids, torch.arange(SEQ, device=ids.device).expand(ids.shape), labels=labels)  # per-token loss [b, s]


def mean_loss(per_token):
    loss = per_token.mean()
    return loss, {"lm loss": loss.detach()}


def sum_loss(per_token):
    return per_token.sum(), torch.tensor(per_token.numel()), {"lm loss": per_token.mean().detach()}


def forward_step(data_iterator, model, loss_func=mean_loss):
    return run_model(model, next(data_iterator)), loss_func


def reference(config_kwargs: dict, data: torch.Tensor, tied: bool = False, device: str = "cpu"):
    """Losses and gradients of ITERS SGD steps on the full model in this process."""
    config = make_config(**config_kwargs)
    torch.manual_seed(SEED)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, share_embeddings_and_output_weights=tied,
                     pg_collection=ProcessGroupCollection()).to(device)
    data = data.to(device)
    losses, grads = [], []
    for step in range(ITERS):
        model.zero_grad(set_to_none=True)
        loss = torch.stack([run_model(model, tokens).mean() for tokens in data[step]]).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad.to("cpu", copy=True) for name, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return losses, grads


def _grad(param):
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def global_grads(chunks, config) -> dict:
    """{(global name, pp rank): (grad, partition_dim or None, stride)} of this rank's chunks."""
    out = {}
    for v, chunk in enumerate(chunks):
        vp_stage = v if len(chunks) > 1 else None
        offset = get_transformer_layer_offset(config, vp_stage)
        for name, p in chunk.named_parameters():
            name = name.removeprefix("module.")
            if name.startswith("decoder.layers."):
                parts = name.split(".")
                parts[2] = str(int(parts[2]) + offset)
                name = ".".join(parts)
            if getattr(p, "shared_embedding", False):
                name = TIED_NAME
            dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            grad = _grad(p).to("cpu", copy=True)
            out[(name, ps.get_pipeline_model_parallel_rank())] = (grad, dim, getattr(p, "partition_stride", 1))
    return out


def pipelined_training(config_kwargs: dict, data: torch.Tensor, tied: bool = False, per_token: bool = False,
                       ddp: bool = False, forward_only_check: bool = False, device: str = "cpu") -> dict:
    """Runs on every rank: build this rank's model chunks, train ITERS steps, report."""
    config = make_config(finalize_model_grads_func=finalize_model_grads, calculate_per_token_loss=per_token,
                         deallocate_pipeline_outputs=True, **config_kwargs)
    ps.initialize_model_parallel(config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                                 config.virtual_pipeline_model_parallel_size)
    num_chunks = config.virtual_pipeline_model_parallel_size or 1
    torch.manual_seed(SEED)
    chunks = [GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, share_embeddings_and_output_weights=tied,
                       pre_process=ps.is_pipeline_first_stage(vp_stage=v),
                       post_process=ps.is_pipeline_last_stage(vp_stage=v), vp_stage=v).to(device)
              for v in range(num_chunks)]
    if ddp:
        chunks = [DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True), c)
                  for c in chunks]
        no_sync = [c.no_sync for c in chunks]
        config.no_sync_func = no_sync[0] if num_chunks == 1 else no_sync
    syncs = []  # (kind, chunk) of every param/grad sync callback, in call order
    if num_chunks > 1:
        config.param_sync_func = [lambda params, v=v: syncs.append(("param", v)) for v in range(num_chunks)]
        config.grad_sync_func = [lambda params, v=v: syncs.append(("grad", v)) for v in range(num_chunks)]
    dp_rank = ps.get_data_parallel_rank()
    mine = data[:, dp_rank * NUM_MICROBATCHES:(dp_rank + 1) * NUM_MICROBATCHES].to(device)
    schedule = get_forward_backward_func()
    step_func = functools.partial(forward_step, loss_func=sum_loss if per_token else mean_loss)
    run = functools.partial(schedule, forward_step_func=step_func, model=chunks, num_microbatches=NUM_MICROBATCHES,
                            seq_length=SEQ, micro_batch_size=MBS)
    result = dict(tp_rank=ps.get_tensor_model_parallel_rank(), dp_rank=dp_rank, losses=[], grads=[])
    if forward_only_check:
        with torch.no_grad():
            logs = run(data_iterator=[iter(mine[0]) for _ in chunks], forward_only=True)
        result["forward_only_losses"] = [d["lm loss"].cpu() for d in logs]
        result["grads_after_forward_only"] = [p.grad for c in chunks for p in c.parameters() if p.grad is not None]
    for step in range(ITERS):
        for c in chunks:
            c.zero_grad_buffer() if ddp else c.zero_grad(set_to_none=True)
        logs = run(data_iterator=[iter(mine[step]) for _ in chunks])
        if logs:
            result["losses"].append(torch.stack([d["lm loss"] for d in logs]).mean().item())
        result["grads"].append(global_grads(chunks, config))
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p -= LR * _grad(p)
    result["syncs"] = syncs
    ps.destroy_model_parallel()
    return result


def check_against_reference(results: list, ref_losses: list, ref_grads: list) -> None:
    dp_size = 1 + max(r["dp_rank"] for r in results)
    pp_size = len({pp_rank for r in results for _, pp_rank in r["grads"][0]})
    assert sum(bool(r["losses"]) for r in results) == len(results) // pp_size  # the last stage's ranks
    curves = {r["dp_rank"]: r["losses"] for r in results if r["losses"]}
    assert_close(torch.tensor([curves[d] for d in range(dp_size)]).mean(0), torch.tensor(ref_losses))
    for step in range(ITERS):
        for dp_rank in range(dp_size):
            shards = {}
            for r in results:
                if r["dp_rank"] == dp_rank:
                    for key, (grad, dim, stride) in r["grads"][step].items():
                        shards.setdefault(key, {})[r["tp_rank"]] = (grad, dim, stride)
            # Every parameter on exactly one stage; a tied embedding on the first and the last.
            tied_copies = [TIED_NAME] if "output_layer.weight" not in ref_grads[step] else []
            assert sorted(name for name, _ in shards) == sorted(list(ref_grads[step]) + tied_copies)
            for (name, pp_rank), by_tp in shards.items():
                grads = [by_tp[t][0] for t in sorted(by_tp)]
                dim, stride = by_tp[0][1], by_tp[0][2]
                full = grads[0] if dim is None else gather_shards(grads, dim, stride)
                assert_close(full, ref_grads[step][name], msg=f"step {step} {name} (pp rank {pp_rank})")


def test_no_pipelining_matches_plain_loop():
    """Gradient accumulation, loss scaling (2- and 3-tuple losses) and the grad-sync hooks."""
    data = make_data(NUM_MICROBATCHES)
    ref_losses, ref_grads = reference({}, data)
    synced, finalized = [], []

    class NoSync:
        def __enter__(self):
            synced.append(False)

        def __exit__(self, *exc):
            synced.append(True)

    for per_token in (False, True):
        synced.clear()
        finalized.clear()
        config = make_config(calculate_per_token_loss=per_token, no_sync_func=NoSync,
                             finalize_model_grads_func=lambda chunks, n: finalized.append(n))
        torch.manual_seed(SEED)
        model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ)
        logs = forward_backward_no_pipelining(
            forward_step_func=functools.partial(forward_step, loss_func=sum_loss if per_token else mean_loss),
            data_iterator=iter(data[0]), model=[model], num_microbatches=NUM_MICROBATCHES, seq_length=SEQ,
            micro_batch_size=MBS)
        assert_close(torch.stack([d["lm loss"] for d in logs]).mean().item(), ref_losses[0])
        assert synced == [False, True] and len(finalized) == 1
        scale = 1.0
        if per_token:
            assert finalized[0].item() == NUM_MICROBATCHES * MBS * SEQ
            scale = finalized[0].item()  # finalize_model_grads would divide by the token count
        else:
            assert finalized[0] is None
        for name, p in model.named_parameters():
            assert_close(p.grad / scale, ref_grads[0][name], msg=name)


def test_no_pipelining_collects_non_loss_data():
    data = make_data(2)
    torch.manual_seed(SEED)
    model = GPTModel(make_config(), get_gpt_layer_local_spec(), VOCAB, SEQ)
    shapes = forward_backward_no_pipelining(
        forward_step_func=lambda it, m: (run_model(m, next(it)), lambda out, non_loss_data: out.shape),
        data_iterator=iter(data[0]), model=model, num_microbatches=2, seq_length=SEQ, micro_batch_size=MBS,
        forward_only=True, collect_non_loss_data=True)
    assert shapes == [(MBS, SEQ)] * 2


def test_interleaving_input_errors():
    config = make_config(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                         microbatch_group_size_per_vp_stage=1)
    chunks = [torch.nn.Linear(1, 1) for _ in range(2)]
    for chunk in chunks:
        chunk.config = config
    run = functools.partial(forward_backward_pipelining_with_interleaving, forward_step_func=forward_step,
                            num_microbatches=4, seq_length=SEQ, micro_batch_size=MBS)
    with pytest.raises(ValueError, match=r"microbatch_group_size_per_vp_stage \(1\) must be at least "
                                         r"pipeline_model_parallel_size \(2\)"):
        run(model=chunks, data_iterator=[iter([]), iter([])])
    with pytest.raises(ValueError, match=r"model has 1 entries but the schedule runs 2 model chunk"):
        run(model=chunks[:1], data_iterator=[iter([])])


def test_pipeline_parallel_2_ranks():
    """PP = 2 (tied embeddings, per-token loss, forward-only), PP = 2 x VPP = 2, uneven stages,
    a layout string (VPP from the layout, variable-length p2p, deferred p2p waits)."""
    data = make_data(NUM_MICROBATCHES)
    cases = [
        (dict(num_layers=4, pipeline_model_parallel_size=2), dict(tied=True, per_token=True, forward_only_check=True)),
        (dict(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), {}),
        (dict(num_layers=5, pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1), {}),
        (dict(num_layers=5, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|t|tL",
              variable_seq_lengths=True, overlap_p2p_comm=True, batch_p2p_comm=False), {}),
    ]

    def body():
        return [pipelined_training(config_kwargs, data, **options) for config_kwargs, options in cases]

    results = run_distributed(body, 2, timeout=120)
    for i, (config_kwargs, options) in enumerate(cases):
        ref_losses, ref_grads = reference({"num_layers": config_kwargs["num_layers"]}, data, tied=options.get("tied", False))
        per_rank = [r[i] for r in results]
        check_against_reference(per_rank, ref_losses, ref_grads)
        if config_kwargs.get("virtual_pipeline_model_parallel_size"):
            # Every chunk, every iteration: one param sync (chunk 0 included) and one grad sync.
            once = [(kind, v) for kind in ("grad", "param") for v in range(2)]
            assert all(sorted(r["syncs"]) == sorted(once * ITERS) for r in per_rank)
        if options.get("forward_only_check"):
            assert_close(torch.stack(per_rank[-1]["forward_only_losses"]).mean().item(), ref_losses[0])
            assert all(not r["grads_after_forward_only"] for r in per_rank)


def test_pipeline_parallel_4_ranks():
    """PP = 4 (embedding and loss counted as layers), PP = 4 x VPP = 2, TP = 2 x PP = 2 with
    sequence parallelism and tied embeddings, PP = 2 x DP = 2 under DDP (grad sync held back)."""
    data = make_data(2 * NUM_MICROBATCHES)
    cases = [
        (dict(num_layers=6, pipeline_model_parallel_size=4, account_for_embedding_in_pipeline_split=True,
              account_for_loss_in_pipeline_split=True), {}),
        (dict(num_layers=8, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2), {}),
        (dict(num_layers=4, tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2),
         dict(tied=True)),
        (dict(num_layers=4, pipeline_model_parallel_size=2), dict(ddp=True)),
    ]

    def body():
        return [pipelined_training(config_kwargs, data, **options) for config_kwargs, options in cases]

    results = run_distributed(body, 4, timeout=120)
    for i, (config_kwargs, options) in enumerate(cases):
        dp = 4 // (config_kwargs["pipeline_model_parallel_size"] * config_kwargs.get("tensor_model_parallel_size", 1))
        ref_losses, ref_grads = reference({"num_layers": config_kwargs["num_layers"]},
                                          data[:, :dp * NUM_MICROBATCHES], tied=options.get("tied", False))
        check_against_reference([r[i] for r in results], ref_losses, ref_grads)


class _Saved:
    def __init__(self, tensor):
        self.tensor = tensor


class SavedActivations:
    """Counts the tensors autograd keeps for backward that are still alive (saved_tensors_hooks)."""

    def __init__(self):
        self.live = self.peak = self.total = 0

    def pack(self, tensor):
        box = _Saved(tensor)
        self.live += 1
        self.total += 1
        self.peak = max(self.peak, self.live)
        weakref.finalize(box, self.release)
        return box

    def release(self):
        self.live -= 1

    @staticmethod
    def unpack(box):
        return box.tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def test_1f1b_memory():
    """The first stage holds at most PP microbatches of saved activations under 1F1B (all of
    them when every forward runs before any backward), and sent outputs are freed."""
    pp, num_microbatches = 2, 8
    data = torch.randint(0, VOCAB, (num_microbatches, MBS, SEQ + 1), generator=torch.Generator().manual_seed(3))

    def body():
        config = make_config(pipeline_model_parallel_size=pp, deallocate_pipeline_outputs=True)
        ps.initialize_model_parallel(pipeline_model_parallel_size=pp)
        torch.manual_seed(SEED)
        model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, pre_process=ps.is_pipeline_first_stage(),
                         post_process=ps.is_pipeline_last_stage())
        counter, outputs = SavedActivations(), []

        def counted_step(data_iterator, model):
            with counter.hooks():
                output, loss_func = forward_step(data_iterator, model)
            outputs.append(output)
            return output, loss_func

        get_forward_backward_func()(forward_step_func=counted_step, data_iterator=iter(data), model=model,
                                    num_microbatches=num_microbatches, seq_length=SEQ, micro_batch_size=MBS)
        result = dict(peak=counter.peak, per_microbatch=counter.total / num_microbatches, live_after=counter.live,
                      sent_sizes=[o.numel() for o in outputs] if ps.get_pipeline_model_parallel_rank() == 0 else [])
        # The same stage with every forward before any backward (no 1F1B).
        all_first = SavedActivations()
        with all_first.hooks():
            kept = [run_model(model, tokens) for tokens in data] if ps.is_pipeline_first_stage() else []
        result["all_forward_first_peak"] = all_first.peak
        del kept
        ps.destroy_model_parallel()
        return result

    first = run_distributed(body, pp, timeout=120)[0]
    assert first["per_microbatch"] > 0 and first["live_after"] == 0
    assert first["peak"] <= pp * first["per_microbatch"]
    assert first["all_forward_first_peak"] == num_microbatches * first["per_microbatch"] > first["peak"]
    assert first["sent_sizes"] == [1] * num_microbatches  # each sent [s, b, h] output freed to a placeholder
