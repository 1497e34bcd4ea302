"""GPTModel trained with DDP + the distributed optimizer (overlapped grad reduce and param gather,
small buckets, clipping) equals plain single-process AdamW training of the same model.

Layouts on 4 ranks: PP=2 x DP=2 with the embedding tied across stages, and TP=2 x DP=2 with
sequence parallelism and a tied embedding; and DP=2 with compiled layers. All with
gradient-accumulation fusion (weight-gradient GEMMs adding into main_grad; the tied copy passed to
the output layer is not fused). The reference runs in the test process: the full
model on all microbatches, torch.optim.AdamW, torch.nn.utils.clip_grad_norm_.
"""

import torch
import torch.distributed as dist

from dist import run_distributed
from teratron import parallel_state as ps
from teratron.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.optimizer import OptimizerConfig, get_megatron_optimizer
from teratron.pipeline_parallel import get_forward_backward_func
from teratron.pipeline_parallel.layout import get_transformer_layer_offset
from teratron.process_groups import ProcessGroupCollection
from teratron.tensor_parallel.utils import shard_tensor
from teratron.transformer.torch_compile import compile_transformer_layers
from teratron.transformer.transformer_layer import TransformerLayer
from teratron.transformer.transformer_config import TransformerConfig

VOCAB, SEQ, MBS, MICROBATCHES, DP, ITERS, LR, WD, CLIP, SEED = 64, 16, 2, 2, 2, 3, 1e-2, 0.1, 0.3, 1234
TIED_NAME = "embedding.word_embeddings.weight"


def _config(**kwargs):
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                             hidden_dropout=0.0, attention_dropout=0.0, **kwargs)


def _data():
    """Token ids [iters, DP * microbatches, b, s + 1]."""
    return torch.randint(0, VOCAB, (ITERS, DP * MICROBATCHES, MBS, SEQ + 1),
                         generator=torch.Generator().manual_seed(7))


def _per_token_loss(model, tokens):
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    return model(ids, torch.arange(SEQ).expand(ids.shape), labels=labels)


def _no_decay(name, param):
    return name.endswith(".bias") or param.dim() == 1


def _reference():
    torch.manual_seed(SEED)
    model = GPTModel(_config(), get_gpt_layer_local_spec(), VOCAB, SEQ, share_embeddings_and_output_weights=True,
                     pg_collection=ProcessGroupCollection())
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if not _no_decay(n, p)], "weight_decay": WD},
                             {"params": [p for n, p in named if _no_decay(n, p)], "weight_decay": 0.0}], lr=LR)
    data, losses = _data(), []
    for step in range(ITERS):
        opt.zero_grad()
        loss = torch.stack([_per_token_loss(model, t).mean() for t in data[step]]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in named}


def _mean_loss(per_token):
    loss = per_token.mean()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, model):
    """Non-last pipeline stages return hidden states; the schedule applies _mean_loss on the last."""
    return _per_token_loss(model, next(data_iterator)), _mean_loss


def _train(compile_layers=False, **layout):
    config = _config(finalize_model_grads_func=finalize_model_grads, gradient_accumulation_fusion=True, **layout)
    ps.initialize_model_parallel(config.tensor_model_parallel_size, config.pipeline_model_parallel_size)
    torch.manual_seed(SEED)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ, share_embeddings_and_output_weights=True,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    if compile_layers:
        torch._inductor.config.compile_threads = 1  # no compile-worker pool in forked ranks
        compile_transformer_layers(model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=4000),
        model)
    if compile_layers:  # param-gather hooks on the compiled layers, none inside them
        layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
        inside = {inner for layer in layers for inner in layer.modules()} - set(layers)
        hooked = set(ddp._params_gathered_before)
        assert set(layers) <= hooked and not hooked & inside
    config.no_sync_func = ddp.no_sync
    opt = get_megatron_optimizer(OptimizerConfig(lr=LR, weight_decay=WD, clip_grad=CLIP), [ddp])
    dp_rank, data, losses = ps.get_data_parallel_rank(), _data(), []
    mine = data[:, dp_rank * MICROBATCHES:(dp_rank + 1) * MICROBATCHES]
    for step in range(ITERS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        logs = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(mine[step]),
                                           model=[ddp], num_microbatches=MICROBATCHES, seq_length=SEQ,
                                           micro_batch_size=MBS)
        assert opt.step()[0]
        if logs:
            loss = torch.stack([d["lm loss"] for d in logs]).mean()
            dist.all_reduce(loss, group=ps.get_data_parallel_group())
            losses.append(loss.item() / DP)
    ddp.start_param_sync(force_sync=True)
    offset = get_transformer_layer_offset(config)
    params = {}
    for name, p in model.named_parameters():
        if name.startswith("decoder.layers."):
            parts = name.split(".")
            parts[2] = str(int(parts[2]) + offset)
            name = ".".join(parts)
        if getattr(p, "shared_embedding", False):
            name = TIED_NAME
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        params[name] = (p.detach().clone(), dim, getattr(p, "partition_stride", 1))
    result = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp=config.tensor_model_parallel_size,
                  losses=losses, params=params)
    ps.destroy_model_parallel()
    return result


def _body():
    return [_train(pipeline_model_parallel_size=2),
            _train(tensor_model_parallel_size=2, sequence_parallel=True)]


def test_gpt_distributed_optimizer_with_compiled_layers_dp2():
    """--torch-compile layers: the parameter all-gather waits at each compiled layer's entry (not
    inside it, which would split its graph) and training still equals the single process."""
    ref_losses, ref_params = _reference()
    for result in run_distributed(lambda: _train(compile_layers=True), 2, timeout=240):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, (local, _, _) in result["params"].items():
            torch.testing.assert_close(local, ref_params[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_gpt_distributed_optimizer_pp2_dp2_and_tp2_sp_dp2():
    ref_losses, ref_params = _reference()
    for per_layout in run_distributed(_body, 4, timeout=240):
        for result in per_layout:
            if result["losses"]:   # the last pipeline stage reports the loss
                torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses),
                                           rtol=1e-5, atol=1e-6)
            for name, (local, dim, stride) in result["params"].items():
                ref = ref_params[name]
                expected = ref if dim is None else shard_tensor(ref, dim, stride, result["tp_rank"], result["tp"])
                torch.testing.assert_close(local, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
