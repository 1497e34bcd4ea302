"""Token dispatchers: move each token to the ranks holding its experts and the results back.

The MoE layer's collectives live here (besides tensor_parallel.mappings). Groups come from the
expert grid: `ep` (ranks holding different experts), `expt_tp` (ranks holding shards of the
same experts) and `tp_ep` (both). Every rank holds different tokens (the MoE layer scatters
replicated tokens first), experts [ep_rank * L, (ep_rank + 1) * L) and their expt_tp shard.

allgather: gather every token of the tp_ep group, run the local experts on the ones routed to
    them, reduce-scatter the results (which also sums the expert-TP partial outputs).
alltoall: sort tokens by expert, exchange them over EP with variable splits, all-gather them
    over expert-TP (peers hold different tokens and the same experts), run the local experts;
    combine is the exact reverse (reduce-scatter over expert-TP, all-to-all back).

dispatch(tokens [T, h], probs [T, E], routing_map [T, E]) -> (expert input [N, h],
tokens per local expert [L] (list), expert probs [N]), grouped by local expert.
combine(expert output [N, h]) -> [T, h] (probs already applied by the experts).
"""

from functools import partial

import torch
import torch.distributed as dist

from teratron import comm
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.tensor_parallel.mappings import (gather_from_sequence_parallel_region,
                                               reduce_scatter_to_sequence_parallel_region)
from teratron.transformer.moe.moe_utils import permute, sort_chunks_by_idxs, unpermute

# ----- collectives with variable sizes ----------------------------------------------------------


def _all_to_all(x, output_splits, input_splits, group):
    if get_pg_size(group) == 1:
        return x
    output = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(output, x.contiguous(), output_splits, input_splits, group=group)
    return output


def _all_gather_v(x, sizes, group):
    """Concatenate every rank's x ([sizes[r], ...]) in group-rank order."""
    world_size = get_pg_size(group)
    if world_size == 1:
        return x
    longest = max(sizes)
    padded = x.new_zeros((longest, *x.shape[1:]))
    padded[:x.shape[0]] = x
    gathered = x.new_empty((world_size * longest, *x.shape[1:]))
    comm.all_gather_into_tensor(gathered, padded, group)
    return torch.cat([chunk[:n] for chunk, n in zip(gathered.split(longest), sizes)])


def _reduce_scatter_v(x, sizes, group):
    """Sum x ([sum(sizes), ...]) over the group and keep this rank's rows (sizes[rank])."""
    world_size = get_pg_size(group)
    if world_size == 1:
        return x
    longest = max(sizes)
    padded = x.new_zeros((world_size * longest, *x.shape[1:]))
    for r, chunk in enumerate(x.split(sizes)):
        padded[r * longest:r * longest + sizes[r]] = chunk
    output = x.new_empty((longest, *x.shape[1:]))
    comm.reduce_scatter_tensor(output, padded, group)
    return output[:sizes[get_pg_rank(group)]]


class _DualCollective(torch.autograd.Function):
    """`forward_op(x)` forward and `backward_op(grad)` backward: the variable-size collectives
    come in dual pairs (all-to-all and its reverse, all-gather and reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, forward_op, backward_op):
        ctx.backward_op = backward_op
        return forward_op(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad), None, None


def all_to_all(x, output_splits, input_splits, group):
    """Rank r sends rows input_splits[j] to rank j, receives output_splits[j] rows from rank j
    (in group-rank order). Backward: the reverse exchange."""
    forward = partial(_all_to_all, output_splits=output_splits, input_splits=input_splits, group=group)
    backward = partial(_all_to_all, output_splits=input_splits, input_splits=output_splits, group=group)
    return _DualCollective.apply(x, forward, backward)


def all_gather_v(x, sizes, group):
    """Forward: concatenate the ranks' x (sizes[r] rows each). Backward: reduce-scatter."""
    return _DualCollective.apply(x, partial(_all_gather_v, sizes=sizes, group=group),
                                 partial(_reduce_scatter_v, sizes=sizes, group=group))


def reduce_scatter_v(x, sizes, group):
    """Forward: sum over ranks, keep this rank's sizes[rank] rows. Backward: all-gather."""
    return _DualCollective.apply(x, partial(_reduce_scatter_v, sizes=sizes, group=group),
                                 partial(_all_gather_v, sizes=sizes, group=group))


# ----- dispatchers ------------------------------------------------------------------------------


class MoETokenDispatcher:
    def __init__(self, num_local_experts: int, local_expert_indices, config, pg_collection):
        self.config = config
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.ep_group = pg_collection.ep
        self.etp_group = pg_collection.expt_tp
        self.tp_ep_group = pg_collection.tp_ep
        self.ep_size, self.ep_rank = get_pg_size(self.ep_group), get_pg_rank(self.ep_group)
        self.etp_size, self.etp_rank = get_pg_size(self.etp_group), get_pg_rank(self.etp_group)


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """Every tp_ep rank sees every token of the group and keeps those of its local experts."""

    def dispatch(self, tokens, probs, routing_map):
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        if get_pg_size(self.tp_ep_group) > 1:
            tokens = gather_from_sequence_parallel_region(tokens, True, self.tp_ep_group)
            probs = gather_from_sequence_parallel_region(probs, True, self.tp_ep_group)
            with torch.no_grad():
                routing_map = gather_from_sequence_parallel_region(
                    routing_map.to(torch.uint8), True, self.tp_ep_group).bool()
        self.num_gathered_tokens = tokens.shape[0]
        local_map = routing_map[:, first:last]
        expert_input, expert_probs, self.sorted_indices = permute(tokens, local_map, probs[:, first:last])
        return expert_input, local_map.sum(dim=0).tolist(), expert_probs

    def combine(self, expert_output):
        output = unpermute(expert_output, self.sorted_indices, self.num_gathered_tokens)
        if get_pg_size(self.tp_ep_group) > 1:
            output = reduce_scatter_to_sequence_parallel_region(output, self.tp_ep_group)
        return output


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """Tokens travel only to the EP ranks of their experts (then to the expert-TP peers)."""

    def _global_counts(self, counts):
        """[ep, etp, E] tokens per expert of every tp_ep rank, indexed by its (ep, etp) rank."""
        if get_pg_size(self.tp_ep_group) == 1:
            return counts.view(1, 1, -1)
        own = torch.cat([torch.tensor([self.ep_rank, self.etp_rank], device=counts.device), counts])
        rows = own.new_empty((get_pg_size(self.tp_ep_group), own.numel()))
        comm.all_gather_into_tensor(rows, own.unsqueeze(0), self.tp_ep_group)
        table = counts.new_zeros((self.ep_size, self.etp_size, counts.numel()))
        table[rows[:, 0], rows[:, 1]] = rows[:, 2:]
        return table

    def dispatch(self, tokens, probs, routing_map):
        self.num_tokens = tokens.shape[0]
        num_local = self.num_local_experts
        permuted, permuted_probs, self.sorted_indices = permute(tokens, routing_map, probs)
        table = self._global_counts(routing_map.sum(dim=0))
        first = self.local_expert_indices[0]
        # received[t, j, l]: tokens of local expert l sent by EP rank j to expert-TP peer t.
        received = table[:, :, first:first + num_local].transpose(0, 1)
        self.input_splits = table[self.ep_rank, self.etp_rank].view(self.ep_size, num_local).sum(-1).tolist()
        self.output_splits = received[self.etp_rank].sum(-1).tolist()
        self.etp_sizes = received.sum(dim=(1, 2)).tolist()
        x = all_to_all(permuted, self.output_splits, self.input_splits, self.ep_group)
        p = all_to_all(permuted_probs, self.output_splits, self.input_splits, self.ep_group)
        if self.etp_size > 1:
            x = all_gather_v(x, self.etp_sizes, self.etp_group)
            p = all_gather_v(p, self.etp_sizes, self.etp_group)
        # Chunks arrive ordered (t, j, l); the experts want (l, t, j).
        self.chunk_sizes = received.flatten().tolist()
        chunk_ids = torch.arange(len(self.chunk_sizes)).view(received.shape)
        self.sorted_chunks = chunk_ids.permute(2, 0, 1).flatten().tolist()
        self.restore_chunks = torch.tensor(self.sorted_chunks).argsort().tolist()
        x = sort_chunks_by_idxs(x, self.chunk_sizes, self.sorted_chunks)
        p = sort_chunks_by_idxs(p, self.chunk_sizes, self.sorted_chunks)
        return x, received.sum(dim=(0, 1)).tolist(), p

    def combine(self, expert_output):
        sorted_sizes = [self.chunk_sizes[i] for i in self.sorted_chunks]
        output = sort_chunks_by_idxs(expert_output, sorted_sizes, self.restore_chunks)
        if self.etp_size > 1:
            output = reduce_scatter_v(output, self.etp_sizes, self.etp_group)
        output = all_to_all(output, self.input_splits, self.output_splits, self.ep_group)
        return unpermute(output, self.sorted_indices, self.num_tokens)


DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}
