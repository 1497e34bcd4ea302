"""MTPProposer: speculative drafts from the target model's own multi-token-prediction layers
(DeepSeek-V3's MTP as a draft; the `DraftProposer` interface: propose, rollback, release).

A request's tokens x_0 .. x_{L-1}: the target has computed positions 0 .. L-2, and its final
hidden state there, h_{L-2}, gave x_{L-1}. Depth 1 of the MTP block at position L-2, fed h_{L-2}
and x_{L-1}, predicts x_L (the first draft); depth 2 at L-2, fed depth 1's output there and that
draft, predicts x_{L+1}; and so on: up to mtp_num_layers drafts a step, one forward per depth.

Each depth attends, as in training, over its own keys at every earlier position, so the proposer
keeps the MTP layers' paged KV cache (a DynamicInferenceContext of its own: one block table per
request, shared by the depths, no prefix caching) and computes each depth's positions once:
depth k at position p needs h^{k-1}_p and x_{p+k}, both final for p < L - k, so depth k's keys
there are kept (`ends[k]`), while positions L - k .. L - 2, fed drafts, are recomputed next step
(their keys are overwritten). The hidden states each depth still needs stay per request (`rows`).
The target's hidden states come from the target's own steps: the engine hands each step's final
hidden states (the decoder's output, which its context keeps: `keep_hidden_states`, CUDA-graph
replays included) to `observe` with the step's chunks. A request whose hidden states have a gap
(a cached prefix the target did not compute) restarts its MTP history after it (positions are
relative to that start: RoPE depends only on distances). Drafts are checked by the target as any
draft model's, so the output is the target's whatever the drafts.
"""

import dataclasses

import torch

from teratron.inference.config import InferenceConfig
from teratron.inference.contexts.dynamic_context import DynamicInferenceContext, StepChunk
from teratron.inference.engines.speculative import DraftRequest, Proposal
from teratron.inference.sampling import Sampler


@dataclasses.dataclass
class _History:
    """One request's MTP state; positions are absolute, `base` is the MTP cache's position 0."""
    base: int
    ends: list
    """ends[0]: the end of the target's hidden states; ends[k]: depth k's keys are final below it."""
    rows: list
    """rows[j]: h^j (j = 0: the target's) for positions ends[j + 1] .. ends[j] - 1, which depth
    j + 1 has not consumed yet."""


class MTPProposer:
    def __init__(self, model: torch.nn.Module, config: InferenceConfig, vocab_size: int):
        """model: the target GPTModel (one pipeline stage) with its MTP block."""
        if getattr(model, "mtp", None) is None:
            raise ValueError("MTP speculative decoding needs a model with multi-token-prediction layers "
                             "(trained with --mtp-num-layers); use a draft model instead")
        if not (model.pre_process and model.post_process):
            raise ValueError("the MTP proposer needs a model of one pipeline stage; load it with "
                             "--pipeline-model-parallel-size 1")
        self.model = model
        self.depths = len(model.mtp.layers)
        self.vocab_size = vocab_size
        self.sampler = Sampler(vocab_size)
        max_seq_length = config.max_seq_length or model.max_sequence_length
        self.context = DynamicInferenceContext.from_model(
            model.mtp, dataclasses.replace(config, prefix_caching=False, max_seq_length=max_seq_length))
        self.histories: dict[int, _History] = {}
        self.num_forwards = 0

    # The target's hidden states.

    def observe(self, chunks: list[StepChunk], hidden_states: torch.Tensor) -> None:
        """The target's step: its final hidden states [t, 1, h] (the chunks' tokens back to back,
        then padding), called after each of its forwards."""
        first = 0
        for chunk in chunks:
            rows = hidden_states[first:first + chunk.end - chunk.start, 0].detach().clone()
            first += chunk.end - chunk.start
            history = self.histories.get(chunk.request_id)
            if history is None or not history.ends[1] <= chunk.start <= history.ends[0]:
                history = self._restart(chunk.request_id, chunk.start, rows)
            history.rows[0] = torch.cat([history.rows[0][:chunk.start - history.ends[1]], rows])
            history.ends[0] = chunk.end

    def _restart(self, request_id: int, start: int, like: torch.Tensor) -> _History:
        """A fresh MTP history from position `start` (the MTP layers see nothing before it)."""
        self.release(request_id)
        self.context.add_request(request_id)
        empty = like.new_empty(0, like.shape[-1])
        history = _History(start, [start] * (self.depths + 1), [empty] * self.depths)
        self.histories[request_id] = history
        return history

    # The DraftProposer interface.

    def propose(self, requests: list[DraftRequest]) -> dict[int, Proposal]:
        """Each request's drafts after its tokens: min(count, mtp_num_layers) of them, or none
        when the target's hidden state at its next-to-last token is missing or the MTP cache has
        no room."""
        plan = [dataclasses.replace(r, count=min(r.count, self.depths)) for r in requests if self._ready(r)]
        tokens = {r.request_id: [] for r in plan}
        probs = {r.request_id: [] for r in plan}
        inputs = [self._target_rows(r) for r in plan]  # h^0 of each request's positions to compute
        for depth in range(1, max((r.count for r in plan), default=0) + 1):
            active = [i for i, r in enumerate(plan) if r.count >= depth]
            outputs, logits = self._run_depth(depth, [plan[i] for i in active], [inputs[i] for i in active],
                                              [tokens[plan[i].request_id] for i in active])
            drafts, q = self.sampler.propose(logits, [plan[i].params for i in active],
                                             [plan[i].generator for i in active])
            for i, output, draft, row in zip(active, outputs, drafts.tolist(), q):
                request = plan[i]
                tokens[request.request_id].append(draft)
                probs[request.request_id].append(row)
                inputs[i] = self._advance(request, depth, inputs[i], output)
        return {r.request_id: Proposal(tokens[r.request_id], torch.stack(probs[r.request_id])
                                       if r.params.temperature > 0 else None) for r in plan}

    def rollback(self, request_id: int, num_tokens: int) -> None:
        """Only the request's first `num_tokens` tokens are final: forget the target's hidden
        states past them (the depths' final keys never go past them)."""
        history = self.histories.get(request_id)
        if history is not None and history.ends[0] > num_tokens:
            history.rows[0] = history.rows[0][:num_tokens - history.ends[1]]
            history.ends[0] = num_tokens
            self.context.truncate(request_id, history.ends[1] - history.base)

    def release(self, request_id: int) -> None:
        if self.histories.pop(request_id, None) is not None:
            self.context.release(request_id)

    def holds(self, request_id: int) -> bool:
        return request_id in self.histories

    def open_slots(self) -> int:
        """How many requests new to the MTP layers they can take (every request the target runs is
        observed, so in decode each is held already)."""
        return self.context.max_requests - len(self.histories)

    # One step.

    def _ready(self, request: DraftRequest) -> bool:
        """The target's hidden states reach position L - 2 and the cache holds positions up to it."""
        history, last = self.histories.get(request.request_id), len(request.token_ids) - 1
        if request.count < 1 or history is None or history.ends[0] < last or history.ends[1] >= last:
            return False
        needed = self.context.blocks_needed(request.request_id, last - history.base)
        if needed > self.context.num_allocatable_blocks():
            return False
        self.context.reserve(request.request_id, last - history.base)
        return True

    def _target_rows(self, request: DraftRequest) -> torch.Tensor:
        """h^0 of positions ends[1] .. L - 2, depth 1's to compute."""
        history = self.histories[request.request_id]
        return history.rows[0][:len(request.token_ids) - 1 - history.ends[1]]

    def _run_depth(self, depth: int, requests: list, inputs: list, drafts: list):
        """Depth `depth` over each request's positions ends[depth] .. L - 2, batched: its outputs
        per request [n, h] and the logits [r, V'] at each request's position L - 2."""
        chunks = []
        for request, draft in zip(requests, drafts):
            history = self.histories[request.request_id]
            sequence = request.token_ids + draft  # x_{p + depth} feeds position p: drafts from L - depth on
            start, end = history.ends[depth] - history.base, len(request.token_ids) - 1 - history.base
            chunks.append(StepChunk(request.request_id, sequence[history.base + depth:], start, end,
                                    drafts=min(depth - 1, end - start)))
        input_ids, position_ids = self.context.initialize_attention_state(chunks)
        hidden = torch.cat(inputs)
        hidden = torch.cat([hidden, hidden.new_zeros(input_ids.shape[1] - hidden.shape[0], hidden.shape[1])])
        model = self.model
        with torch.no_grad():
            embeddings = model.embedding(input_ids, position_ids)  # [t, 1, h]
            rotary = None if model.rotary_pos_emb is None else model.rotary_pos_emb(position_ids)
            output = model.mtp.layers[depth - 1](embeddings, hidden[:, None].to(embeddings.dtype), None, rotary,
                                                 inference_context=self.context)[:, 0]  # [t, h]
            lengths = [c.end - c.start for c in chunks]
            last_rows = torch.tensor(lengths, device=output.device).cumsum(0) - 1
            logits = model.output_logits(output[last_rows][:, None], runtime_gather_output=True)[:, 0]
        self.num_forwards += 1
        return list(output[:sum(lengths)].split(lengths)), logits

    def _advance(self, request: DraftRequest, depth: int, inputs: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """After depth `depth` computed positions ends[depth] .. L - 2: keep the final keys and the
        hidden states later depths need; returns depth + 1's inputs (h^depth from ends[depth + 1])."""
        history, last = self.histories[request.request_id], len(request.token_ids) - 1
        start, final = history.ends[depth], last + 1 - depth  # positions below `final` saw only final tokens
        source = history.rows[0] if depth == 1 else inputs  # h^(depth - 1) from `start`
        history.rows[depth - 1] = source[final - start:history.ends[depth - 1] - start]
        history.ends[depth] = final
        if depth == self.depths:
            return None
        following = torch.cat([history.rows[depth], output])  # h^depth from ends[depth + 1] to L - 2
        if depth == request.count:  # depth + 1 does not run this step: keep its final inputs
            history.rows[depth] = following[:final - history.ends[depth + 1]]
        return following
