"""Packed documents (THD, FlexAttention document masks) against the two ways before them: the
same packed row with a dense s x s mask, and one document per row padded to the longest (issue
21's performance section). One GPU, the benchmark model (bf16, layers compiled as `teratron
train` compiles them), forward + backward of one micro-batch; prints real (non-padding) tokens per
second of each and the ratios.

    python bench/packed_sequences_bench.py [--tokens 16384] [--iters 10]

The documents: lengths drawn log-uniformly in [--min-length, --max-length] (seeded) until
--tokens are filled, the last one cut to fit.
"""

import argparse
import math
import random

import torch

from teratron.models.gpt.builder import build_gpt_model
from teratron.packed_seq_params import PackedSeqParams
from teratron.training.arguments import parse_train_args
from teratron.training.config import run_config_from_args
from teratron.transformer.torch_compile import compile_transformer_layers

MODEL = ("--num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --vocab-size 50304 "
         "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
         "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --bf16 "
         "--tokenizer-type NullTokenizer --mock-data --train-iters 1 --lr 1e-4 --micro-batch-size 1")


def document_lengths(args) -> list:
    rng, lengths = random.Random(args.seed), []
    while sum(lengths) < args.tokens:
        length = int(math.exp(rng.uniform(math.log(args.min_length), math.log(args.max_length))))
        lengths.append(min(length, args.tokens - sum(lengths)))
    return lengths


def packed_batch(lengths, vocab, dense: bool):
    """One row of the documents back to back: PackedSeqParams, or the dense block-diagonal mask."""
    total = sum(lengths)
    ids = torch.randint(0, vocab, (1, total), device="cuda")
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    if not dense:
        return ids, positions, dict(packed_seq_params=PackedSeqParams(cu_seqlens_q=cu, max_seqlen_q=max(lengths)))
    documents = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))
    allowed = (documents[:, None] == documents[None, :]) & torch.ones(total, total, dtype=torch.bool,
                                                                       device="cuda").tril()
    return ids, positions, dict(attention_mask=~allowed[None, None])


def padded_batch(lengths, vocab):
    """One document per row, padded to the longest (causal attention; the padding computes too)."""
    longest = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), longest), device="cuda")
    positions = torch.arange(longest, device="cuda").expand(len(lengths), -1)
    return ids, positions, {}


def time_step(model, ids, positions, kwargs, args) -> float:
    def step():
        loss = model(ids, positions, labels=ids, **kwargs)
        loss.sum().backward()
        model.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / args.iters / 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="Real tokens per micro-batch.")
    parser.add_argument("--min-length", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lengths = document_lengths(args)
    train_args = parse_train_args(MODEL.split() + ["--seq-length", str(args.tokens), "--max-position-embeddings",
                                                   str(args.tokens)])
    run = run_config_from_args(train_args, 1, 50304, cuda=True)
    model = build_gpt_model(run.model).cuda()
    compile_transformer_layers(model)
    vocab = run.model.vocab_size
    print(f"{len(lengths)} documents, {sum(lengths)} tokens, lengths {min(lengths)}..{max(lengths)}")
    cases = {"packed THD (document masks)": packed_batch(lengths, vocab, dense=False),
             "packed, dense s x s mask": packed_batch(lengths, vocab, dense=True),
             "padded, one document per row": padded_batch(lengths, vocab)}
    speeds = {}
    for name, batch in cases.items():
        seconds = time_step(model, *batch, args)
        speeds[name] = sum(lengths) / seconds
        print(f"RESULT {name}: {seconds * 1000:.1f} ms, {speeds[name]:,.0f} real tokens/s, "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
        torch.cuda.reset_peak_memory_stats()
    packed = speeds["packed THD (document masks)"]
    for name, speed in speeds.items():
        print(f"RATIO packed THD / {name}: {packed / speed:.2f}")


if __name__ == "__main__":
    main()
