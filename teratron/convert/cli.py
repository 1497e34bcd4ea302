"""`teratron convert import-hf | export-hf`: Hugging Face folders <-> teratron checkpoints (CPU only).

    teratron convert import-hf --hf-path DIR --save CKPT [--tensor-model-parallel-size N
                                                          --pipeline-model-parallel-size M
                                                          --expert-model-parallel-size E
                                                          --moe-grouped-gemm]
    teratron convert export-hf --load CKPT --out DIR [--max-shard-size 5GB] [--dtype bf16]
    teratron convert gpt-to-hybrid --load GPT --save OUT --hybrid-layer-pattern "M*-M*-" [--mamba-state-dim N
                                   --mamba-head-dim P --mamba-num-groups G --mamba-num-heads H --seed S
                                   --spec megatron.core.models.hybrid.hybrid_layer_specs gdp_stack_spec
                                   --gdp-num-householder M]
    teratron convert hybrid-to-gpt --load HYBRID --save OUT
"""

import re

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text.upper())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r}: give a positive size such as 5GB, 500MB or 1000000")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def add_arguments(parser):
    sub = parser.add_subparsers(dest="convert_command", required=True,
                                metavar="{import-hf,export-hf,gpt-to-hybrid,hybrid-to-gpt}")
    imp = sub.add_parser("import-hf", help="Hugging Face folder -> teratron checkpoint.")
    imp.add_argument("--hf-path", required=True, help="Folder with config.json and *.safetensors.")
    imp.add_argument("--save", required=True, help="Checkpoint folder to write (iteration 0).")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size the model must split into.")
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size the model must split into.")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                     help="Pad the vocabulary to a multiple of this times the TP size (as training does).")
    imp.add_argument("--expert-model-parallel-size", type=int, default=1,
                     help="EP size the experts must split into (MoE models).")
    imp.add_argument("--moe-grouped-gemm", action="store_true",
                     help="Store experts as GroupedMLP weights, for training with --moe-grouped-gemm (MoE models).")
    exp = sub.add_parser("export-hf", help="teratron checkpoint -> Hugging Face folder.")
    exp.add_argument("--load", required=True, help="Checkpoint folder (its latest iteration) or an iter_* folder.")
    exp.add_argument("--out", required=True, help="New folder for the Hugging Face model.")
    exp.add_argument("--max-shard-size", default="5GB", help="Largest safetensors file (e.g. 5GB, 500MB).")
    exp.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="Cast the weights (default: as saved).")
    to_hybrid = sub.add_parser("gpt-to-hybrid", help="GPT checkpoint -> hybrid checkpoint (docs/hybrid.md).")
    to_hybrid.add_argument("--load", required=True, help="GPT checkpoint folder (its latest iteration) or iter_*.")
    to_hybrid.add_argument("--save", required=True, help="New save directory for the hybrid checkpoint.")
    to_hybrid.add_argument("--hybrid-layer-pattern", required=True,
                           help="The hybrid layers: one '*' and one '-' (or 'E' for MoE) per GPT layer, in order, "
                                "with Mamba layers (M) anywhere.")
    to_hybrid.add_argument("--mamba-state-dim", type=int, default=128, help="New Mamba layers' state size.")
    to_hybrid.add_argument("--mamba-head-dim", type=int, default=64, help="New Mamba layers' head size.")
    to_hybrid.add_argument("--mamba-num-groups", type=int, default=8, help="New Mamba layers' groups.")
    to_hybrid.add_argument("--mamba-num-heads", type=int, default=None, help="New Mamba layers' heads.")
    to_hybrid.add_argument("--spec", nargs="+", default=None, metavar=("MODULE", "NAME"),
                           help="Megatron's hybrid stack, as `teratron train` takes it: '... gdp_stack_spec' makes "
                                "the new M layers Gated Delta Product mixers (default: Mamba-2).")
    to_hybrid.add_argument("--gdp-num-householder", type=int, default=3,
                           help="New Gated Delta Product layers' Householder substeps per token.")
    to_hybrid.add_argument("--seed", type=int, default=1234, help="Seed of the new M layers' initialisation.")
    to_gpt = sub.add_parser("hybrid-to-gpt", help="Hybrid checkpoint -> GPT checkpoint (Mamba layers dropped).")
    to_gpt.add_argument("--load", required=True, help="Hybrid checkpoint folder or iter_* folder.")
    to_gpt.add_argument("--save", required=True, help="New save directory for the GPT checkpoint.")
    return parser


def run(args) -> int:
    from teratron.convert.hf import export_hf, import_hf

    if args.convert_command in ("gpt-to-hybrid", "hybrid-to-gpt"):
        return _translate(args)
    if args.convert_command == "import-hf":
        for flag, value in (("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                            ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
                            ("--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by),
                            ("--expert-model-parallel-size", args.expert_model_parallel_size)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        folder = import_hf(args.hf_path, args.save, args.tensor_model_parallel_size,
                           args.pipeline_model_parallel_size, args.make_vocab_size_divisible_by,
                           args.expert_model_parallel_size, args.moe_grouped_gemm)
        print(f"imported {args.hf_path} -> {folder}")
    else:
        out = export_hf(args.load, args.out, parse_size(args.max_shard_size), _DTYPES.get(args.dtype))
        print(f"exported {args.load} -> {out}")
    return 0


def _translate(args) -> int:
    from teratron.convert.hybrid_translation import gpt_to_hybrid, hybrid_to_gpt

    if args.convert_command == "hybrid-to-gpt":
        folder = hybrid_to_gpt(args.load, args.save)
    else:
        mamba = {name: getattr(args, name) for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
                                                        "mamba_num_heads", "spec", "gdp_num_householder")}
        folder = gpt_to_hybrid(args.load, args.save, args.hybrid_layer_pattern, mamba, args.seed)
    print(f"translated {args.load} -> {folder} (model weights only: train it with --load {args.save} --finetune)")
    return 0
