"""Gated Delta Product (Megatron Core's `GatedDeltaProductMixer`, its `gdp_stack_spec`): the hybrid
pattern's `M` layers as GDP mixers, [s, b, h] -> [s, b, h].

Gated DeltaNet's state takes one rank-one (Householder-like) update a token; GDP takes M of them
(`gdp_num_householder`), each with its own key, value and beta, and reads the output after the last:

    z, V, K, Q, b, a = in_proj(hidden)     z [d_inner], V [M * d_inner], K [M * groups * n],
                                           Q [groups * n], b [M * heads], a [heads]
    V, K, Q = silu(causal_conv1d([V; K; Q]))    a short depthwise convolution, no bias
    q, k    = l2norm(Q) / sqrt(n), l2norm(K)    per group, each group's then repeated for its heads
    g       = -exp(A_log) * softplus(a + dt_bias),   beta = sigmoid(b)
    for each token t, substeps m = 1 .. M:
        S = alpha_m S (I - beta_tm k_tm k_tm^T) + beta_tm v_tm k_tm^T,   alpha_1 = exp(g_t), the others 1
    o_t = S q_t                                 after the token's last substep
    out = out_proj(rmsnorm_per_group(o * silu(z)))

Sizes are Mamba's: heads = --mamba-num-heads (of --mamba-head-dim channels p; d_inner = heads * p),
keys and queries per group of --mamba-num-groups with --mamba-state-dim channels n. The M substeps
of a token are the gated delta rule over a sequence M times longer (`gated_delta_product`), so
GDP runs on teratron's gated-delta-rule kernels (Triton on GPUs, PyTorch elsewhere).

in_proj's rows are Megatron's [z; V_0 .. V_{M-1}; K_0 .. K_{M-1}; Q; b_0 .. b_{M-1}; a] (each V_m
holds every head: the substeps are the outer axis), and tensor parallelism splits each of those
parts over TP separately (a tuple partition stride), so a rank holds its heads' and groups' rows of
every part and runs whole heads and groups, as Mamba's mixer does; the convolution over
[V_0 ..; K_0 ..; Q], dt_bias, A_log and the norm's weight are split alike, out_proj is row-parallel.
Context parallelism runs the convolution and the rule over whole sequences for a share of the heads
(`teratron.ssm.context_parallel`). Megatron's defaults: no biases, A = U(0, 16), dt_bias as
Mamba-2's, the norm's groups of d_inner / groups channels; no D.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.ssm.causal_conv1d import causal_conv1d_silu
from teratron.ssm.context_parallel import HeadShare, heads_to_tokens, set_up_head_exchange, tokens_to_heads
from teratron.ssm.gated_delta_net import l2_normed_heads
from teratron.ssm.gated_delta_rule import gated_delta_rule
from teratron.ssm.mamba_mixer import (D_CONV, GroupGatedRMSNorm, check_heads_and_groups, initial_dt_bias,
                                      mamba_num_heads)
from teratron.ssm.recurrence import conv_state_bytes, mix_tokens
from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from teratron.tensor_parallel.layers import param_device, set_tensor_model_parallel_attributes
from teratron.tensor_parallel.utils import resolve_tp_group, shard_tensor
from teratron.topology import resolve_pg_collection

A_INIT_RANGE = (0.0, 16.0)  # A = exp(A_log) ~ U(this range) (Megatron's GDP default)
CHUNK_SIZE = 64  # tokens of the expanded sequence per chunk of the gated delta rule


def gated_delta_product(q, k, v, g, beta, num_householder: int, initial_state=None, chunk_size: int = CHUNK_SIZE,
                        seq_idx=None):
    """q [b, s, h, n], k [b, s * M, h, n], v [b, s * M, h, p], beta [b, s * M, h] (token-major: a
    token's M substeps in a row), g [b, s, h], initial_state [b, h, p, n] or None, seq_idx [b, s] or
    None -> (o [b, s, h, p], the state after the last token): the gated delta rule
    (`teratron.ssm.gated_delta_rule`) over the M substeps of every token, the token's decay at its
    first substep and its query at its last (zero queries and decays elsewhere)."""
    b, s, h, n = q.shape
    m = num_householder
    expanded_q = torch.cat([q.new_zeros(b, s, m - 1, h, n), q[:, :, None]], dim=2).flatten(1, 2)
    expanded_g = torch.cat([g[:, :, None], g.new_zeros(b, s, m - 1, h)], dim=2).flatten(1, 2)
    expanded_seq_idx = None if seq_idx is None else seq_idx.repeat_interleave(m, dim=1)
    o, state = gated_delta_rule(expanded_q, k, v, expanded_g, beta, initial_state=initial_state,
                                chunk_size=chunk_size, seq_idx=expanded_seq_idx)
    # a copy of the tokens' outputs: a view would keep every substep's output alive for the norm's backward
    return o.unflatten(1, (s, m))[:, :, -1].contiguous(), state


class GatedDeltaProductMixer(nn.Module):
    def __init__(self, config, layer_number: int | None = None, pg_collection=None, d_conv: int = D_CONV,
                 dt_min: float = 0.001, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 A_init_range=A_INIT_RANGE, tp_group=None):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        self.num_householder = m = config.gdp_num_householder
        self.d_state, self.head_dim, self.ngroups = config.mamba_state_dim, config.mamba_head_dim, config.mamba_num_groups
        self.nheads = mamba_num_heads(config)
        self.chunk_size = CHUNK_SIZE
        self.d_inner = self.nheads * self.head_dim
        if tp_group is None and pg_collection is not None:
            tp_group = pg_collection.tp
        self.tp_group = resolve_tp_group(tp_group)
        tp, rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        check_heads_and_groups("Gated Delta Product", self.nheads, self.ngroups, tp)
        self.nheads_local, self.ngroups_local, self.d_inner_local = self.nheads // tp, self.ngroups // tp, self.d_inner // tp
        gn = self.ngroups * self.d_state
        # Global rows of in_proj's parts (z, V_m, K_m, Q, b_m, a) and conv1d's (V_m, K_m, Q), each split over TP
        self.in_proj_parts = parts = ((self.d_inner,) + (self.d_inner,) * m + (gn,) * m + (gn,)
                                      + (self.nheads,) * m + (self.nheads,))
        self.conv1d_parts = conv_parts = (self.d_inner,) * m + (gn,) * m + (gn,)
        self.in_proj_part_names = ("z", *(f"V{i}" for i in range(m)), *(f"K{i}" for i in range(m)), "Q",
                                   *(f"b{i}" for i in range(m)), "a")  # Megatron's checkpoint names
        self.conv1d_part_names = self.in_proj_part_names[1:2 * m + 2]
        self.in_proj = ColumnParallelLinear(config.hidden_size, sum(parts), config=config,
                                            init_method=config.init_method, bias=False, stride=parts,
                                            tp_group=self.tp_group)
        self.out_proj = RowParallelLinear(self.d_inner, config.hidden_size, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=False, tp_group=self.tp_group)

        device = param_device(config)
        bound = 1.0 / math.sqrt(d_conv)  # torch's Conv1d default for a depthwise kernel of d_conv taps
        conv_weight = torch.empty(sum(conv_parts), 1, d_conv).uniform_(-bound, bound)
        dt_bias = initial_dt_bias(self.nheads, dt_min, dt_max, dt_init_floor)
        A = torch.empty(self.nheads).uniform_(*A_init_range)

        def shard(full, parts_=1):
            part = shard_tensor(full, 0, parts_, rank, tp)
            return nn.Parameter(part if part.is_meta else part.to(device))  # built on meta: shapes only

        # An nn.Conv1d for Megatron's parameter name and shape ([c, 1, d_conv]); causal_conv1d runs it.
        self.conv_width_local = channels = sum(conv_parts) // tp
        self.conv1d = nn.Conv1d(channels, channels, d_conv, groups=channels, bias=False, device="meta")
        self.conv1d.weight = shard(conv_weight, conv_parts)
        self.dt_bias = shard(dt_bias)
        self.A_log = shard(torch.log(A))
        self.norm = GroupGatedRMSNorm(shard(torch.ones(self.d_inner)), self.ngroups_local, config.layernorm_epsilon)
        for param, stride in ((self.conv1d.weight, conv_parts), (self.dt_bias, 1), (self.A_log, 1),
                              (self.norm.weight, 1)):
            set_tensor_model_parallel_attributes(param, True, 0, stride)
        for param in (self.conv1d.weight, self.norm.weight):
            param.data = param.data.to(config.params_dtype)
        self.whole = HeadShare(range(self.nheads_local), range(self.ngroups_local))
        set_up_head_exchange(self, resolve_pg_collection(pg_collection).cp, self.nheads_local, self.ngroups_local,
                             ("heads", "groups", "Gated Delta Product"), device)

    def _projection_parts(self, share: HeadShare) -> tuple:
        """The projection's channels a CP share reads (V_m, K_m, Q, b_m, a; z stays), as channel_index
        parts: projected is z, V_m, K_m, Q, then b_m, a."""
        gates = self.d_inner_local + self.conv_width_local
        return (*self._conv_parts(share, offset=self.d_inner_local),
                *((gates + i * self.nheads_local, 1, share.heads) for i in range(self.num_householder + 1)))

    def _conv_parts(self, share: HeadShare, offset: int = 0) -> tuple:
        """The convolution's channels (V_m, K_m, Q) a share reads, as channel_index parts."""
        m, gn = self.num_householder, self.ngroups_local * self.d_state
        values = [(offset + i * self.d_inner_local, self.head_dim, share.heads) for i in range(m)]
        keys_start = offset + m * self.d_inner_local
        keys = [(keys_start + i * gn, self.d_state, share.groups) for i in range(m + 1)]  # K_0 .. K_{M-1}, Q
        return (*values, *keys)

    recurrent = True  # the inference context keeps a state per request for it (`run_recurrent`)

    def inference_state_bytes(self) -> int:
        """One request's state in inference, at most: the convolution's, and the rule's [heads, p, n]
        (counted in fp32; kept in the activations' dtype)."""
        return conv_state_bytes(self.conv1d) + 4 * self.nheads_local * self.head_dim * self.d_state

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        """hidden_states [s, b, h] ([s/tp, b, h] under sequence parallelism) -> ([s, b, h], None).
        Causal by construction: of the attention arguments a layer passes it reads only packed documents
        (attention_mask a PackedSeqParams: each document from a zero state). With `inference_context`
        (the engine's step: [t, 1, h], requests back to back) each request's tokens continue from the
        convolution and rule states its earlier ones left."""
        projected, _ = self.in_proj(hidden_states)  # [s, b, parts / tp]
        if self.cp_share is not None and inference_context is None:
            y = self._mix_context_parallel(projected, attention_mask)
        else:
            y = mix_tokens(self._mix, projected, self.layer_number, inference_context, attention_mask)
        out, _ = self.out_proj(y)  # y [s, b, d_inner / tp]
        return out, None

    def _mix(self, projected, state, seq_idx=None):
        """projected [b, s, parts / tp] and the (convolution, rule) state before it (None: zeros),
        seq_idx [b, s] (packed documents) or None -> (the gated, normed output [b, s, d_inner / tp], the
        state after it)."""
        heads = self.nheads_local
        # Split in the projection's memory order ([s, b] in training), as MambaMixer._mix does: the
        # gradient's concatenation then comes out laid out as in_proj's backward reads it.
        parts = projected.transpose(0, 1).split(
            [self.d_inner_local, self.conv_width_local, self.num_householder * heads, heads], dim=-1)
        z, vkq, beta, alpha = (part.transpose(0, 1) for part in parts)  # [b, s, c]
        o, state = self._rule(vkq, beta, alpha, self.whole, state, seq_idx)
        return self.norm(o.flatten(2), z), state

    def _mix_context_parallel(self, projected, attention_mask):
        """projected [s, b, parts / tp] of this CP rank's tokens -> the gated, normed output
        [s, b, d_inner / tp]: the convolution and the rule over whole sequences for this rank's share of
        the heads, between two all-to-alls."""
        heads = len(self.cp_share.heads)
        inputs, seq_idx = tokens_to_heads(projected, self.cp_channels, self.cp_group, attention_mask)
        vkq, beta, alpha = inputs.split([len(self.cp_conv_channels), self.num_householder * heads, heads], dim=-1)
        o, _ = self._rule(vkq, beta, alpha, self.cp_share, None, seq_idx)
        o = heads_to_tokens(o.flatten(2), self.cp_group, attention_mask)  # [s, b, d_inner / tp]
        z = projected[..., :self.d_inner_local]
        return self.norm(o.transpose(0, 1), z.transpose(0, 1)).transpose(0, 1)

    def _rule(self, vkq, beta, alpha, share: HeadShare, state, seq_idx):
        """The convolution and the substeps of a share of the heads: vkq [b, s, its V_m, K_m, Q
        channels], beta [b, s, M x its heads], alpha [b, s, its heads] -> (o [b, s, its heads, p], the
        (convolution, rule) state after)."""
        conv_state, rule_state = state if state is not None else (None, None)
        weight, dt_bias, A_log = self.conv1d.weight[:, 0], self.dt_bias, self.A_log
        if share is not self.whole:  # slices taken here, so that gradients reach the rank's parameters
            heads = slice(share.heads.start, share.heads.stop)
            weight, dt_bias, A_log = weight.index_select(0, self.cp_conv_channels), dt_bias[heads], A_log[heads]
        m, heads, gn = self.num_householder, len(share.heads), len(share.groups) * self.d_state
        vkq, conv_state = causal_conv1d_silu(vkq, weight, initial_state=conv_state, seq_idx=seq_idx)
        v, k, q = vkq.split([m * heads * self.head_dim, m * gn, gn], dim=-1)
        b, s = v.shape[:2]
        v = v.reshape(b, s * m, heads, self.head_dim)  # a token's substeps in a row: [b, s * M, heads, p]
        k = l2_normed_heads(k.reshape(b, s * m, gn), self.d_state, heads)  # [b, s * M, heads, n]
        q = l2_normed_heads(q, self.d_state, heads, 1 / math.sqrt(self.d_state))  # [b, s, heads, n]
        g = -torch.exp(A_log.float()) * F.softplus(alpha.float() + dt_bias.float())  # [b, s, heads]
        o, rule_state = gated_delta_product(q, k, v, g, torch.sigmoid(beta).reshape(b, s * m, heads), m,
                                            initial_state=rule_state, chunk_size=self.chunk_size, seq_idx=seq_idx)
        return o, (conv_state, rule_state)
