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
sequence and out_proj reduce-scatters it, as attention's projections do. No biases on the two
projections, whatever add_bias_linear says (Megatron's MambaMixer defaults to bias=False and its
HybridModel keeps that); the convolution has one.

Initialisation follows Mamba-2 and is layout-invariant (each parameter is drawn whole, then
sharded): dt_bias is the inverse softplus of dt ~ exp(U(log dt_min, log dt_max)) (at least
dt_init_floor), A_log = log(U(1, 16)), D = 1, the convolution Kaiming-uniform as torch's Conv1d.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.ssm import gated_norm_triton
from teratron.ssm.causal_conv1d import causal_conv1d_silu
from teratron.ssm.recurrence import mix_tokens
from teratron.ssm.ssd import ssd
from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from teratron.tensor_parallel.layers import param_device, set_tensor_model_parallel_attributes
from teratron.tensor_parallel.utils import resolve_tp_group, shard_tensor


CHUNK_SIZE = 128  # tokens per chunk of the scan (Megatron's mamba_chunk_size)
EXPAND = 2  # Mamba-2's d_inner / hidden_size when --mamba-num-heads is not given


def mamba_num_heads(config) -> int:
    """A layer's Mamba heads: --mamba-num-heads, else EXPAND x hidden_size / --mamba-head-dim."""
    return config.mamba_num_heads or EXPAND * config.hidden_size // config.mamba_head_dim


class MambaMixer(nn.Module):
    def __init__(self, config, layer_number: int | None = None, pg_collection=None, d_state: int | None = None,
                 head_dim: int | None = None, ngroups: int | None = None, nheads: int | None = None,
                 expand: int = EXPAND, d_conv: int = 4, chunk_size: int = CHUNK_SIZE, dt_min: float = 0.001,
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
        for what, size in (("heads", self.nheads), ("groups", ngroups)):
            if size % tp:
                raise ValueError(f"Mamba's {size} {what} do not split over tensor-parallel size {tp}; choose "
                                 f"--mamba-num-{what} divisible by it")
        if self.nheads % ngroups:
            raise ValueError(f"Mamba's {self.nheads} heads do not split into {ngroups} groups; choose "
                             "--mamba-num-groups dividing the heads")
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
        bound = 1.0 / math.sqrt(d_conv)  # torch's Conv1d default for a depthwise kernel of d_conv taps
        conv_weight = torch.empty(sum(conv_parts), d_conv).uniform_(-bound, bound)
        conv_bias = torch.empty(sum(conv_parts)).uniform_(-bound, bound)
        dt = torch.exp(torch.rand(self.nheads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        A = torch.empty(self.nheads).uniform_(*A_init_range)

        def shard(full, parts_=1):
            part = shard_tensor(full, 0, parts_, rank, tp)
            return nn.Parameter(part if part.is_meta else part.to(device))  # built on meta: shapes only

        # An nn.Conv1d for Megatron's parameter names and shape ([c, 1, d_conv]); causal_conv1d runs it.
        channels = sum(conv_parts) // tp
        self.conv1d = nn.Conv1d(channels, channels, d_conv, groups=channels, device="meta")
        self.conv1d.weight = shard(conv_weight[:, None, :], conv_parts)
        self.conv1d.bias = shard(conv_bias, conv_parts)
        self.dt_bias = shard(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.A_log = shard(torch.log(A))
        self.D = shard(torch.ones(self.nheads))
        self.norm = GroupGatedRMSNorm(shard(torch.ones(self.d_inner)), self.ngroups_local, config.layernorm_epsilon)
        for param, stride in ((self.conv1d.weight, conv_parts), (self.conv1d.bias, conv_parts), (self.dt_bias, 1),
                              (self.A_log, 1), (self.D, 1), (self.norm.weight, 1)):
            set_tensor_model_parallel_attributes(param, True, 0, stride)
        for param in (self.conv1d.weight, self.conv1d.bias, self.norm.weight):
            param.data = param.data.to(config.params_dtype)

    recurrent = True  # the inference context keeps a state per request for it (`run_recurrent`)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        """hidden_states [s, b, h] ([s/tp, b, h] under sequence parallelism) -> ([s, b, h], None).
        The mixer is causal by construction: of the attention arguments a layer passes it reads only
        packed documents (attention_mask a PackedSeqParams: each document from a zero state).
        With `inference_context` (the engine's step: [t, 1, h], requests back to back) each
        request's tokens continue from the convolution and scan states its earlier ones left."""
        projected, _ = self.in_proj(hidden_states)  # [s, b, parts / tp]
        y = mix_tokens(self._mix, projected, self.layer_number, inference_context, attention_mask)
        out, _ = self.out_proj(y)  # y [s, b, d_inner / tp]
        return out, None

    def _mix(self, projected, state, seq_idx=None):
        """projected [b, s, parts / tp] and the (convolution, scan) state before it (None: zeros),
        seq_idx [b, s] (packed documents) or None -> (the gated, normed scan output [b, s, d_inner / tp],
        the state after it)."""
        conv_state, scan_state = state if state is not None else (None, None)
        bc = self.ngroups_local * self.d_state
        # Split in the projection's memory order ([s, b] in training): the gradient's concatenation then
        # comes out laid out as the input projection's backward reads it (no transposing copy).
        parts = projected.transpose(0, 1).split([self.d_inner_local, self.d_inner_local + 2 * bc, self.nheads_local],
                                                dim=-1)
        z, xbc, dt = (part.transpose(0, 1) for part in parts)
        # [b, s, c]
        xbc, conv_state = causal_conv1d_silu(xbc, self.conv1d.weight[:, 0], self.conv1d.bias, conv_state,
                                             seq_idx=seq_idx)
        x, B, C = xbc.split([self.d_inner_local, bc, bc], dim=-1)
        b, s = x.shape[:2]
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [b, s, heads]
        # Views of the convolution's output: the scan's kernels read them by their strides (no copies).
        x = x.unflatten(-1, (self.nheads_local, self.head_dim))
        B, C = (t.unflatten(-1, (self.ngroups_local, self.d_state)) for t in (B, C))
        y, scan_state = ssd(x, dt, -torch.exp(self.A_log.float()), B, C, self.D, initial_state=scan_state,
                            chunk_size=self.chunk_size, seq_idx=seq_idx)
        return self.norm(y.reshape(b, s, self.d_inner_local), z), (conv_state, scan_state)


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
