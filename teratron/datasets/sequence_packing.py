"""Sequence packing: variable-length samples packed into rows without padding between them, spread
over the data-parallel ranks with equal tokens (Megatron's DP-balanced packing).

Each training step takes the next `global_batch_size` samples; every rank reads them all (it needs
their lengths, and its own share). `balance_over_ranks` gives each DP rank a share of near-equal
tokens: longest first, each to the rank with the fewest tokens so far. Each rank packs its share
into rows of `row_length` (= --seq-length) tokens (`pack_rows`: first fit, longest first), every
sample padded up to a multiple of `divisor` (2 x CP, x TP under sequence parallelism) so context
parallelism can cut each into its 2 x CP chunks (per-document load balance); the last sample of a
row takes the row's remaining padding. Every DP rank runs as many rows (micro-batches) as the rank
that needs most; rows past a rank's own are all padding.

A row is a 'thd' micro-batch [1, row_length] with its PackedSeqParams (`cu_seqlens_q`: the real
lengths; `cu_seqlens_q_padded`: the padded ones): position ids restart per sample, and labels and
the loss mask cover real tokens only. Micro-batches hold different numbers of tokens, so the loss
is per token over the whole step (calculate_per_token_loss), the same for any layout.
"""

import heapq

import torch

from teratron.packed_seq_params import PackedSeqParams


def balance_over_ranks(lengths: list, ranks: int) -> list:
    """Sample indices per rank (each rank's in the order given), tokens balanced: longest first,
    each to the rank with the fewest tokens so far (the lowest rank on ties). Deterministic."""
    heap = [(0, rank) for rank in range(ranks)]
    shares = [[] for _ in range(ranks)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, rank = heapq.heappop(heap)
        shares[rank].append(index)
        heapq.heappush(heap, (tokens + lengths[index], rank))
    return [sorted(share) for share in shares]


def padded_length(length: int, divisor: int) -> int:
    return -(-length // divisor) * divisor


def pack_rows(lengths: list, row_length: int, divisor: int) -> list:
    """Rows of sample indices: first fit of the samples, longest first, each taking its length
    padded to a multiple of `divisor`; a row's samples in index order."""
    rows, free = [], []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        need = padded_length(lengths[index], divisor)
        if need > row_length:
            raise ValueError(f"a sample of {lengths[index]} tokens padded to {need} does not fit a row of "
                             f"--seq-length {row_length}; raise --seq-length or cut the samples")
        row = next((r for r, space in enumerate(free) if space >= need), None)
        if row is None:
            rows.append([])
            free.append(row_length)
            row = len(rows) - 1
        rows[row].append(index)
        free[row] -= need
    return [sorted(row) for row in rows]


def packed_row(samples: list, row_length: int, divisor: int) -> dict:
    """One 'thd' micro-batch of `samples` (dicts of 1-D tokens, labels, loss_mask of equal
    lengths): tokens, labels, loss_mask, position_ids [1, row_length] and packed_seq_params."""
    tokens = torch.zeros(row_length, dtype=torch.long)
    labels = torch.zeros(row_length, dtype=torch.long)
    loss_mask = torch.zeros(row_length, dtype=torch.float)
    position_ids = torch.zeros(row_length, dtype=torch.long)
    real, padded, start = [0], [0], 0
    for i, sample in enumerate(samples):
        n = sample["tokens"].numel()
        span = row_length - start if i == len(samples) - 1 else padded_length(n, divisor)
        tokens[start:start + n], labels[start:start + n] = sample["tokens"], sample["labels"]
        loss_mask[start:start + n] = sample["loss_mask"]
        position_ids[start:start + span] = torch.arange(span)
        start += span
        real.append(real[-1] + n)
        padded.append(start)
    if not samples:  # a row of padding only: one document
        real.append(0)
        padded.append(row_length)
        position_ids = torch.arange(row_length)
    cu_real, cu_padded = torch.tensor(real, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)
    lengths = [b - a for a, b in zip(real, real[1:])]
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real,
                             cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    return {"tokens": tokens[None], "labels": labels[None], "loss_mask": loss_mask[None],
            "position_ids": position_ids[None], "packed_seq_params": params}


class DocumentSamples:
    """The documents of a GPTDataset's split as variable-length samples: sample i is the i-th
    document in the dataset's shuffled order (documents of fewer than 2 tokens left out), cut to
    `max_length` + 1 tokens; its tokens are all but the last, its labels all but the first. With
    `eod` (--eod-mask-loss) positions whose input is the end-of-document token get no loss."""

    def __init__(self, dataset, max_length: int, eod: int | None = None):
        lengths = dataset.dataset.sequence_lengths
        self.dataset, self.max_length, self.eod = dataset.dataset, max_length, eod
        self.documents = [int(d) for d in dataset.document_index if lengths[d] >= 2]
        if not self.documents:
            raise ValueError("--sequence-packing: the split has no document of 2 tokens or more")

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, i: int) -> dict:
        document = self.documents[i]
        length = min(int(self.dataset.sequence_lengths[document]), self.max_length + 1)
        text = torch.from_numpy(self.dataset.get(document, offset=0, length=length).astype("int64"))
        tokens = text[:-1]
        loss_mask = torch.ones(tokens.numel(), dtype=torch.float)
        if self.eod is not None:
            loss_mask[tokens == self.eod] = 0.0
        return {"tokens": tokens, "labels": text[1:], "loss_mask": loss_mask}


class PackedBatches:
    """This DP rank's packed micro-batches, one training step at a time. `samples[i]` is a dict of
    1-D tokens, labels, loss_mask; the steps start after `consumed` samples.

        count = batches.next_step()     # prepares the step; the micro-batches of every DP rank
        batch = next(batches)           # count times
    """

    def __init__(self, samples, global_batch_size: int, consumed: int, row_length: int, divisor: int,
                 dp_rank: int, dp_size: int):
        self.samples, self.global_batch_size, self.position = samples, global_batch_size, consumed
        self.row_length, self.divisor, self.dp_rank, self.dp_size = row_length, divisor, dp_rank, dp_size
        self.pending: list = []

    def next_step(self) -> int:
        """Read the step's samples, keep this rank's rows; returns the micro-batches per rank."""
        step = [self.samples[(self.position + i) % len(self.samples)] for i in range(self.global_batch_size)]
        self.position += self.global_batch_size
        lengths = [s["tokens"].numel() for s in step]
        shares = balance_over_ranks(lengths, self.dp_size)
        rows = [pack_rows([lengths[i] for i in share], self.row_length, self.divisor) for share in shares]
        mine, own, count = shares[self.dp_rank], rows[self.dp_rank], max(len(r) for r in rows)
        self.pending = [packed_row([step[mine[i]] for i in row], self.row_length, self.divisor) for row in own]
        self.pending += [packed_row([], self.row_length, self.divisor) for _ in range(count - len(own))]
        return count

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.pending:
            raise RuntimeError("PackedBatches: every micro-batch of the step was taken; call next_step() first")
        return self.pending.pop(0)
