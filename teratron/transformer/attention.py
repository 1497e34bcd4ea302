"""Self-attention: fused QKV projection, optional qk-norm and RoPE (not on the NoPE layers that
`no_rope_freq` marks; with YaRN the rotated channels scaled by its concentration factor), core
attention, output projection.

linear_qkv is column-parallel and its output rows are interleaved per query group,
[ng, (np/ng + 2) * hn] = per group its np/ng query heads, then one key and one value head, so a
contiguous TP shard holds whole groups (MHA: ng = np; MQA: ng = 1 with TP = 1). linear_proj is
row-parallel: each rank's heads feed its shard of the input dimension.

Gated attention (`attention_output_gate`, Megatron's layout): each group also projects one gate per
query head, [ng, (2 np/ng + 2) * hn] = its query heads, their gates, its key and value head (the
gate rows travel with their group under TP); each head's output is multiplied by sigmoid(gate)
before linear_proj.

QK-clip (`qk_clip_scales`, applied by `teratron.optimizer.qk_clip`) scales the query and key rows
of linear_qkv per query group, by Megatron's rule.
"""

from dataclasses import dataclass
from typing import Union

import torch

from teratron import fusions, tensor_parallel
from teratron.process_groups import get_pg_size
from teratron.topology import resolve_pg_collection
from teratron.transformer import activation_offload
from teratron.transformer.enums import AttnMaskType
from teratron.transformer.identity_op import IdentityOp
from teratron.transformer.rope import apply_rotary_pos_emb, yarn_concentration_factor
from teratron.transformer.spec_utils import ModuleSpec, build_module
from teratron.transformer.transformer_config import pattern_layer_number


def qk_clip_eta(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """QK-clip's factor per head: threshold / max logit where the max exceeds the threshold, else 1
    (exactly, so the weights of heads within it are multiplied by 1)."""
    return torch.where(max_logits > threshold, threshold / max_logits, torch.ones_like(max_logits))


@dataclass
class SelfAttentionSubmodules:
    linear_qkv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = IdentityOp
    k_layernorm: Union[ModuleSpec, type] = IdentityOp


class SelfAttention(torch.nn.Module):
    """[s, b, h] -> ([s, b, h], bias of linear_proj or None). Under sequence parallelism input and
    output are [s/tp, b, h]; linear_qkv gathers the sequence and linear_proj scatters it back."""

    def __init__(self, config, submodules: SelfAttentionSubmodules, layer_number: int,
                 attn_mask_type=AttnMaskType.causal, cp_comm_type=None, pg_collection=None):
        super().__init__()
        if config.multi_latent_attention:
            raise ValueError("SelfAttention was given a config with multi_latent_attention=True; MLA layers are "
                             "MLASelfAttention (get_gpt_layer_local_spec(multi_latent_attention=True))")
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.pg_collection = resolve_pg_collection(pg_collection)
        tp = self.pg_collection.tp
        tp_size = get_pg_size(tp)
        heads, groups = config.num_attention_heads, config.num_query_groups
        if heads % groups:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by num_query_groups ({groups})")
        if groups % tp_size:
            raise ValueError(
                f"num_query_groups ({groups}) must be divisible by the tensor-parallel size ({tp_size}); "
                f"choose a tensor_model_parallel_size that divides it"
            )
        self.hn = config.kv_channels
        self.np = heads // tp_size  # query heads on this rank
        self.ng = groups // tp_size  # query groups on this rank
        query_size, kv_size = heads * self.hn, groups * self.hn
        self.output_gate = config.attention_output_gate
        gate_size = query_size if self.output_gate else 0

        self.linear_qkv = build_module(
            submodules.linear_qkv, config.hidden_size, query_size + gate_size + 2 * kv_size, config=config,
            init_method=config.init_method, gather_output=False,
            bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False, tp_group=tp,
        )
        self.q_layernorm = build_module(submodules.q_layernorm, config=config, hidden_size=self.hn,
                                        eps=config.layernorm_epsilon)
        self.k_layernorm = build_module(submodules.k_layernorm, config=config, hidden_size=self.hn,
                                        eps=config.layernorm_epsilon)
        # Every TP rank normalises different heads with the same weights: sum their grads over TP
        # (finalize_model_grads does, for parameters marked like sequence-parallel norms).
        for param in (*self.q_layernorm.parameters(), *self.k_layernorm.parameters()):
            param.sequence_parallel = True
        self.core_attention = build_module(
            submodules.core_attention, config=config, layer_number=layer_number,
            attn_mask_type=attn_mask_type, attention_type="self", cp_comm_type=cp_comm_type,
            pg_collection=self.pg_collection,
        )
        self.linear_proj = build_module(
            submodules.linear_proj, query_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, tp_group=tp,
        )
        self.recompute_core_attention = (
            config.recompute_granularity == "selective" and "core_attn" in (config.recompute_modules or [])
        )
        # NoPE layers (no_rope_freq): queries and keys keep no position rotation.
        pattern_layer = pattern_layer_number(config, layer_number)  # an MTP layer takes the last layer's
        self.apply_rope = not (config.no_rope_freq and config.no_rope_freq[pattern_layer - 1])
        # YaRN's concentration factor on the rotated channels (1 without YaRN).
        self.rope_mscale = yarn_concentration_factor(config.yarn_rotary_scaling_factor, config.yarn_mscale,
                                                     config.yarn_mscale_all_dim)

    def qk_clip_scales(self, max_logits: torch.Tensor) -> dict:
        """QK-clip's factors for the rows of linear_qkv's weight (and bias), given this rank's
        heads' max logits [np]: {param: factors [rows]}. As Megatron, a query group's heads share
        eta = qk_clip_eta(their largest logit) (they share one key head); the group's query rows
        scale by eta ** qk_clip_alpha, its key rows by eta ** (1 - qk_clip_alpha), so each of its
        logits scales by eta; value rows stay. (Megatron leaves the bias out; scaling it too keeps
        the logit's factor eta with --add-qkv-bias.)"""
        alpha, per_group = self.config.qk_clip_alpha, self.np // self.ng
        eta = qk_clip_eta(max_logits.float().view(self.ng, per_group).amax(dim=1), self.config.qk_clip_threshold)
        eta = eta[:, None]  # [ng, 1]
        gate = [torch.ones_like(eta).expand(-1, per_group * self.hn)] if self.output_gate else []
        rows = torch.cat([eta.pow(alpha).expand(-1, per_group * self.hn), *gate, eta.pow(1 - alpha).expand(-1, self.hn),
                          torch.ones_like(eta).expand(-1, self.hn)], dim=1)  # [ng, (np/ng (x2 gated) + 2) * hn]
        qkv = self.linear_qkv
        return {param: rows.reshape(-1) for param in (qkv.weight, qkv.bias) if param is not None}

    def get_query_key_value_tensors(self, hidden_states):
        """[s, b, h] -> q [s, b, np, hn], k and v [s, b, ng, hn], qk-norm applied, and the output
        gate [s, b, np * hn] (None without attention_output_gate)."""
        with activation_offload.offload("qkv_linear"):
            mixed_qkv, _ = self.linear_qkv(hidden_states)
        s, b = mixed_qkv.shape[:2]
        query_width = self.np // self.ng * self.hn
        gate_width = query_width if self.output_gate else 0
        mixed_qkv = mixed_qkv.view(s, b, self.ng, query_width + gate_width + 2 * self.hn)
        query, gate, key, value = mixed_qkv.split([query_width, gate_width, self.hn, self.hn], dim=-1)
        query = query.reshape(s, b, self.np, self.hn)
        gate = gate.reshape(s, b, self.np * self.hn) if self.output_gate else None
        return self.q_layernorm(query), self.k_layernorm(key), value, gate

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        """hidden_states [s, b, h] -> output [s, b, h] (and the bias linear_proj kept apart). With
        `inference_context` the new keys and values go to its KV cache and the queries attend
        over the cache (`inference_context.attend(layer_number, q, k, v)`, Megatron's
        inference_context), instead of core_attention over this call's tokens."""
        query, key, value, gate = self.get_query_key_value_tensors(hidden_states)
        if rotary_pos_emb is not None and self.apply_rope:
            interleaved = self.config.rotary_interleaved
            rope = fusions.fused(apply_rotary_pos_emb) if self.config.apply_rope_fusion else apply_rotary_pos_emb
            query = rope(query, rotary_pos_emb, interleaved, self.rope_mscale)
            key = rope(key, rotary_pos_emb, interleaved, self.rope_mscale)
        if inference_context is not None:
            context = inference_context.attend(self.layer_number, query, key, value)  # [s, b, np * hn]
        elif self.recompute_core_attention:
            context = tensor_parallel.checkpoint(self.core_attention, False, query, key, value, attention_mask)
        else:
            with activation_offload.offload("core_attn"):
                context = self.core_attention(query, key, value, attention_mask)
        if gate is not None:
            context = context * torch.sigmoid(gate)  # [s, b, np * hn]
        with activation_offload.offload("attn_proj"):
            return self.linear_proj(context)
