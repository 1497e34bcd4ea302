"""DynamicInferenceContext: the paged KV cache of one pipeline stage and the metadata of the step
being run (Megatron's `inference.contexts.dynamic_context`).

Memory: one buffer [2 (K, V), local layers, num_blocks, block_size, ng, hn] in the model's dtype,
sized from `InferenceConfig.buffer_size_gb`. A request owns a block table, the ids of the blocks
holding its tokens' keys and values in order (token p is in block table[p // block_size] at
offset p % block_size). With prefix caching, full blocks are registered under the hash of the
tokens up to their end, and a new request shares the blocks of its longest cached prefix.

A step is a list of chunks, each some consecutive new tokens of one request
(`initialize_attention_state`); the model then calls `attend` once per layer with the step's
tokens back to back.
"""

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from teratron.inference.config import InferenceConfig
from teratron.inference.contexts.kv_block_allocator import KVBlockAllocator, block_hash
from teratron.process_groups import get_pg_size
from teratron.transformer.attention import SelfAttention


@dataclass(frozen=True)
class StepChunk:
    """Tokens token_ids[start:end] of request `request_id` are computed this step (at positions
    start..end-1); token_ids holds at least the request's tokens up to `end`."""
    request_id: int
    token_ids: Sequence[int]
    start: int
    end: int


@dataclass
class _AttentionBatch:
    """Requests whose queries attend as one padded batch: R requests, up to Q queries each,
    keys from up to B blocks each."""
    token_index: torch.Tensor   # [n] the step tokens of this batch (index into t)
    padded_index: torch.Tensor  # [n] where each sits in the padded queries [R * Q]
    block_table: torch.Tensor   # [R, B] (padding: block 0, masked out)
    mask: torch.Tensor          # bool [R, 1, Q, B * block_size], True = attend
    shape: tuple                # (R, Q)


class DynamicInferenceContext:
    def __init__(self, config: InferenceConfig, layer_numbers: Sequence[int], num_query_groups: int,
                 head_dim: int, dtype: torch.dtype, device, softmax_scale: float | None = None,
                 token_multiple: int = 1):
        """token_multiple: a step's tokens are padded to a multiple of it (the tensor-parallel size:
        an MoE layer under TP splits them over the ranks)."""
        if not layer_numbers:
            raise ValueError("the model has no attention layer on this stage; an inference context needs one")
        self.config = config
        self.block_size = config.block_size
        self.token_multiple = token_multiple
        self.layer_slot = {number: slot for slot, number in enumerate(layer_numbers)}
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        element_size = torch.empty((), dtype=dtype).element_size()
        self.bytes_per_block = 2 * len(layer_numbers) * self.block_size * num_query_groups * head_dim * element_size
        self.num_blocks = int(config.buffer_size_gb * 1024**3) // self.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(f"buffer_size_gb={config.buffer_size_gb} holds no KV block of {self.bytes_per_block} "
                             "bytes; raise --inference-dynamic-batching-buffer-size-gb")
        # Zeros, not empty: masked keys of padding blocks get weight 0, and 0 * NaN would be NaN.
        self.memory_buffer = torch.zeros(2, len(layer_numbers), self.num_blocks, self.block_size, num_query_groups,
                                         head_dim, dtype=dtype, device=device)
        self.device = self.memory_buffer.device
        self.allocator = KVBlockAllocator(self.num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.block_hashes: dict[int, list[bytes]] = {}  # per request, the hashes of its full computed blocks
        self.chunks: list[StepChunk] = []

    @classmethod
    def from_model(cls, model: torch.nn.Module, config: InferenceConfig) -> "DynamicInferenceContext":
        """A context for the attention layers of `model` (this stage's), in its dtype and device."""
        attentions = [m for m in model.modules() if isinstance(m, SelfAttention)]
        if not attentions:
            raise ValueError("the model has no attention layer on this stage; an inference context needs one")
        first = attentions[0]
        weight = next(first.parameters())
        return cls(config, [a.layer_number for a in attentions], first.ng, first.hn, weight.dtype, weight.device,
                   first.config.softmax_scale, token_multiple=get_pg_size(first.pg_collection.tp))

    # Requests' memory.

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks of the longest cached prefix of a new request's `token_ids` (none
        without prefix caching). At least the last token is left to compute: its logits are needed."""
        if not self.config.prefix_caching:
            return []
        usable = (len(token_ids) - 1) // self.block_size
        return self.allocator.lookup(self._hashes(token_ids, 0, usable))

    def num_allocatable_blocks(self, retaining: Sequence[int] = ()) -> int:
        return self.allocator.num_allocatable(excluding=retaining)

    def blocks_needed(self, request_id: int, num_tokens: int) -> int:
        """New blocks request `request_id` needs to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.block_tables[request_id]))

    def add_request(self, request_id: int, cached_blocks: Sequence[int] = (), token_ids: Sequence[int] = ()) -> None:
        """Start a block table for `request_id` from `cached_blocks` (its cached prefix of
        `token_ids`, see `cached_prefix`), whose tokens count as computed."""
        if request_id in self.block_tables:
            raise ValueError(f"request {request_id} already holds KV blocks")
        self.allocator.retain(cached_blocks)
        self.block_tables[request_id] = list(cached_blocks)
        self.block_hashes[request_id] = self._hashes(token_ids, 0, len(cached_blocks)) if cached_blocks else []

    def reserve(self, request_id: int, num_tokens: int) -> None:
        """Allocate blocks until request `request_id` can hold `num_tokens` tokens."""
        self.block_tables[request_id] += self.allocator.allocate(self.blocks_needed(request_id, num_tokens))

    def truncate(self, request_id: int, num_tokens: int) -> None:
        """Keep the blocks holding the request's first `num_tokens` tokens and free the rest (rejected
        speculative tokens); keys and values written past `num_tokens` are overwritten later."""
        table = self.block_tables[request_id]
        keep = self.blocks_for(num_tokens)
        self.allocator.release(table[keep:][::-1])
        del table[keep:]

    def release(self, request_id: int) -> None:
        """Free the request's blocks (cached ones stay cached while memory allows)."""
        self.allocator.release(self.block_tables.pop(request_id)[::-1])
        self.block_hashes.pop(request_id)

    def _hashes(self, token_ids: Sequence[int], first_block: int, end_block: int, parent: bytes | None = None):
        hashes = []
        for block in range(first_block, end_block):
            parent = block_hash(parent, token_ids[block * self.block_size:(block + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    # The step.

    def initialize_attention_state(self, chunks: Sequence[StepChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a step computing `chunks` (whose blocks are reserved); returns the model's
        input_ids and position_ids [1, t], the chunks' tokens back to back, then padding (token 0
        at position 0, neither stored nor attended) up to a multiple of token_multiple."""
        self.chunks = list(chunks)
        positions = [p for c in chunks for p in range(c.start, c.end)]
        tokens = [t for c in chunks for t in c.token_ids[c.start:c.end]]
        padding = -len(tokens) % self.token_multiple
        blocks = [self.block_tables[c.request_id][p // self.block_size] for c in chunks for p in range(c.start, c.end)]
        self.write_blocks = torch.tensor(blocks, dtype=torch.long, device=self.device)  # [t]
        self.write_offsets = torch.tensor(positions, dtype=torch.long, device=self.device) % self.block_size  # [t]
        first_token = [0]
        for c in chunks:
            first_token.append(first_token[-1] + c.end - c.start)
        decode = [i for i, c in enumerate(chunks) if c.end - c.start == 1]
        prefill = [i for i, c in enumerate(chunks) if c.end - c.start > 1]
        self.attention_batches = [self._attention_batch([chunks[i] for i in rows], [first_token[i] for i in rows])
                                  for rows in (decode, prefill) if rows]
        ids = torch.tensor([tokens + [0] * padding, positions + [0] * padding], dtype=torch.long, device=self.device)
        return ids[:1], ids[1:]

    def _attention_batch(self, chunks: Sequence[StepChunk], first_token: Sequence[int]) -> _AttentionBatch:
        num_queries = max(c.end - c.start for c in chunks)
        num_blocks = max(self.blocks_for(c.end) for c in chunks)
        token_index, padded_index = [], []
        table = torch.zeros(len(chunks), num_blocks, dtype=torch.long)
        query_positions = torch.zeros(len(chunks), num_queries, dtype=torch.long)  # padding: position 0
        for row, (chunk, first) in enumerate(zip(chunks, first_token)):
            count = chunk.end - chunk.start
            token_index += range(first, first + count)
            padded_index += range(row * num_queries, row * num_queries + count)
            used = self.blocks_for(chunk.end)
            table[row, :used] = torch.tensor(self.block_tables[chunk.request_id][:used])
            query_positions[row, :count] = torch.arange(chunk.start, chunk.end)
        key_positions = torch.arange(num_blocks * self.block_size)
        mask = key_positions[None, None, None, :] <= query_positions[:, None, :, None]  # [R, 1, Q, B * bs]
        index = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        return _AttentionBatch(index(token_index), index(padded_index), table.to(self.device), mask.to(self.device),
                               (len(chunks), num_queries))

    def attend(self, layer_number: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Store this step's keys and values of layer `layer_number` and attend: q [t, 1, np, hn],
        k and v [t, 1, ng, hn] -> [t, 1, np * hn]; each query sees its request's keys up to its
        own position (causal), cached and new."""
        keys, values = self.memory_buffer[:, self.layer_slot[layer_number]]  # [num_blocks, bs, ng, hn] each
        real = len(self.write_blocks)
        keys[self.write_blocks, self.write_offsets] = key[:real, 0]
        values[self.write_blocks, self.write_offsets] = value[:real, 0]
        t, _, heads, head_dim = query.shape
        output = query.new_zeros(t, heads, head_dim)  # padding tokens keep zeros
        for batch in self.attention_batches:
            output[batch.token_index] = self._attend_batch(batch, query[:, 0], keys, values)
        return output.view(t, 1, heads * head_dim)

    def _attend_batch(self, batch: _AttentionBatch, query, keys, values) -> torch.Tensor:
        """query [t, np, hn] -> the context of the batch's tokens [n, np, hn]."""
        rows, num_queries = batch.shape
        heads, head_dim = query.shape[1:]
        padded = query.new_zeros(rows * num_queries, heads, head_dim)
        padded[batch.padded_index] = query[batch.token_index]
        q = padded.view(rows, num_queries, heads, head_dim).transpose(1, 2)  # [R, np, Q, hn]
        # [R, B, bs, ng, hn] -> [R, ng, B * bs, hn]
        k, v = (cache[batch.block_table].flatten(1, 2).transpose(1, 2) for cache in (keys, values))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, scale=self.softmax_scale,
                                                 enable_gqa=heads != k.shape[1])
        return context.transpose(1, 2).reshape(rows * num_queries, heads, head_dim)[batch.padded_index]

    def commit_step(self, chunks: Sequence[StepChunk] | None = None) -> None:
        """After the step's forward: with prefix caching, register the blocks it filled. chunks:
        the step's chunks cut to their final tokens (rejected speculative tokens left out);
        default: the step's chunks."""
        if self.config.prefix_caching:
            self._register_full_blocks(self.chunks if chunks is None else chunks)
        self.chunks = []

    def _register_full_blocks(self, chunks: Sequence[StepChunk]) -> None:
        for chunk in chunks:
            table, hashes = self.block_tables[chunk.request_id], self.block_hashes[chunk.request_id]
            full = chunk.end // self.block_size
            new = self._hashes(chunk.token_ids, len(hashes), full, parent=hashes[-1] if hashes else None)
            for block, hash_ in zip(table[len(hashes):full], new):
                self.allocator.register(block, hash_)
            hashes += new
