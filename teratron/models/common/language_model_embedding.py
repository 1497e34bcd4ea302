"""Token (+ learned absolute position) embedding: ids [b, s] -> hidden [s, b, h].

The word table is vocab-parallel (each TP rank holds a slice of the padded vocab); with
`unpadded_vocab_size` its real rows start as an unpadded table's would and its padding rows at
zero (never looked up, they stay zero). Position embeddings are replicated. Under sequence
parallelism the output is scattered to [s/tp, b, h] and dropout runs under the TP RNG tracker
(each rank holds a different slice).
"""

import torch

from teratron import tensor_parallel
from teratron.tensor_parallel import mappings
from teratron.tensor_parallel.layers import padded_vocab_init_method, param_device


class LanguageModelEmbedding(torch.nn.Module):
    def __init__(self, config, vocab_size: int, max_sequence_length: int,
                 position_embedding_type: str = "learned_absolute", num_tokentypes: int = 0,
                 scatter_to_sequence_parallel: bool = True, tp_group=None,
                 unpadded_vocab_size: int | None = None):
        super().__init__()
        if num_tokentypes:
            raise NotImplementedError(f"num_tokentypes={num_tokentypes}: token-type embeddings are not built; use 0")
        self.config = config
        self.vocab_size = vocab_size
        self.unpadded_vocab_size = unpadded_vocab_size
        self.max_sequence_length = max_sequence_length
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            vocab_size, config.hidden_size, config=config,
            init_method=padded_vocab_init_method(config.embedding_init_method, unpadded_vocab_size),
            tp_group=tp_group,
        )
        self.tp_group = self.word_embeddings.tp_group  # None given: the current topology's, resolved there
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        if self.add_position_embedding:
            self.position_embeddings = torch.nn.Embedding(max_sequence_length, config.hidden_size,
                                                          dtype=config.params_dtype,
                                                          device=param_device(config))
            if config.perform_initialization:
                config.embedding_init_method(self.position_embeddings.weight.data)
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids, position_ids):
        embeddings = self.word_embeddings(input_ids)  # [b, s, h]
        if self.add_position_embedding:
            if input_ids.shape[1] > self.max_sequence_length:
                raise ValueError(
                    f"sequence length {input_ids.shape[1]} exceeds max_sequence_length "
                    f"({self.max_sequence_length}) of the learned position embeddings; raise --max-position-embeddings"
                )
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()  # [s, b, h]
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        if self.config.sequence_parallel and self.scatter_to_sequence_parallel:
            embeddings = mappings.scatter_to_sequence_parallel_region(embeddings, group=self.tp_group)
            if self.training and self.embedding_dropout.p > 0:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    return self.embedding_dropout(embeddings)
        return self.embedding_dropout(embeddings)
