"""Index builders of Megatron's `helpers.cpp`, in numpy: the GPT sample index and the greedy
blending index. Their outputs match Megatron's element for element, so caches and runs agree."""

import math

import numpy


def build_sample_idx(
    sizes: numpy.ndarray,
    document_indices: numpy.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: bool = True,
) -> numpy.ndarray:
    """The 2-D sample index `[num_samples + 1, 2]`: row i is (position in `document_indices`,
    token offset in that document) where sample i starts.

    The documents, in `document_indices` order, form one token stream; sample i covers stream
    tokens `[i * L, i * L + L + extra)`. Megatron records the start of sample i + 1 relative to the
    document that holds the last token sample i consumed, so a boundary at the end of a document
    stays on that document (offset = its length - extra) rather than moving to the next one."""
    assert sequence_length > 1 and num_epochs > 0 and tokens_per_epoch > 1
    extra = int(add_extra_token_to_sequence)
    total = num_epochs * tokens_per_epoch - extra
    if drop_last_partial_sequence:
        num_samples = total // sequence_length
    else:
        # Megatron divides in single precision here; do the same so counts agree at any scale.
        num_samples = math.ceil(numpy.float32(total) / numpy.float32(sequence_length))

    doc_lengths = sizes[document_indices].astype(numpy.int64)
    doc_ends = numpy.cumsum(doc_lengths)  # stream position one past each document

    # Sample k (1-based) has consumed stream tokens [0, e_k), e_k = k * L + extra; it ends in the
    # first document with doc_end >= e_k, i.e. after the documents whose end is < e_k. Document d
    # ends before e_k from k = (doc_end_d - extra) // L + 1 on: count those starts and accumulate.
    first_k = numpy.clip((doc_ends - extra) // sequence_length + 1, 0, num_samples + 1)
    doc = numpy.cumsum(numpy.bincount(first_k, minlength=num_samples + 2))[1: num_samples + 1]
    consumed_end = numpy.arange(1, num_samples + 1, dtype=numpy.int64) * sequence_length + extra
    if num_samples and doc[-1] == len(document_indices):
        # Only the last, partial sample can run off the end: it stops at the last document's end.
        doc[-1] = len(document_indices) - 1
        consumed_end[-1] = doc_ends[-1]
    offset = consumed_end - (doc_ends - doc_lengths)[doc] - extra

    sample_idx_max = max(document_indices.shape[0], int(sizes.max()))
    dtype = numpy.int32 if sample_idx_max <= numpy.iinfo(numpy.int32).max else numpy.int64
    sample_idx = numpy.zeros((num_samples + 1, 2), dtype=dtype)
    sample_idx[1:, 0] = doc
    sample_idx[1:, 1] = offset
    return sample_idx


def _most_behind(weights: list, counts: list, candidates, i: int) -> int:
    """The candidate furthest below its share at sample i, `argmax_j (w_j * max(i, 1) - count_j)`,
    ties to the first candidate (Megatron's greedy rule)."""
    scale = float(max(i, 1))
    best, best_error = -1, -math.inf
    for j in candidates:
        error = weights[j] * scale - counts[j]
        if error > best_error:
            best, best_error = j, error
    return best


def build_blending_indices(weights, size: int):
    """Megatron's greedy blend: sample i goes to the dataset furthest below its share (see
    `_most_behind`). The count of every dataset stays within a few samples of `w_j * i`.
    Returns (dataset_index int16, dataset_sample_index int64)."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    candidates = range(len(weights))
    chosen, taken = [0] * size, [0] * size
    for i in range(size):
        best = _most_behind(weights, counts, candidates, i)
        chosen[i] = best
        taken[i] = counts[best]
        counts[best] += 1
    return numpy.array(chosen, dtype=numpy.int16), numpy.array(taken, dtype=numpy.int64)


def build_exhaustive_blending_indices(sizes):
    """Draw every sample of every dataset exactly once, interleaved in proportion to the sizes
    (the same greedy rule restricted to datasets that still have samples)."""
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    weights = [s / float(total) for s in sizes]
    counts = [0] * len(sizes)
    unspent = [j for j in range(len(sizes)) if sizes[j] > 0]
    chosen, taken = [0] * total, [0] * total
    for i in range(total):
        best = _most_behind(weights, counts, unspent, i)
        chosen[i] = best
        taken[i] = counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return numpy.array(chosen, dtype=numpy.int16), numpy.array(taken, dtype=numpy.int64)
