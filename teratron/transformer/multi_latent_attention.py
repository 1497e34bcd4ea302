"""Multi-latent attention (DeepSeek-V2/V3; Megatron's MLASelfAttention).

Per token, with n heads, d_c = kv_lora_rank, d_q = q_lora_rank, d_n = qk_head_dim,
d_r = qk_pos_emb_head_dim, d_v = v_head_dim:

    q          = norm_q(x W_qd) W_qu        [n, d_n + d_r]   (q_lora_rank None: q = x W_q)
    c_kv, k_r  = x W_kvd                    [d_c], [d_r]     (one RoPE key for all heads)
    k_n, v     = norm_kv(c_kv) W_kvu        [n, d_n], [n, d_v]
    q = [q_n, m RoPE(q_r)],  k = [k_n, m RoPE(k_r)]
    out        = softmax(q k^T * scale) v W_o,   scale = yarn_mscale(s, mscale_all_dim)^2 / sqrt(d_n + d_r)

m is YaRN's concentration factor (1 for rope_type 'rope'); the norms are there with qk_layernorm,
as in Megatron. The positional channels rotate as (2i, 2i + 1) pairs (DeepSeek's layout); the
angles come from GPTModel, computed once per forward from the position ids
(`mla_rotary_embedding`), not inside the layer as in Megatron, so inference positions and
reset position ids reach MLA as they reach plain attention.

Tensor parallelism: linear_q_proj / linear_q_up_proj / linear_kv_up_proj are column-parallel
(whole heads per rank, [d_n + d_r] or [d_n + d_v] rows per head), linear_proj row-parallel. The
down projections (linear_q_down_proj, linear_kv_down_proj) are replicated on every TP rank
(`DuplicatedLinear`, Megatron's Transformer Engine spec): under sequence parallelism each rank
projects its own s/tp tokens and the up projections all-gather the small latents instead of the
hidden state; without it every rank computes them whole. The RoPE key k_r feeds every head, so
it is all-gathered over the sequence (SP) or entered into the TP region with
copy_to_tensor_model_parallel_region (its gradient summed over the ranks' heads).

Recompute: 'mla_up_proj' in recompute_modules reruns the up projections and RoPE in backward
(`tensor_parallel.CheckpointWithoutOutput`): q, k and v are freed once core attention has run
and refilled when backward reaches it; 'core_attn' recomputes core attention as for SelfAttention.

QK-clip (`qk_clip_scales`, applied by `teratron.optimizer.qk_clip`, Megatron's rule for MLA): per
head, eta = qk_clip_eta(its max logit); its query rows scale by eta ** alpha (q_n) and eta (q_r),
its key rows of linear_kv_up_proj by eta ** (1 - alpha), so q_n.k_n and q_r.k_r, hence the
logit, scale by eta; values and the shared RoPE key (linear_kv_down_proj) stay.

Inference (`inference_context.attend`): the per-head keys [d_n + d_r] and values [d_v] go to
the paged KV cache, padded with zeros to one head size; with `cache_mla_latents` the cache
holds one latent [c_kv, RoPE(k_r)] (d_c + d_r) per token instead and the up projections are
absorbed: q_n W_uk^T per head is the query of the latent keys, the context of the latent values
times W_uv per head is the output (multi-query attention over the latents, values = keys, the
first d_c channels kept).
"""

import math
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

from teratron import fusions, tensor_parallel
from teratron.process_groups import get_pg_size
from teratron.topology import resolve_pg_collection
from teratron.transformer import activation_offload
from teratron.transformer.attention import qk_clip_eta
from teratron.transformer.enums import AttnBackend, AttnMaskType
from teratron.transformer.rope import (RotaryEmbedding, YarnRotaryEmbedding, apply_rotary_pos_emb,
                                      yarn_concentration_factor, yarn_mscale)
from teratron.transformer.spec_utils import ModuleSpec, build_module


@dataclass
class MLASelfAttentionSubmodules:
    linear_q_proj: Union[ModuleSpec, type] = None
    linear_q_down_proj: Union[ModuleSpec, type] = None
    linear_q_up_proj: Union[ModuleSpec, type] = None
    linear_kv_down_proj: Union[ModuleSpec, type] = None
    linear_kv_up_proj: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    kv_layernorm: Union[ModuleSpec, type] = None


def mla_rotary_embedding(config) -> RotaryEmbedding:
    """The rotation angles of MLA's positional channels: position ids [b, s] -> [s, b, 1, d_r]
    in the (2i, 2i + 1) pair layout, YaRN's frequencies with rope_type 'yarn'."""
    if config.rope_type == "yarn":
        return YarnRotaryEmbedding(
            config.qk_pos_emb_head_dim, rotary_interleaved=True, rotary_base=config.rotary_base,
            scaling_factor=config.rotary_scaling_factor,
            original_max_position_embeddings=config.original_max_position_embeddings,
            beta_fast=config.beta_fast, beta_slow=config.beta_slow)
    return RotaryEmbedding(config.qk_pos_emb_head_dim, config.rotary_percent, rotary_interleaved=True,
                           rotary_base=config.rotary_base)


def mla_rope_concentration(config) -> float:
    """YaRN's factor on the rotated channels (1 for rope_type 'rope')."""
    if config.rope_type != "yarn":
        return 1.0
    return yarn_concentration_factor(config.rotary_scaling_factor, config.mscale, config.mscale_all_dim)


def mla_softmax_scale(config) -> float:
    """mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim), mscale from rotary_scaling_factor and
    mscale_all_dim (Megatron applies it whatever the rope_type)."""
    mscale = yarn_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
    return mscale * mscale / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)


class MLASelfAttention(torch.nn.Module):
    """[s, b, h] -> ([s, b, h], bias of linear_proj or None); [s/tp, b, h] under sequence
    parallelism. `rotary_pos_emb`: the angles of `mla_rotary_embedding` [s, b, 1, d_r] (None: no
    rotation)."""

    def __init__(self, config, submodules: MLASelfAttentionSubmodules, layer_number: int,
                 attn_mask_type=AttnMaskType.causal, cp_comm_type=None, pg_collection=None):
        super().__init__()
        if not hasattr(config, "kv_lora_rank"):
            raise ValueError("multi_latent_attention=True needs an MLATransformerConfig (q/kv ranks and head "
                             "dims); build the config with MLATransformerConfig")
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.pg_collection = resolve_pg_collection(pg_collection)
        tp = self.pg_collection.tp
        self.tp_size = get_pg_size(tp)
        heads = config.num_attention_heads
        if heads % self.tp_size:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by the tensor-parallel size "
                             f"({self.tp_size})")
        self.np = heads // self.tp_size  # heads on this rank
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.softmax_scale = mla_softmax_scale(config)
        self.rope_concentration = mla_rope_concentration(config)
        self.cache_mla_latents = config.cache_mla_latents
        # The KV cache's head: per head q_head_dim and v_head_dim padded to one size, or one latent.
        if self.cache_mla_latents:
            self.ng, self.hn = 1, config.kv_lora_rank + config.qk_pos_emb_head_dim
        else:
            self.ng, self.hn = self.np, max(self.q_head_dim, config.v_head_dim)
        # SDPA's flash kernel takes one head size for q, k and v: pad v (or q, k) with zeros.
        self.pad_heads = config.attention_backend == AttnBackend.flash and self.q_head_dim != config.v_head_dim

        column = dict(config=config, init_method=config.init_method, gather_output=False, bias=False,
                      skip_bias_add=False, tp_group=tp)
        duplicated = dict(config=config, init_method=config.init_method, bias=False, tp_group=tp)
        if config.q_lora_rank is None:
            self.linear_q_proj = build_module(submodules.linear_q_proj, config.hidden_size,
                                              heads * self.q_head_dim, **column)
        else:
            self.linear_q_down_proj = build_module(submodules.linear_q_down_proj, config.hidden_size,
                                                   config.q_lora_rank, **duplicated)
            self.linear_q_up_proj = build_module(submodules.linear_q_up_proj, config.q_lora_rank,
                                                 heads * self.q_head_dim, **column)
            self.q_layernorm = build_module(submodules.q_layernorm, config=config, hidden_size=config.q_lora_rank,
                                            eps=config.layernorm_epsilon)
        self.linear_kv_down_proj = build_module(submodules.linear_kv_down_proj, config.hidden_size,
                                                config.kv_lora_rank + config.qk_pos_emb_head_dim, **duplicated)
        self.linear_kv_up_proj = build_module(submodules.linear_kv_up_proj, config.kv_lora_rank,
                                              heads * (config.qk_head_dim + config.v_head_dim), **column)
        self.kv_layernorm = build_module(submodules.kv_layernorm, config=config, hidden_size=config.kv_lora_rank,
                                         eps=config.layernorm_epsilon)
        self.core_attention = build_module(
            submodules.core_attention, config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
            attention_type="self", softmax_scale=self.softmax_scale, cp_comm_type=cp_comm_type,
            pg_collection=self.pg_collection,
        )
        self.linear_proj = build_module(
            submodules.linear_proj, heads * config.v_head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear, input_is_parallel=True,
            skip_bias_add=True, tp_group=tp,
        )
        selective = (config.recompute_modules or []) if config.recompute_granularity == "selective" else []
        self.recompute_core_attention = "core_attn" in selective
        self.recompute_up_proj = "mla_up_proj" in selective

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None, inference_context=None):
        """hidden_states [s, b, h] -> output [s, b, h] (and linear_proj's bias kept apart). With
        `inference_context` the keys and values (or the latents) go to its KV cache and the
        queries attend over it (`inference_context.attend(layer_number, q, k, v)`)."""
        with activation_offload.offload("qkv_linear"):
            latents = self._down_projections(hidden_states)
        if inference_context is not None and self.cache_mla_latents:
            context = self._attend_latents(*latents, rotary_pos_emb, inference_context)
        elif inference_context is not None:
            context = self._attend_cache(*self._up_projections(*latents, rotary_pos_emb), inference_context)
        else:
            context = self._core_attention(latents, rotary_pos_emb, attention_mask)
        with activation_offload.offload("attn_proj"):
            return self.linear_proj(context)

    def qk_clip_scales(self, max_logits: torch.Tensor) -> dict:
        """QK-clip's factors for the rows of the query projection (linear_q_proj or
        linear_q_up_proj, [np, d_n + d_r] rows) and of linear_kv_up_proj ([np, d_n + d_v] rows),
        given this rank's heads' max logits [np]: {weight: factors [rows]} (module docstring)."""
        config, alpha = self.config, self.config.qk_clip_alpha
        eta = qk_clip_eta(max_logits.float(), config.qk_clip_threshold)[:, None]  # [np, 1]
        query_rows = torch.cat([eta.pow(alpha).expand(-1, config.qk_head_dim),
                                eta.expand(-1, config.qk_pos_emb_head_dim)], dim=1)  # [np, d_n + d_r]
        kv_rows = torch.cat([eta.pow(1 - alpha).expand(-1, config.qk_head_dim),
                             torch.ones_like(eta).expand(-1, config.v_head_dim)], dim=1)  # [np, d_n + d_v]
        query = self.linear_q_proj if config.q_lora_rank is None else self.linear_q_up_proj
        return {query.weight: query_rows.reshape(-1), self.linear_kv_up_proj.weight: kv_rows.reshape(-1)}

    def _down_projections(self, hidden_states):
        """[s(/tp), b, h] -> the query input (q_layernorm(c_q) [s/tp, b, d_q], or the hidden
        state without q_lora_rank), norm_kv(c_kv) [s/tp, b, d_c] and k_r [s, b, d_r] (whole
        sequence, in the TP region)."""
        config = self.config
        if config.q_lora_rank is None:
            q_input = hidden_states
        else:
            q_input = self.q_layernorm(self.linear_q_down_proj(hidden_states)[0])
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        kv_compressed, k_pos_emb = kv_combined.split([config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
        if self.tp_size > 1 and config.sequence_parallel:
            k_pos_emb = tensor_parallel.gather_from_sequence_parallel_region(k_pos_emb, True, self.pg_collection.tp)
        elif self.tp_size > 1:
            k_pos_emb = tensor_parallel.copy_to_tensor_model_parallel_region(k_pos_emb, self.pg_collection.tp)
        return q_input, self.kv_layernorm(kv_compressed), k_pos_emb

    def _queries(self, q_input, rotary_pos_emb):
        """-> q_n [s, b, np, d_n] and the rotated q_r [s, b, np, d_r]."""
        linear = self.linear_q_proj if self.config.q_lora_rank is None else self.linear_q_up_proj
        q, _ = linear(q_input)
        q = q.view(*q.shape[:2], self.np, self.q_head_dim)
        q_nope, q_pos = q.split([self.config.qk_head_dim, self.config.qk_pos_emb_head_dim], dim=-1)
        return q_nope, self._rotate(q_pos, rotary_pos_emb)

    def _rotate(self, t, rotary_pos_emb):
        if rotary_pos_emb is None:
            return t
        rope = fusions.fused(apply_rotary_pos_emb) if self.config.apply_rope_fusion else apply_rotary_pos_emb
        return rope(t, rotary_pos_emb, True, self.rope_concentration)

    def _up_projections(self, q_input, kv_compressed, k_pos_emb, rotary_pos_emb):
        """-> query [s, b, np, d_n + d_r], key [s, b, np, d_n + d_r], value [s, b, np, d_v], each
        contiguous (they are what 'mla_up_proj' recompute frees and refills)."""
        config = self.config
        q_nope, q_pos = self._queries(q_input, rotary_pos_emb)
        kv, _ = self.linear_kv_up_proj(kv_compressed)
        kv = kv.view(*kv.shape[:2], self.np, config.qk_head_dim + config.v_head_dim)
        k_nope, value = kv.split([config.qk_head_dim, config.v_head_dim], dim=-1)
        k_pos = self._rotate(k_pos_emb.unsqueeze(2), rotary_pos_emb)
        query = torch.cat([q_nope, q_pos], dim=-1)
        key = torch.cat([k_nope, k_pos.expand(-1, -1, self.np, -1)], dim=-1)
        return query, key, value.contiguous()

    def _core_attention(self, latents, rotary_pos_emb, attention_mask):
        """Training and full-sequence forward: up projections, then core attention -> [s, b, np * d_v]."""
        with activation_offload.offload("qkv_linear"):
            if self.recompute_up_proj:
                up_proj = tensor_parallel.CheckpointWithoutOutput()
                query, key, value = up_proj.checkpoint(self._up_projections, *latents, rotary_pos_emb)
            else:
                query, key, value = self._up_projections(*latents, rotary_pos_emb)
        if self.pad_heads:
            query, key, value = (_pad_head(t, self.hn) for t in (query, key, value))
        if self.recompute_core_attention:
            context = tensor_parallel.checkpoint(self.core_attention, False, query, key, value, attention_mask)
        else:
            with activation_offload.offload("core_attn"):
                context = self.core_attention(query, key, value, attention_mask)
        if self.pad_heads:
            context = _unpad_context(context, self.np, self.config.v_head_dim)
        if self.recompute_up_proj:
            up_proj.discard_output_and_register_recompute(context)
        return context

    def _attend_cache(self, query, key, value, inference_context):
        """Per-head keys and values into the cache, padded to one head size -> [t, 1, np * d_v]."""
        query, key, value = (_pad_head(t, self.hn) for t in (query, key, value))
        context = inference_context.attend(self.layer_number, query, key, value)
        return _unpad_context(context, self.np, self.config.v_head_dim)

    def _attend_latents(self, q_input, kv_compressed, k_pos_emb, rotary_pos_emb, inference_context):
        """The latent cache with absorbed up projections -> [t, 1, np * d_v]."""
        config = self.config
        q_nope, q_pos = self._queries(q_input, rotary_pos_emb)
        weight = self.linear_kv_up_proj.weight.view(self.np, config.qk_head_dim + config.v_head_dim, -1)
        up_k, up_v = weight.split([config.qk_head_dim, config.v_head_dim], dim=1)  # [np, d_n or d_v, d_c]
        query = torch.cat([torch.einsum("sbnd,ndc->sbnc", q_nope, up_k), q_pos], dim=-1)
        latent = torch.cat([kv_compressed, self._rotate(k_pos_emb.unsqueeze(2), rotary_pos_emb)[:, :, 0]], dim=-1)
        latent = latent.unsqueeze(2)  # [t, 1, 1, d_c + d_r]: one key head, its first d_c channels the value
        context = inference_context.attend(self.layer_number, query, latent, latent)
        context = context.view(*context.shape[:2], self.np, self.hn)[..., :config.kv_lora_rank]
        context = torch.einsum("sbnc,nvc->sbnv", context, up_v)
        return context.reshape(*context.shape[:2], self.np * config.v_head_dim)


def _pad_head(t, size: int):
    """[..., d] -> [..., size], zeros appended (no change to q k^T, and the padded value
    channels of the context are dropped)."""
    return t if t.shape[-1] == size else F.pad(t, (0, size - t.shape[-1]))


def _unpad_context(context, heads: int, v_head_dim: int):
    """[s, b, np * size] -> [s, b, np * v_head_dim], each head's first v_head_dim channels."""
    s, b = context.shape[:2]
    return context.view(s, b, heads, -1)[..., :v_head_dim].reshape(s, b, heads * v_head_dim)
