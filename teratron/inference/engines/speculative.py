"""DraftProposer: the draft model of speculative decoding and its own paged KV cache.

The draft keeps, per request, how many of the request's tokens it has computed; at each
speculative step it first catches up on the tokens it has not seen (the whole prompt the first
time, then the tokens accepted since), which gives its first proposal, then feeds its own greedy
proposals one at a time. The engine verifies them with the target and rolls the draft back to
the tokens that stayed.
"""

import dataclasses

import torch

from teratron.inference.config import InferenceConfig
from teratron.inference.contexts.dynamic_context import DynamicInferenceContext, StepChunk


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
        # The draft's blocks are private: its speculative writes must never land in a shared block.
        self.context = DynamicInferenceContext.from_model(model, dataclasses.replace(config, prefix_caching=False))
        self.computed: dict[int, int] = {}  # request id -> tokens whose keys and values the draft holds
        self.num_forwards = 0

    def propose(self, requests: list[tuple[int, list[int], int]]) -> dict[int, list[int]]:
        """requests: (request id, its tokens, how many to propose). Returns each request's greedy draft
        tokens following its tokens: as many as asked, or fewer (maybe none) when the draft's cache
        has no room."""
        plan = {}
        for request_id, token_ids, count in requests:
            count = self._reserve(request_id, len(token_ids), count)
            if count:
                plan[request_id] = (token_ids, count)
        proposals = {request_id: [] for request_id in plan}
        for j in range(max((count for _, count in plan.values()), default=0)):
            active = [(request_id, tokens) for request_id, (tokens, count) in plan.items() if count > j]
            chunks = [StepChunk(request_id, tokens + proposals[request_id], self.computed[request_id], len(tokens) + j)
                      for request_id, tokens in active]
            for (request_id, _), chunk, token in zip(active, chunks, self._next_tokens(chunks)):
                self.computed[request_id] = chunk.end
                proposals[request_id].append(token)
        return proposals

    def _reserve(self, request_id: int, num_tokens: int, count: int) -> int:
        """Blocks for proposing up to `count` tokens after the first `num_tokens` (the last proposal is
        never fed back); the count that fits."""
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

    def _next_tokens(self, chunks: list[StepChunk]) -> list[int]:
        """The draft's greedy token after the last token of each chunk."""
        last_tokens = torch.tensor([c.end - c.start for c in chunks]).cumsum(0) - 1
        input_ids, position_ids = self.context.initialize_attention_state(chunks, last_tokens.tolist())
        with torch.no_grad():
            logits = self.model(input_ids, position_ids, None, inference_context=self.context,
                                runtime_gather_output=True)  # [1, len(chunks), V']
        self.context.commit_step()
        self.num_forwards += 1
        return logits[0, :, :self.vocab_size].argmax(-1).tolist()

    def rollback(self, request_id: int, num_tokens: int) -> None:
        """Only the request's first `num_tokens` tokens are final: forget what the draft computed past them."""
        if request_id in self.computed:
            self.computed[request_id] = min(self.computed[request_id], num_tokens)
            self.context.truncate(request_id, self.computed[request_id])

    def release(self, request_id: int) -> None:
        if self.computed.pop(request_id, None) is not None:
            self.context.release(request_id)
