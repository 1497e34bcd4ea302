"""GPTModel: embedding -> transformer block -> output layer (-> vocab-parallel cross entropy).

One instance is one pipeline stage (or virtual stage): `pre_process` holds the embedding,
`post_process` the final norm and output layer. `vocab_size` is the PADDED vocabulary (as in
Megatron, callers pad with `tensor_parallel.pad_vocab_size`); `unpadded_vocab_size` (teratron's
own) is the real one, and the ids past it are padding, not tokens: their embedding and output
rows start at zero, their logits are -inf and the loss ignores them, so the model (loss,
gradients, samples) does not depend on how far it was padded, hence on the TP size. With
`share_embeddings_and_output_weights` the output layer reuses the word embedding; when the two
live on different stages the last stage holds a copy (attribute `shared_embedding=True`) that
starts equal to the embedding (both are built under the "embedding" init stream) and whose
gradient `finalize_model_grads` sums with the first stage's over the embedding group.
Without `pg_collection` the model takes the current topology's groups; the config's parallel
sizes must equal the groups' (`topology.check_parallel_sizes`).

With `mtp_block_spec` (the stage holding the loss, when config.mtp_num_layers is set) the stage
also holds the multi-token-prediction block (`transformer.multi_token_prediction`): its loss
joins the LM loss's backward and its depths' losses go to the log. MTP needs the embedding on
that stage: the first stage's, or on a later stage a copy (`shared_embedding=True`, built
under the "embedding" stream, its gradient summed with the first stage's like the tied output
copy, which it then replaces). With config.freeze_base_model_for_mtp only the MTP block trains:
every other parameter is frozen and the main model runs without autograd.
"""

import contextlib
import functools

from typing import Literal

import torch

from teratron import tensor_parallel
from teratron.models.common.language_model_embedding import LanguageModelEmbedding
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.tensor_parallel import mappings
from teratron.tensor_parallel.cross_entropy import real_vocab_in_partition
from teratron.tensor_parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from teratron.tensor_parallel.layers import padded_vocab_init_method
from teratron.topology import check_parallel_sizes, resolve_pg_collection
from teratron.transformer.context_parallel import cp_token_index
from teratron.transformer.init_rng import build_component
from teratron.transformer.multi_latent_attention import mla_rotary_embedding
from teratron.transformer.multi_token_prediction import MultiTokenPredictionBlock, attach_mtp_loss, roll_left
from teratron.transformer.rope import RotaryEmbedding, YarnRotaryEmbedding
from teratron.transformer.transformer_block import TransformerBlock

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "yarn", "none")


class GPTModel(torch.nn.Module):
    def __init__(self, config, transformer_layer_spec, vocab_size: int, max_sequence_length: int,
                 pre_process: bool = True, post_process: bool = True,
                 fp16_lm_cross_entropy: bool = False, parallel_output: bool = True,
                 share_embeddings_and_output_weights: bool = False,
                 position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = "learned_absolute",
                 rotary_percent: float = 1.0, rotary_base: int = 10000, rope_scaling: bool = False,
                 rope_scaling_factor: float = 8.0, pg_collection=None, vp_stage=None,
                 unpadded_vocab_size: int | None = None, mtp_block_spec=None,
                 rope_scaling_low_freq_factor: float = 1.0, rope_scaling_high_freq_factor: float = 4.0,
                 rope_scaling_original_max_position_embeddings: int = 8192):
        super().__init__()
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type={position_embedding_type!r}; use one of {POSITION_EMBEDDING_TYPES}"
            )
        self.config = config
        self.vocab_size = vocab_size
        self.unpadded_vocab_size = unpadded_vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.vp_stage = vp_stage
        self.pg_collection = resolve_pg_collection(pg_collection)
        check_parallel_sizes(config, self.pg_collection)
        tp = self.pg_collection.tp
        if vocab_size % get_pg_size(tp):
            raise ValueError(
                f"vocab_size ({vocab_size}) is not divisible by the tensor-parallel size ({get_pg_size(tp)}); "
                f"pass the padded size tensor_parallel.pad_vocab_size(vocab_size, make_vocab_size_divisible_by, tp)"
            )
        if unpadded_vocab_size is not None and not 2 <= unpadded_vocab_size <= vocab_size:
            raise ValueError(
                f"unpadded_vocab_size={unpadded_vocab_size} must be in [2, vocab_size={vocab_size}]: pass the "
                f"tokenizer's vocab size (vocab_size is the padded one), or None when there is no padding"
            )

        self.mtp_process = mtp_block_spec is not None
        if self.mtp_process:
            _check_mtp_stage(config, post_process, position_embedding_type)
        if pre_process or self.mtp_process:
            self.embedding = build_component("embedding", functools.partial(
                LanguageModelEmbedding, config, vocab_size, max_sequence_length,
                position_embedding_type=position_embedding_type, tp_group=tp,
                unpadded_vocab_size=unpadded_vocab_size), config.init_model_with_meta_device)
        self.rotary_pos_emb = None
        if config.multi_latent_attention:  # MLA rotates its positional channels whatever the type (Megatron)
            self.rotary_pos_emb = mla_rotary_embedding(config)
        elif position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels, rotary_percent, config.rotary_interleaved, rotary_base, rope_scaling,
                rope_scaling_factor, rope_scaling_low_freq_factor, rope_scaling_high_freq_factor,
                rope_scaling_original_max_position_embeddings)
        elif position_embedding_type == "yarn":  # attention scales the rotated channels (rope_mscale)
            self.rotary_pos_emb = YarnRotaryEmbedding(
                config.kv_channels, config.rotary_interleaved, rotary_base, config.yarn_rotary_scaling_factor,
                config.yarn_original_max_position_embeddings, config.yarn_beta_fast, config.yarn_beta_slow,
                config.yarn_correction_range_round_to_int)
        self.decoder = TransformerBlock(config, transformer_layer_spec, pre_process=pre_process,
                                        post_process=post_process, pg_collection=self.pg_collection,
                                        vp_stage=vp_stage)
        self.mtp = None
        if self.mtp_process:
            self.mtp = MultiTokenPredictionBlock(config, mtp_block_spec, self.pg_collection, vp_stage)
            if not pre_process:  # the stage's copy of the first stage's embedding
                self.embedding.word_embeddings.weight.shared_embedding = True
        if post_process:
            has_embedding = pre_process or self.mtp_process
            tied_copy = share_embeddings_and_output_weights and not has_embedding
            init_method = config.embedding_init_method if tied_copy else config.init_method
            self.output_layer = build_component("embedding" if tied_copy else "output_layer", functools.partial(
                tensor_parallel.ColumnParallelLinear, config.hidden_size, vocab_size, config=config,
                init_method=padded_vocab_init_method(init_method, unpadded_vocab_size),
                bias=False, skip_bias_add=False, gather_output=False,
                skip_weight_param_allocation=has_embedding and share_embeddings_and_output_weights,
                tp_group=tp), config.init_model_with_meta_device)
            if tied_copy:
                self.output_layer.weight.shared_embedding = True
        if config.freeze_base_model_for_mtp:
            for name, param in self.named_parameters():
                if not name.startswith("mtp."):
                    param.requires_grad_(False)

    def set_input_tensor(self, input_tensor):
        """The previous pipeline stage's output (Megatron passes a one-element list)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel takes one input tensor from the previous stage, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def shared_embedding_or_output_weight(self):
        """The tied weight this stage holds: the word embedding on the first stage (or its copy on
        the MTP stage), else the output layer's copy."""
        if self.pre_process or self.mtp_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None, decoder_input=None,
                runtime_gather_output: bool | None = None, inference_context=None, packed_seq_params=None,
                loss_mask=None):
        """input_ids, position_ids, labels, loss_mask: [b, s] (position_ids None = 0..s-1); attention_mask:
        bool [b, 1, s, s] (True = masked out) or None for causal; `packed_seq_params` (a
        PackedSeqParams, instead of a mask): the documents of a packed batch, each attending
        causally to itself (the layers get it as their attention mask). Under context parallelism
        the [b, s] tensors are this CP rank's tokens (`get_batch_on_this_cp_rank`), and the
        default position_ids are theirs in the full sequence. Returns logits [b, s, V/tp]
        ([b, s, V] when not parallel_output, or as runtime_gather_output says; V is the padded
        vocab, the padding columns -inf), the per-token loss [b, s] with labels (then computed
        in token chunks without the full logits when config.cross_entropy_loss_fusion; on the MTP
        stage with the MTP loss joined to its backward, masked by loss_mask, None = every token),
        or on a non-last stage the hidden states [s, b, h].

        With `inference_context` (teratron.inference: the KV cache and this step's requests) the
        batch is the step's new tokens of every request back to back, input_ids and position_ids
        [1, t]; each attention layer stores its keys and values in the context and attends over
        what the context holds for each token's request (`inference_context.attend`); the logits
        are those of the tokens the context samples after (`output_hidden_states`), [1, r, V]."""
        if packed_seq_params is not None:
            if attention_mask is not None:
                raise ValueError("GPTModel.forward got both attention_mask and packed_seq_params; pass one")
            attention_mask = packed_seq_params
        if position_ids is None and input_ids is not None:
            position_ids = self._positions(input_ids.shape[1], input_ids.device).expand_as(input_ids)
        frozen = self.config.freeze_base_model_for_mtp and self.training
        with torch.no_grad() if frozen else contextlib.nullcontext():
            if decoder_input is None and self.pre_process:
                decoder_input = self.embedding(input_ids, position_ids)
            rotary_pos_emb = self._rotary_pos_emb(decoder_input, position_ids)
            hidden_states = self.decoder(decoder_input, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                         inference_context=inference_context)
        if not self.post_process:
            return hidden_states
        if inference_context is not None:
            hidden_states = inference_context.output_hidden_states(hidden_states)  # the tokens it samples after
        if labels is None:
            return self.output_logits(hidden_states, runtime_gather_output).transpose(0, 1).contiguous()
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        with torch.no_grad() if frozen else contextlib.nullcontext():
            loss = self._language_model_loss(labels, hidden_states, weight)
        if self.mtp_process:
            loss = self._add_mtp_loss(loss, input_ids, position_ids, hidden_states, labels, loss_mask, weight,
                                      attention_mask, rotary_pos_emb)
        return loss

    def output_logits(self, hidden_states, runtime_gather_output: bool | None = None):
        """Final hidden states [s, b, h] -> logits [s, b, V/tp] (all V columns when not
        parallel_output, or as runtime_gather_output says), the padding columns -inf."""
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight)
        logits = self._mask_vocab_padding(logits)
        gather = not self.parallel_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            logits = mappings.gather_from_tensor_model_parallel_region(logits, group=self.pg_collection.tp)
        return logits

    def _language_model_loss(self, labels, hidden_states, weight):
        """labels [b, s], final hidden states [s, b, h] -> per-token loss [b, s]."""
        if self.config.cross_entropy_loss_fusion:
            return self._fused_language_model_loss(labels, hidden_states, weight)
        logits, _ = self.output_layer(hidden_states, weight=weight)  # [s, b, V/tp]
        return self.compute_language_model_loss(labels, logits)

    def _add_mtp_loss(self, lm_loss, input_ids, position_ids, hidden_states, labels, loss_mask, weight,
                      attention_mask, rotary_pos_emb):
        """lm_loss [b, s] with the MTP depths' losses joined to its backward."""
        mask = torch.ones_like(labels, dtype=torch.float) if loss_mask is None else loss_mask.float()
        depths = self.mtp(input_ids, position_ids, hidden_states, self.embedding, attention_mask, rotary_pos_emb)
        cp = self.pg_collection.cp
        depth_losses = [(self._language_model_loss(roll_left(labels, k, cp, attention_mask), h, weight),
                         roll_left(mask, k, cp, attention_mask)) for k, h in enumerate(depths, 1)]
        return attach_mtp_loss(lm_loss, depth_losses, self.config, mask.sum(), cp)

    def _mask_vocab_padding(self, logits):
        """Vocab-parallel logits [s, b, V/tp] with the padding columns set to -inf, so a softmax
        or a sampler over them sees only the real vocabulary."""
        partition = logits.shape[-1]
        real = real_vocab_in_partition(self.unpadded_vocab_size, partition, get_pg_rank(self.pg_collection.tp))
        if real == partition:
            return logits
        return logits.masked_fill(torch.arange(partition, device=logits.device) >= real, float("-inf"))

    def _rotary_pos_emb(self, decoder_input, position_ids):
        if self.rotary_pos_emb is None:
            return None
        if position_ids is None:
            # A middle stage without ids: positions 0..s-1 of the full sequence (this CP rank's).
            hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
            seq_len = hidden.shape[0]
            if self.config.sequence_parallel:
                seq_len *= get_pg_size(self.pg_collection.tp)
            position_ids = self._positions(seq_len, hidden.device).unsqueeze(0)
        return self.rotary_pos_emb(position_ids)

    def _positions(self, local_length: int, device):
        """Positions 0..s-1 of the full sequence that this CP rank's `local_length` tokens hold."""
        cp = self.pg_collection.cp
        if get_pg_size(cp) == 1:
            return torch.arange(local_length, device=device)
        return cp_token_index(local_length * get_pg_size(cp), get_pg_size(cp), get_pg_rank(cp), device=device)

    def _fused_language_model_loss(self, labels, hidden_states, weight):
        """labels [b, s], final hidden states [s, b, h] -> per-token loss [b, s], equal to the
        output layer + compute_language_model_loss, without the full logits."""
        loss = fused_vocab_parallel_cross_entropy(
            hidden_states, self.output_layer.weight if weight is None else weight,
            labels.transpose(0, 1).contiguous(), group=self.pg_collection.tp,
            unpadded_vocab_size=self.unpadded_vocab_size, sequence_parallel=self.output_layer.sequence_parallel,
        )
        return loss.transpose(0, 1).contiguous()

    def compute_language_model_loss(self, labels, logits):
        """labels [b, s], vocab-parallel logits [s, b, V/tp] -> per-token loss [b, s]. The loss is
        computed in fp32 whatever the logits' dtype (so fp16_lm_cross_entropy changes nothing), without
        an fp32 copy of the logits."""
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(),
                                                            group=self.pg_collection.tp,
                                                            unpadded_vocab_size=self.unpadded_vocab_size)
        return loss.transpose(0, 1).contiguous()


def _check_mtp_stage(config, post_process: bool, position_embedding_type: str) -> None:
    if not config.mtp_num_layers:
        raise ValueError("an MTP block spec was given but config.mtp_num_layers is not set; set it or pass "
                         "mtp_block_spec=None")
    if not post_process:
        raise ValueError("the MTP layers sit on the stage holding the loss; build them with post_process=True")
    if position_embedding_type == "learned_absolute":
        raise ValueError("multi-token prediction needs position_embedding_type 'rope', 'yarn' or 'none' (as in "
                         "Megatron), not 'learned_absolute'")
