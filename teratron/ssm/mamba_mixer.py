"""Mamba-2's mixer (Megatron Core's `MambaMixer`): [s, b, h] -> [s, b, h].

    z, xBC, dt = in_proj(hidden)                z, x [d_inner], B, C [groups * d_state], dt [heads]
    x, B, C    = silu(causal_conv1d(xBC))       a short depthwise convolution over the sequence
    y          = SSD(x, softplus(dt + dt_bias), -exp(A_log), B, C, D)   (teratron.ssm.ssd)
    out        = out_proj(rmsnorm_per_group(y * silu(z)))

d_inner = expand * hidden = heads * head_dim; heads share B and C within each of `ngroups` groups.
Tensor parallelism splits heads and groups: in_proj is column-parallel with the five parts
[z; x; B; C; dt] each split over TP (a tuple partition stride), the convolution, dt_bias, A_log,
D and the norm's weight are split alike, out_proj is row-parallel; so each rank runs whole heads
and groups and nothing is exchanged inside the mixer. With sequence parallelism in_proj gathers the
sequence and out_proj reduce-scatters it, as attention's projections do. Context parallelism runs the
convolution and the scan on whole sequences for a share of the heads (`teratron.ssm.context_parallel`).
No biases on the two projections, whatever add_bias_linear says (Megatron's MambaMixer defaults to
bias=False and its HybridModel keeps that); the convolution has one.

Initialisation follows Mamba-2 and is layout-invariant (each parameter is drawn whole, then
sharded): dt_bias is the inverse softplus of dt ~ exp(U(log dt_min, log dt_max)) (at least
dt_init_floor), A_log = log(U(1, 16)), D = 1, the convolution Kaiming-uniform as torch's Conv1d.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.ssm import gated_norm_triton, mamba_core
from teratron.ssm.causal_conv1d import causal_conv1d_silu
from teratron.ssm.context_parallel import HeadShare, heads_to_tokens, set_up_head_exchange, tokens_to_heads
from teratron.ssm.recurrence import conv_state_bytes, mix_tokens
from teratron.ssm.ssd import ssd
from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from teratron.tensor_parallel.layers import param_device, set_tensor_model_parallel_attributes
from teratron.tensor_parallel.utils import resolve_tp_group, shard_tensor
from teratron.topology import resolve_pg_collection


CHUNK_SIZE = 128  # tokens per chunk of the scan (Megatron's mamba_chunk_size)
EXPAND = 2  # Mamba-2's d_inner / hidden_size when --mamba-num-heads is not given
D_CONV = 4  # taps of the causal depthwise convolution


def mamba_num_heads(config) -> int:
    """A layer's Mamba heads: --mamba-num-heads, else EXPAND x hidden_size / --mamba-head-dim."""
    return config.mamba_num_heads or EXPAND * config.hidden_size // config.mamba_head_dim


def check_heads_and_groups(mixer: str, heads: int, groups: int, tp: int):
    """A Mamba-sized mixer's heads and groups split over TP, and its heads into the groups."""
    for what, size in (("heads", heads), ("groups", groups)):
        if size % tp:
            raise ValueError(f"{mixer}'s {size} {what} do not split over tensor-parallel size {tp}; choose "
                             f"--mamba-num-{what} divisible by it")
    if heads % groups:
        raise ValueError(f"{mixer}'s {heads} heads do not split into {groups} groups; choose --mamba-num-groups "
                         "dividing the heads")


def initial_dt_bias(heads: int, dt_min: float, dt_max: float, dt_init_floor: float) -> torch.Tensor:
    """Mamba-2's dt_bias [heads]: softplus(dt_bias) = dt, dt log-uniform in [dt_min, dt_max], at least
    dt_init_floor."""
    dt = torch.exp(torch.rand(heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=dt_init_floor)
    return dt + torch.log(-torch.expm1(-dt))


class MambaMixer(nn.Module):
    def __init__(self, config, layer_number: int | None = None, pg_collection=None, d_state: int | None = None,
                 head_dim: int | None = None, ngroups: int | None = None, nheads: int | None = None,
                 expand: int = EXPAND, d_conv: int = D_CONV, chunk_size: int = CHUNK_SIZE, dt_min: float = 0.001,
                 dt_max: float = 0.1, dt_init_floor: float = 1e-4, A_init_range=(1.0, 16.0), tp_group=None):
        """Sizes left None come from the config (mamba_state_dim, mamba_head_dim, mamba_num_groups,
        mamba_num_heads; heads default to expand * hidden_size / head_dim)."""
        super().__init__()
        d_state = config.mamba_state_dim if d_state is None else d_state
        head_dim = config.mamba_head_dim if head_dim is None else head_dim
        ngroups = config.mamba_num_groups if ngroups is None else ngroups
        nheads = config.mamba_num_heads if nheads is None else nheads
        self.config, self.d_state, self.head_dim, self.chunk_size = config, d_state, head_dim, chunk_size
        self.layer_number = layer_number
        self.nheads = nheads if nheads is not None else expand * config.hidden_size // head_dim
        self.d_inner = self.nheads * head_dim
        self.ngroups = ngroups
        if tp_group is None and pg_collection is not None:
            tp_group = pg_collection.tp
        self.tp_group = resolve_tp_group(tp_group)
        tp, rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        check_heads_and_groups("Mamba", self.nheads, ngroups, tp)
        self.nheads_local, self.ngroups_local = self.nheads // tp, ngroups // tp
        self.d_inner_local = self.d_inner // tp
        bc = ngroups * d_state
        # Global rows of in_proj's and conv1d's parts (z x B C dt; x B C), each split over TP
        self.in_proj_parts = parts = (self.d_inner, self.d_inner, bc, bc, self.nheads)
        self.in_proj = ColumnParallelLinear(config.hidden_size, sum(parts), config=config,
                                            init_method=config.init_method, bias=False,
                                            stride=parts, tp_group=self.tp_group)
        self.out_proj = RowParallelLinear(self.d_inner, config.hidden_size, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=False, tp_group=self.tp_group)

        device = param_device(config)
        self.conv1d_parts = conv_parts = (self.d_inner, bc, bc)
        self.in_proj_part_names = ("z", "x", "B", "C", "dt")  # Megatron's checkpoint names
        self.conv1d_part_names = self.in_proj_part_names[1:4]
        bound = 1.0 / math.sqrt(d_conv)  # torch's Conv1d default for a depthwise kernel of d_conv taps
        conv_weight = torch.empty(sum(conv_parts), d_conv).uniform_(-bound, bound)
        conv_bias = torch.empty(sum(conv_parts)).uniform_(-bound, bound)
        dt_bias = initial_dt_bias(self.nheads, dt_min, dt_max, dt_init_floor)
        A = torch.empty(self.nheads).uniform_(*A_init_range)

        def shard(full, parts_=1):
            part = shard_tensor(full, 0, parts_, rank, tp)
            return nn.Parameter(part if part.is_meta else part.to(device))  # built on meta: shapes only

        # An nn.Conv1d for Megatron's parameter names and shape ([c, 1, d_conv]); causal_conv1d runs it.
        channels = sum(conv_parts) // tp
        self.conv1d = nn.Conv1d(channels, channels, d_conv, groups=channels, device="meta")
        self.conv1d.weight = shard(conv_weight[:, None, :], conv_parts)
        self.conv1d.bias = shard(conv_bias, conv_parts)
        self.dt_bias = shard(dt_bias)
        self.A_log = shard(torch.log(A))
        self.D = shard(torch.ones(self.nheads))
        self.norm = GroupGatedRMSNorm(shard(torch.ones(self.d_inner)), self.ngroups_local, config.layernorm_epsilon)
        for param, stride in ((self.conv1d.weight, conv_parts), (self.conv1d.bias, conv_parts), (self.dt_bias, 1),
                              (self.A_log, 1), (self.D, 1), (self.norm.weight, 1)):
            set_tensor_model_parallel_attributes(param, True, 0, stride)
        for param in (self.conv1d.weight, self.conv1d.bias, self.norm.weight):
            param.data = param.data.to(config.params_dtype)
        self.whole = HeadShare(range(self.nheads_local), range(self.ngroups_local))
        set_up_head_exchange(self, resolve_pg_collection(pg_collection).cp, self.nheads_local, self.ngroups_local,
                             ("heads", "groups", "Mamba"), device)

    def _projection_parts(self, share: HeadShare) -> tuple:
        """The projection's channels a CP share reads (the convolution's x, B, C and dt; z stays), as
        channel_index parts: projected is z, then the convolution's channels, then dt."""
        z = self.d_inner_local
        return (*self._conv_parts(share, offset=z), (z + self._conv_width(), 1, share.heads))

    def _conv_width(self) -> int:
        return self.d_inner_local + 2 * self.ngroups_local * self.d_state

    def _conv_parts(self, share: HeadShare, offset: int = 0) -> tuple:
        """The convolution's channels (x, B, C) a share reads, as channel_index parts."""
        b_start = offset + self.d_inner_local
        c_start = b_start + self.ngroups_local * self.d_state
        return ((offset, self.head_dim, share.heads), (b_start, self.d_state, share.groups),
                (c_start, self.d_state, share.groups))

    recurrent = True  # the inference context keeps a state per request for it (`run_recurrent`)

    def inference_state_bytes(self) -> int:
        """One request's state in inference, at most: the convolution's, and the scan's [heads, p, n]
        (fp32 on the kernels; the PyTorch path keeps it in the activations' dtype)."""
        return conv_state_bytes(self.conv1d) + 4 * self.nheads_local * self.head_dim * self.d_state

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        """hidden_states [s, b, h] ([s/tp, b, h] under sequence parallelism) -> ([s, b, h], None).
        The mixer is causal by construction: of the attention arguments a layer passes it reads only
        packed documents (attention_mask a PackedSeqParams: each document from a zero state).
        With `inference_context` (the engine's step: [t, 1, h], requests back to back) each
        request's tokens continue from the convolution and scan states its earlier ones left."""
        projected, _ = self.in_proj(hidden_states)  # [s, b, parts / tp]
        if self.cp_share is not None and inference_context is None:
            y = self._mix_context_parallel(projected, attention_mask)
        else:
            mix = self._mix if inference_context is not None else self._mix_from_zero
            y = mix_tokens(mix, projected, self.layer_number, inference_context, attention_mask)
        out, _ = self.out_proj(y)  # y [s, b, d_inner / tp]
        return out, None

    def _mix(self, projected, state, seq_idx=None):
        """projected [b, s, parts / tp] and the (convolution, scan) state before it (None: zeros),
        seq_idx [b, s] (packed documents) or None -> (the gated, normed scan output [b, s, d_inner / tp],
        the state after it)."""
        # Split in the projection's memory order ([s, b] in training): the gradient's concatenation then
        # comes out laid out as the input projection's backward reads it (no transposing copy).
        parts = projected.transpose(0, 1).split([self.d_inner_local, self._conv_width(), self.nheads_local], dim=-1)
        z, xbc, dt = (part.transpose(0, 1) for part in parts)  # [b, s, c]
        y, state = self._scan(xbc, dt, self.whole, state, seq_idx)
        return self.norm(y, z), state

    def _mix_from_zero(self, projected, state, seq_idx=None):
        """`_mix` from zero states (state None) when the state after is not kept (training,
        evaluation): on the Triton kernels everything between the projections is one custom op,
        teratron.ssm.mamba_core, which returns no state (None)."""
        if not mamba_core.runs_here(projected, self.conv1d.weight, self.chunk_size):
            return self._mix(projected, state, seq_idx)
        return mamba_core.mamba_core(projected, self.conv1d.weight[:, 0], self.conv1d.bias, self.dt_bias, self.A_log,
                                     self.D, self.norm.weight, self.head_dim, self.ngroups_local, self.d_state,
                                     self.chunk_size, self.norm.eps, seq_idx), None

    def _mix_context_parallel(self, projected, attention_mask):
        """projected [s, b, parts / tp] of this CP rank's tokens -> the gated, normed scan output
        [s, b, d_inner / tp]: the convolution and scan over whole sequences for this rank's share of
        the heads, between two all-to-alls."""
        share = self.cp_share
        inputs, seq_idx = tokens_to_heads(projected, self.cp_channels, self.cp_group, attention_mask)
        xbc, dt = inputs.split([len(self.cp_conv_channels), len(share.heads)], dim=-1)
        y, _ = self._scan(xbc, dt, share, None, seq_idx)
        y = heads_to_tokens(y, self.cp_group, attention_mask)  # [s, b, d_inner / tp]
        z = projected[..., :self.d_inner_local]
        return self.norm(y.transpose(0, 1), z.transpose(0, 1)).transpose(0, 1)

    def _scan(self, xbc, dt, share: HeadShare, state, seq_idx):
        """The convolution and the scan of a share of the heads: xbc [b, s, its x, B, C channels],
        dt [b, s, its heads] -> (y [b, s, its heads x head_dim], the (convolution, scan) state after)."""
        conv_state, scan_state = state if state is not None else (None, None)
        weight, bias, dt_bias, A_log, D = self.conv1d.weight[:, 0], self.conv1d.bias, self.dt_bias, self.A_log, self.D
        if share is not self.whole:  # slices taken here, so that gradients reach the rank's parameters
            heads = slice(share.heads.start, share.heads.stop)
            weight, bias = weight.index_select(0, self.cp_conv_channels), bias.index_select(0, self.cp_conv_channels)
            dt_bias, A_log, D = dt_bias[heads], A_log[heads], D[heads]
        nheads, bc = len(share.heads), len(share.groups) * self.d_state
        xbc, conv_state = causal_conv1d_silu(xbc, weight, bias, conv_state, seq_idx=seq_idx)
        x, B, C = xbc.split([nheads * self.head_dim, bc, bc], dim=-1)
        b, s = x.shape[:2]
        dt = F.softplus(dt.float() + dt_bias.float())  # [b, s, heads]
        # Views of the convolution's output: the scan's kernels read them by their strides (no copies).
        x = x.unflatten(-1, (nheads, self.head_dim))
        B, C = (t.unflatten(-1, (len(share.groups), self.d_state)) for t in (B, C))
        y, scan_state = ssd(x, dt, -torch.exp(A_log.float()), B, C, D, initial_state=scan_state,
                            chunk_size=self.chunk_size, seq_idx=seq_idx)
        return y.reshape(b, s, nheads * self.head_dim), (conv_state, scan_state)


class GroupGatedRMSNorm(nn.Module):
    """Mamba-2's output norm: RMSNorm of y * silu(z) over each group's channels (so TP, which
    splits whole groups, normalises exactly as one process), times `weight`; in fp32."""

    def __init__(self, weight: nn.Parameter, groups: int, eps: float):
        super().__init__()
        if weight.shape[-1] % groups:
            raise ValueError(f"GroupGatedRMSNorm: {weight.shape[-1]} channels do not split into {groups} groups; "
                             "choose groups dividing the channels")
        self.weight, self.groups, self.eps = weight, groups, eps

    def forward(self, y, z):
        """y, z [b, s, d] -> [b, s, d]: by Triton kernels where they run (teratron.ssm.gated_norm_triton),
        else `reference`."""
        if gated_norm_triton.runs_here(y, z):
            return gated_norm_triton.gated_rmsnorm_triton(y, z, self.weight, self.groups, self.eps)
        return self.reference(y, z)

    def reference(self, y, z):
        dtype = torch.promote_types(y.dtype, torch.float32)
        gated = (y.to(dtype) * F.silu(z.to(dtype))).unflatten(-1, (self.groups, -1))
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed.flatten(-2) * self.weight.to(dtype)).to(y.dtype)
