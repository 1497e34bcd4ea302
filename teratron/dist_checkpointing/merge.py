"""Weighted merge of checkpoints: `teratron merge --inputs A B C --weights 0.5 0.3 0.2 --output OUT`.

CPU only, one process, no model built: the structure comes from the checkpoints' metadata.
The output holds sum_i w_i * x_i for every floating-point model tensor (accumulated in float64,
stored in the inputs' dtype); non-floating tensors must be equal in every input and are copied.
Weights are used as given (they need not sum to 1) unless `--normalize` divides them by their sum.

Every input's files are checked against their recorded checksums first, and nothing read from
them can run code (`safe_load`).

Fail-closed: the inputs must have the same model args and the same model tensors (keys, global
shapes, dtypes, chunking); any difference refuses with the reason before anything is written.
The recorded layouts themselves need not match: an import (which records only TP/PP/EP) merges
with a run fine-tuned from it, since the chunks show whether the tensors were stored alike.
The output is a new save directory, written in a hidden folder beside OUT and renamed into
place when complete; it loads like any checkpoint (its optimizer state and RNG states are
dropped: resume from it with --no-load-optim --no-load-rng, or --finetune), and its
metadata.json records the inputs, the weights and that the optimizer state was dropped.
"""

import math
import os

import torch

from teratron.dist_checkpointing import serialization, storage
from teratron.dist_checkpointing.checkpoint import save_model_tensors
from teratron.dist_checkpointing.model_state import is_model_key
from teratron.dist_checkpointing.safe_load import read_common_state


def _model_tensors(checkpoint_dir):
    """key -> (global shape, dtype, sorted chunk boxes) of the model's tensors."""
    out = {}
    for key, md in serialization.read_metadata(checkpoint_dir).state_dict_metadata.items():
        if is_model_key(key):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(md, "chunks", []))
            dtype = md.properties.dtype if hasattr(md, "properties") else None
            out[key] = (tuple(md.size) if hasattr(md, "size") else None, dtype, chunks)
    return out


def model_arg_values(name: str, *labelled) -> str:
    """A model arg and its values, e.g. 'ffn_hidden_size (first input 32, this input 64)'. The
    `teratron merge` command passes `training.arguments.flag_values` instead, which names the flag."""
    return f"{name} ({', '.join(f'{label} {value}' for label, value in labelled)})"


def _differences(a: dict, b: dict, describe) -> list:
    return [describe(k, ("first input", a.get(k)), ("this input", b.get(k)))
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def check_compatible(checkpoint_dirs: list, describe=model_arg_values) -> dict:
    """The shared model structure; raises ValueError naming the first incompatibility (model args
    that differ, each with both values written by `describe`)."""
    first, first_meta = checkpoint_dirs[0], storage.read_metadata(checkpoint_dirs[0])
    first_tensors = _model_tensors(first)
    if any(shape is None for shape, _, _ in first_tensors.values()):
        raise ValueError(f"{first}: model entries that are not tensors cannot be merged")
    for other in checkpoint_dirs[1:]:
        meta, tensors = storage.read_metadata(other), _model_tensors(other)
        diff = _differences(first_meta.get("model_args", {}), meta.get("model_args", {}), describe)
        if diff:
            raise ValueError(f"{other} holds another model than the first input {first}: model args differ: "
                             f"{'; '.join(diff)}")
        missing = sorted(set(first_tensors) ^ set(tensors))
        if missing:
            raise ValueError(f"{other} and {first} hold different tensors ({len(missing)}), e.g. {missing[0]}")
        for key, (shape, dtype, chunks) in first_tensors.items():
            other_shape, other_dtype, other_chunks = tensors[key]
            if other_shape != shape:
                raise ValueError(f"{key}: shape {other_shape} in {other}, {shape} in {first}")
            if other_dtype != dtype:
                raise ValueError(f"{key}: dtype {other_dtype} in {other}, {dtype} in {first}")
            if other_chunks != chunks:
                raise ValueError(f"{key}: saved in other chunks in {other} than in {first}; merge "
                                 "checkpoints of the same layout")
    return first_tensors


def _check_weights(inputs, weights, normalize) -> list:
    if len(inputs) < 2:
        raise ValueError("--inputs: give at least two checkpoints to merge")
    if len(weights) != len(inputs):
        raise ValueError(f"--weights: {len(weights)} weights for {len(inputs)} --inputs; give one per input")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"--weights {weights}: every weight must be a positive finite number")
    total = sum(weights)
    return [w / total for w in weights] if normalize else list(weights)


def _merge_tensor(key, checkpoint_dirs, coefficients):
    tensors = [serialization.load_full(d, lambda k: k == key)[key] for d in checkpoint_dirs]
    if not tensors[0].is_floating_point():
        if not all(torch.equal(tensors[0], t) for t in tensors[1:]):
            raise ValueError(f"{key}: a non-floating tensor differs between the inputs; it cannot be averaged")
        return tensors[0]
    acc = torch.zeros(tensors[0].shape, dtype=torch.float64)
    for c, t in zip(coefficients, tensors):
        acc += c * t.to(torch.float64)
    return acc.to(tensors[0].dtype)


def merge_checkpoints(inputs: list, weights: list, output: str, normalize: bool = False,
                      describe=model_arg_values) -> str:
    """Write the weighted merge of `inputs` (save dirs or iteration folders) as the new save
    directory `output`; returns its iteration folder. `describe` writes a model arg that differs
    (see `check_compatible`)."""
    coefficients = _check_weights(inputs, weights, normalize)
    if os.path.exists(output):
        raise FileExistsError(f"--output {output}: already exists; merge into a new folder")
    dirs = [os.path.abspath(storage.resolve_checkpoint_dir(path, "--inputs")) for path in inputs]
    metas = [storage.read_metadata(d) for d in dirs]
    for folder, meta in zip(dirs, metas):
        storage.verify_files(folder, meta)
    structure = check_compatible(dirs, describe)
    iteration = max(m.get("iteration", 0) for m in metas)
    merged = {key: _merge_tensor(key, dirs, coefficients) for key in structure}

    common = read_common_state(dirs[[m.get("iteration", 0) for m in metas].index(iteration)])
    common.pop("optimizer", None)
    common.pop("opt_param_scheduler", None)
    return save_model_tensors(output, iteration, merged, common, {
        "model_args": metas[0].get("model_args"), "layout": metas[0].get("layout"), "has_optimizer": False,
        "has_rng": False, "merge": {"inputs": dirs, "weights": list(weights), "coefficients": coefficients,
                                    "normalized": normalize, "optimizer_state": "dropped"}}, dirs[0])


def add_arguments(parser):
    parser.add_argument("--inputs", nargs="+", required=True, help="Checkpoints (save dirs or iter_* folders).")
    parser.add_argument("--weights", nargs="+", type=float, required=True, help="One positive weight per input.")
    parser.add_argument("--output", required=True, help="New save directory for the merged checkpoint.")
    parser.add_argument("--normalize", action="store_true", help="Divide the weights by their sum.")
    return parser


def run(args, describe=model_arg_values) -> int:
    folder = merge_checkpoints(args.inputs, args.weights, args.output, args.normalize, describe)
    print(f"merged {len(args.inputs)} checkpoints -> {folder} (model weights only; optimizer state dropped)")
    return 0
