"""The embedded demo: `teratron train` with no data flags.

It trains a small GPT (the shape is `arguments.demo_argv()`) on English prose built offline
from the Python installation's own documentation (`teratron.datasets.demo_corpus`), then
writes under --demo-dir (default runs/demo): checkpoints/, metrics.jsonl, loss.png and
samples.txt, and prints the sampled lines.
"""

import os

import torch

DEFAULT_DEMO_DIR = os.path.join("runs", "demo")
DEFAULT_NUM_SAMPLES = 4
PROMPTS = ["The", "A function", "This module", "In Python, the", "The default value", "If the"]
_TOKENIZER_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")


def check_not_demo(args) -> None:
    for name in ("demo_dir", "demo_samples"):
        if getattr(args, name) is not None:
            raise ValueError(f"--{name.replace('_', '-')} only applies to the embedded demo "
                             "(no --data-path/--mock-data); drop it")


def prepare(args) -> None:
    """Point the run at the demo corpus and its tokenizer, and at the demo's output folder."""
    from teratron.datasets.demo_corpus import prepare_demo_data

    given = [name for name in _TOKENIZER_FLAGS if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')}: the embedded demo uses its own tokenizer; "
                         "pass --data-path or --mock-data to choose one")
    args.demo_dir = args.demo_dir or DEFAULT_DEMO_DIR
    args.demo_samples = DEFAULT_NUM_SAMPLES if args.demo_samples is None else args.demo_samples
    if args.demo_samples < 0:
        raise ValueError(f"--demo-samples must be >= 0, got {args.demo_samples}")
    print(f"teratron demo: no --data-path given, so training a small GPT on the bundled English "
          f"text; outputs go to {args.demo_dir}/", flush=True)
    data = prepare_demo_data()
    print(f"teratron demo: corpus of {data.num_tokens:,} tokens, vocabulary {data.vocab_size}", flush=True)
    args.data_path = [data.data_prefix]
    args.tokenizer_type = "HuggingFaceTokenizer"
    args.tokenizer_model = data.tokenizer_model
    if args.save is None:
        args.save = os.path.join(args.demo_dir, "checkpoints")
        args.overwrite = True  # the demo's own folder: a rerun replaces the last demo, like its metrics
    if args.metrics_file is None:
        args.metrics_file = os.path.join(args.demo_dir, "metrics.jsonl")
        if os.path.exists(args.metrics_file):
            os.remove(args.metrics_file)


def finish(run) -> None:
    """After training: the loss curve, a few sampled lines, and where everything is."""
    if not run.is_logging_rank:
        return
    args = run.args
    os.makedirs(args.demo_dir, exist_ok=True)
    png = write_loss_plot(run.state, os.path.join(args.demo_dir, "loss.png"))
    print(f"teratron demo: loss curve -> {png}", flush=True)
    if args.world_size > 1:
        print("teratron demo: sampling runs single-process only; skipped under torchrun", flush=True)
        return
    lines = sample_lines(run, args.demo_samples)
    path = os.path.join(args.demo_dir, "samples.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"teratron demo: samples from the trained model -> {path}")
    for line in lines:
        print(f"  > {line}")
    print(f"teratron demo: checkpoint -> {args.save}", flush=True)


def sample_lines(run, count: int) -> list:
    from teratron.inference import generate

    generator = torch.Generator(device=run.device).manual_seed(run.args.seed)
    model = run.model[0]
    return [" ".join(generate(model, run.tokenizer, PROMPTS[i % len(PROMPTS)], max_new_tokens=40,
                              max_sequence_length=run.args.seq_length, generator=generator).split())
            for i in range(count)]


def write_loss_plot(state, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if state.loss_history:
        its, losses = zip(*state.loss_history)
        ax.plot(its, losses, lw=0.8, alpha=0.4, label="train (per iteration)")
        window = max(1, len(losses) // 30)
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(its, smooth, lw=1.8, label=f"train ({window}-iteration mean)")
    if state.eval_history:
        its, losses = zip(*state.eval_history)
        ax.plot(its, losses, "o-", label="validation")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("teratron demo")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
