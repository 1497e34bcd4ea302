"""Context parallelism inside Mamba-2, Gated DeltaNet and Gated Delta Product layers (Megatron's all-to-all
CP for SSMs).

Under context parallelism (CP) a rank holds two chunks of every sequence
(`teratron.transformer.context_parallel`), but a recurrent layer's convolution and scan run over a
whole sequence in order. So around them the layer trades tokens for heads, as CP's 'a2a' attention
does: every CP rank sends each rank that rank's share of the heads for its own tokens (one
all-to-all of the projection's channels the share reads), sorts what it receives into sequence
order, runs the convolution and the scan over whole sequences for its share, and sends each rank
the outputs for that rank's tokens (a second all-to-all). The projections, the output norm and its
gate z stay on the rank's tokens: only the scan's inputs and outputs travel.

Shares (`head_shares`): the heads of a tensor-parallel rank must divide by CP. Heads read a shared
tensor per group (Mamba's B and C, Gated DeltaNet's key heads, Gated Delta Product's keys and
queries): with at least CP groups they divide by CP too and each rank takes its own; with fewer, CP
must divide by them and a group goes to every rank whose heads read it (autograd sums its gradient back). A share's parameters (convolution
channels, dt_bias, A_log, D) are slices of the rank's, taken in the forward: each CP rank's
gradient lands on its rows, and the data-parallel reduction over the DP x CP ranks sums them.
Packed documents: the scan takes the whole sequence's `seq_idx`. Inference runs without CP.
"""

from dataclasses import dataclass

import torch

from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.ssm.recurrence import packed_document_index
from teratron.transformer.context_parallel import heads_to_sequence, sequence_to_heads, token_layout


@dataclass(frozen=True)
class HeadShare:
    """Heads one CP rank scans and the groups they read, as ranges of the tensor-parallel rank's."""

    heads: range
    groups: range


def head_shares(heads: int, groups: int, cp: int, what: tuple[str, str, str]) -> list:
    """Every CP rank's HeadShare of `heads` heads in `groups` groups (per tensor-parallel rank).
    `what` names them for the error: (heads' name, groups' name, the mixer)."""
    head_name, group_name, mixer = what
    if heads % cp:
        raise ValueError(f"{mixer}'s {heads} {head_name} per tensor-parallel rank do not split over context-parallel "
                         f"size {cp}; choose a CP size dividing them (or more {head_name})")
    if groups % cp and cp % groups:
        raise ValueError(f"{mixer}'s {groups} {group_name} per tensor-parallel rank neither split over "
                         f"context-parallel size {cp} nor divide it; choose a CP size that divides or is a multiple "
                         f"of them")
    per_rank = heads // cp
    if groups % cp == 0:
        share = groups // cp
        return [HeadShare(range(r * per_rank, (r + 1) * per_rank), range(r * share, (r + 1) * share))
                for r in range(cp)]
    ranks_per_group = cp // groups
    return [HeadShare(range(r * per_rank, (r + 1) * per_rank), range(r // ranks_per_group, r // ranks_per_group + 1))
            for r in range(cp)]


def set_up_head_exchange(mixer, cp_group, heads: int, groups: int, what: tuple[str, str, str], device):
    """Gives `mixer` its CP group and share: `cp_group`, `cp_share` (this rank's HeadShare; None without
    CP) and, under CP, the buffers `cp_channels` (the projection's channels every share reads, rank 0's
    first: the mixer's `_projection_parts(share)`) and `cp_conv_channels` (its convolution's channels
    this share reads: `_conv_parts(share)`). heads, groups, what: as `head_shares` takes them."""
    mixer.cp_group, cp = cp_group, get_pg_size(cp_group)
    mixer.cp_share = None
    if cp == 1:
        return
    shares = head_shares(heads, groups, cp, what)
    mixer.cp_share = shares[get_pg_rank(cp_group)]
    reads = torch.cat([channel_index(*mixer._projection_parts(share)) for share in shares])
    mixer.register_buffer("cp_channels", reads.to(device), persistent=False)
    mixer.register_buffer("cp_conv_channels", channel_index(*mixer._conv_parts(mixer.cp_share)).to(device),
                          persistent=False)


def channel_index(*parts) -> torch.Tensor:
    """Channels of a tensor laid out as consecutive parts: `parts` are (offset, width, units) with
    `units` a range of the part's units of `width` channels -> int64 [sum of len(units) x width]."""
    return torch.cat([((offset + width * torch.tensor(list(units)))[:, None] + torch.arange(width)).flatten()
                      for offset, width, units in parts])


@torch.compiler.disable
def tokens_to_heads(projected, channels, cp_group, attention_mask):
    """projected [s, b, c] of this CP rank's tokens; channels [CP x c'] int64: the channels each
    rank's share reads (rank 0's first) -> (inputs [b, CP x s, c']: this rank's share over whole
    sequences in order, seq_idx [b, CP x s] of packed documents or None). Outside torch.compile: it
    communicates and caches the layout."""
    cp = get_pg_size(cp_group)
    s, b = projected.shape[:2]
    order, _ = token_layout(attention_mask, cp, s, b, projected.device).order(tuple(range(cp)), projected.device)
    send = projected.index_select(-1, channels.to(projected.device)).unflatten(-1, (cp, -1))  # [s, b, cp, c']
    inputs = heads_to_sequence(send, cp_group).index_select(0, order).squeeze(2)  # [cp * s, b, c'] in order
    return inputs.transpose(0, 1), packed_document_index(attention_mask, b, cp * s, projected.device)


@torch.compiler.disable
def heads_to_tokens(outputs, cp_group, attention_mask):
    """`tokens_to_heads`' way back: outputs [b, CP x s, d'] of this rank's share -> [s, b, CP x d']:
    every share's outputs (rank order, the tensor-parallel rank's head order) for this rank's tokens."""
    cp = get_pg_size(cp_group)
    b, length = outputs.shape[:2]
    _, back = token_layout(attention_mask, cp, length // cp, b, outputs.device).order(tuple(range(cp)),
                                                                                      outputs.device)
    held = outputs.transpose(0, 1).index_select(0, back).unsqueeze(2).contiguous()  # [cp * s, b, 1, d'] rank order
    return sequence_to_heads(held, cp_group).flatten(2)
