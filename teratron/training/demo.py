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


def output_dir(args) -> str:
    return args.demo_dir or DEFAULT_DEMO_DIR


def num_samples(args) -> int:
    samples = DEFAULT_NUM_SAMPLES if args.demo_samples is None else args.demo_samples
    if samples < 0:
        raise ValueError(f"--demo-samples must be >= 0, got {samples}")
    return samples


def prepare(args) -> list:
    """Build the demo corpus; returns the flags that point the run at it, its tokenizer and the
    demo's output folder (under the demo's shape and schedule, `arguments.demo_argv()`)."""
    from teratron.datasets.demo_corpus import prepare_demo_data

    given = [name for name in _TOKENIZER_FLAGS if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')}: the embedded demo uses its own tokenizer; "
                         "pass --data-path or --mock-data to choose one")
    demo_dir = output_dir(args)
    num_samples(args)
    print(f"teratron demo: no --data-path given, so training a small GPT on the bundled English "
          f"text; outputs go to {demo_dir}/", flush=True)
    data = prepare_demo_data()
    print(f"teratron demo: corpus of {data.num_tokens:,} tokens, vocabulary {data.vocab_size}", flush=True)
    flags = ["--data-path", data.data_prefix, "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", data.tokenizer_model]
    if args.save is None:  # the demo's own folder: a rerun replaces the last demo, like its metrics
        flags += ["--save", os.path.join(demo_dir, "checkpoints"), "--overwrite"]
    if args.metrics_file is None:
        metrics_file = os.path.join(demo_dir, "metrics.jsonl")
        flags += ["--metrics-file", metrics_file]
        if os.path.exists(metrics_file):
            os.remove(metrics_file)
    return flags


def finish(trainer, demo_dir: str, count: int) -> None:
    """After training: the loss curve, a few sampled lines, and where everything is."""
    from teratron.training.trainer import is_logging_rank

    if not is_logging_rank():
        return
    run = trainer.run
    os.makedirs(demo_dir, exist_ok=True)
    png = write_loss_plot(trainer.state, os.path.join(demo_dir, "loss.png"))
    print(f"teratron demo: loss curve -> {png}", flush=True)
    if run.distributed.world_size > 1:
        print("teratron demo: sampling runs single-process only; skipped under torchrun", flush=True)
        return
    lines = sample_lines(trainer, count)
    path = os.path.join(demo_dir, "samples.txt")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"teratron demo: samples from the trained model -> {path}")
    for line in lines:
        print(f"  > {line}")
    print(f"teratron demo: checkpoint -> {run.checkpoint.save}", flush=True)


def sample_lines(trainer, count: int) -> list:
    from teratron.inference import generate

    generator = torch.Generator(device=trainer.device).manual_seed(trainer.run.training.seed)
    model = trainer.model[0]
    return [" ".join(generate(model, trainer.tokenizer, PROMPTS[i % len(PROMPTS)], max_new_tokens=40,
                              max_sequence_length=trainer.run.training.seq_length, generator=generator).split())
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
