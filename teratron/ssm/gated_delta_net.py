"""Gated DeltaNet's mixer (Megatron Core's `GatedDeltaNet`): [s, b, h] -> [s, b, h].

    q, k, v, z, b, a = in_proj(hidden)          q, k [key heads * dk]; v, z [value heads * dv]; b, a [value heads]
    q, k, v = silu(causal_conv1d([q; k; v]))    a short depthwise convolution over the sequence
    q, k    = l2norm(q) / sqrt(dk), l2norm(k)   per head, in fp32, then rounded to v's dtype; each key head
                                                then repeated for its group of value heads
    g       = -exp(A_log) * softplus(a + dt_bias),   beta = sigmoid(b)       per value head and token
    o       = gated delta rule(q, k, v, g, beta)     (teratron.ssm.gated_delta_rule)
    out     = out_proj(out_norm(o) * silu(z))        out_norm over each value head's dv channels

Value head j reads key head j // (value heads / key heads) (GQA's grouping, key heads repeated in
place). The activation is SiLU, whatever config.activation_func says: Megatron's GDN kernels accept
only SiLU. out_norm is the config's normalization (RMSNorm or LayerNorm), one weight shared by all
heads. No biases (Megatron's GDN defaults, whatever add_bias_linear says).

in_proj's rows are Megatron's [q; k; v; z; b; a], and tensor parallelism splits each of the six
parts over TP separately (a tuple partition stride): rank r holds [q_r; k_r; v_r; z_r; b_r; a_r],
its slice of the key heads and the same slice of the value heads. This is Megatron's layout too
(its local in_proj is split in these six parts, and its checkpoints store each part as its own
tensor), and because value heads are grouped under their key head in order, rank r's value heads are
exactly the groups of its key heads: each rank runs whole key-head groups and nothing is exchanged
inside the mixer. The convolution over [q; k; v], dt_bias and A_log are split alike; out_proj is
row-parallel. With sequence parallelism in_proj gathers the sequence and out_proj reduce-scatters
it, as attention's projections do. Context parallelism runs the convolution and the rule on whole
sequences for a share of the heads (`teratron.ssm.context_parallel`). out_norm's weight is
replicated: every rank normalises different heads with it, so its gradient is summed over TP
(marked like a sequence-parallel norm).

Parameter names are Megatron's (in_proj.weight, conv1d.weight [c, 1, k], dt_bias, A_log,
out_norm.weight, out_proj.weight). Initialisation is Megatron's, drawn whole then sharded (so it
does not depend on TP): in_proj with init_method, out_proj with output_layer_init_method, conv1d
Kaiming-uniform as torch's Conv1d, dt_bias = 1, A_log = log(U(1, 16)), out_norm as a norm layer.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.ssm.causal_conv1d import causal_conv1d_silu
from teratron.ssm.context_parallel import HeadShare, heads_to_tokens, set_up_head_exchange, tokens_to_heads
from teratron.ssm.gated_delta_rule import gated_delta_rule
from teratron.ssm.recurrence import conv_state_bytes, mix_tokens
from teratron.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from teratron.tensor_parallel.layers import param_device, set_tensor_model_parallel_attributes
from teratron.tensor_parallel.utils import resolve_tp_group, shard_tensor
from teratron.topology import resolve_pg_collection
from teratron.transformer.norms import Norm

L2NORM_EPS = 1e-6  # of q and k's L2 normalisation (FLA's l2norm, which Megatron calls)
A_INIT_RANGE = (1.0, 16.0)  # A = exp(A_log) is drawn uniformly from this range
CHUNK_SIZE = 64  # tokens per chunk of the gated delta rule (Megatron's)


class GatedDeltaNet(nn.Module):
    def __init__(self, config, layer_number: int | None = None, pg_collection=None, tp_group=None):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        if tp_group is None and pg_collection is not None:
            tp_group = pg_collection.tp
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.chunk_size = CHUNK_SIZE
        self.tp_group = resolve_tp_group(tp_group)
        tp, rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        if self.num_key_heads % tp:  # value heads are a multiple of key heads (config), so they split too
            raise ValueError(f"Gated DeltaNet's {self.num_key_heads} key heads do not split over tensor-parallel "
                             f"size {tp}; choose --linear-num-key-heads divisible by it")
        self.num_key_heads_local, self.num_value_heads_local = self.num_key_heads // tp, self.num_value_heads // tp
        qk_dim, v_dim = self.num_key_heads * self.key_head_dim, self.num_value_heads * self.value_head_dim
        self.qk_dim_local, self.v_dim_local = qk_dim // tp, v_dim // tp
        # Global rows of in_proj's and conv1d's parts (q k v z b a; q k v), each split over TP
        self.in_proj_parts = parts = (qk_dim, qk_dim, v_dim, v_dim, self.num_value_heads, self.num_value_heads)
        self.in_proj = ColumnParallelLinear(config.hidden_size, sum(parts), config=config,
                                            init_method=config.init_method, bias=False, stride=parts,
                                            tp_group=self.tp_group)
        self.out_proj = RowParallelLinear(v_dim, config.hidden_size, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group)

        device = param_device(config)
        self.conv1d_parts = conv_parts = (qk_dim, qk_dim, v_dim)
        self.in_proj_part_names = ("query", "key", "value", "z", "beta", "alpha")  # Megatron's checkpoint names
        self.conv1d_part_names = self.in_proj_part_names[:3]
        kernel = config.linear_conv_kernel_dim
        bound = 1.0 / math.sqrt(kernel)  # torch's Conv1d default for a depthwise kernel of `kernel` taps
        conv_weight = torch.empty(sum(conv_parts), 1, kernel).uniform_(-bound, bound)
        A = torch.empty(self.num_value_heads).uniform_(*A_INIT_RANGE)

        def shard(full, parts_=1):
            part = shard_tensor(full, 0, parts_, rank, tp)
            # built under torch.device("meta") (shape checks): shapes only, nothing to copy
            return nn.Parameter(part.to(dtype=config.params_dtype) if part.is_meta else
                                part.to(device=device, dtype=config.params_dtype))

        # An nn.Conv1d for Megatron's parameter name and shape; causal_conv1d runs it.
        self.conv1d = nn.Conv1d(sum(conv_parts) // tp, sum(conv_parts) // tp, kernel, groups=sum(conv_parts) // tp,
                                bias=False, device="meta")
        self.conv1d.weight = shard(conv_weight, conv_parts)
        self.dt_bias = shard(torch.ones(self.num_value_heads))
        self.A_log = shard(torch.log(A))
        for param, stride in ((self.conv1d.weight, conv_parts), (self.dt_bias, 1), (self.A_log, 1)):
            set_tensor_model_parallel_attributes(param, True, 0, stride)
        self.out_norm = Norm(config, self.value_head_dim, eps=config.layernorm_epsilon)
        for param in self.out_norm.parameters():
            param.sequence_parallel = True  # finalize_model_grads sums these grads over TP
        self.whole = HeadShare(range(self.num_value_heads_local), range(self.num_key_heads_local))
        set_up_head_exchange(self, resolve_pg_collection(pg_collection).cp, self.num_value_heads_local,
                             self.num_key_heads_local, ("value heads", "key heads", "Gated DeltaNet"), device)

    def _projection_parts(self, share: HeadShare) -> tuple:
        """The projection's channels a CP share reads (q, k, v, b, a; z stays), as channel_index parts:
        projected is q k v z b a, value heads grouped by key head."""
        gates = 2 * self.qk_dim_local + 2 * self.v_dim_local
        return (*self._conv_parts(share), (gates, 1, share.heads), (gates + self.num_value_heads_local, 1, share.heads))

    def _conv_parts(self, share: HeadShare) -> tuple:
        """The convolution's channels (q, k, v) a share reads, as channel_index parts."""
        return ((0, self.key_head_dim, share.groups), (self.qk_dim_local, self.key_head_dim, share.groups),
                (2 * self.qk_dim_local, self.value_head_dim, share.heads))

    recurrent = True  # the inference context keeps a state per request for it (`run_recurrent`)

    def inference_state_bytes(self) -> int:
        """One request's state in inference, at most: the convolution's, and the rule's [value heads, dv,
        dk] (counted in fp32; kept in the activations' dtype)."""
        return (conv_state_bytes(self.conv1d)
                + 4 * self.num_value_heads_local * self.value_head_dim * self.key_head_dim)

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        """hidden_states [s, b, h] ([s/tp, b, h] under sequence parallelism) -> (the same shape, None).
        The layer is causal by construction: of the attention arguments of the enclosing layer it reads
        only packed documents (attention_mask a PackedSeqParams: each document from a zero state).
        With `inference_context` (the engine's step: [t, 1, h], requests back to back) each
        request's tokens continue from the convolution and delta-rule states its earlier ones left."""
        projected, _ = self.in_proj(hidden_states)  # [s, b, parts / tp]
        if self.cp_share is not None and inference_context is None:
            y = self._mix_context_parallel(projected, attention_mask)
        else:
            y = mix_tokens(self._mix, projected, self.layer_number, inference_context, attention_mask)
        return self.out_proj(y)  # y [s, b, v_dim / tp]

    def _mix(self, projected, state, seq_idx=None):
        """projected [b, s, parts / tp] and the (convolution, delta-rule) state before it (None:
        zeros), seq_idx [b, s] (packed documents) or None -> (the gated, normed output
        [b, s, v_dim / tp], the state after it)."""
        qkv, z, beta, alpha = projected.split(
            [2 * self.qk_dim_local + self.v_dim_local, self.v_dim_local, self.num_value_heads_local,
             self.num_value_heads_local], dim=-1)  # [b, s, ...]
        o, state = self._rule(qkv, beta, alpha, self.whole, state, seq_idx)
        y = self._gated_norm(o, z.reshape_as(o))  # [b, s, value heads / tp, dv]
        return y.flatten(2), state

    def _mix_context_parallel(self, projected, attention_mask):
        """projected [s, b, parts / tp] of this CP rank's tokens -> the gated, normed output
        [s, b, v_dim / tp]: the convolution and the rule over whole sequences for this rank's share of
        the heads, between two all-to-alls."""
        heads = len(self.cp_share.heads)
        inputs, seq_idx = tokens_to_heads(projected, self.cp_channels, self.cp_group, attention_mask)
        qkv, beta, alpha = inputs.split([len(self.cp_conv_channels), heads, heads], dim=-1)
        o, _ = self._rule(qkv, beta, alpha, self.cp_share, None, seq_idx)
        o = heads_to_tokens(o.flatten(2), self.cp_group, attention_mask)  # [s, b, v_dim / tp]
        z_start = 2 * self.qk_dim_local + self.v_dim_local
        z = projected[..., z_start:z_start + self.v_dim_local]
        per_head = (-1, self.value_head_dim)
        return self._gated_norm(o.unflatten(-1, per_head), z.unflatten(-1, per_head)).flatten(2)

    def _rule(self, qkv, beta, alpha, share: HeadShare, state, seq_idx):
        """The convolution and the gated delta rule of a share of the heads: qkv [b, s, its q, k, v
        channels], beta and alpha [b, s, its value heads] -> (o [b, s, its value heads, dv], the
        (convolution, delta-rule) state after)."""
        conv_state, rule_state = state if state is not None else (None, None)
        weight, dt_bias, A_log = self.conv1d.weight[:, 0], self.dt_bias, self.A_log
        if share is not self.whole:  # slices taken here, so that gradients reach the rank's parameters
            heads = slice(share.heads.start, share.heads.stop)
            weight, dt_bias, A_log = weight.index_select(0, self.cp_conv_channels), dt_bias[heads], A_log[heads]
        key_heads, value_heads = len(share.groups), len(share.heads)
        qkv, conv_state = causal_conv1d_silu(qkv, weight, initial_state=conv_state, seq_idx=seq_idx)
        q, k, v = qkv.split([key_heads * self.key_head_dim, key_heads * self.key_head_dim,
                             value_heads * self.value_head_dim], dim=-1)
        b, s = v.shape[:2]
        q = l2_normed_heads(q, self.key_head_dim, value_heads, 1 / math.sqrt(self.key_head_dim))  # [b, s, heads, dk]
        k = l2_normed_heads(k, self.key_head_dim, value_heads)
        g = -torch.exp(A_log.float()) * F.softplus(alpha.float() + dt_bias.float())  # [b, s, value heads]
        o, rule_state = gated_delta_rule(q, k, v.reshape(b, s, value_heads, self.value_head_dim), g,
                                         torch.sigmoid(beta), initial_state=rule_state, chunk_size=self.chunk_size,
                                         seq_idx=seq_idx)
        return o, (conv_state, rule_state)

    def _gated_norm(self, o, z):
        """out_norm of each head's output times silu(z), in fp32; returned in o's dtype."""
        return (self.out_norm(o.float()).float() * F.silu(z.float())).to(o.dtype)


def l2_normed_heads(x, head_dim: int, heads: int, scale: float = 1.0):
    """[b, s, groups * head_dim] -> each group's head L2-normalised (in fp32) times `scale`, rounded to
    x's dtype (16-bit q and k halve the rule's reads; FLA's l2norm also returns x's dtype, scaling q
    after), each repeated for its share of the `heads`: [b, s, heads, head_dim]."""
    groups = x.unflatten(-1, (-1, head_dim)).float()
    groups = (groups * (scale * torch.rsqrt(groups.pow(2).sum(-1, keepdim=True) + L2NORM_EPS))).to(x.dtype)
    return groups.repeat_interleave(heads // groups.shape[2], dim=2)
