"""Core attention: softmax(q k^T * scale + mask) v over this rank's heads.

Masks follow Megatron: a boolean tensor broadcastable to [b, np, sq, sk] with True = masked out;
None with a causal mask type means the lower triangle. Two variants change which keys a query
sees and how its softmax is normalised:

- Sliding window (`window_size` = (left, right) on the layers `window_attn_skip_freq` picks):
  query i sees keys i - left .. i + right (-1: unbounded on that side); a causal layer also
  hides every key after i, so a causal model uses the left window only.
- Attention sink (`softmax_type`): every query's softmax gets one more logit, z (0 for
  'off-by-one', a learned `softmax_offset` per head for 'learnable'), that attends to nothing:
  p_j = exp(s_j) / (exp(z) + sum_k exp(s_k)).

`_attend` picks the kernel, all with one meaning:
- `scaled_dot_product_attention` for plain attention (flash, cuDNN or memory-efficient kernels on
  GPU, see `_SDPA_BACKENDS`);
- cuDNN's fused attention with the window as a band native to the kernel
  (`cudnn_window_attention`, through the cuDNN frontend's Python package, `pip install
  teratron[cudnn]`) for a causal window on CUDA without dropout or sink, 16-bit, head sizes cuDNN
  supports, `attention_backend` auto or fused (flash keeps windows off cuDNN): its kernels skip
  the key tiles outside the band;
- the banded path (`banded_attention`) for a causal window of at least 256 keys without dropout
  on the CPU (a sink allowed): chunks of the window's width on aten's CPU flash kernel, merged by
  log-sum-exp, so nothing of size s x s is built;
- FlexAttention (compiled) for the other windows and sinks on CUDA, and for every CUDA window
  when the cuDNN frontend is not installed: the window is a block mask, built once per (sq, sk,
  causal, window) and cached, so windowed layers skip the blocks outside the band and nothing of
  size s x s is built; the sink rescales the plain output by its log-sum-exp L:
  sum_k exp(s_k) / (exp(z) + sum_k exp(s_k)) = sigmoid(L - z), so out_sink = out * sigmoid(L - z),
  differentiable in the scores (through L) and in z;
- the explicit reference (`attention_backend` unfused / local, and those windows or sinks on CPU,
  where FlexAttention has no backward): it materialises the scores, softmax in fp32 when
  `attention_softmax_in_fp32`, the sink as an extra column.
Dropout of attention probabilities runs under the tensor-parallel RNG tracker, since every TP
rank holds different heads; FlexAttention has none, so a window or sink with dropout on CUDA is
refused unless the backend is the reference.

With `qk_clip` or `log_max_attention_logit`, a training forward also records the largest
pre-softmax logit of each head (`current_max_attn_logits`, Megatron's name), for QK-clip
(`teratron.optimizer.qk_clip`). No kernel above returns it (the log-sum-exp only bounds it), so
`max_attention_logits` computes q k^T once more under no_grad, a chunk of queries at a time over
the keys they may see: one extra QK^T GEMM in the forward, nothing of size s x s.
"""

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from teratron import fusions, tensor_parallel
from teratron.process_groups import get_pg_rank, get_pg_size
from teratron.tensor_parallel.layers import param_device, set_tensor_model_parallel_attributes
from teratron.tensor_parallel.utils import shard_tensor
from teratron.topology import resolve_pg_collection
from teratron.transformer import banded_attention, context_parallel, cudnn_window_attention
from teratron.transformer.attention_masks import allowed_keys, max_attention_logits
from teratron.transformer.enums import AttnBackend, AttnMaskType
from teratron.transformer.transformer_config import pattern_layer_number

_REFERENCE_BACKENDS = (AttnBackend.unfused, AttnBackend.local)
# On CUDA, `flash` pins SDPA to the flash kernel and `fused` to cuDNN's fused attention (what
# Megatron's 'fused' means: Transformer Engine's cuDNN backend); `auto` keeps SDPA's own choice.
_SDPA_BACKENDS = {
    AttnBackend.flash: [SDPBackend.FLASH_ATTENTION],
    AttnBackend.fused: [SDPBackend.CUDNN_ATTENTION],
}
# Backends under which a causal window runs on cuDNN's native band (flash keeps it off cuDNN).
_CUDNN_WINDOW_BACKENDS = (AttnBackend.auto, AttnBackend.fused)


def _sdpa_backends(backend: AttnBackend, on_cuda: bool):
    if on_cuda and backend in _SDPA_BACKENDS:
        return _pinned_sdpa(backend)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _pinned_sdpa(backend: AttnBackend):
    with sdpa_kernel(_SDPA_BACKENDS[backend]):
        try:
            yield
        except RuntimeError as error:
            if "No available kernel" not in str(error):
                raise
            raise RuntimeError(
                f"attention_backend={backend.name}: SDPA's {backend.name} kernel cannot run these inputs (e.g. fp32, "
                "an explicit attention mask, or an unsupported head size); use attention_backend auto") from error


def is_layer_window_attention(window_size, window_attn_skip_freq, layer_number: int) -> bool:
    """Whether layer `layer_number` (1-based, global) attends through the sliding window: every
    layer when window_attn_skip_freq is None, all but every N-th for an int N, those marked 1
    in a per-layer list (Megatron's rule)."""
    if window_size is None:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    return bool(window_attn_skip_freq[layer_number - 1])


def _create_block_mask(mask_mod, batch, sq: int, sk: int, device):
    # Compiled on CUDA, so the mask is evaluated block by block instead of as one s x s tensor.
    create = fusions.fused(create_block_mask) if torch.device(device).type == "cuda" else create_block_mask
    return create(mask_mod, batch, None, sq, sk, device=device)


@functools.lru_cache(maxsize=64)
def _cached_block_mask(sq: int, sk: int, causal: bool, window, device: str):
    def mask_mod(b, h, q_idx, kv_idx):
        return allowed_keys(q_idx, kv_idx, causal, window)
    return _create_block_mask(mask_mod, None, sq, sk, device)


@torch.compiler.disable
def block_mask_for(sq: int, sk: int, causal: bool, window, device, attention_mask=None):
    """The FlexAttention block mask of `allowed_keys`, cached per (sq, sk, causal, window, device);
    with an explicit `attention_mask` (bool [b or 1, 1, sq, sk], True = masked out) also hiding
    what it masks, built for that mask. Runs outside torch.compile: a compiled layer looks the
    cached mask up instead of rebuilding it in its graph."""
    if attention_mask is None:
        return _cached_block_mask(sq, sk, causal, window, str(device))
    masked = attention_mask.expand(attention_mask.shape[0], 1, sq, sk)

    def mask_mod(b, h, q_idx, kv_idx):
        return ~masked[b, 0, q_idx, kv_idx] & allowed_keys(q_idx, kv_idx, causal, window)
    return _create_block_mask(mask_mod, masked.shape[0], sq, sk, device)


def flex_attention_with_sink(q, k, v, block_mask, scale: float, sink=None):
    """q [b, np, sq, hn], k and v [b, ng, sk, hn] -> [b, np, sq, hn]: attention over the keys
    `block_mask` allows, with the extra softmax logit sink [np] per head when given (see the
    module docstring). Compiled on CUDA; eager elsewhere (CPU: forward only)."""
    flex = fusions.fused(flex_attention) if q.is_cuda else flex_attention
    gqa = q.shape[1] != k.shape[1]
    if sink is None:
        return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    out, aux = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    kept = torch.sigmoid(aux.lse.float() - sink.float().view(1, -1, 1))  # [b, np, sq]: 1 - the sink's share
    # In out's dtype: the product's backward then keeps out (which FlexAttention keeps anyway) and
    # the small `kept`, not an fp32 copy of the output.
    return out * kept.unsqueeze(-1).to(out.dtype)


class DotProductAttention(torch.nn.Module):
    """Takes q [sq, b, np, hn] and k, v [sk, b, ng, hn] (ng query groups); returns [sq, b, np * hn].

    `window_size`: this layer's (left, right) window or None; `softmax_offset`: the sink logits of
    this rank's heads [np] (a buffer of zeros for 'off-by-one', a TP-sharded parameter for
    'learnable') or None."""

    def __init__(self, config, layer_number: int, attn_mask_type=AttnMaskType.causal,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.config = config
        self.attn_mask_type = attn_mask_type
        self.use_reference = config.attention_backend in _REFERENCE_BACKENDS
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if softmax_scale is None:
            softmax_scale = config.softmax_scale
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(config.kv_channels)
        self.softmax_scale = softmax_scale
        # Query-key layer scaling divides the scores by the layer number before the softmax input
        # is upcast and multiplies it back afterwards: the same math, a smaller fp16 range.
        self.layer_scale = max(1, layer_number) if config.apply_query_key_layer_scaling else 1
        use_window = is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                               pattern_layer_number(config, layer_number))
        self.window_size = config.window_size if use_window else None
        pg_collection = resolve_pg_collection(pg_collection)
        self._build_softmax_offset(config, pg_collection.tp)
        self.context_parallel = context_parallel.context_parallel_config(
            config, layer_number, cp_comm_type, pg_collection, self.softmax_scale, self.window_size,
            self.use_reference)
        self.track_max_logit = config.qk_clip or config.log_max_attention_logit
        if self.track_max_logit:
            # The largest logit of each of this rank's heads since QKClip.reduce() last took it.
            heads = config.num_attention_heads // get_pg_size(pg_collection.tp)
            self.register_buffer("current_max_attn_logits", torch.full((heads,), float("-inf"),
                                 device=param_device(config)), persistent=False)

    def _build_softmax_offset(self, config, tp):
        if config.softmax_type == "vanilla":
            self.softmax_offset = None
            return
        heads, device = config.num_attention_heads // get_pg_size(tp), param_device(config)
        if config.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, device=device), persistent=False)
            return
        self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        if config.perform_initialization:
            # Layout-invariant: every rank draws all heads' logits and keeps its own.
            full = torch.empty(config.num_attention_heads, dtype=torch.float32, device=device)
            config.init_method(full)
            with torch.no_grad():
                self.softmax_offset.copy_(shard_tensor(full, 0, 1, get_pg_rank(tp), get_pg_size(tp)))

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal_type = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        dropout_p = self.dropout_p if self.training else 0.0
        if context_parallel.runs_here(self.context_parallel, attention_mask):  # CP or packed documents
            record = self.current_max_attn_logits if self.track_max_logit and self.training else None
            return context_parallel.context_parallel_attention(
                self.context_parallel, query, key, value, attention_mask, causal_type, self.softmax_offset, dropout_p,
                record)
        is_causal = attention_mask is None and causal_type
        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.track_max_logit and self.training:
            self._track_max_logit(q, k, attention_mask, is_causal)
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
            out = self._attend(q, k, v, attention_mask, is_causal, dropout_p)
        b, n, s, hn = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * hn)

    @torch.no_grad()
    def _track_max_logit(self, q, k, attention_mask, is_causal):
        logits = max_attention_logits(q, k, self.softmax_scale, is_causal, self.window_size, attention_mask)
        self.current_max_attn_logits.copy_(torch.maximum(self.current_max_attn_logits, logits))

    def _attend(self, q, k, v, attention_mask, is_causal, dropout_p):
        """The kernel: SDPA for plain attention, cuDNN's native band for a causal window on CUDA,
        the banded dense kernels for a wide causal window on the CPU, FlexAttention for other
        windows or a sink on CUDA, the reference for the unfused backend and for those windows or
        sinks on the CPU."""
        if self._runs_cudnn_window(q, k, v, is_causal, dropout_p):
            return cudnn_window_attention.cudnn_window_attention(q, k, v, self.window_size[0], self.softmax_scale)
        if banded_attention.runs_banded(self.window_size, is_causal, dropout_p, q, k, v, self.use_reference):
            return banded_attention.banded_attention(q, k, v, self.window_size[0], self.softmax_scale,
                                                     self.softmax_offset)
        plain = self.window_size is None and self.softmax_offset is None
        if self.use_reference or (not plain and not q.is_cuda):
            return self._reference(q, k, v, attention_mask, is_causal, dropout_p)
        if plain:
            with _sdpa_backends(self.config.attention_backend, q.is_cuda):
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
                    dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale,
                    enable_gqa=q.shape[1] != k.shape[1],
                )
        if dropout_p > 0:
            raise ValueError(f"attention_dropout={dropout_p}: FlexAttention (sliding windows, attention sinks) has "
                             "no attention dropout; set attention_dropout to 0 or attention_backend to 'unfused'")
        block_mask = block_mask_for(q.shape[2], k.shape[2], is_causal, self.window_size, q.device, attention_mask)
        return flex_attention_with_sink(q, k, v, block_mask, self.softmax_scale, self.softmax_offset)

    def _runs_cudnn_window(self, q, k, v, is_causal, dropout_p) -> bool:
        return (self.config.attention_backend in _CUDNN_WINDOW_BACKENDS
                and cudnn_window_attention.available(q, k, v, self.window_size, is_causal, dropout_p,
                                                     self.softmax_offset))

    def _reference(self, q, k, v, attention_mask, is_causal, dropout_p):
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (self.softmax_scale / self.layer_scale)
        if self.config.attention_softmax_in_fp32:
            scores = scores.float()
        scores = scores * self.layer_scale
        if is_causal or self.window_size is not None:
            sq, sk = scores.shape[-2:]
            positions = functools.partial(torch.arange, device=scores.device)
            outside = ~allowed_keys(positions(sq)[:, None], positions(sk)[None, :], is_causal, self.window_size)
            attention_mask = outside if attention_mask is None else attention_mask | outside
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = self._softmax(scores).to(v.dtype)
        if attention_mask is not None:
            # A query that may attend to nothing gets a zero context, as from SDPA (not NaN).
            probs = probs.masked_fill(attention_mask.all(dim=-1, keepdim=True), 0.0)
        probs = F.dropout(probs, p=dropout_p, training=dropout_p > 0)
        return torch.matmul(probs, v)

    def _softmax(self, scores):
        """Softmax over the keys [b, np, sq, sk]; with a sink, over the keys and the sink logit."""
        if self.softmax_offset is None:
            return torch.softmax(scores, dim=-1)
        b, heads, sq, _ = scores.shape
        sink = self.softmax_offset.to(scores.dtype).view(1, heads, 1, 1).expand(b, heads, sq, 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
