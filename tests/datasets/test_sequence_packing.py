"""Sequence packing (teratron/datasets/sequence_packing.py): DP-balanced shares, first-fit rows,
the 'thd' micro-batch of a row, and the steps of PackedBatches."""

import pytest
import torch

from teratron.datasets.sequence_packing import (PackedBatches, balance_over_ranks, pack_rows, packed_row,
                                                padded_length)


def test_ranks_get_equal_tokens():
    lengths = [9, 3, 7, 7, 2, 5, 1, 6]  # 40 tokens
    shares = balance_over_ranks(lengths, 2)
    # longest first to the rank with fewer tokens: 9->0, 7->1, 7->1, 6->0, 5->1, 3->0, 2->0, 1->1
    assert shares == [[0, 1, 4, 7], [2, 3, 5, 6]]
    assert [sum(lengths[i] for i in share) for share in shares] == [20, 20]
    assert sorted(i for share in balance_over_ranks(lengths, 3) for i in share) == list(range(8))


def test_rows_are_filled_first_fit_with_padded_lengths():
    assert padded_length(5, 4) == 8 and padded_length(8, 4) == 8
    # padded to multiples of 4: 12, 4, 8, 8, 4 -> rows of 16: [12, 4] [8, 8] [4]
    assert pack_rows([10, 3, 7, 8, 1], 16, 4) == [[0, 1], [2, 3], [4]]
    assert pack_rows([15], 16, 4) == [[0]]  # padded to 16: fits
    with pytest.raises(ValueError, match="padded to 20 does not fit a row of --seq-length 16"):
        pack_rows([17], 16, 4)


def _sample(values):
    tokens = torch.tensor(values)
    return {"tokens": tokens, "labels": tokens + 100, "loss_mask": torch.ones(len(values))}


def test_a_row_is_a_thd_micro_batch():
    row = packed_row([_sample([1, 2, 3]), _sample([4, 5])], 12, 4)
    assert row["tokens"].tolist() == [[1, 2, 3, 0, 4, 5, 0, 0, 0, 0, 0, 0]]
    assert row["labels"].tolist() == [[101, 102, 103, 0, 104, 105, 0, 0, 0, 0, 0, 0]]
    assert row["loss_mask"].tolist() == [[1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]  # the last takes the rest
    params = row["packed_seq_params"]
    assert params.qkv_format == "thd" and params.max_seqlen_q == 3
    assert params.cu_seqlens_q.tolist() == [0, 3, 5] and params.cu_seqlens_q_padded.tolist() == [0, 4, 12]
    empty = packed_row([], 8, 4)
    assert empty["loss_mask"].sum() == 0 and empty["packed_seq_params"].cu_seqlens_q_padded.tolist() == [0, 8]


def test_steps_give_every_rank_the_same_number_of_micro_batches():
    samples = [_sample(list(range(1, n + 1))) for n in (6, 2, 5, 3, 8, 1, 4, 7)]
    ranks = [PackedBatches(samples, 4, 2, 8, 2, rank, 2) for rank in range(2)]
    counts = [batches.next_step() for batches in ranks]
    # After 2 consumed: samples 2..5 of lengths 5, 3, 8, 1. Rank 0 gets 8 and 1 (9 tokens: 1 goes to
    # rank 0 on the 8-8 tie), rank 1 gets 5 and 3 (8); rows of 8, lengths padded to even: 8 | 2 and
    # 6 | 4 -- two micro-batches each.
    assert counts == [2, 2]
    rows = [[next(batches) for _ in range(2)] for batches in ranks]
    assert [[int(r["loss_mask"].sum()) for r in rank_rows] for rank_rows in rows] == [[8, 1], [5, 3]]
    assert rows[1][0]["tokens"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
    assert ranks[0].next_step() == 2 and ranks[0].position == 10  # samples 6, 7, 0, 1 (wrapping around)
    with pytest.raises(RuntimeError, match="call next_step"):
        next(ranks[1])
