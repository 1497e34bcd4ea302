"""The command lines `teratron bench` trains: the benchmark shape of ARCHITECTURE.md (or a tiny
one for a CPU smoke test) with Megatron's training semantics, timed on mock data.

Benchmark shape: 24 layers, hidden 2048, FFN 5632 (SwiGLU), 16 heads, seq 2048, vocab 50304,
RoPE, RMSNorm, no biases, untied embeddings; micro-batch 4, global batch 32. Semantics: bf16
parameters with fp32 master weights and fp32 main gradients, Adam, grad clipping at 1.0, the
distributed optimizer off. Flags given to `teratron bench` come after these and win.
"""

BENCHMARK_SHAPE = [
    "--num-layers", "24", "--hidden-size", "2048", "--ffn-hidden-size", "5632",
    "--num-attention-heads", "16", "--seq-length", "2048", "--max-position-embeddings", "2048",
    "--vocab-size", "50304", "--micro-batch-size", "4", "--global-batch-size", "32",
]

TINY_SHAPE = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
    "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
    "--vocab-size", "512", "--micro-batch-size", "2", "--global-batch-size", "4", "--num-workers", "0",
]

# Llama-style model, training semantics, and a run that only trains and logs every iteration.
TRAINING = [
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--bf16", "--accumulate-allreduce-grads-in-fp32", "--optimizer", "adam", "--clip-grad", "1.0",
    "--lr", "3e-4", "--lr-decay-style", "constant",
    "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--eval-iters", "0", "--log-interval", "1", "--no-progress-bar",
]


def train_argv(tiny: bool, warmup_iters: int, iters: int, overrides: list, metrics_file: str) -> list:
    """`teratron train` flags of the benchmark run; `overrides` (the user's) come last."""
    shape = TINY_SHAPE if tiny else BENCHMARK_SHAPE
    return (shape + TRAINING + ["--train-iters", str(warmup_iters + iters)] + list(overrides)
            + ["--metrics-file", metrics_file])
