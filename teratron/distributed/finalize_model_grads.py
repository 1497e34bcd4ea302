"""Make every rank's gradients final after backward: the one place grads are reduced.

Order, as in Megatron: the data-parallel reduce (each DDP chunk's buckets), then the grads of
sequence-parallel parameters over TP (norm weights see only this rank's sequence slice), then
the word embedding's copies over the embedding group (first and last pipeline stage hold one
copy each when tied or with multi-token prediction), then the optional per-token
normalisation. Works on `param.main_grad` when a parameter has one (DDP-wrapped) and on
`param.grad` otherwise.
"""

import torch
import torch.distributed as dist

from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.topology import resolve_pg_collection


def _unwrap(model_chunk):
    """The innermost module under DDP-style wrappers (each keeps its child in `.module`)."""
    while isinstance(getattr(model_chunk, "module", None), torch.nn.Module):
        model_chunk = model_chunk.module
    return model_chunk


def _grad_of(param):
    """The gradient tensor to reduce; a missing `.grad` becomes zeros so all ranks stay in step."""
    if hasattr(param, "main_grad"):
        return param.main_grad
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def _all_reduce_coalesced(tensors, group):
    """Sum `tensors` in place over `group` with one collective per dtype."""
    by_dtype = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same_dtype in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same_dtype])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same_dtype:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def _allreduce_sequence_parallel_grads(model_chunks, tp_group):
    if get_pg_size(tp_group) == 1:
        return
    grads = [_grad_of(p) for chunk in model_chunks for p in chunk.parameters()
             if p.requires_grad and getattr(p, "sequence_parallel", False)]
    if grads:
        _all_reduce_coalesced(grads, tp_group)


def _allreduce_embedding_grads(model_chunks, embd_group, pp_group):
    """Sum the grads of the word embedding of the first stage and its copy on the last stage
    (the tied output layer's, or the multi-token-prediction stage's embedding) over the
    embedding group, Megatron's `_allreduce_word_embedding_grads`.

    Every rank of the group makes the same call, or none: the group is the first and the last
    pipeline rank, whether there is a copy is the `share_embeddings_and_output_weights` and
    `config.mtp_num_layers` every stage's GPTModel is built with, and a stage always holds its
    end (the first stage's first chunk the embedding, the last stage's last chunk the copy). A
    frozen end contributes zeros instead of skipping the collective. Without a copy, neither end
    communicates.
    """
    if get_pg_size(embd_group) == 1 or get_pg_size(pp_group) == 1:
        return
    wrapper = model_chunks[0] if get_pg_rank(pp_group) == 0 else model_chunks[-1]
    chunk = _unwrap(wrapper)
    if not (getattr(chunk, "share_embeddings_and_output_weights", False)
            or getattr(getattr(chunk, "config", None), "mtp_num_layers", None)):
        return
    weight = chunk.shared_embedding_or_output_weight()
    assert weight is not None, "a tied pipeline end must hold the embedding or its copy"
    if weight.requires_grad:
        grad = _grad_of(weight)
    else:  # zeros in the dtype the other end's (main) grad has
        fp32 = getattr(getattr(wrapper, "ddp_config", None), "grad_reduce_in_fp32", False)
        grad = torch.zeros_like(weight, dtype=torch.float32 if fp32 else weight.dtype)
    dist.all_reduce(grad, group=embd_group)


def _normalize_by_num_tokens(model_chunks, num_tokens, pp_group, dp_cp_group):
    """Divide grads by the global token count; only the last pipeline stage knows its share."""
    num_tokens = num_tokens.detach().clone()
    if get_pg_size(pp_group) > 1:
        last = dist.get_global_rank(pp_group, get_pg_size(pp_group) - 1)
        dist.broadcast(num_tokens, src=last, group=pp_group)
    if get_pg_size(dp_cp_group) > 1:
        dist.all_reduce(num_tokens, group=dp_cp_group)
    if num_tokens.item() <= 0:
        return
    scale = 1.0 / num_tokens.item()
    for chunk in model_chunks:
        if hasattr(chunk, "scale_gradients"):
            chunk.scale_gradients(scale)
        else:
            for p in chunk.parameters():
                if p.requires_grad and p.grad is not None:
                    p.grad.mul_(scale)


def finalize_model_grads(model_chunks, num_tokens=None, pg_collection=None):
    """Reduce the grads of `model_chunks` (a list of modules, DDP-wrapped or not) in place.

    num_tokens: optional scalar tensor of tokens this rank's last pipeline stage saw; when given,
    grads are divided by the total over the data-parallel (x context-parallel) ranks.
    """
    if not isinstance(model_chunks, (list, tuple)):
        model_chunks = [model_chunks]
    pg_collection = resolve_pg_collection(pg_collection)
    for chunk in model_chunks:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync()
    _allreduce_sequence_parallel_grads(model_chunks, pg_collection.tp)
    _allreduce_embedding_grads(model_chunks, pg_collection.embd, pg_collection.pp)
    if num_tokens is not None:
        _normalize_by_num_tokens(model_chunks, num_tokens, pg_collection.pp, pg_collection.dp_cp)
