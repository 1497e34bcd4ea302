"""Megatron-LM's own checkpoints (`--ckpt-format torch_dist`), read into any teratron layout.

A Megatron-LM iteration folder holds torch.distributed.checkpoint files like teratron's, with
other names for the same global tensors:

    metadata.json        {"sharded_backend": "torch_dist", ...} (no teratron "format")
    .metadata, *.distcp  the model as boxes of global tensors, and `common_state` (an object:
                         args, iteration, checkpoint_version, the scheduler)

    teratron                                    Megatron-LM
    decoder.layers.<i>.<name>                   decoder.layers.<name>, layer i of a tensor stacked
                                                over the layers ([L, ...]; per-layer keys
                                                `decoder.layers.<i>.<name>` when Megatron saved
                                                its layers apart, e.g. MoE every other layer)
    decoder.layers.<i>.input_layernorm.*        ...self_attention.linear_qkv.layer_norm_* (Megatron
    decoder.layers.<i>.pre_mlp_layernorm.*      ...mlp.linear_fc1.layer_norm_*    keeps the norms
                                                under Transformer Engine's fused names, whichever
                                                layer implementation wrote them)

Every other name and every tensor's row layout (QKV grouped per query group, SwiGLU's gate and
up halves, vocabulary padding) is the same, so reading is teratron's own sharded load with keys
translated: each teratron box becomes a view of the Megatron box it is (a leading layer axis of
one), and DCP fills it in place under any TP / PP / DP layout. `_extra_state` objects (Transformer
Engine's FP8 metadata) are not read. Nothing read runs code (`safe_load`).
"""

import argparse
import json
import os
import re

from teratron.dist_checkpointing import serialization, storage
from teratron.dist_checkpointing.mapping import ShardedTensor
from teratron.dist_checkpointing.model_state import model_sharded_items, param_layouts, unwrap
from teratron.dist_checkpointing.optimizer_state import load_optimizer_common_state, prepare_for_load

SHARDED_BACKEND = "torch_dist"
COMMON_STATE_KEY = "common_state"
_OPTIMIZER_STATE = "optimizer.state."
TERATRON_RECORD = "teratron_record"  # a teratron-written torch_dist checkpoint's model args and tokenizer
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


def is_megatron_checkpoint(checkpoint_dir: str) -> bool:
    """Whether `checkpoint_dir` is an iteration folder Megatron-LM wrote (torch_dist)."""
    path = os.path.join(checkpoint_dir, storage.METADATA_FILENAME)
    try:
        with open(path) as f:
            metadata = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(metadata, dict) and "format" not in metadata and \
        metadata.get("sharded_backend") == SHARDED_BACKEND


def _split_prefix(key: str) -> tuple:
    """(optimizer-state prefix or '', the model key): optimizer.state.<name>.<model key>."""
    if key.startswith(_OPTIMIZER_STATE):
        name, rest = key[len(_OPTIMIZER_STATE):].split(".", 1)
        return f"{_OPTIMIZER_STATE}{name}.", rest
    return "", key


def _megatron_box(item: ShardedTensor, saved: dict, num_layers: int) -> ShardedTensor:
    """The Megatron key and box of a teratron box (a view of the same data), as `saved` has it."""
    prefix, key = _split_prefix(item.key)
    match = _LAYER.match(key)
    if match is None:
        return item
    layer, name = int(match.group(1)), match.group(2)
    for candidate in (_FUSED_NORMS.get(name), name):
        if candidate is None:
            continue
        if f"{prefix}decoder.layers.{layer}.{candidate}" in saved:  # saved layer by layer
            return ShardedTensor(f"{prefix}decoder.layers.{layer}.{candidate}", item.data, item.global_shape,
                                 item.global_offset, item.resizable_rows, item.replica)
        if f"{prefix}decoder.layers.{candidate}" in saved:  # stacked over the layers
            return ShardedTensor(f"{prefix}decoder.layers.{candidate}", item.data.unsqueeze(0),
                                 (num_layers,) + tuple(item.global_shape), (layer,) + tuple(item.global_offset),
                                 item.resizable_rows, item.replica)
    return item  # reported missing by the load, under teratron's name


def _teratron_view(saved: dict, num_layers: int) -> dict:
    """The saved keys and global shapes under teratron's names (a stacked tensor is num_layers
    tensors of its shape without the layer axis)."""
    unfused = {fused: name for name, fused in _FUSED_NORMS.items()}
    view = {}
    for full_key, shape in saved.items():
        prefix, key = _split_prefix(full_key)
        match = _LAYER.match(key)
        if match is not None:  # per layer
            view[f"{prefix}decoder.layers.{match.group(1)}.{unfused.get(match.group(2), match.group(2))}"] = shape
        elif key.startswith("decoder.layers.") and shape is not None:  # stacked
            name = key[len("decoder.layers."):]
            for layer in range(num_layers):
                view[f"{prefix}decoder.layers.{layer}.{unfused.get(name, name)}"] = tuple(shape[1:])
        else:
            view[full_key] = shape
    return view


def to_megatron_items(items: list, num_layers: int, stacked: bool) -> list:
    """This rank's teratron items (model, and optimizer states named after the model's keys)
    under Megatron-LM's names: layers stacked over `num_layers` when `stacked` (Megatron's rule:
    every layer alike), else per layer; the attention norm under its fused name, the MLP norm too
    where the layer's MLP is dense (an MoE layer keeps `pre_mlp_layernorm`)."""
    dense = {match.group(1) for match in map(_LAYER.match, (item.key for item in items))
             if match is not None and match.group(2) == "mlp.linear_fc1.weight"}
    out = []
    for item in items:
        prefix, key = _split_prefix(item.key)
        match = _LAYER.match(key) if isinstance(item, ShardedTensor) else None
        if match is None:
            out.append(item)
            continue
        layer, name = match.group(1), match.group(2)
        if name.startswith("input_layernorm.") or (name.startswith("pre_mlp_layernorm.") and layer in dense):
            name = _FUSED_NORMS[name]
        if stacked:
            out.append(ShardedTensor(f"{prefix}decoder.layers.{name}", item.data.unsqueeze(0),
                                     (num_layers,) + tuple(item.global_shape), (int(layer),) + tuple(item.global_offset),
                                     item.resizable_rows, item.replica))
        else:
            out.append(ShardedTensor(f"{prefix}decoder.layers.{layer}.{name}", item.data, item.global_shape,
                                     item.global_offset, item.resizable_rows, item.replica))
    return out


def megatron_common_state(common: dict, metadata: dict, iteration: int) -> dict:
    """Megatron-LM's common state of a teratron save: its args (a Namespace of Megatron's flag
    names: the model's, and the consumed samples it resumes from), checkpoint_version 3.0,
    iteration and scheduler; teratron's own common entries ride along under their names, and its
    metadata.json record (model args, tokenizer) and run description (`run_args`) under
    TERATRON_RECORD."""
    args = argparse.Namespace(**metadata.get("model_args", {}), ckpt_format=SHARDED_BACKEND,
                              consumed_train_samples=common.get("consumed_train_samples", 0),
                              consumed_valid_samples=common.get("consumed_valid_samples", 0))
    return {**common, "args": args, "checkpoint_version": 3.0, "iteration": iteration,
            TERATRON_RECORD: {**{key: metadata[key] for key in ("model_args", "tokenizer") if key in metadata},
                              "run_args": common.get("args")}}


def stacking(model_chunks) -> dict:
    """to_megatron_items' num_layers and stacked for this model (Megatron stacks the layers
    unless they differ: MoE on some layers only)."""
    config = unwrap(model_chunks[0]).config
    freq = config.moe_layer_freq
    uniform = config.num_moe_experts is None or (isinstance(freq, int) and freq == 1)
    return {"num_layers": config.num_layers, "stacked": uniform}


def megatron_metadata() -> dict:
    """metadata.json of a Megatron-LM torch_dist checkpoint."""
    return {"sharded_backend": SHARDED_BACKEND, "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}


def _is_megatron_model_key(key: str) -> bool:
    return not key.startswith(("optimizer.", "rng_state", COMMON_STATE_KEY)) and "_extra_state" not in key


def read_common_state(checkpoint_dir: str) -> dict:
    """Megatron's common state (args, iteration, checkpoint_version, opt_param_scheduler, ...):
    the `common_state` object of the DCP files, or a `common.pt` file (older Megatron-LM)."""
    saved = serialization.saved_keys(checkpoint_dir)
    keys = [key for key in saved if key == COMMON_STATE_KEY or key.startswith(COMMON_STATE_KEY + "/")]
    if not keys:
        from teratron.dist_checkpointing.safe_load import read_common_state as read_common_file

        return read_common_file(checkpoint_dir)
    common = serialization.load_full(checkpoint_dir, lambda key: key == keys[0])[keys[0]]
    if isinstance(common, list) and len(common) == 1:  # Megatron saves it as a one-item list
        common = common[0]
    if not isinstance(common, dict):
        raise storage.DamagedCheckpointError(f"{checkpoint_dir}: Megatron-LM's common state is a "
                                             f"{type(common).__name__}, not a dict; the checkpoint is damaged")
    return common


def load_megatron_checkpoint(checkpoint_dir: str, model_chunks, num_layers: int, optimizer=None,
                             source: str = "--load") -> dict:
    """Load a torch_dist folder into `model_chunks` (any layout; a collective over the ranks) and,
    given an `optimizer`, its optimizer state (written by teratron in Megatron's model-space
    names); returns the common state."""
    saved = serialization.saved_keys(checkpoint_dir)
    common = read_common_state(checkpoint_dir)
    layouts = param_layouts(model_chunks)
    items = model_sharded_items(model_chunks)
    refresh_masters = False
    if optimizer is not None:
        if "optimizer" not in common or not any(key.startswith(_OPTIMIZER_STATE) for key in saved):
            raise ValueError(f"{source} {checkpoint_dir}: a checkpoint Megatron-LM wrote; teratron reads its model "
                             "weights but not yet Megatron's own optimizer state; add --no-load-optim (continue at "
                             "its iteration with a fresh optimizer) or --finetune")
        optimizer_items, refresh_masters = prepare_for_load(optimizer, layouts, _teratron_view(saved, num_layers))
        items += optimizer_items
    items = [_megatron_box(item, saved, num_layers) for item in items]
    serialization.load(items, checkpoint_dir, unexpected_filter=_is_megatron_model_key)
    if optimizer is not None:
        load_optimizer_common_state(optimizer, common["optimizer"], f"{source} {checkpoint_dir}")
        if refresh_masters:
            optimizer.reload_model_params()
    return common

