"""`teratron estimate`: peak memory per GPU and FLOPs of a `teratron train` command line.

    teratron estimate --mock-data --tokenizer-type NullTokenizer --vocab-size 50304 \
        --num-layers 24 --hidden-size 2048 ... --world-size 8 [--json]

Takes every `teratron train` flag (same parser, same YAML --config, same defaults); --train-iters
and --lr are optional here. Its own flags: --world-size (GPUs of the job), --target-device and
--json. Without any train flag it estimates the embedded demo (`teratron train` alone); the
demo's shape and schedule never mix with flags or a --config that are given.
"""

import contextlib
import json
import sys

from teratron.training.arguments import ArgumentParser, build_train_parser, parse_train_args


def add_arguments(parser):
    g = parser.add_argument_group("estimate")
    g.add_argument("--world-size", type=int, default=None,
                   help="GPUs of the job; default TP x PP x CP (one data-parallel replica).")
    g.add_argument("--target-device", default="cuda", choices=["cuda", "cpu"],
                   help="Whose kernels' saved tensors to count (probed when that device is present).")
    g.add_argument("--json", action="store_true", help="Print the estimate as JSON.")
    return parser


def parse_args(argv):
    """Train flags (parse_train_args) plus the estimate's own."""
    argv = list(argv)
    if "-h" in argv or "--help" in argv:
        add_arguments(build_train_parser(prog="teratron estimate")).print_help()
        raise SystemExit(0)
    own, rest = add_arguments(ArgumentParser(prog="teratron estimate", add_help=False,
                                             allow_abbrev=False)).parse_known_args(argv)
    args = parse_train_args(rest, defaults=None if not rest else [])
    vars(args).update(vars(own))
    return args


def default_world_size(args) -> int:
    return args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size


def run(args) -> int:
    from teratron.estimate.report import estimate_from_args, format_table

    world_size = default_world_size(args) if args.world_size is None else args.world_size
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    # With --json stdout is the JSON alone: the run description's NOTEs go to stderr.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        estimate = estimate_from_args(args, world_size, args.target_device)
    print(json.dumps(estimate.to_json(), indent=1) if args.json else format_table(estimate))
    return 0


def main(argv=None) -> int:
    return run(parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
