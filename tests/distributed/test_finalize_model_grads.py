"""finalize_model_grads' tied-embedding reduce on 2 pipeline stages: both ends make the same
collective (tied, with one or two model chunks per rank, or one end frozen) or none (untied)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist import run_distributed
from teratron import parallel_state
from teratron.distributed import finalize_model_grads
from teratron.models.gpt import GPTModel, get_gpt_layer_local_spec
from teratron.transformer.transformer_config import TransformerConfig


def _chunk(pre, post, tied):
    config = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16,
                               activation_func=F.gelu, pipeline_model_parallel_size=2,
                               use_cpu_initialization=True, pipeline_dtype=torch.float32)
    return GPTModel(config, get_gpt_layer_local_spec(), 32, 8, pre_process=pre, post_process=post,
                    share_embeddings_and_output_weights=tied)


def _stage(rank, tied, chunks):
    """This rank's chunks: the first stage's first chunk holds the embedding, the last stage's
    last chunk the output layer; the others (virtual stages in between) hold neither."""
    return [_chunk(pre=rank == 0 and i == 0, post=rank == 1 and i == chunks - 1, tied=tied)
            for i in range(chunks)]


def _finalize_counting(model_chunks):
    calls = []
    all_reduce = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tuple(tensor.shape))
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        finalize_model_grads(model_chunks)
    finally:
        dist.all_reduce = all_reduce
    return calls


def _cases():
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    rank = dist.get_rank()
    results = {}
    for name, tied, chunks, frozen_copy in [("tied", True, 1, False), ("tied-2-chunks", True, 2, False),
                                            ("untied", False, 1, False), ("frozen-copy", True, 1, True)]:
        model = _stage(rank, tied, chunks)
        for chunk in model:
            for p in chunk.parameters():
                p.grad = torch.full_like(p, float(rank + 1))
        end = model[0] if rank == 0 else model[-1]
        weight = end.shared_embedding_or_output_weight()
        if frozen_copy and rank == 1:
            weight.requires_grad_(False)
            weight.grad = None
        calls = _finalize_counting(model)
        results[name] = (calls, None if weight.grad is None else weight.grad.unique().tolist())
    return results


def test_tied_embedding_reduce_is_the_same_call_on_both_ends():
    first, last = run_distributed(_cases, 2)
    vocab_by_hidden = [(32, 8)]
    for name in ("tied", "tied-2-chunks"):
        assert first[name] == last[name] == (vocab_by_hidden, [3.0]), name  # 1 + 2 on both ends
    assert first["untied"][0] == last["untied"][0] == []
    # A frozen copy contributes zeros: the first stage keeps its own grad, nobody waits.
    assert first["frozen-copy"] == (vocab_by_hidden, [1.0]) and last["frozen-copy"] == (vocab_by_hidden, None)
