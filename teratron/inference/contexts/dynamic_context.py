"""DynamicInferenceContext: the paged KV cache of one pipeline stage and the metadata of the step
being run (Megatron's `inference.contexts.dynamic_context`).

Memory: one buffer [2 (K, V), local layers, num_blocks + 1, block_size, ng, hn] in the model's
dtype (keys only, [1, ...], when the values are the keys: MLA's latent cache), sized from
`InferenceConfig.buffer_size_gb`; the last block is the scratch block, where padding tokens write
their keys and values. A request owns a block table, the ids of the blocks
holding its tokens' keys and values in order (token p is in block table[p // block_size] at
offset p % block_size). With prefix caching, full blocks are registered under the hash of the
tokens up to their end, and a new request shares the blocks of its longest cached prefix.

A step is a list of chunks, each some consecutive new tokens of one request
(`initialize_attention_state`); the model then calls `attend` once per layer with the step's
tokens back to back. `attend` writes the step's keys and values with one indexed copy, then
attends: short chunks (decode, speculative verification) with the paged-attention kernel, which
reads each query's keys in place through its block table, prefill chunks as padded SDPA batches.
A decode step (`initialize_decode_state`) keeps its metadata in buffers at fixed addresses, so
that a CUDA graph captured for its row count replays it (`inference.cuda_graphs`).

Recurrent layers (Mamba-2, Gated DeltaNet) call `run_recurrent` instead: the context keeps each
request's state per layer, after its last computed tokens (and, for speculative decoding, after each
of the last few, to continue from the last accepted one; for prefix caching, at cached block
boundaries: `RecurrentPrefixCache`).
"""

import math
import warnings
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from teratron.inference.config import InferenceConfig
from teratron.inference.contexts.kv_block_allocator import KVBlockAllocator, block_hash
from teratron.inference.contexts.recurrent_prefix_cache import RecurrentPrefixCache
from teratron.inference.kernels.paged_attention import paged_attention
from teratron.inference.windowed_attention import attend as attend_padded, window_mask
from teratron.process_groups import get_pg_size
from teratron.transformer.attention import SelfAttention
from teratron.transformer.multi_latent_attention import MLASelfAttention

# Not cuDNN: its host-side setup for each new shape (a prefill batch's shape changes from step to
# step) took 3.5 ms per layer on an H200, seven times the kernel (bench/RESULTS.md, 2026-12-01).
PREFILL_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]

PAGED_QUERY_LIMIT = 16
"""Chunks of up to this many tokens (decode, speculative verification) attend with the paged
kernel, which reads each query's keys in place; longer ones are prefill and run as SDPA batches."""


@dataclass(frozen=True)
class StepChunk:
    """Tokens token_ids[start:end] of request `request_id` are computed this step (at positions
    start..end-1); token_ids holds at least the request's tokens up to `end`."""
    request_id: int
    token_ids: Sequence[int]
    start: int
    end: int
    drafts: int = 0
    """How many of the chunk's last tokens are speculative (drafts, or fed by drafts): recurrent
    layers keep their state after each of them, which a later chunk may continue from."""


@dataclass
class _AttentionBatch:
    """Prefill chunks whose queries attend as one padded batch: R chunks, up to Q queries each,
    keys from up to B blocks each."""
    token_index: torch.Tensor      # [n] the step tokens of this batch (index into t)
    padded_index: torch.Tensor     # [n] where each sits in the padded queries [R * Q]
    block_table: torch.Tensor      # [R, B] (padding: the scratch block, masked out)
    query_positions: torch.Tensor  # [R, Q] (padding queries: position 0)
    num_keys: int                  # B * block_size
    shape: tuple                   # (R, Q)
    masks: dict = field(default_factory=dict)  # window -> bool [R, 1, Q, B * block_size], True = attend

    def mask(self, window: tuple | None) -> torch.Tensor:
        """Causal, within `window` (left, right) when given; built once per window a step."""
        if window not in self.masks:
            key_positions = torch.arange(self.num_keys, device=self.query_positions.device)
            self.masks[window] = window_mask(self.query_positions[:, None, :], key_positions, window)
        return self.masks[window]


@dataclass
class _PagedQueries:
    """Queries that attend with the paged-attention kernel (decode tokens and short chunks such as
    speculative verification): one block-table row and key count per query."""
    token_index: torch.Tensor | None  # [p] the step tokens concerned (index into t); None: all t, in order
    block_table: torch.Tensor         # int32 [p, max_blocks_per_request]
    kv_lengths: torch.Tensor          # int32 [p]: query i attends its request's keys 0 .. kv_lengths[i]-1


def attention_modules(module: torch.nn.Module) -> list:
    """The attention layers (self-attention, multi-latent attention) a context caches keys for."""
    return [m for m in module.modules() if isinstance(m, (SelfAttention, MLASelfAttention))]


class DynamicInferenceContext:
    def __init__(self, config: InferenceConfig, layer_numbers: Sequence[int], num_query_groups: int,
                 head_dim: int, dtype: torch.dtype, device, softmax_scale: float | None = None,
                 token_multiple: int = 1, max_seq_length: int | None = None, values_are_keys: bool = False,
                 state_bytes_per_request: int = 0):
        """token_multiple: a step's tokens are padded to a multiple of it (the tensor-parallel size:
        an MoE layer under TP splits them over the ranks). max_seq_length: the longest request
        (config.max_seq_length when None; one of them must be given). values_are_keys: the values
        are the keys themselves (MLA's latent cache), so the buffer holds keys only, [1, ...].
        state_bytes_per_request: what a running request's recurrent layers keep (hybrid models),
        which the buffer holds first (`_recurrent_state_budget`)."""
        self.config = config
        self.block_size = config.block_size
        max_seq_length = max_seq_length or config.max_seq_length
        if max_seq_length is None:
            raise ValueError("DynamicInferenceContext needs max_seq_length (or config.max_seq_length)")
        self.max_blocks_per_request = self.blocks_for(max_seq_length)
        self.token_multiple = token_multiple
        self.layer_slot = {number: slot for slot, number in enumerate(layer_numbers)}
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        element_size = torch.empty((), dtype=dtype).element_size()
        self.values_are_keys = values_are_keys
        kinds = 1 if values_are_keys else 2
        self.bytes_per_block = kinds * len(layer_numbers) * self.block_size * num_query_groups * head_dim * element_size
        self.recurrent_states_kept = config.num_speculative_tokens + 1  # see recurrent_states
        self.max_requests, self.recurrent_state_bytes = self._recurrent_state_budget(state_bytes_per_request)
        """The most requests running at once (config.max_requests, or fewer by mamba_memory_ratio), and
        the bytes of the buffer their recurrent layers' states take (hybrid models)."""
        # One block of the budget is the scratch block: padding tokens write their keys there. Without
        # attention layers (recurrent ones only) blocks hold nothing: they only count each request's
        # tokens, and every request may reach max_seq_length.
        kv_bytes = int(config.buffer_size_gb * 1024**3) - self.recurrent_state_bytes
        self.num_blocks = (kv_bytes // self.bytes_per_block - 1 if layer_numbers
                           else self.max_requests * self.max_blocks_per_request)
        if self.num_blocks < 1:
            raise ValueError(f"buffer_size_gb={config.buffer_size_gb} holds no KV block of {self.bytes_per_block} "
                             "bytes besides the scratch block; raise --inference-dynamic-batching-buffer-size-gb")
        self.scratch_block = self.num_blocks
        # Zeros, not empty: masked keys of padding blocks get weight 0, and 0 * NaN would be NaN.
        self.memory_buffer = torch.zeros(kinds, len(layer_numbers), self.num_blocks + 1, self.block_size,
                                         num_query_groups, head_dim, dtype=dtype, device=device)
        self.device = self.memory_buffer.device
        self.allocator = KVBlockAllocator(self.num_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.block_hashes: dict[int, list[bytes]] = {}  # per request, the hashes of its full computed blocks
        self.chunks: list[StepChunk] = []
        # The rows of a decode step live in these buffers, at fixed addresses (a CUDA graph replays
        # reading them): token ids, positions and cache slots [3, R]; key counts [R]; block tables.
        rows = -(-config.max_requests // token_multiple) * token_multiple
        self.num_decode_rows = rows
        self.decode_ids = torch.zeros(3, rows, dtype=torch.long, device=self.device)
        self.decode_kv_lengths = torch.ones(rows, dtype=torch.int32, device=self.device)
        self.decode_block_table = torch.full((rows, self.max_blocks_per_request), self.scratch_block,
                                             dtype=torch.int32, device=self.device)
        self.output_token_index: torch.Tensor | None = None
        self.paged_query_limit = PAGED_QUERY_LIMIT
        self.layer_windows: dict[int, tuple] = {}
        """Sliding windows (left, right) of the layers that have one (from_model)."""
        self.layer_sinks: dict[int, torch.Tensor] = {}
        """Attention-sink logits [np] of the layers that have them (from_model)."""
        self.keep_hidden_states = False
        """Keep each step's final hidden states (`hidden_states`; the MTP proposer reads them)."""
        self.hidden_states: torch.Tensor | None = None
        """With keep_hidden_states: the last step's final hidden states [t, 1, h], every step token
        (a CUDA-graph replay's: its graph's output, see DecodeCudaGraphs)."""
        self.kv_window: int | None = None
        """When every layer has a sliding window: the largest left window W. A query at position p
        reads keys from p - W on, so the engine frees the blocks before (`release_out_of_window`)."""
        self.recurrent_states: dict[tuple[int, int], dict[int, tuple]] = {}
        """(layer number, request id) -> {tokens computed: the state a recurrent layer (Mamba-2, Gated
        DeltaNet) carries from them to the request's next tokens} (`run_recurrent`): the latest, and
        with speculative decoding the states after each of the last num_speculative_tokens + 1
        tokens, so that a chunk after rejected drafts continues from the last accepted token."""
        self.recurrent_layers: list[int] = []
        """The layer numbers of the recurrent layers (from_model)."""
        self.recurrent_prefixes: RecurrentPrefixCache | None = None
        """Prefix caching of a hybrid model (with prefix_caching_mamba_gb): the recurrent layers'
        states at cached block boundaries, under the block's hash."""
        self.recurrent_boundaries: dict[int, set[int]] = {}
        """Request id -> the token counts after which its recurrent states go to the prefix cache."""
        self._boundary_states: dict[tuple[int, int], dict] = {}  # (request, tokens) -> {layer: state}, this step

    def _recurrent_state_budget(self, per_request: int) -> tuple[int, int]:
        """(requests that may run at once, bytes of the buffer kept for their recurrent states):
        config.mamba_memory_ratio of the buffer, or the states of max_requests requests (Megatron's
        split); with speculative decoding a request keeps num_speculative_tokens + 1 states."""
        config, buffer = self.config, int(self.config.buffer_size_gb * 1024**3)
        per_request *= self.recurrent_states_kept
        if not per_request:
            return config.max_requests, 0
        if config.mamba_memory_ratio is None:
            if config.max_requests * per_request >= buffer:
                raise ValueError(f"the Mamba / Gated DeltaNet states of max_requests={config.max_requests} requests "
                                 f"({config.max_requests * per_request / 1024**3:.3g} GiB) fill buffer_size_gb="
                                 f"{config.buffer_size_gb}; lower --inference-max-requests, raise "
                                 "--inference-dynamic-batching-buffer-size-gb or set "
                                 "--inference-dynamic-batching-mamba-memory-ratio")
            return config.max_requests, config.max_requests * per_request
        states = int(buffer * config.mamba_memory_ratio)
        if states < per_request:
            raise ValueError(f"mamba_memory_ratio={config.mamba_memory_ratio} of buffer_size_gb={config.buffer_size_gb} "
                             f"holds no request's Mamba / Gated DeltaNet states ({per_request} bytes); raise "
                             "--inference-dynamic-batching-mamba-memory-ratio or the buffer")
        return min(config.max_requests, states // per_request), states

    @classmethod
    def from_model(cls, model: torch.nn.Module, config: InferenceConfig) -> "DynamicInferenceContext":
        """A context for the attention layers of `model` (this stage's; a GPTModel's decoder's
        only: its multi-token-prediction layers cache in a context of their own, the MTP
        proposer's), in its dtype and device. Multi-latent attention caches what its layer's `ng`
        and `hn` say (per-head keys and values padded to one size, or one latent) under its own
        softmax scale."""
        layers = getattr(model, "decoder", model)
        attentions = attention_modules(layers)
        mixers = [m for m in layers.modules() if getattr(m, "recurrent", False)]
        recurrent, state_bytes = [m.layer_number for m in mixers], sum(m.inference_state_bytes() for m in mixers)
        if not attentions and not recurrent:
            raise ValueError("the model has neither attention nor Mamba / Gated DeltaNet layers on this stage; an "
                             "inference context caches theirs")
        weight = next(model.parameters())
        max_seq_length = config.max_seq_length or model.max_sequence_length
        if attentions:
            first = attentions[0]
            context = cls(config, [a.layer_number for a in attentions], first.ng, first.hn, weight.dtype,
                          weight.device, getattr(first, "softmax_scale", first.config.softmax_scale),
                          token_multiple=get_pg_size(first.pg_collection.tp), max_seq_length=max_seq_length,
                          values_are_keys=getattr(first, "cache_mla_latents", False), state_bytes_per_request=state_bytes)
        else:  # recurrent layers only: no keys to cache (a context of no KV layers)
            pg = next(m.pg_collection for m in model.modules() if hasattr(m, "pg_collection"))
            context = cls(config, [], 1, 1, weight.dtype, weight.device, token_multiple=get_pg_size(pg.tp),
                          max_seq_length=max_seq_length, state_bytes_per_request=state_bytes)
        for attention in attentions:
            core = attention.core_attention
            if getattr(core, "window_size", None) is not None:
                context.layer_windows[attention.layer_number] = tuple(core.window_size)
            if getattr(core, "softmax_offset", None) is not None:  # read at each step: refits update it
                context.layer_sinks[attention.layer_number] = core.softmax_offset
        context.recurrent_layers = recurrent
        if config.prefix_caching and context.recurrent_layers:
            if config.prefix_caching_mamba_gb:
                context.recurrent_prefixes = RecurrentPrefixCache(int(config.prefix_caching_mamba_gb * 1024**3))
                context.allocator.on_evict = context.recurrent_prefixes.drop
            else:
                warnings.warn("prefix caching of a model with Mamba or Gated DeltaNet layers without "
                              "prefix_caching_mamba_gb (--inference-dynamic-batching-prefix-caching-mamba-gb): "
                              "their states are not cached, so its requests reuse no prefix")
        lefts = [context.layer_windows.get(a.layer_number, (-1,))[0] for a in attentions]
        if lefts and min(lefts) >= 0:  # every layer windowed: older keys can go
            context.kv_window = max(lefts)
        return context

    # Requests' memory.

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks of the longest cached prefix of a new request's `token_ids` (none
        without prefix caching). At least the last token is left to compute: its logits are needed."""
        if not self.config.prefix_caching:
            return []
        hashes = self._hashes(token_ids, 0, (len(token_ids) - 1) // self.block_size)
        blocks = self.allocator.lookup(hashes)
        if self.recurrent_layers:  # recurrent layers start only after a block whose states are cached
            cache = self.recurrent_prefixes
            blocks = blocks[:next((n for n in range(len(blocks), 0, -1) if cache and hashes[n - 1] in cache), 0)]
        return blocks

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
        if self.recurrent_prefixes is not None and token_ids:
            self._plan_recurrent_prefix(request_id, len(cached_blocks), token_ids)

    def _plan_recurrent_prefix(self, request_id: int, cached: int, token_ids: Sequence[int]) -> None:
        """A hybrid request after `cached` cached blocks: its recurrent layers start from the states
        cached after them, and will cache theirs (as Megatron does) after the last block its keys and
        values matched (the prefix it shares with earlier requests: later ones find the states there)
        and after its prompt's last full block before the last token."""
        if cached:
            start = cached * self.block_size
            for layer, state in self.recurrent_prefixes.get(self.block_hashes[request_id][-1]).items():
                self.recurrent_states[(layer, request_id)] = {start: state}
        usable = (len(token_ids) - 1) // self.block_size
        hashes = self.block_hashes[request_id]  # the cached blocks' (matched already): hash only the rest
        rest = self._hashes(token_ids, cached, usable, parent=hashes[-1] if hashes else None)
        matched = cached + len(self.allocator.lookup(rest))
        self.recurrent_boundaries[request_id] = {n * self.block_size for n in (matched, usable) if n > cached}

    def reserve(self, request_id: int, num_tokens: int) -> None:
        """Allocate blocks until request `request_id` can hold `num_tokens` tokens."""
        self.block_tables[request_id] += self.allocator.allocate(self.blocks_needed(request_id, num_tokens))

    def truncate(self, request_id: int, num_tokens: int) -> None:
        """Keep the blocks holding the request's first `num_tokens` tokens and free the rest (rejected
        speculative tokens); keys and values written past `num_tokens` are overwritten later."""
        table = self.block_tables[request_id]
        keep = self.blocks_for(num_tokens)
        self.allocator.release(self._held(table[keep:][::-1]))
        del table[keep:]

    def release(self, request_id: int) -> None:
        """Free the request's blocks (cached ones stay cached while memory allows) and its
        recurrent layers' states."""
        self.allocator.release(self._held(self.block_tables.pop(request_id)[::-1]))
        self.block_hashes.pop(request_id)
        self.recurrent_boundaries.pop(request_id, None)
        for key in [key for key in self.recurrent_states if key[1] == request_id]:
            del self.recurrent_states[key]

    def release_out_of_window(self, request_id: int, first_position: int) -> None:
        """Free the request's blocks wholly before `first_position`, which no layer attends to any
        more (every layer's window starts at or after it: see `kv_window`); their table entries
        become the scratch block, which nothing reads."""
        table = self.block_tables[request_id]
        index = min(first_position // self.block_size, len(table)) - 1
        while index >= 0 and table[index] != self.scratch_block:  # the ones before went earlier
            self.allocator.release([table[index]])
            table[index] = self.scratch_block
            index -= 1

    def _held(self, blocks: Sequence[int]) -> list[int]:
        """`blocks` less the scratch entries of released out-of-window blocks."""
        return [block for block in blocks if block != self.scratch_block]

    def _hashes(self, token_ids: Sequence[int], first_block: int, end_block: int, parent: bytes | None = None):
        hashes = []
        for block in range(first_block, end_block):
            parent = block_hash(parent, token_ids[block * self.block_size:(block + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    # The step.

    def initialize_attention_state(self, chunks: Sequence[StepChunk],
                                   output_token_index: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a step computing `chunks` (whose blocks are reserved); returns the model's
        input_ids and position_ids [1, t], the chunks' tokens back to back, then padding (token 0
        at position 0, stored in the scratch block, attended by nothing) up to a multiple of
        token_multiple. output_token_index: the step tokens whose next token is sampled (only
        they reach the output layer), None for all. Chunks of up to paged_query_limit tokens
        attend with the paged-attention kernel, longer ones (prefill) as padded SDPA batches."""
        self.chunks = list(chunks)
        lengths = np.array([c.end - c.start for c in chunks], dtype=np.int64)
        positions = np.concatenate([np.arange(c.start, c.end) for c in chunks])
        tokens = np.concatenate([np.asarray(c.token_ids[c.start:c.end], dtype=np.int64) for c in chunks])
        tables = self._block_table_rows(chunks)  # [C, max_blocks]
        tables = tables[:, :max(self.blocks_for(c.end) for c in chunks)]  # the paged kernel reads no further
        chunk_of_token = np.repeat(np.arange(len(chunks)), lengths)
        slots = tables[chunk_of_token, positions // self.block_size] * self.block_size + positions % self.block_size
        padding = -len(tokens) % self.token_multiple
        ids = np.zeros((3, len(tokens) + padding), dtype=np.int64)
        ids[2] = self.scratch_block * self.block_size
        ids[:, :len(tokens)] = tokens, positions, slots
        ids = torch.from_numpy(ids).to(self.device)
        self.write_slots = ids[2]
        short = lengths <= self.paged_query_limit
        self.paged = self._paged_queries(tables, chunk_of_token, positions, short, padding) if short.any() else None
        first_token = np.concatenate([[0], np.cumsum(lengths)])
        prefill = np.flatnonzero(~short)
        self.attention_batches = [self._attention_batch([chunks[i] for i in prefill], first_token[prefill],
                                                        tables[prefill])] if len(prefill) else []
        self.output_token_index = None if output_token_index is None else torch.tensor(
            output_token_index, dtype=torch.long, device=self.device)
        return ids[:1], ids[1:2]

    def initialize_decode_state(self, chunks: Sequence[StepChunk], num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a decode step (one new token per chunk) padded to `num_rows` rows in the
        fixed decode buffers (num_rows <= num_decode_rows: max_requests rounded up to
        token_multiple): the step a CUDA graph captured for `num_rows` rows replays. Every row's
        next token is sampled. Returns input_ids, position_ids [1, num_rows]; padding rows are token 0 at position 0 in the scratch block."""
        if not len(chunks) <= num_rows <= self.num_decode_rows:
            raise ValueError(f"a decode step of {len(chunks)} requests in {num_rows} rows; "
                             f"at most {self.num_decode_rows} rows (max_requests)")
        self.chunks = list(chunks)
        count = len(chunks)
        positions = np.fromiter((c.start for c in chunks), dtype=np.int64, count=count)
        tables = np.full((num_rows, self.max_blocks_per_request), self.scratch_block, dtype=np.int32)
        tables[:count] = self._block_table_rows(chunks)
        ids = np.zeros((3, num_rows), dtype=np.int64)
        ids[2] = self.scratch_block * self.block_size
        ids[0, :count] = [c.token_ids[c.start] for c in chunks]
        ids[1, :count] = positions
        ids[2, :count] = tables[np.arange(count), positions // self.block_size] * self.block_size \
            + positions % self.block_size
        kv_lengths = np.ones(num_rows, dtype=np.int32)
        kv_lengths[:count] = positions + 1
        self.decode_ids[:, :num_rows].copy_(torch.from_numpy(ids))
        self.decode_kv_lengths[:num_rows].copy_(torch.from_numpy(kv_lengths))
        self.decode_block_table[:num_rows].copy_(torch.from_numpy(tables))
        self.write_slots = self.decode_ids[2, :num_rows]
        self.paged = _PagedQueries(None, self.decode_block_table[:num_rows], self.decode_kv_lengths[:num_rows])
        self.attention_batches = []
        self.output_token_index = None
        return self.decode_ids[0, :num_rows][None], self.decode_ids[1, :num_rows][None]

    def _block_table_rows(self, chunks: Sequence[StepChunk]) -> np.ndarray:
        """int32 [C, max_blocks_per_request]: each chunk's request's blocks, then the scratch block."""
        rows = np.full((len(chunks), self.max_blocks_per_request), self.scratch_block, dtype=np.int32)
        for row, chunk in enumerate(chunks):
            table = self.block_tables[chunk.request_id]
            rows[row, :len(table)] = table
        return rows

    def _paged_queries(self, tables, chunk_of_token, positions, short, padding) -> _PagedQueries:
        """The tokens of the short chunks: their rows of the block tables and key counts."""
        tokens = np.flatnonzero(short[chunk_of_token])
        to_device = lambda array: torch.from_numpy(np.ascontiguousarray(array)).to(self.device)  # noqa: E731
        index = None if len(tokens) == len(positions) and not padding else to_device(tokens)
        return _PagedQueries(index, to_device(tables[chunk_of_token[tokens]]),
                             to_device((positions[tokens] + 1).astype(np.int32)))

    def _attention_batch(self, chunks: Sequence[StepChunk], first_token: Sequence[int],
                         tables: np.ndarray) -> _AttentionBatch:
        num_queries = max(c.end - c.start for c in chunks)
        num_blocks = max(self.blocks_for(c.end) for c in chunks)
        token_index, padded_index = [], []
        query_positions = torch.zeros(len(chunks), num_queries, dtype=torch.long)  # padding: position 0
        for row, (chunk, first) in enumerate(zip(chunks, first_token)):
            count = chunk.end - chunk.start
            token_index += range(first, first + count)
            padded_index += range(row * num_queries, row * num_queries + count)
            query_positions[row, :count] = torch.arange(chunk.start, chunk.end)
        index = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        table = torch.from_numpy(tables[:, :num_blocks].astype(np.int64)).to(self.device)
        return _AttentionBatch(index(token_index), index(padded_index), table, query_positions.to(self.device),
                               num_blocks * self.block_size, (len(chunks), num_queries))

    def attend(self, layer_number: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Store this step's keys and values of layer `layer_number` and attend: q [t, 1, np, hn],
        k and v [t, 1, ng, hn] -> [t, 1, np * hn]; each query sees its request's keys up to its
        own position (causal), cached and new. With values_are_keys `value` is not stored."""
        cache = self.memory_buffer[:, self.layer_slot[layer_number]]  # [num_blocks + 1, bs, ng, hn] each
        keys, values = cache[0], cache[-1]
        t, _, heads, head_dim = query.shape
        groups = key.shape[2]
        keys.view(-1, groups, head_dim).index_copy_(0, self.write_slots, key[:, 0])
        if not self.values_are_keys:
            values.view(-1, groups, head_dim).index_copy_(0, self.write_slots, value[:, 0])
        window, sinks = self.layer_windows.get(layer_number), self.layer_sinks.get(layer_number)
        options = dict(window_left=-1 if window is None else window[0], sinks=sinks)
        paged = self.paged
        if paged is not None and paged.token_index is None:  # every token (a decode step)
            context = paged_attention(query[:, 0], keys, values, paged.block_table, paged.kv_lengths,
                                      self.softmax_scale, **options)
            return context.view(t, 1, heads * head_dim)
        output = query.new_zeros(t, heads, head_dim)  # padding tokens keep zeros
        if paged is not None:
            output[paged.token_index] = paged_attention(query[paged.token_index, 0], keys, values, paged.block_table,
                                                        paged.kv_lengths, self.softmax_scale, **options)
        for batch in self.attention_batches:
            output[batch.token_index] = self._attend_batch(batch, query[:, 0], keys, values, window, sinks)
        return output.view(t, 1, heads * head_dim)

    def _attend_batch(self, batch: _AttentionBatch, query, keys, values, window=None, sinks=None) -> torch.Tensor:
        """query [t, np, hn] -> the context of the batch's tokens [n, np, hn] (causal, within the
        layer's `window`, with its attention `sinks` [np])."""
        rows, num_queries = batch.shape
        heads, head_dim = query.shape[1:]
        padded = query.new_zeros(rows * num_queries, heads, head_dim)
        padded[batch.padded_index] = query[batch.token_index]
        q = padded.view(rows, num_queries, heads, head_dim).transpose(1, 2)  # [R, np, Q, hn]
        # [R, B, bs, ng, hn] -> [R, ng, B * bs, hn]
        k, v = (cache[batch.block_table].flatten(1, 2).transpose(1, 2) for cache in (keys, values))
        with sdpa_kernel(PREFILL_SDPA_BACKENDS):
            context = attend_padded(q, k, v, batch.mask(window), self.softmax_scale, sinks)
        return context.transpose(1, 2).reshape(rows * num_queries, heads, head_dim)[batch.padded_index]

    def run_recurrent(self, layer_number: int, inputs: torch.Tensor, mix) -> torch.Tensor:
        """A recurrent layer's step: inputs [t, 1, c] (the step's tokens, chunks back to back, then
        padding) -> its outputs [t, 1, c']. Each chunk's tokens run through `mix(x [b, n, c],
        state) -> (y [b, n, c'], state)` from the state after the request's first chunk.start
        tokens (None before the first), and the state after them is kept; padding tokens give
        zeros. Single tokens that continue a state (decode, and a chunk's speculative tokens one at
        a time, keeping the state after each) run as one batch per position, their states stacked."""
        outputs = inputs.new_zeros(inputs.shape[0], 1, 0)
        # (row, key, tokens before it) of the single tokens, by position: decode tokens and
        # speculative chunks' first tokens, then each chunk's i-th speculative token
        singles = [[] for _ in range(1 + max((chunk.drafts for chunk in self.chunks), default=0))]
        for chunk, first in zip(self.chunks, accumulate((c.end - c.start for c in self.chunks), initial=0)):
            key, count = (layer_number, chunk.request_id), chunk.end - chunk.start
            state = self._recurrent_state(key, chunk.start)
            head = max(count - chunk.drafts, int(state is None))  # a request's first token has no state to stack
            if head == 1 and state is not None:
                singles[0].append((first, key, chunk.start))
            elif head:  # in pieces ending at the boundaries whose states the prefix cache keeps
                ends = {n - chunk.start for n in self.recurrent_boundaries.get(chunk.request_id, ())}
                done = 0
                for end in sorted({end for end in ends if 0 < end < head} | {head}):
                    y, state = mix(inputs[first + done:first + end].transpose(0, 1), state)
                    self._keep_recurrent_state(key, chunk.start + end, state)
                    outputs = self._place(outputs, slice(first + done, first + end), y.transpose(0, 1))
                    done = end
            for i in range(count - head):
                singles[i + 1].append((first + head + i, key, chunk.start + head + i))
        for batch in filter(None, singles):
            rows = torch.tensor([row for row, _, _ in batch], device=inputs.device)
            states = [self._recurrent_state(key, position) for _, key, position in batch]
            y, stacked = mix(inputs.index_select(0, rows), tuple(torch.cat(parts) for parts in zip(*states)))
            outputs = self._place(outputs, rows, y)  # y [r, 1, c']: a row per request
            for i, (_, key, position) in enumerate(batch):
                self._keep_recurrent_state(key, position + 1, tuple(part[i:i + 1] for part in stacked))
        return outputs

    def _recurrent_state(self, key: tuple, position: int):
        """The state after the request's first `position` tokens (None at 0); a state kept after
        later tokens (rejected drafts) is dropped."""
        states = self.recurrent_states.get(key, {})
        for later in [p for p in states if p > position]:
            del states[later]
        if position == 0:
            return None
        if position not in states:
            raise RuntimeError(f"no recurrent state of layer {key[0]} after {position} tokens of request {key[1]}: "
                               "a chunk continues from a position the context did not keep")
        return states[position]

    def _keep_recurrent_state(self, key: tuple, position: int, state: tuple) -> None:
        layer, request_id = key
        if position in self.recurrent_boundaries.get(request_id, ()):  # for the prefix cache, at commit_step
            self._boundary_states.setdefault((request_id, position), {})[layer] = state
        states = self.recurrent_states.setdefault(key, {})
        states[position] = state
        while len(states) > self.recurrent_states_kept:
            del states[next(iter(states))]

    @staticmethod
    def _place(outputs: torch.Tensor, where, values: torch.Tensor) -> torch.Tensor:
        """outputs [t, 1, c'] (made on the first call, when it has no channels yet) with `values` at
        rows `where`."""
        if outputs.shape[-1] == 0:
            outputs = values.new_zeros(outputs.shape[0], 1, values.shape[-1])
        outputs[where] = values
        return outputs

    def output_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The step's final hidden states [t, 1, h] -> those of the tokens whose next token the
        step samples [r, 1, h] (all of them kept as `self.hidden_states` with keep_hidden_states)."""
        if self.keep_hidden_states:
            self.hidden_states = hidden_states
        if self.output_token_index is None:
            return hidden_states
        return hidden_states.index_select(0, self.output_token_index)

    def commit_step(self, chunks: Sequence[StepChunk] | None = None) -> None:
        """After the step's forward: with prefix caching, register the blocks it filled. chunks:
        the step's chunks cut to their final tokens (rejected speculative tokens left out);
        default: the step's chunks."""
        if self.config.prefix_caching:
            self._register_full_blocks(self.chunks if chunks is None else chunks)
        for (request_id, position), states in self._boundary_states.items():
            hashes = self.block_hashes.get(request_id, [])
            if len(states) == len(self.recurrent_layers) and len(hashes) * self.block_size >= position:
                self.recurrent_prefixes.put(hashes[position // self.block_size - 1], states)
                self.recurrent_boundaries[request_id].discard(position)
        self._boundary_states.clear()

    def _register_full_blocks(self, chunks: Sequence[StepChunk]) -> None:
        for chunk in chunks:
            table, hashes = self.block_tables[chunk.request_id], self.block_hashes[chunk.request_id]
            full = chunk.end // self.block_size
            new = self._hashes(chunk.token_ids, len(hashes), full, parent=hashes[-1] if hashes else None)
            for block, hash_ in zip(table[len(hashes):full], new):
                self.allocator.register(block, hash_)
            hashes += new
