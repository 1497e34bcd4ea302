"""DraftProposer: the draft model of speculative decoding and its own paged KV cache.

The draft keeps, per request, how many of the request's tokens it has computed; at each
speculative step it first catches up on the tokens it has not seen (the whole prompt the first
time, then the tokens accepted since), which gives its first proposal, then feeds its own
proposals back one at a time. A greedy request's proposals are the draft's argmax; a sampled
request's are drawn with the request's generator from the draft's distribution q (the request's
temperature, top-k and top-p applied to the draft's logits), returned with q for the target's
verification (speculative sampling). The engine verifies the proposals with the target and rolls
the draft back to the tokens that stayed.
"""

import dataclasses
from typing import Optional

import torch

from teratron.inference.config import InferenceConfig
from teratron.inference.contexts.dynamic_context import DynamicInferenceContext, StepChunk
from teratron.inference.sampling import Sampler
from teratron.inference.sampling_params import SamplingParams


@dataclasses.dataclass
class DraftRequest:
    request_id: int
    token_ids: list[int]
    """The request's tokens so far (prompt and generated)."""
    count: int
    """How many tokens to propose after them."""
    params: SamplingParams
    generator: Optional[torch.Generator]
    """The request's generator: a sampled request's proposals are drawn with it."""


@dataclasses.dataclass
class Proposal:
    token_ids: list[int]
    probs: Optional[torch.Tensor]
    """[len(token_ids), V]: the draft's distribution q each token was drawn from (a sampled
    request), or None (a greedy request: the tokens are the draft's argmax)."""


class DraftProposer:
    def __init__(self, model: torch.nn.Module, config: InferenceConfig, vocab_size: int):
        """model: a GPTModel of one stage sharing the target's vocabulary (`vocab_size` real ids)."""
        if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
            raise ValueError("the draft model must be of one pipeline stage; load it with "
                             "--pipeline-model-parallel-size 1")
        draft_vocab = model.unpadded_vocab_size or model.vocab_size
        if draft_vocab != vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab}) differs from the target's ({vocab_size}); "
                             "use a draft model with the target's tokenizer")
        self.model = model.eval()
        self.vocab_size = vocab_size
        self.sampler = Sampler(vocab_size)
        # The draft's blocks are private: its speculative writes must never land in a shared block.
        self.context = DynamicInferenceContext.from_model(model, dataclasses.replace(config, prefix_caching=False))
        self.computed: dict[int, int] = {}  # request id -> tokens whose keys and values the draft holds
        self.num_forwards = 0

    def propose(self, requests: list[DraftRequest]) -> dict[int, Proposal]:
        """Each request's draft tokens following its tokens: as many as asked, or fewer (maybe
        none) when the draft's cache has no room."""
        plan = {}
        for request in requests:
            count = self._reserve(request.request_id, len(request.token_ids), request.count)
            if count:
                plan[request.request_id] = dataclasses.replace(request, count=count)
        tokens = {request_id: [] for request_id in plan}
        probs = {request_id: [] for request_id in plan}
        for j in range(max((request.count for request in plan.values()), default=0)):
            active = [request for request in plan.values() if request.count > j]
            chunks = [StepChunk(r.request_id, r.token_ids + tokens[r.request_id], self.computed[r.request_id],
                                len(r.token_ids) + j) for r in active]
            next_tokens, next_probs = self._next_tokens(chunks, active)
            for request, chunk, token, q in zip(active, chunks, next_tokens, next_probs):
                self.computed[request.request_id] = chunk.end
                tokens[request.request_id].append(token)
                probs[request.request_id].append(q)
        return {request_id: Proposal(tokens[request_id], torch.stack(probs[request_id])
                                     if request.params.temperature > 0 else None)
                for request_id, request in plan.items()}

    def holds(self, request_id: int) -> bool:
        return request_id in self.context.block_tables

    def open_slots(self) -> int:
        """How many requests new to the draft it can take: its max_requests less those it holds (a hybrid
        draft's state budget may hold fewer requests than the target's)."""
        return self.context.max_requests - len(self.context.block_tables)

    def _reserve(self, request_id: int, num_tokens: int, count: int) -> int:
        """Blocks for proposing up to `count` tokens after the first `num_tokens` (the last proposal is
        never fed back); the count that fits. A request new to the draft gets none when it has no
        open slot."""
        if not self.holds(request_id) and self.open_slots() <= 0:
            return 0
        table = self.context.block_tables.get(request_id, [])
        room = (len(table) + self.context.num_allocatable_blocks()) * self.context.block_size
        count = min(count, room - num_tokens + 1)
        if count <= 0:
            return 0
        if request_id not in self.context.block_tables:
            self.context.add_request(request_id)
            self.computed[request_id] = 0
        self.context.reserve(request_id, num_tokens + count - 1)
        return count

    def _next_tokens(self, chunks: list[StepChunk], requests: list[DraftRequest]):
        """The draft's token after the last token of each chunk, and the distribution [V] it was
        drawn from (None for a greedy request)."""
        last_tokens = torch.tensor([c.end - c.start for c in chunks]).cumsum(0) - 1
        input_ids, position_ids = self.context.initialize_attention_state(chunks, last_tokens.tolist())
        with torch.no_grad():
            logits = self.model(input_ids, position_ids, None, inference_context=self.context,
                                runtime_gather_output=True)  # [1, len(chunks), V']
        self.context.commit_step()
        self.num_forwards += 1
        tokens, probs = self.sampler.propose(logits[0], [r.params for r in requests],
                                             [r.generator for r in requests])
        return tokens.tolist(), probs

    def rollback(self, request_id: int, num_tokens: int) -> None:
        """Only the request's first `num_tokens` tokens are final: forget what the draft computed past them."""
        if request_id in self.computed:
            self.computed[request_id] = min(self.computed[request_id], num_tokens)
            self.context.truncate(request_id, self.computed[request_id])

    def release(self, request_id: int) -> None:
        if self.computed.pop(request_id, None) is not None:
            self.context.release(request_id)
