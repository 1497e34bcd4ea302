"""The `teratron` command (also `python -m teratron`).

    teratron train [flags]          pretrain a GPT (Megatron pretrain_gpt.py flags); no data
                                    flags runs the embedded demo
    teratron preprocess [flags]     JSONL -> Megatron .bin/.idx
    teratron convert import-hf|export-hf [flags]   Hugging Face <-> teratron checkpoints (and gpt-to-hybrid,
                                                 hybrid-to-gpt: docs/hybrid.md)
    teratron merge [flags]          weighted average of checkpoints
    teratron estimate [train flags] [--world-size N] [--json]
                                    peak memory per GPU and FLOPs of a `teratron train` command
    teratron bench [flags]          training throughput next to the Hugging Face baseline
    teratron generate --load CKPT --prompt TEXT [flags]
                                    continue a prompt with a checkpoint's model (streams the text)
    teratron serve --load CKPT [--host 127.0.0.1] [--port 8000]
                                    OpenAI-compatible HTTP server (completions, chat, streaming);
                                    both take --tensor-model-parallel-size (under torchrun) and
                                    --draft-load / --num-speculative-tokens
    teratron analyze-routing FILE... [--csv PATH] [--plot PATH]
                                    MoE routing statistics of router replay recordings

Bad input (a flag, a config value, a file) ends the command with one line on stderr,
`teratron: error: <message>`, and exit status 2; no traceback. Ctrl+C ends it with one line
(`teratron train`'s names the checkpoint to resume from) and exit status 130.
"""

import argparse
import importlib
import os
import signal
import sys

import teratron

# Exceptions that mean "the user asked for something wrong or impossible": printed as one line.
USER_ERRORS = (ValueError, NotImplementedError, OSError)


def _train(argv) -> int:
    from teratron.training import demo
    from teratron.training.arguments import demo_argv, parse_train_args
    from teratron.training.training import pretrain

    args = parse_train_args(argv)
    interrupted = []

    def on_ctrl_c(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        if not args.demo:
            demo.check_not_demo(args)
            pretrain(_fitting_run(args))
            return 0
        demo_dir, samples = demo.output_dir(args), demo.num_samples(args)
        args = parse_train_args(argv, defaults=demo_argv() + demo.prepare(args))
        pretrain(_fitting_run(args), after_training=lambda trainer: demo.finish(trainer, demo_dir, samples))
        return 0
    except KeyboardInterrupt:
        return _interrupted(args.save)
    except Exception:
        if not interrupted:
            raise
        return _interrupted(args.save)  # Ctrl+C inside a library call can surface as another error
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted(save) -> int:
    from teratron.training.checkpointing import resume_hint

    if os.environ.get("RANK", "0") == "0":  # torchrun passes Ctrl+C to every rank: one says it
        print(f"teratron: interrupted; {resume_hint(save)}", file=sys.stderr, flush=True)
    return 130


def _fitting_run(args):
    """The run description, refused (before anything is allocated) when `teratron estimate` says
    it cannot fit this machine."""
    import torch

    from teratron.estimate.report import check_fits
    from teratron.training.config import build_run_config

    run = build_run_config(args)
    check_fits(run, "cuda" if torch.cuda.is_available() else "cpu")
    return run


def _merge(argv) -> int:
    """`teratron merge`, whose refusals name the model args that differ by their `teratron train` flags."""
    from teratron.dist_checkpointing import merge
    from teratron.training.arguments import ArgumentParser, flag_values

    parser = ArgumentParser(prog="teratron merge", description="Weighted average of checkpoints of one model.",
                            allow_abbrev=False)
    return merge.run(merge.add_arguments(parser).parse_args(argv), describe=flag_values)


def _module_command(module_name: str, prog: str, description: str, add: str = "add_arguments", run: str = "run"):
    """A subcommand whose module provides `add(parser)` and `run(args) -> int` (by default
    `add_arguments` and `run`)."""
    def command(argv) -> int:
        from teratron.training.arguments import ArgumentParser

        module = importlib.import_module(module_name)
        parser = ArgumentParser(prog=prog, description=description, allow_abbrev=False)
        return getattr(module, run)(getattr(module, add)(parser).parse_args(argv))
    return command


def _main_command(module_name: str):
    """A subcommand whose module parses its own flags in `main(argv) -> int`."""
    def command(argv) -> int:
        return importlib.import_module(module_name).main(argv)
    return command


COMMANDS = {
    "train": _train,
    "preprocess": _module_command("teratron.datasets.preprocess", "teratron preprocess",
                                  "Tokenize JSONL into Megatron .bin/.idx datasets."),
    "convert": _module_command("teratron.convert.cli", "teratron convert",
                               "Hugging Face folders <-> teratron checkpoints."),
    "merge": _merge,
    "estimate": _main_command("teratron.estimate.cli"),
    "bench": _main_command("teratron.bench.cli"),
    "generate": _module_command("teratron.inference.cli", "teratron generate",
                                "Continue a prompt with a checkpoint's model.", "add_generate_arguments", "run_generate"),
    "serve": _module_command("teratron.inference.cli", "teratron serve",
                             "Serve a checkpoint's model over an OpenAI-compatible HTTP API.", "add_serve_arguments",
                             "run_serve"),
    "analyze-routing": _module_command("teratron.transformer.moe.routing_analysis", "teratron analyze-routing",
                                       "Per-expert load, its concentration and layer-to-layer predictability "
                                       "of MoE routing recordings."),
}


def _top_parser():
    from teratron.training.arguments import ArgumentParser

    parser = ArgumentParser(prog="teratron", description="Train transformer language models at scale.",
                            epilog="commands:\n" + __doc__.split("\n\n")[1] +
                                   "\n\nRun `teratron COMMAND --help` for a command's flags.",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"teratron {teratron.__version__}")
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to do")
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    from teratron.training.rerun import ReproducibleFaultError
    from teratron.training.trainer import NonFiniteLossError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        ns = _top_parser().parse_args(argv)
        return COMMANDS[ns.command](ns.args)
    except USER_ERRORS + (NonFiniteLossError,) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"teratron: error: {message}", file=sys.stderr, flush=True)
        return 2
    except ReproducibleFaultError as e:  # Megatron's exit code: resume elsewhere to tell a fault from the data
        print(f"teratron: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("teratron: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
