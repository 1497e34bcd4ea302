"""DynamicInferenceEngine: continuous batching over a paged KV cache (Megatron's
`inference.engines.dynamic_engine`).

Each `step()` is one forward of the model over up to `max_tokens_per_step` new tokens: first one
token (decode) or the next prefill chunk of every running request, oldest first, then the first
chunks of waiting requests, first come first served, while tokens, request slots and KV blocks
last. A request whose prefill reaches its last token samples its next token in the same step.
Finished requests free their blocks at once; new requests join between steps. Decode steps replay
CUDA graphs (`inference.cuda_graphs`); other steps run eagerly.

Async scheduling: `step()` launches step n's forward and sampling, then, while the device runs
them, turns step n-1's tokens into outputs (detokenizing, stop strings), and only then waits for
step n's tokens. Outputs therefore come one `step()` after their tokens. A request whose stop
string is found this way has a token in flight in step n: it is dropped, as are any tokens after
the stop string's in step n-1 (speculative steps make several). Stop tokens, the end of document
and the length limit are checked as tokens arrive, so those requests free their blocks at once.

Memory: a request takes the blocks of its next chunk only (and shares cached prefix blocks with
prefix caching). When a running request needs a block and none is left, the newest running
request is preempted: it gives its blocks back and waits at the head of the queue, keeping its
tokens, which it recomputes when readmitted. The oldest request alone always fits (add_request
refuses any request that could not), so every step makes progress.

Speculative decoding (`num_speculative_tokens` n): a request in decode gets n draft tokens from
the draft model (`DraftProposer`), or without one from the model's own multi-token-prediction
layers (`MTPProposer`, at most mtp_num_layers drafts: one per depth; the context then keeps each
step's final hidden states for it, CUDA-graph replays included), and its chunk in the target's
step is its last token plus the drafts. At each of those positions the target chooses a token: a greedy
request's argmax; a sampled request's is the draft token with probability min(1, p/q) (p the
target's and q the draft's distribution, both after the request's temperature, top-k and top-p),
else a token from norm(max(0, p - q)), never the draft token (speculative sampling, which makes
the output distributed exactly as the target's sampling). The longest prefix where the target's
tokens equal the drafts is accepted, plus the target's token at the first mismatch (or after the
last draft). Both caches are cut back to the accepted tokens; recurrent layers (Mamba-2, Gated
DeltaNet) verify the drafts one position at a time and continue from the state after the last
accepted token (`DynamicInferenceContext.run_recurrent`).
"""

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

import torch

from teratron.inference.config import InferenceConfig
from teratron.inference.contexts.dynamic_context import DynamicInferenceContext, StepChunk
from teratron.inference.cuda_graphs import DecodeCudaGraphs, cuda_graph_batch_sizes
from teratron.inference.detokenizer import IncrementalDetokenizer
from teratron.inference.engines.mtp_proposer import MTPProposer
from teratron.inference.engines.speculative import DraftProposer, DraftRequest, Proposal
from teratron.inference.refit import refit_weights
from teratron.inference.sampling import Sampler
from teratron.inference.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    """The request's own list (never changed): not to be modified."""
    token_ids: list[int]
    """Every generated token so far (a stop or end-of-document token included)."""
    new_token_ids: list[int]
    """The tokens this step added."""
    text: str
    """The generated text so far (a stop string and what follows it trimmed)."""
    new_text: str
    """What this step added to text (for streaming)."""
    finished: bool
    finish_reason: Optional[str]
    """One of "stop" (end of document, a stop token or stop string), "length", "abort"."""
    log_probs: Optional[list[float]] = None
    top_n_logprobs: Optional[list[dict[int, float]]] = None


@dataclass(eq=False)
class _Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detokenizer: IncrementalDetokenizer
    token_ids: list[int]
    """Prompt and generated tokens."""
    num_computed: int = 0
    """Tokens whose keys and values are in the cache."""
    text: str = ""
    log_probs: Optional[list[float]] = None
    top_n_logprobs: Optional[list[dict[int, float]]] = None
    finish_reason: Optional[str] = None
    new_token_ids: list[int] = field(default_factory=list)
    """The tokens the last step added, reported by the next `step` (see `_emit`)."""
    new_text: str = ""
    draft_probs: Optional[torch.Tensor] = None
    """[drafts, V]: the draft's distribution each of this step's draft tokens was drawn from (a
    sampled request; None for a greedy one)."""

    @property
    def generated(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    def output(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt_token_ids, self.generated, self.new_token_ids,
                             self.text, self.new_text, self.finish_reason is not None, self.finish_reason,
                             None if self.log_probs is None else list(self.log_probs),
                             None if self.top_n_logprobs is None else list(self.top_n_logprobs))


class DynamicInferenceEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: InferenceConfig, seed: int = 0,
                 draft_model: Optional[torch.nn.Module] = None):
        """model: a GPTModel holding every layer (one pipeline stage), in eval mode from here on;
        tokenizer: a teratron tokenizer (text in and out, the end-of-document id); draft_model: a
        smaller GPTModel with the same vocabulary proposing config.num_speculative_tokens tokens a
        step (speculative decoding), or None: then a model with MTP layers drafts for itself when
        num_speculative_tokens >= 1."""
        self.recurrent = any(getattr(m, "recurrent", False) for m in model.modules())
        if draft_model is not None and config.num_speculative_tokens == 0:
            raise ValueError("a draft model needs num_speculative_tokens >= 1 (draft tokens per step); set it or "
                             "drop the draft model")
        if config.num_speculative_tokens and draft_model is None and getattr(model, "mtp", None) is None:
            raise ValueError(f"num_speculative_tokens={config.num_speculative_tokens} needs a draft model or a model "
                             "with multi-token-prediction layers (trained with --mtp-num-layers); give one, or set 0")
        if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
            raise ValueError("DynamicInferenceEngine runs a model of one pipeline stage; load it with "
                             "--pipeline-model-parallel-size 1")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.context = DynamicInferenceContext.from_model(model, config)
        self.max_seq_length = config.max_seq_length or model.max_sequence_length
        self.vocab_size = model.unpadded_vocab_size or model.vocab_size
        self.eod = _eod(tokenizer)
        self.sampler = Sampler(self.vocab_size)
        self.draft, self.num_speculative_tokens = None, config.num_speculative_tokens
        if draft_model is not None:
            self.draft = DraftProposer(draft_model, config, self.vocab_size)
        elif config.num_speculative_tokens:
            self.draft = MTPProposer(model, config, self.vocab_size)
            self.num_speculative_tokens = min(config.num_speculative_tokens, self.draft.depths)
            self.context.keep_hidden_states = True  # the proposer reads the target's (graphs capture them)
        self.cuda_graphs = self._capture_cuda_graphs()
        self.generator = torch.Generator().manual_seed(seed)  # seeds of requests that bring none
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []  # holding KV blocks, oldest first
        self.aborted: list[_Request] = []  # to report in the next step
        self.unemitted: dict[int, _Request] = {}  # requests with tokens the next step reports
        self.next_request_id = 0
        self.num_tokens_computed = 0
        """Tokens run through the model so far (prefill and decode)."""
        self.num_forwards = 0
        """Forward passes of the (target) model so far."""
        self.num_draft_tokens_proposed = 0
        self.num_draft_tokens_accepted = 0

    def _capture_cuda_graphs(self) -> Optional[DecodeCudaGraphs]:
        """Decode CUDA graphs on a CUDA device, unless config.num_cuda_graphs is 0 or the model
        has MoE layers (data-dependent shapes) or recurrent layers (their states per request)."""
        if (self.context.device.type != "cuda" or self.config.num_cuda_graphs == 0
                or getattr(self.model.config, "num_moe_experts", None) or self.recurrent):
            return None
        sizes = cuda_graph_batch_sizes(self.config.max_requests, self.config.num_cuda_graphs)
        return DecodeCudaGraphs(self.model, self.context, sizes)

    # Requests.

    def add_request(self, prompt: Union[str, Sequence[int]], sampling_params: Optional[SamplingParams] = None) -> int:
        """Queue a prompt (text or token ids); returns its request id. Raises ValueError when the
        request could never run: no tokens, an id outside the vocabulary, or prompt plus
        num_tokens_to_generate longer than max_seq_length or than the whole KV buffer."""
        params = sampling_params or SamplingParams()
        token_ids = self.tokenizer.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_fits(token_ids, params)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self.generator))
        request = _Request(self.next_request_id, token_ids, params,
                           torch.Generator(device=self.context.device).manual_seed(seed),
                           IncrementalDetokenizer(self.tokenizer, params.stop, token_ids), list(token_ids),
                           log_probs=[] if params.return_log_probs else None,
                           top_n_logprobs=[] if params.top_n_logprobs else None)
        self.next_request_id += 1
        self.waiting.append(request)
        return request.request_id

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt has no tokens; give at least one")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        length = len(token_ids) + params.num_tokens_to_generate
        if length > self.max_seq_length:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + num_tokens_to_generate "
                             f"({params.num_tokens_to_generate}) exceeds max_seq_length {self.max_seq_length}; "
                             "shorten the request or raise --inference-max-seq-length")
        blocks = self.context.blocks_for(length - 1)  # the last token is never fed back
        if blocks > self.context.num_blocks:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + num_tokens_to_generate "
                             f"({params.num_tokens_to_generate}) needs {blocks} KV blocks, the buffer holds "
                             f"{self.context.num_blocks}; shorten the request or raise "
                             "--inference-dynamic-batching-buffer-size-gb")

    def abort(self, request_id: int) -> None:
        """Stop a request and free its blocks; its next output has finish_reason "abort". A request
        that has finished (or is unknown) is left alone."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    if queue is self.running:
                        self._release(request)
                    queue.remove(request)
                    request.finish_reason, request.new_token_ids, request.new_text = "abort", [], ""
                    self.aborted.append(request)
                    return

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.aborted or self.unemitted)

    # Steps.

    def step(self) -> list[RequestOutput]:
        """One engine step n: schedule it, launch its forward and sampling, and while the device
        runs them turn the tokens of step n-1 into outputs (text, stop strings: `_emit`); then wait
        for step n's tokens and apply them (`_apply_tokens`). Returns the outputs of the requests
        that got tokens in step n-1 or were aborted since the last call: a request's tokens are
        reported one step after they are made (async scheduling: the host's output work overlaps
        the device's next step)."""
        outputs = [request.output() for request in self.aborted]
        self.aborted = []
        scheduled = self._schedule()
        if not scheduled and self.waiting and not self.unemitted:  # add_request admits only what fits
            raise RuntimeError(f"no request could be scheduled with {len(self.waiting)} waiting")
        if self.draft is not None and scheduled:
            scheduled = self._add_draft_tokens(scheduled)
        launched = self._launch(scheduled) if scheduled else None
        outputs += self._emit()
        if launched is not None:
            self._take(*launched)
        return outputs

    def _launch(self, scheduled: list[tuple[_Request, StepChunk]]) -> tuple:
        """Start the step's forward and sampling on the device; what `_take` needs to finish it."""
        sampling, rows, end = [], [], 0
        for request, chunk in scheduled:
            end += chunk.end - chunk.start
            if chunk.end >= len(request.token_ids):  # its last token (and any drafts) run
                sampling.append((request, chunk))
                rows += range(end - 1 - (chunk.end - len(request.token_ids)), end)
            else:
                request.num_computed = chunk.end
        chunks = [chunk for _, chunk in scheduled]
        logits = self._forward(chunks, rows)  # [len(rows), V']
        if self.context.keep_hidden_states:
            self.draft.observe(chunks, self.context.hidden_states)
        self.num_forwards += 1
        self.num_tokens_computed += end
        samples = self._sample(sampling, logits.float()) if sampling else None
        return scheduled, sampling, samples

    def _take(self, scheduled, sampling, samples) -> None:
        """Wait for the step's tokens; accept (drafts), register cached blocks, and append them to
        their requests, leaving out the requests that finished meanwhile (a stop string found by
        `_emit` while the device ran this step: its token here is dropped)."""
        tokens = self._split_samples(sampling, *samples) if sampling else []
        live = [(request, chunk, new) for (request, chunk), new in zip(sampling, tokens) if request.finish_reason is None]
        accepted = [self._accept(request, chunk, new) for request, chunk, new in live]
        if self.config.prefix_caching:  # register the blocks filled by final tokens
            self.context.commit_step([replace(chunk, end=request.num_computed) for request, chunk in scheduled
                                      if request.finish_reason is None])
        for (request, _, _), (new, log_probs, top_n) in zip(live, accepted):
            self._apply_tokens(request, new, log_probs, top_n)
        if self.context.kv_window is not None:  # sliding windows on every layer: bounded KV
            for request in self.running:
                self.context.release_out_of_window(request.request_id, request.num_computed - self.context.kv_window)

    def _forward(self, chunks: list[StepChunk], output_rows: list[int]) -> torch.Tensor:
        """Run the step's chunks through the model; the logits [len(output_rows), V'] of the step
        tokens `output_rows`. A decode step (every chunk one token, sampled) replays the smallest
        CUDA graph that holds it; other steps run eagerly."""
        decode = len(output_rows) == len(chunks) and all(c.end - c.start == 1 for c in chunks)
        rows = self.cuda_graphs.rows_for(len(chunks)) if decode and self.cuda_graphs is not None else None
        if rows is not None:
            self.context.initialize_decode_state(chunks, rows)
            return self.cuda_graphs.replay(rows)[:len(chunks)]
        input_ids, position_ids = self.context.initialize_attention_state(chunks, output_rows)
        with torch.no_grad():
            return self.model(input_ids, position_ids, None, inference_context=self.context,
                              runtime_gather_output=True)[0]

    def _sample(self, sampling: list[tuple[_Request, StepChunk]], logits: torch.Tensor) -> tuple:
        """logits [r, V']: the next token after each request's last token and after each of its draft
        tokens. Launches the sampling; returns (tokens [r], log-probs [r] or None, top-n or None)."""
        per_row = [1 + chunk.end - len(request.token_ids) for request, chunk in sampling]
        params = [request.params for (request, _), rows in zip(sampling, per_row) for _ in range(rows)]
        generators = [request.generator for (request, _), rows in zip(sampling, per_row) for _ in range(rows)]
        drafts = [draft for request, chunk in sampling for draft in self._drafts_to_verify(request, chunk)]
        return self.sampler.sample(logits, params, generators, drafts)

    def _split_samples(self, sampling: list[tuple[_Request, StepChunk]], tokens, log_probs, top_n) -> list[tuple]:
        """Per request of `sampling`: (tokens, their log-probs or None, their top-n or None)."""
        tokens = tokens.tolist()  # the step's one wait for the device
        log_probs = log_probs.tolist() if log_probs is not None else None
        result, first = [], 0
        for request, chunk in sampling:
            rows_of = slice(first, first + 1 + chunk.end - len(request.token_ids))
            result.append((tokens[rows_of], None if request.log_probs is None else log_probs[rows_of],
                           None if request.top_n_logprobs is None else top_n[rows_of]))
            first = rows_of.stop
        return result

    def _drafts_to_verify(self, request: _Request, chunk: StepChunk) -> list[Optional[tuple[int, torch.Tensor]]]:
        """Per row of the request in `_sample`: (draft token, the draft's distribution it was drawn
        from) for a sampled request's draft token, else None (greedy drafts are compared as they are)."""
        drafts = chunk.token_ids[len(request.token_ids):chunk.end]
        if not drafts or request.draft_probs is None:
            return [None] * (1 + len(drafts))
        return [*zip(drafts, request.draft_probs), None]

    def _accept(self, request: _Request, chunk: StepChunk, sampled: tuple) -> tuple:
        """Keep the target's tokens up to its first disagreement with the draft tokens of `chunk`
        (all of them without drafts): for a sampled request the target's token at a draft's position
        is the draft token if speculative sampling kept it, else a different one. Cut both caches
        back to the request's final tokens."""
        tokens, log_probs, top_n = sampled
        drafts = chunk.token_ids[len(request.token_ids):chunk.end]
        request.draft_probs = None  # verified
        accepted = 0
        while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
            accepted += 1
        request.num_computed = len(request.token_ids) + accepted
        if self.draft is not None:  # blocks were reserved for every draft token asked for
            self.num_draft_tokens_proposed += len(drafts)
            self.num_draft_tokens_accepted += accepted
            self.context.truncate(request.request_id, request.num_computed)
            self.draft.rollback(request.request_id, request.num_computed)
        keep = accepted + 1
        return tokens[:keep], log_probs and log_probs[:keep], top_n and top_n[:keep]  # None stays None

    def _apply_tokens(self, request: _Request, tokens: list[int], log_probs, top_n) -> None:
        """Append a step's tokens one by one until one finishes the request (a stop token, the end
        of document, its length); a finished request gives its blocks back at once. Their text
        (and stop strings) comes in the next step's `_emit`."""
        for i, token in enumerate(tokens):
            request.token_ids.append(token)
            request.new_token_ids.append(token)
            if request.log_probs is not None:
                request.log_probs.append(log_probs[i])
            if request.top_n_logprobs is not None:
                request.top_n_logprobs.append(top_n[i])
            if self._is_stop_token(request, token):
                request.finish_reason = "stop"
            elif len(request.generated) >= request.params.num_tokens_to_generate:
                request.finish_reason = "length"
            if request.finish_reason is not None:
                self._finish(request)
                break
        self.unemitted[request.request_id] = request

    def _emit(self) -> list[RequestOutput]:
        """The outputs of the tokens the last step applied: their text, detokenized one token at a
        time so that a stop string ends its request at its token (the tokens after it are dropped,
        and so is the token the request gets in the step running now)."""
        outputs = []
        for request in self.unemitted.values():
            if request.finish_reason == "abort":
                continue  # reported by abort
            new_ids = text_ids = request.new_token_ids
            if new_ids and self._is_stop_token(request, new_ids[-1]):
                text_ids = new_ids[:-1]  # a stop token is not text
            request.new_text = ""
            for i, token in enumerate(text_ids):
                new_text, stopped = request.detokenizer.add([token])
                request.new_text += new_text
                if stopped:
                    self._drop_tokens_after(request, len(new_ids) - i - 1)
                    request.finish_reason = "stop"
                    self._finish(request)
                    break
            if request.finish_reason is not None:
                request.new_text += request.detokenizer.flush()
            request.text = request.detokenizer.text
            outputs.append(request.output())
            request.new_token_ids = []
        self.unemitted = {}
        return outputs

    def _drop_tokens_after(self, request: _Request, count: int) -> None:
        """Forget the request's last `count` tokens (those after the token that completed a stop string)."""
        if count:
            del request.token_ids[-count:], request.new_token_ids[-count:]
            for values in (request.log_probs, request.top_n_logprobs):
                if values is not None:
                    del values[-count:]

    def _is_stop_token(self, request: _Request, token: int) -> bool:
        return token in request.params.stop_token_ids or (token == self.eod and not request.params.ignore_eod)

    def _finish(self, request: _Request) -> None:
        """A request that has just finished gives its blocks back and leaves the queues."""
        if request in self.running:
            self._release(request)
            self.running.remove(request)
        elif request in self.waiting:  # preempted in the step being scheduled
            self.waiting.remove(request)

    def _release(self, request: _Request) -> None:
        self.context.release(request.request_id)
        if self.draft is not None:
            self.draft.release(request.request_id)

    # Scheduling.

    def _schedule(self) -> list[tuple[_Request, StepChunk]]:
        """This step's chunks: running requests first, then waiting ones (none after a preemption,
        which would only bring back what was just given up)."""
        budget = self.config.max_tokens_per_step
        scheduled, preempted = [], False
        draft_slots = self.draft.open_slots() if self.draft is not None else 0
        index = 0
        while index < len(self.running) and budget:
            request = self.running[index]
            drafts = self._num_drafts_wanted(request)
            if drafts and not self.draft.holds(request.request_id):  # room for drafts only where they can come
                if draft_slots > 0:
                    draft_slots -= 1
                else:
                    drafts = 0
            wanted = len(request.token_ids) - request.num_computed + drafts
            count = self._fit(request, min(wanted, budget))
            if count == 0:
                self._preempt(self.running[-1])
                preempted = True
                continue  # the same index again, or past the end if it was this request
            scheduled.append((request, self._reserve(request, request.num_computed, count)))
            budget -= count
            index += 1
        while not preempted and self.waiting and budget and len(self.running) < self.context.max_requests:
            request = self.waiting[0]
            chunk = self._admit(request, budget)
            if chunk is None:
                break
            scheduled.append((request, chunk))
            budget -= chunk.end - chunk.start
        return scheduled

    def _num_drafts_wanted(self, request: _Request) -> int:
        """Draft tokens for a request in decode; none past its last generated token. `_schedule`
        reserves none for a request new to the draft once the draft has no open slot (a hybrid draft
        may hold fewer requests than the target runs): its blocks would wait for drafts that cannot come."""
        if self.draft is None or request.num_computed < len(request.token_ids) - 1:
            return 0
        left = request.params.num_tokens_to_generate - len(request.generated)
        return min(self.num_speculative_tokens, left - 1)

    def _add_draft_tokens(self, scheduled: list[tuple[_Request, StepChunk]]) -> list[tuple[_Request, StepChunk]]:
        """Extend the decode chunks that have room for drafts with the draft model's proposals (the
        chunks' blocks are reserved for all of them; fewer may come)."""
        wanted = [DraftRequest(request.request_id, request.token_ids, chunk.end - len(request.token_ids),
                               request.params, request.generator)
                  for request, chunk in scheduled if chunk.end > len(request.token_ids)]
        proposals = self.draft.propose(wanted) if wanted else {}
        extended = []
        for request, chunk in scheduled:
            if chunk.end > len(request.token_ids):
                proposal = proposals.get(request.request_id, Proposal([], None))
                request.draft_probs = proposal.probs
                chunk = StepChunk(request.request_id, request.token_ids + proposal.token_ids, chunk.start,
                                  len(request.token_ids) + len(proposal.token_ids), drafts=len(proposal.token_ids))
            extended.append((request, chunk))
        return extended

    def _fit(self, request: _Request, count: int) -> int:
        """The most of `count` next tokens of a running request its blocks and the free ones hold."""
        table = self.context.block_tables[request.request_id]
        room = (len(table) + self.context.num_allocatable_blocks()) * self.context.block_size - request.num_computed
        return min(count, room)

    def _admit(self, request: _Request, budget: int) -> Optional[StepChunk]:
        """The first chunk of a waiting request, from the end of its cached prefix, or None when
        no block is left for it."""
        cached = self.context.cached_prefix(request.token_ids)
        computed = len(cached) * self.context.block_size
        room = (len(cached) + self.context.num_allocatable_blocks(retaining=cached)) * self.context.block_size
        count = min(len(request.token_ids) - computed, budget, room - computed)
        if count <= 0:
            return None
        self.waiting.popleft()
        self.context.add_request(request.request_id, cached, request.token_ids)
        request.num_computed = computed
        self.running.append(request)
        return self._reserve(request, computed, count)

    def _reserve(self, request: _Request, start: int, count: int) -> StepChunk:
        self.context.reserve(request.request_id, start + count)
        return StepChunk(request.request_id, request.token_ids, start, start + count)

    def _preempt(self, request: _Request) -> None:
        """Give back a running request's blocks; it waits first in line and recomputes its tokens."""
        self._release(request)
        self.running.remove(request)
        request.num_computed = 0
        self.waiting.appendleft(request)

    def update_weights(self, weights: Union[torch.nn.Module, dict, list], training_pg_collection=None,
                       inference_pg_collection=None) -> None:
        """Load new weights between requests: a state dict of this model's layout, a model of the
        same layout and parameter names, or the model chunks of a live training run in any
        TP/PP/EP layout (a list; every rank calls it, `refit_weights` moves the pieces with
        collectives, nothing goes through disk). Cached prefixes are dropped, their keys and values
        having been computed with the old weights."""
        if self.waiting or self.running:
            raise ValueError(f"update_weights with {len(self.waiting) + len(self.running)} requests unfinished; "
                             "let them finish or abort them first")
        if isinstance(weights, (list, tuple)):
            refit_weights(self.model, list(weights), training_pg_collection, inference_pg_collection)
        else:
            state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
            self.model.load_state_dict(state, strict=True)
        self.context.allocator.forget_cached()

    # Whole prompts.

    def generate(self, prompts: Sequence[Union[str, Sequence[int]]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> list[RequestOutput]:
        """Run `prompts` (texts or token-id lists) to the end; their final outputs in order.
        sampling_params: one for all, or one per prompt."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts; give one, or one "
                             "per prompt")
        ids = [self.add_request(prompt, params) for prompt, params in zip(prompts, sampling_params)]
        final = {}
        while len(final) < len(ids) and self.has_unfinished_requests():
            for output in self.step():
                if output.finished:
                    final[output.request_id] = output
        return [final[i] for i in ids]


def _eod(tokenizer) -> Optional[int]:
    """The tokenizer's end-of-document id, or None when it has none."""
    try:
        return tokenizer.eod
    except (AttributeError, NotImplementedError):
        return None
