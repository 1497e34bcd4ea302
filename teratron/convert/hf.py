"""Hugging Face <-> teratron: a model in memory, or a checkpoint on disk.

    model, config = from_hf("path/to/llama")          single-process GPTModel (fp32 by default)
    load_hf_weights("path/to/llama", model_chunks)   fill a model of any TP/PP/EP layout (this rank's part)
    import_hf("path/to/llama", "ckpt", tp=2, pp=2)   a sharded checkpoint (loads into any layout)
    export_hf("ckpt", "out")                          safetensors + config.json + tokenizer files
                                                     (the tokenizer the model was trained with: `hf_tokenizer`)

Weights map through the tables of `hf_mapping`; the config through `hf_config` (MoE fields:
`hf_moe`; DeepSeek-V3: `hf_deepseek`; gpt-oss: `hf_gpt_oss`; GPT-2: `hf_gpt2`; the hybrid models of
Nemotron-H: `hf_nemotron_h` and Qwen3-Next: `hf_qwen3_next`). The vocabulary of `from_hf` is
exactly the HF one (no padding), so logits compare one to one; checkpoints are padded like a
training run (`make_vocab_size_divisible_by` x TP) and exports cut the padding off.

Reading streams the files shard by shard (`hf_mapping.stream_hf_to_teratron`), dtypes as stored:
`load_hf_weights` copies each converted tensor's boxes into the rank's parameters and drops it,
and `import_hf` has each tensor produced as the checkpoint writer reaches it, so neither holds
more than one shard (plus the inputs of tensors spanning shards) besides, for a model, its own
parameters.
"""

import argparse
import contextlib
import json
import os
import shutil

import torch

from teratron.convert.hf_config import GDP_HAS_NO_FAMILY, hf_config_from_model_args, model_args_from_hf
from teratron.convert.hf_deepseek import check_mtp_copies, mtp_args, rope_layout_fix
from teratron.convert.hf_gpt2 import lm_head_model_names
from teratron.convert.hf_mapping import check_hf_tensors, mtp_copies, stream_hf_to_teratron, teratron_to_hf
from teratron.convert.hf_moe import moe_training_config_from_hf
from teratron.convert.hf_tokenizer import (GENERATION_CONFIG, TOKENIZER_FILES, token_ids, trained_tokenizer,
                                           write_tokenizer)
from teratron.convert.safetensors_io import HFWeights, readable_by_others, save_hf_weights
from teratron.dist_checkpointing import serialization, storage
from teratron.dist_checkpointing.mapping import ShardedTensor
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.dist_checkpointing.model_state import is_model_key, model_sharded_items, unwrap
from teratron.dist_checkpointing.safe_load import read_common_state
from teratron.models.gpt.builder import build_gpt_model
from teratron.process_groups import ProcessGroupCollection
from teratron.topology import current_topology, set_current_topology
from teratron.transformer.moe import moe_layer_pattern

# Files of an HF model folder besides the weights: config, generation defaults, tokenizer.
HF_SIDE_FILES = ("config.json", GENERATION_CONFIG) + TOKENIZER_FILES


def read_hf_config(path: str) -> dict:
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"--hf-path {path}: no config.json; pass a Hugging Face model folder")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_file}: not valid JSON ({e}); restore the model's config.json") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: holds a {type(config).__name__}, not a JSON object; restore the "
                         "model's config.json")
    return config


def _read_hf_folder(path: str) -> tuple:
    """(config.json, HFWeights) of an HF folder; a GPT-2's tensors by GPT2LMHeadModel's names."""
    hf = read_hf_config(path)
    weights = HFWeights(path)
    if hf.get("model_type") == "gpt2":
        weights.rename(lm_head_model_names(list(weights.shapes)))
    return hf, weights


@contextlib.contextmanager
def _one_process():
    """Models built inside are single-process ones (groups of one) even in a parallel run: the
    whole model, as from_hf and the shape check need it."""
    previous = current_topology()
    set_current_topology(None)
    try:
        yield
    finally:
        set_current_topology(previous)


def expected_hf_shapes(model_args: dict, family: str) -> dict:
    """HF tensor name -> shape for the model of `model_args`: the parameters of the model built on
    the meta device (no memory) mapped through the export transforms, so the import expects
    exactly what an export of that model writes."""
    model_config = gpt_config_from_model_args(model_args, perform_initialization=False)
    with torch.device("meta"), _one_process():
        model = build_gpt_model(model_config, pg_collection=ProcessGroupCollection())
    return {name: tuple(t.shape) for name, t in teratron_to_hf(model.state_dict(), model_args, family).items()}


def _model_args(path, hf, weights, make_vocab_size_divisible_by=1, tensor_model_parallel_size=1) -> dict:
    """The model args of the HF folder: its config's, with DeepSeek-V3's MTP layers when the
    files hold them."""
    source = f"--hf-path {path}"
    model_args = model_args_from_hf(hf, source, make_vocab_size_divisible_by, tensor_model_parallel_size)
    if hf["model_type"] == "deepseek_v3":
        model_args.update(mtp_args(hf, weights.shapes, source))
    return model_args


def _check_hf(path, model_args, hf, weights) -> None:
    """Every file's header matches the config (names and shapes); DeepSeek's MTP copies are copies."""
    family, source = hf["model_type"], f"--hf-path {path}"
    check_hf_tensors(weights, expected_hf_shapes(model_args, family), model_args, family, source)
    if family == "deepseek_v3":
        check_mtp_copies(weights.read, weights.shapes, mtp_copies(model_args), source)


def _stream(model_args, hf, weights, meta: bool = False):
    """(teratron name, global tensor) of the checked HF folder, shard by shard."""
    fix = rope_layout_fix(hf) if hf["model_type"] == "deepseek_v3" else None
    return stream_hf_to_teratron(weights, model_args, hf["model_type"], fix, meta)


def _copy_box(box: ShardedTensor, tensor: torch.Tensor, source: str) -> None:
    """Copy the box's part of the global `tensor` into it; vocabulary rows past the files' are
    the model's padding (zero)."""
    fits = tuple(tensor.shape[1:]) == tuple(box.global_shape[1:]) if box.resizable_rows \
        else tuple(tensor.shape) == tuple(box.global_shape)
    if not fits:
        raise ValueError(f"{source}: {box.key} has shape {list(tensor.shape)} in the files but "
                         f"{list(box.global_shape)} in the model; build the model from this folder's config.json")
    data = box.data
    if box.resizable_rows:
        keep = max(0, min(data.shape[0], tensor.shape[0] - box.global_offset[0]))
        data.narrow(0, keep, data.shape[0] - keep).zero_()
        data = data.narrow(0, 0, keep)
    region = tuple(slice(offset, offset + length) for offset, length in zip(box.global_offset, data.shape))
    with torch.no_grad():
        data.copy_(tensor[region])


def _fill(model_chunks, stream, source: str, pg_collection=None) -> None:
    """Copy each streamed tensor's boxes into the chunks' parameters (this rank's); tensors of
    other ranks' parameters are dropped as they come."""
    boxes = {}
    for item in model_sharded_items(model_chunks, pg_collection):
        boxes.setdefault(item.key, []).append(item)
    for key, tensor in stream:
        for box in boxes.pop(key, ()):
            _copy_box(box, tensor, source)
        del tensor  # before the stream reads on
    if boxes:
        more = f" (and {len(boxes) - 1} more)" if len(boxes) > 1 else ""
        raise ValueError(f"{source}: the model has {sorted(boxes)[0]}{more}, which the files do not give; build "
                         "the model from this folder's config.json")


def load_hf_weights(path: str, model_chunks, pg_collection=None) -> None:
    """Fill this rank's parameters of `model_chunks` (a GPTModel's chunks in any TP/PP/EP layout,
    built from the folder's config.json, e.g. through `model_args_from_hf`) from the HF folder
    `path`, read shard by shard: a rank holds its own parameters plus at most one shard and the
    inputs of tensors spanning shards, never the whole model."""
    config = unwrap(model_chunks[0]).config
    if config.gdp_layers:
        raise ValueError(f"--hf-path {path}: the model to fill has {GDP_HAS_NO_FAMILY}; build it from the folder's "
                         "config.json (model_args_from_hf), without gdp_layers")
    hf, weights = _read_hf_folder(path)
    model_args = _model_args(path, hf, weights)
    if model_args["num_experts"]:
        model_args["moe_grouped_gemm"] = config.moe_grouped_gemm
    _check_hf(path, model_args, hf, weights)
    _fill(model_chunks, _stream(model_args, hf, weights), f"--hf-path {path}", pg_collection)


def from_hf(path: str, params_dtype: torch.dtype = torch.float32, moe_grouped_gemm: bool = False):
    """(GPTModel, TransformerConfig) of the HF model in `path`, in this process alone; MoE
    experts as GroupedMLP with `moe_grouped_gemm`, and the config carries the model's aux-loss
    coefficient for training it."""
    hf, weights = _read_hf_folder(path)
    model_args = _model_args(path, hf, weights)
    if moe_grouped_gemm and not model_args["num_experts"]:
        raise ValueError(f"from_hf({path!r}, moe_grouped_gemm=True): the model is dense; leave it False")
    overrides = {}
    if model_args["num_experts"]:
        model_args["moe_grouped_gemm"] = moe_grouped_gemm
        overrides = moe_training_config_from_hf(hf)
    model_config = gpt_config_from_model_args(model_args, params_dtype=params_dtype, perform_initialization=False,
                                              **overrides)
    config = model_config.transformer
    with _one_process():
        model = build_gpt_model(model_config, pg_collection=ProcessGroupCollection())
    _check_hf(path, model_args, hf, weights)
    _fill([model], _stream(model_args, hf, weights), f"--hf-path {path}")
    return model.eval(), config


def _copy_side_files(src: str, dst: str, skip=()) -> None:
    """Copies with the mode `open` gives (readable by others), whatever the source's."""
    os.makedirs(dst, exist_ok=True)
    for name in HF_SIDE_FILES:
        if name not in skip and os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
            readable_by_others(os.path.join(dst, name))


def _check_mlp_split(model_args: dict, config) -> None:
    """The MLP sizes split over TP (dense layers) and expert-TP (experts)."""
    a, tp = model_args, config.tensor_model_parallel_size
    moe = moe_layer_pattern(a["num_layers"], a["moe_layer_freq"]) if a["num_experts"] else [0]
    if not all(moe) and a["ffn_hidden_size"] % tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} does not divide the MLP size "
                         f"({a['ffn_hidden_size']}); choose a TP size that does")
    etp = config.expert_tensor_parallel_size
    if any(moe) and a["moe_ffn_hidden_size"] % etp:
        raise ValueError(f"the expert-tensor-parallel size {etp} (the TP size) does not divide the experts' MLP "
                         f"size ({a['moe_ffn_hidden_size']}); choose a TP size that does")


def import_hf(hf_path: str, save: str, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
              make_vocab_size_divisible_by: int = 128, expert_model_parallel_size: int = 1,
              moe_grouped_gemm: bool = False) -> str:
    """Write the HF model as iteration 0 of the save directory `save`; returns its folder.

    The sharded format is layout-free (any TP/PP/EP loads it); the given sizes are checked
    against the model (heads, groups, layers, experts must split) and recorded as the layout it
    was made for. MoE experts are stored as GroupedMLP weights with `moe_grouped_gemm` (train
    with --moe-grouped-gemm), else per expert (SequentialMLP)."""
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    hf, weights = _read_hf_folder(hf_path)
    model_args = _model_args(hf_path, hf, weights, make_vocab_size_divisible_by, tp)
    if not model_args["num_experts"] and (ep > 1 or moe_grouped_gemm):
        raise ValueError(f"--hf-path {hf_path} holds a dense model; --expert-model-parallel-size and "
                         "--moe-grouped-gemm apply to MoE models only")
    if model_args["num_experts"]:
        model_args["moe_grouped_gemm"] = moe_grouped_gemm
        if model_args["num_experts"] % ep:
            raise ValueError(f"--expert-model-parallel-size {ep} does not divide the model's "
                             f"{model_args['num_experts']} experts; choose an EP size that does")
    # Experts with biases (gpt-oss) stay whole on every TP rank: teratron runs them at expert-TP 1.
    etp = 1 if model_args["num_experts"] and model_args["add_bias_linear"] else tp
    config = gpt_config_from_model_args(model_args, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp).transformer
    _check_mlp_split(model_args, config)
    if os.path.exists(save) and os.listdir(save):
        raise FileExistsError(f"--save {save}: exists and is not empty; import into a new folder")
    _check_hf(hf_path, model_args, hf, weights)
    created = not os.path.exists(save)
    try:
        tmp = storage.temporary_dir(save, 0)
        os.makedirs(tmp)
        _save_streamed(model_args, hf, weights, tmp)
        storage.write_metadata(tmp, {
            "iteration": 0, "model_args": model_args, "has_optimizer": False,
            "layout": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                       "expert_model_parallel_size": ep},
            "source": {"huggingface": os.path.abspath(hf_path)}, "files": storage.record_files(tmp),
        })
        _copy_side_files(hf_path, os.path.join(save, storage.HF_DIRNAME))
        return storage.publish(save, 0)
    except BaseException:  # leave `save` as it was (absent or empty), so a retry can use it
        shutil.rmtree(save, ignore_errors=True)
        if not created:
            os.makedirs(save, exist_ok=True)
        raise


def _save_streamed(model_args, hf, weights, checkpoint_dir: str) -> None:
    """The HF tensors as a layout-free DCP checkpoint: planned from the headers (the stream run on
    the meta device), each tensor produced by the stream as the writer reaches it."""
    planned = [ShardedTensor(key, t, tuple(t.shape), (0,) * t.dim())
               for key, t in _stream(model_args, hf, weights, meta=True)]
    stream = _stream(model_args, hf, weights)

    def resolve(item):
        key, tensor = next(stream)
        assert key == item.key, f"the HF stream gives {key} where the writer expects {item.key}"
        return tensor
    serialization.save(planned, checkpoint_dir, no_dist=True, resolve=resolve)
    assert next(stream, None) is None, "the HF stream gives more tensors than were planned"


def _trained_aux_loss_coeff(common: dict):
    """The aux-loss coefficient of the training run that saved the checkpoint (its common state;
    None: an import, or a run without an aux loss)."""
    args = common.get("args")
    if isinstance(args, argparse.Namespace):  # checkpoints before the run description: the flags
        args = vars(args)
    elif isinstance(args, dict) and "model" in args:  # a RunConfig's record
        args = args["model"]["transformer"]
    args = args or {}
    types = args.get("moe_router_load_balancing_type")
    coeffs = args.get("moe_aux_loss_coeff")
    types, coeffs = (v if isinstance(v, list) else [v] for v in (types, coeffs))
    return next((float(c) for t, c in zip(types, coeffs) if t == "aux_loss"), None)


def _check_export_shapes(tensors: dict, model_args: dict, family: str, checkpoint_dir: str) -> None:
    """Every exported tensor has the shape the written config.json gives it, so transformers can
    load the folder (a checkpoint imported without shape checks may not)."""
    expected = expected_hf_shapes(model_args, family)
    wrong = [name for name in sorted(tensors) if tuple(tensors[name].shape) != expected[name]]
    if wrong:
        name = wrong[0]
        raise ValueError(f"--load {checkpoint_dir}: {name} would have shape {list(tensors[name].shape)} but "
                         f"the model args in metadata.json give {list(expected[name])}"
                         f"{f' (and {len(wrong) - 1} more)' if len(wrong) > 1 else ''}; the checkpoint does "
                         "not match its metadata: import or save the model again")


def _write_tokenizer(trained, hf_side: str, out: str, max_length: int) -> None:
    """The run's tokenizer (`trained`), else the imported files in `hf_side`, into `out`."""
    if trained is not None:
        write_tokenizer(trained, out, max_length)
    elif os.path.isdir(hf_side):
        _copy_side_files(hf_side, out, skip=("config.json",))
    else:
        print("NOTE: the checkpoint records no tokenizer (no hf/ files from an import, no run description); the "
              "export has no tokenizer files", flush=True)


def export_hf(load: str, out: str, max_shard_size_bytes: int = 5 * 1024**3, dtype: torch.dtype | None = None) -> str:
    """Write the checkpoint in `load` (a save directory or an iteration folder) as an HF model
    folder `out`, published by renaming a finished temporary folder."""
    checkpoint_dir = storage.resolve_checkpoint_dir(load)
    metadata = storage.read_metadata(checkpoint_dir)
    storage.verify_files(checkpoint_dir, metadata)
    model_args = metadata.get("model_args")
    if not model_args:
        raise ValueError(f"--load {checkpoint_dir}: metadata.json records no model_args, so the model cannot "
                         "be rebuilt; export a checkpoint saved by `teratron train`, import-hf or merge")
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"--out {out}: exists and is not empty; choose a new folder")
    hf_side = os.path.join(storage.checkpoint_root(checkpoint_dir), storage.HF_DIRNAME)
    base = read_hf_config(hf_side) if os.path.isfile(os.path.join(hf_side, "config.json")) else None
    common = read_common_state(checkpoint_dir)
    trained = trained_tokenizer(checkpoint_dir, metadata, common, hf_side)
    if base is not None and trained is None:  # the imported config's vocabulary (HF models often pad theirs)
        model_args = {**model_args, "vocab_size": base.get("vocab_size", model_args["vocab_size"])}
    aux_loss_coeff = _trained_aux_loss_coeff(common) if model_args.get("num_experts") else None
    hf_config = hf_config_from_model_args(model_args, base, aux_loss_coeff)
    if trained is not None:  # an imported config's ids are another tokenizer's
        hf_config.update(token_ids(trained))
    tensors = teratron_to_hf(serialization.load_full(checkpoint_dir, is_model_key), model_args,
                             hf_config["model_type"])
    _check_export_shapes(tensors, model_args, hf_config["model_type"], checkpoint_dir)
    if dtype is not None:  # DeepSeek's expert bias stays fp32, as transformers keeps it
        tensors = {k: v if k.endswith("e_score_correction_bias") else v.to(dtype) for k, v in tensors.items()}
    tmp = storage.staging_dir(out)
    try:
        save_hf_weights(tensors, tmp, max_shard_size_bytes)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2, sort_keys=True)
        _write_tokenizer(trained, hf_side, tmp, model_args["max_position_embeddings"])
        if os.path.isdir(out):
            os.rmdir(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
