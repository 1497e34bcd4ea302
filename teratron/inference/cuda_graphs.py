"""CUDA graphs of the decode step (Megatron's `--inference-dynamic-batching-num-cuda-graphs`).

A decode step runs about forty small kernels a layer; launched one by one, the host takes far
longer to launch them than the device to run them. `DecodeCudaGraphs` captures the model's
forward over a decode step of R rows once per row count R, and replays it: one launch a step. A
step of n requests replays the graph of the smallest R >= n, its rows past n being padding (the
scratch block, see DynamicInferenceContext). The context keeps a decode step's inputs and
metadata in buffers at fixed addresses, so a replay reads the step the context last prepared.

Graphs are captured largest first, each smaller one reusing the memory pool of the one before:
they never run at once, and a step reads its logits before the next replay. When the context
keeps the step's final hidden states (`keep_hidden_states`: the MTP proposer reads them), each
graph outputs them too, and a replay leaves them in the context as an eager step does.
"""

import bisect

import torch


def cuda_graph_batch_sizes(max_requests: int, num_cuda_graphs: int) -> list[int]:
    """The row counts to capture: -1, every count 1..max_requests; n >= 1, at most n counts from
    1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and their 1.5x) spread evenly, max_requests always
    among them (a decode step of up to max_requests requests always has a graph)."""
    if num_cuda_graphs == -1:
        return list(range(1, max_requests + 1))
    candidates = sorted({size for power in range(max_requests.bit_length())
                         for size in (1 << power, 3 << power >> 1) if 1 <= size < max_requests} | {max_requests})
    if len(candidates) <= num_cuda_graphs:
        return candidates
    step = (len(candidates) - 1) / (num_cuda_graphs - 1) if num_cuda_graphs > 1 else 0
    return sorted({candidates[len(candidates) - 1 - round(i * step)] for i in range(num_cuda_graphs)})


class DecodeCudaGraphs:
    def __init__(self, model: torch.nn.Module, context, batch_sizes: list[int]):
        """model: the engine's GPTModel (eval); context: its DynamicInferenceContext."""
        self.model, self.context = model, context
        self.batch_sizes = sorted(batch_sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.hidden_states: dict[int, torch.Tensor] = {}  # with context.keep_hidden_states
        self.num_replays = 0
        pool = None
        for rows in reversed(self.batch_sizes):
            self.graphs[rows], self.logits[rows] = self._capture(rows, pool)
            if context.keep_hidden_states:
                self.hidden_states[rows] = context.hidden_states  # the captured step's, at a fixed address
            pool = self.graphs[rows].pool()

    def rows_for(self, num_requests: int) -> int | None:
        """The row count of the graph a decode step of `num_requests` replays (None: none is that big)."""
        index = bisect.bisect_left(self.batch_sizes, num_requests)
        return self.batch_sizes[index] if index < len(self.batch_sizes) else None

    def replay(self, rows: int) -> torch.Tensor:
        """Run the decode step the context prepared (`initialize_decode_state(chunks, rows)`);
        its logits [rows, V'] (and with keep_hidden_states the context's hidden_states
        [rows, 1, h]), valid until the next replay."""
        self.graphs[rows].replay()
        self.num_replays += 1
        if self.context.keep_hidden_states:
            self.context.hidden_states = self.hidden_states[rows]
        return self.logits[rows]

    def _forward(self, rows: int) -> torch.Tensor:
        ids = self.context.decode_ids  # [3, R]: token ids, positions, cache slots
        logits = self.model(ids[0, :rows][None], ids[1, :rows][None], None, inference_context=self.context,
                            runtime_gather_output=True)  # [1, rows, V']
        return logits[0]

    @torch.no_grad()
    def _capture(self, rows: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (lazy initialisation, autotuning), then capture, over a step
        of padding rows only (their keys go to the scratch block)."""
        self.context.initialize_decode_state([], rows)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(rows)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._forward(rows)
        return graph, logits
