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

    mtp.layers.<d>.transformer_layer.<name>     the same, with the norms under the fused names (an
                                                MTP depth's layer: never stacked)

    multi-latent attention layers (Megatron's Transformer Engine spec):
    decoder.layers.<i>.input_layernorm.*        the same (a norm module of its own)
    ...self_attention.q_layernorm.*             ...self_attention.linear_q_up_proj.layer_norm_*
    ...self_attention.kv_layernorm.*            ...self_attention.linear_kv_up_proj.layer_norm_*

    hybrid models (Megatron Core's HybridModel, whose layers are Transformer Engine's only; never stacked):
    decoder.layers.<i>.norm.*                   ...mixer.in_proj.layer_norm_*   (a Mamba or Gated Delta
                                                Product layer's norm)
    decoder.layers.<i>.input_layernorm.*        ...self_attention.in_proj.layer_norm_*   (a Gated DeltaNet
                                                layer's; an attention layer's as above)
    ...mixer.in_proj.weight                     ...mixer.in_proj.weight.<part>    the parts as tensors
    ...mixer.conv1d.{weight,bias}               ...mixer.conv1d.{weight,bias}.<part>   of their own, each
    ...self_attention.in_proj.weight            ...self_attention.in_proj.weight.<part>   part's global rows
    ...self_attention.conv1d.weight             ...self_attention.conv1d.weight.<part>    (the mixer's
                                                in_proj_parts / conv1d_parts, named by its
                                                in_proj_part_names / conv1d_part_names):
        Mamba-2 (M)                   in_proj z, x, B, C, dt; conv1d x, B, C
        Gated Delta Product (M, gdp_layers; M = gdp_num_householder)
                                      in_proj z, V0 .. V{M-1}, K0 .. K{M-1}, Q, b0 .. b{M-1}, a;
                                      conv1d V0 .. V{M-1}, K0 .. K{M-1}, Q (no bias)
        Gated DeltaNet (G)            in_proj query, key, value, z, beta, alpha; conv1d query, key, value
    decoder.final_layernorm.*                   decoder.final_norm.*
    mtp.layers.<d>.transformer_layer.layers.<j> mtp.layers.<d>.mtp_model_layer.layers.<j>

Every other name and every tensor's row layout (QKV grouped per query group, SwiGLU's gate and
up halves, vocabulary padding) is the same, so reading is teratron's own sharded load with keys
translated: each teratron box becomes a view of the Megatron box it is (a leading layer axis of
one), and DCP fills it in place under any TP / PP / DP layout. `_extra_state` objects (Transformer
Engine's FP8 metadata) are not read. Nothing read runs code (`safe_load`).
"""

import argparse
import dataclasses
import json
import os
import re

import torch

from teratron.dist_checkpointing import serialization, storage
from teratron.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from teratron.dist_checkpointing.model_state import model_sharded_items, param_layouts, unwrap
from teratron.dist_checkpointing.optimizer_state import (GROUP_SIGNATURE, load_optimizer_common_state,
                                                         prepare_for_load, report_fresh_states, set_step_count,
                                                         signed_groups, step_count)

SHARDED_BACKEND = "torch_dist"
COMMON_STATE_KEY = "common_state"
_OPTIMIZER_STATE = "optimizer.state."
TERATRON_RECORD = "teratron_record"  # a teratron-written torch_dist checkpoint's model args and tokenizer
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer)\.(.+)$")  # an MTP depth's transformer layer
# A hybrid MTP depth's layer j, under teratron's name or Megatron's
_HYBRID_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+)\.(?:transformer_layer|mtp_model_layer)\.layers\.(\d+)\.(.+)$")
# Optimizer states Megatron-LM names otherwise (the fp32 master weights); the rest share names.
_MEGATRON_STATE_NAME = {"fp32_param": "param"}
_TERATRON_STATE_NAME = {megatron: teratron for teratron, megatron in _MEGATRON_STATE_NAME.items()}
# The per-parameter optimizer state layout Megatron-LM reads in any TP / PP / DP layout (its
# --dist-ckpt-optim-fully-reshardable); its default, dp_reshardable, is the distributed optimizer's
# flat buffers, readable only into the layout that wrote them.
FULLY_RESHARDABLE = "fully_reshardable"
_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
# Multi-latent attention layers (Megatron's Transformer Engine spec): the input norm is a module of its own
# (no fused QKV projection to hold it), and the latent norms are fused into the up projections.
_MLA_NORMS = {f"self_attention.{norm}.{kind}": f"self_attention.{up}.layer_norm_{kind}"
              for norm, up in (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj"))
              for kind in ("weight", "bias")}
_MLA_MARK = "self_attention.linear_kv_down_proj.weight"  # a parameter only MLA layers have
# Hybrid models (the module docstring): the norms fused into the mixers' in_proj, the final norm's name,
# and the submodules of a mixer whose parameters Megatron stores part by part: a mixer with
# `<submodule>_part_names` (Megatron's names of the parts) and `<submodule>_parts` (their global rows).
_MAMBA_NORMS = {"norm.weight": "mixer.in_proj.layer_norm_weight", "norm.bias": "mixer.in_proj.layer_norm_bias"}
_GDN_NORMS = {"input_layernorm.weight": "self_attention.in_proj.layer_norm_weight",
              "input_layernorm.bias": "self_attention.in_proj.layer_norm_bias"}
_HYBRID_FINAL_NORM = {"decoder.final_layernorm.weight": "decoder.final_norm.weight",
                      "decoder.final_layernorm.bias": "decoder.final_norm.bias"}
_SPLIT_SUBMODULES = ("in_proj", "conv1d")


@dataclasses.dataclass(frozen=True)
class HybridLayout:
    """What Megatron names otherwise in a hybrid model: which layers are Gated DeltaNet layers
    (`_layer_key`'s layers: decoder numbers, MTP layer paths), and each split parameter's parts,
    ((name, global rows), ...), by its name in the layer."""
    gdn_layers: frozenset
    splits: dict


def _mtp_layer(depth_path: str, j) -> str:
    """teratron's path of layer j of a hybrid MTP depth `mtp.layers.<d>`."""
    return f"{depth_path}.transformer_layer.layers.{j}"


def hybrid_layout(model_chunks) -> HybridLayout | None:
    """The HybridLayout of a hybrid model (None for a GPT model)."""
    from teratron.models.hybrid import Symbols, parse_hybrid_pattern

    config = unwrap(model_chunks[0]).config
    if config.hybrid_layer_pattern is None:
        return None
    pattern = parse_hybrid_pattern(config.hybrid_layer_pattern)
    gdn = {i for i, symbol in enumerate(pattern.layers) if symbol == Symbols.GDN}
    gdn |= {_mtp_layer(f"mtp.layers.{depth}", j) for depth in range(pattern.mtp_depths)
            for j, symbol in enumerate(pattern.mtp_layers) if symbol == Symbols.GDN}
    splits = {}
    for chunk in model_chunks:
        for path, module in unwrap(chunk).named_modules():
            splits.update(_split_parameters(path, module))
    return HybridLayout(frozenset(gdn), splits)


def _split_parameters(path: str, mixer) -> dict:
    """The parameters of the module at `path` that Megatron stores part by part: their names in the layer
    -> ((part, global rows), ...), from the mixer's part names and sizes (`_SPLIT_SUBMODULES`); {} for a
    module without them."""
    out = {}
    for submodule in _SPLIT_SUBMODULES:
        names = getattr(mixer, f"{submodule}_part_names", None)
        if names is None:
            continue
        parts = tuple(zip(names, getattr(mixer, f"{submodule}_parts"), strict=True))
        for name, _ in getattr(mixer, submodule).named_parameters():
            key = _layer_key(f"{path}.{submodule}.{name}")
            if key is not None:
                out[key[1]] = parts
    return out


def mla_layers(items) -> frozenset:
    """The layers (`_layer_key`'s) of these items that are multi-latent attention layers."""
    keys = (_layer_key(_split_prefix(item.key)[1]) for item in items)
    return frozenset(key[0] for key in keys if key is not None and key[1] == _MLA_MARK)


def _megatron_names(layer, name: str, hybrid: HybridLayout | None, mla: frozenset = frozenset()) -> list:
    """Megatron's names of a layer's `name`, the one Megatron writes first: a norm under the name of
    the linear layer it is fused into, then its own (a multi-latent attention layer's input norm
    under its own first: `mla` holds those layers)."""
    if layer in mla and name in _MLA_NORMS:
        return [_MLA_NORMS[name], name]
    if layer in mla and name in _FUSED_NORMS and name.startswith("input_layernorm."):
        return [name, _FUSED_NORMS[name]]  # the fused name: what teratron wrote before it knew MLA's
    if hybrid is not None and layer in hybrid.gdn_layers and name in _GDN_NORMS:
        fused = _GDN_NORMS[name]
    else:
        fused = _MAMBA_NORMS.get(name, _FUSED_NORMS.get(name))
    return [fused, name] if fused is not None else [name]


def _split_parts(box: ShardedTensor, parts) -> list:
    """`box`, rows of a parameter Megatron stores part by part, as boxes of the parts it covers
    (`<key>.<part>`), views of the same data."""
    out, start = [], 0
    lo, hi = box.global_offset[0], box.global_offset[0] + box.data.shape[0]
    for part, rows in parts:
        begin, end = max(lo, start), min(hi, start + rows)
        if begin < end:
            out.append(dataclasses.replace(box, key=f"{box.key}.{part}",
                                           data=box.data.narrow(0, begin - lo, end - begin),
                                           global_shape=(rows,) + tuple(box.global_shape[1:]),
                                           global_offset=(begin - start,) + tuple(box.global_offset[1:])))
        start += rows
    return out


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


def _split_prefix(key: str, names: dict | None = None) -> tuple:
    """(optimizer-state prefix or '', the model key): optimizer.state.<name>.<model key>; the
    state's name translated by `names` (teratron's <-> Megatron-LM's) when given."""
    if key.startswith(_OPTIMIZER_STATE):
        name, rest = key[len(_OPTIMIZER_STATE):].split(".", 1)
        name = (names or {}).get(name, name)
        return f"{_OPTIMIZER_STATE}{name}.", rest
    return "", key


_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")  # SequentialMLP's expert e
_GROUPED = {"mlp.experts.weight1": "mlp.experts.experts.linear_fc1.weight",  # GroupedMLP's [E, in, out]
            "mlp.experts.weight2": "mlp.experts.experts.linear_fc2.weight"}


def _layer_key(key: str):
    """(layer, name) of a transformer layer's key: a decoder layer's number, or the path of an MTP
    depth's layer ('mtp.layers.<d>.transformer_layer'), and the name within the layer; None for
    every other key."""
    hybrid_mtp = _HYBRID_MTP_LAYER.match(key)
    if hybrid_mtp is not None:
        depth_path, j, name = hybrid_mtp.groups()
        return _mtp_layer(depth_path, j), name
    match = _LAYER.match(key) or _MTP_LAYER.match(key)
    if match is None:
        return None
    layer = match.group(1)
    return (int(layer) if layer.isdigit() else layer), match.group(2)


def _megatron_form(item: ShardedTensor, prefix: str, layer, name: str, stacked: bool, num_layers: int,
                   num_experts: int | None) -> ShardedTensor:
    """A teratron layer box (`_layer_key`'s layer) under Megatron's key with its leading axes
    (layers when `stacked`, experts for an expert's weight), a view of the same data. Megatron
    keeps every expert of a layer in one [E, out, in] tensor (`mlp.experts.experts.*`)."""
    data, shape, offset = item.data, tuple(item.global_shape), tuple(item.global_offset)
    expert = _EXPERT.match(name)
    if expert is not None:
        name = f"mlp.experts.experts.{expert.group(2)}"
        data, shape, offset = data.unsqueeze(0), (num_experts,) + shape, (int(expert.group(1)),) + offset
    elif name in _GROUPED:  # [E, in, out] -> [E, out, in]
        name = _GROUPED[name]
        data = data.transpose(-1, -2)
        shape, offset = shape[:-2] + shape[-1:] + shape[-2:-1], offset[:-2] + offset[-1:] + offset[-2:-1]
    if isinstance(layer, str):  # an MTP depth's layer (a hybrid depth's in Megatron's hybrid stack)
        key = f"{prefix}{layer.replace('.transformer_layer.layers.', '.mtp_model_layer.layers.')}.{name}"
    elif stacked:
        data, shape, offset = data.unsqueeze(0), (num_layers,) + shape, (layer,) + offset
        key = f"{prefix}decoder.layers.{name}"
    else:
        key = f"{prefix}decoder.layers.{layer}.{name}"
    return ShardedTensor(key, data, shape, offset, item.resizable_rows, item.replica)


def _saved_experts(saved: dict) -> int | None:
    """The number of experts per layer in a Megatron checkpoint (None: no MoE)."""
    for key, shape in saved.items():
        if ".mlp.experts.experts." in f".{key}" and shape is not None:
            stacked = _layer_key(_split_prefix(key)[1]) is None
            return shape[1] if stacked else shape[0]
    return None


def _megatron_boxes(item: ShardedTensor, saved: dict, num_layers: int, experts: int | None,
                    hybrid: HybridLayout | None = None, mla: frozenset = frozenset()) -> list:
    """The ways `saved` holds a teratron box, each a list of Megatron boxes (views of the same data;
    several for a parameter stored part by part), the one to read first: stacked or per layer, the
    norm under its fused name or its own (teratron writes an MoE layer's MLP norm under both)."""
    prefix, key = _split_prefix(item.key, _MEGATRON_STATE_NAME)
    parts = _layer_key(key)
    if parts is None:
        final = [_HYBRID_FINAL_NORM[key]] if hybrid is not None and key in _HYBRID_FINAL_NORM else []
        named = [[dataclasses.replace(item, key=prefix + name)] for name in final if prefix + name in saved]
        return named or [[dataclasses.replace(item, key=prefix + key)]]
    layer, name = parts
    split = hybrid.splits.get(name) if hybrid is not None else None
    ways = []
    for candidate in _megatron_names(layer, name, hybrid, mla):
        for stacked in (False, True):
            box = _megatron_form(item, prefix, layer, candidate, stacked, num_layers, experts)
            boxes = _split_parts(box, split) if split and not stacked else [box]
            if all(part.key in saved for part in boxes):
                ways.append(boxes)
    return ways


def _teratron_view(saved: dict, num_layers: int, hybrid: HybridLayout | None = None) -> dict:
    """The saved keys and global shapes under teratron's names (a stacked tensor is num_layers
    tensors of its shape without the layer axis; Megatron's experts under both of teratron's
    expert layouts; a hybrid model's parts as the parameters `hybrid` says they make up)."""
    unfused = {fused: name for table in (_FUSED_NORMS, _MAMBA_NORMS, _GDN_NORMS, _MLA_NORMS)
               for name, fused in table.items()}
    unsplit = {f"{name}.{part}": name for name, parts in (hybrid.splits if hybrid is not None else {}).items()
               for part, _ in parts}
    final = {megatron: name for name, megatron in _HYBRID_FINAL_NORM.items()}
    view = {}

    def add(prefix, layer, name, shape):
        path = layer if isinstance(layer, str) else f"decoder.layers.{layer}"
        if name.startswith("mlp.experts.experts.") and shape is not None:
            rest = name[len("mlp.experts.experts."):]
            for e in range(shape[0]):
                view[f"{prefix}{path}.mlp.experts.local_experts.{e}.{rest}"] = tuple(shape[1:])
            grouped = {megatron: teratron for teratron, megatron in _GROUPED.items()}.get(name)
            if grouped is not None:
                view[f"{prefix}{path}.{grouped}"] = tuple(shape[:-2]) + (shape[-1], shape[-2])
        elif name in unsplit and shape is not None:  # the parts' rows add up
            key = f"{prefix}{path}.{unsplit[name]}"
            view[key] = (shape[0] + view.get(key, (0,))[0],) + tuple(shape[1:])
        else:
            view[f"{prefix}{path}.{unfused.get(name, name)}"] = shape

    for full_key, shape in saved.items():
        prefix, key = _split_prefix(full_key, _TERATRON_STATE_NAME)
        parts = _layer_key(key)
        if parts is not None:  # per layer
            add(prefix, *parts, shape)
        elif key.startswith("decoder.layers.") and shape is not None:  # stacked
            for layer in range(num_layers):
                add(prefix, layer, key[len("decoder.layers."):], tuple(shape[1:]))
        else:
            view[prefix + final.get(key, key)] = shape
    return view


def to_megatron_items(items: list, num_layers: int, stacked: bool, num_experts: int | None = None,
                      hybrid: HybridLayout | None = None) -> list:
    """This rank's teratron items (model, and optimizer states named after the model's keys)
    under Megatron-LM's names: layers stacked over `num_layers` when `stacked` (Megatron's rule:
    every layer alike), else per layer; experts in one tensor per layer; the norms under their
    fused names (as Megatron's local layers save them), and an MoE layer's MLP norm under its own
    name too (as Transformer Engine's MoE layers save it); a hybrid model's names and split
    parameters as its `hybrid_layout` says."""
    out, mla = [], mla_layers(items)
    for item in items:
        prefix, key = _split_prefix(item.key, _MEGATRON_STATE_NAME)
        if prefix and (not isinstance(item, ShardedTensor) or not item.global_shape):
            continue  # Adam's step count: Megatron keeps it in the param groups (megatron_optimizer_state)
        parts = _layer_key(key) if isinstance(item, ShardedTensor) else None
        if parts is None:
            final = _HYBRID_FINAL_NORM.get(key, key) if hybrid is not None else key
            out.append(dataclasses.replace(item, key=prefix + final))
            continue
        layer, name = parts
        if name.startswith("pre_mlp_layernorm.") and num_experts is not None:
            out.append(_megatron_form(item, prefix, layer, name, stacked, num_layers, num_experts))
        box = _megatron_form(item, prefix, layer, _megatron_names(layer, name, hybrid, mla)[0], stacked, num_layers,
                             num_experts)
        split = hybrid.splits.get(name) if hybrid is not None else None
        out += _split_parts(box, split) if split else [box]
    return out


def megatron_common_state(common: dict, metadata: dict, iteration: int, optimizer=None) -> dict:
    """Megatron-LM's common state of a teratron save: its args (a Namespace of Megatron's flag
    names: the model's, and the consumed samples it resumes from), checkpoint_version 3.0,
    iteration, scheduler and the optimizer's common state in Megatron's form
    (`megatron_optimizer_state`); teratron's own common entries ride along under their names, and
    its metadata.json record (model args, tokenizer) and run description (`run_args`) under
    TERATRON_RECORD."""
    args = argparse.Namespace(**metadata.get("model_args", {}), ckpt_format=SHARDED_BACKEND,
                              consumed_train_samples=common.get("consumed_train_samples", 0),
                              consumed_valid_samples=common.get("consumed_valid_samples", 0))
    state = {key: value for key, value in common.items() if key != "optimizer"}
    if optimizer is not None:
        state["optimizer"] = megatron_optimizer_state(optimizer)
        state["content_metadata"] = {"distrib_optim_sharding_type": FULLY_RESHARDABLE,
                                     "distrib_optim_fully_reshardable_mem_efficient": False,
                                     "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    return {**state, "args": args, "checkpoint_version": 3.0, "iteration": iteration,
            TERATRON_RECORD: {**{key: metadata[key] for key in ("model_args", "tokenizer") if key in metadata},
                              "run_args": common.get("args")}}


def megatron_optimizer_state(optimizer):
    """The optimizer's common state as Megatron-LM's distributed optimizer keeps it: torch's
    param groups in a list (hyper-parameters, what the group is -- wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr, max_lr, min_lr -- and the step count, which Megatron
    keeps there rather than per parameter), the loss scaler, and the per-parameter layout
    (fully_reshardable). A model with experts gets two, dense then experts, as Megatron chains
    its optimizers."""
    step = step_count(optimizer)
    scaler = optimizer.grad_scaler.state_dict() if optimizer.grad_scaler is not None else None
    chains = {}
    for _, group in signed_groups(optimizer):
        saved = {key: value for key, value in group.items() if key != "params"}
        chains.setdefault(bool(group.get("is_expert_parallel")), []).append({**saved, "step": step})
    states = []
    for expert in sorted(chains):
        state = {"optimizer": {"param_groups": chains[expert]}, "param_state_sharding_type": FULLY_RESHARDABLE}
        if scaler is not None:  # Megatron keeps the scale as a tensor
            state["grad_scaler"] = {**scaler, "scale": torch.tensor(float(scaler["scale"]))}
        states.append(state)
    return states[0] if len(states) == 1 else states


def _megatron_optimizer_common(saved, optimizer, where: str) -> tuple:
    """(teratron's optimizer common state, the step count) of Megatron-LM's (one dict, or one per
    chained optimizer), its groups matched to this optimizer's by what they are."""
    states = saved if isinstance(saved, list) else [saved]
    by_meaning, steps, scaler = {}, set(), None
    for state in states:
        layout = state.get("param_state_sharding_type") if isinstance(state, dict) else None
        if layout != FULLY_RESHARDABLE:
            raise ValueError(_layout_refusal(where, layout))
        for group in state["optimizer"]["param_groups"]:
            by_meaning[tuple(group.get(key) for key in GROUP_SIGNATURE)] = group
            steps.add(float(group.get("step", 0)))
        scaler = state.get("grad_scaler", scaler)
    groups = {signature: by_meaning[signature[1:]] for signature, _ in signed_groups(optimizer)
              if signature[1:] in by_meaning}
    step = max(steps, default=0.0)
    return {"param_groups": groups, "grad_scaler": scaler}, step


def _layout_refusal(where: str, layout) -> str:
    what = {"dp_reshardable": "Megatron-LM's default distributed-optimizer layout (dp_reshardable: flat buffers "
                              "of the layout that wrote them)",
            None: "a layout other than the distributed optimizer's"}.get(layout, f"the {layout} layout")
    return (f"{where}: its optimizer state is saved in {what}; teratron reads Megatron's optimizer state "
            "saved fully_reshardable (Megatron-LM's --use-distributed-optimizer "
            "--dist-ckpt-optim-fully-reshardable); re-save it so, or add --no-load-optim (continue at its "
            "iteration with a fresh optimizer)")


def stacking(model_chunks) -> dict:
    """to_megatron_items' num_layers, stacked and num_experts for this model (Megatron stacks the
    layers unless they differ: MoE on some layers only)."""
    config = unwrap(model_chunks[0]).config
    freq = config.moe_layer_freq
    uniform = config.hybrid_layer_pattern is None and (config.num_moe_experts is None or
                                                       (isinstance(freq, int) and freq == 1))
    return {"num_layers": config.num_layers, "stacked": uniform, "num_experts": config.num_moe_experts}


def mtp_layout(model_chunks) -> dict:
    """extra_states' mtp_num_layers and mtp_moe for this model: an MTP depth's layer is like the
    last decoder layer (MoE when that one is)."""
    from teratron.transformer.moe.moe_logging import moe_layer_indices

    config = unwrap(model_chunks[0]).config
    # Hybrid models get no `_extra_state` objects (Megatron's Transformer Engine modules' set is not known
    # here: docs/checkpoints.md)
    depths = (config.mtp_num_layers or 0) if config.hybrid_layer_pattern is None else 0
    moe = depths > 0 and config.num_moe_experts is not None and config.num_layers in moe_layer_indices(config)
    return {"mtp_num_layers": depths, "mtp_moe": moe}


def extra_states(num_layers: int, stacked: bool, num_experts: int | None, mtp_num_layers: int = 0,
                 mtp_moe: bool = False) -> list:
    """The `_extra_state` objects Megatron-LM saves for each linear layer (Transformer Engine's
    FP8 metadata; None for its local layers) and expects back on load: one per layer and linear
    (and expert), keyed `..._extra_state/shard_<layer>_<layers>` (`shard_<layer>.<e>_<layers>.<E>`
    for experts), each holding [None]. Written for layers Megatron stacks (per-layer decoder keys
    get none) and for each MTP depth: `mtp.layers.<d>.<linear>._extra_state/shard_0_1`
    (`shard_<e>_<E>` for its experts)."""
    items = []
    for depth in range(mtp_num_layers):
        layer = f"mtp.layers.{depth}.transformer_layer"
        linears = [f"mtp.layers.{depth}.eh_proj", f"{layer}.self_attention.linear_proj",
                   f"{layer}.self_attention.linear_qkv"]
        if not mtp_moe:
            linears += [f"{layer}.mlp.linear_fc1", f"{layer}.mlp.linear_fc2"]
        items += [ShardedObject(f"{name}._extra_state/shard_0_1", [None]) for name in linears]
        for e in range(num_experts if mtp_moe else 0):
            for name in ("linear_fc1", "linear_fc2"):
                items.append(ShardedObject(f"{layer}.mlp.experts.experts.{name}._extra_state/shard_{e}_{num_experts}",
                                           [None]))
    if not stacked:
        return items
    linears = ["self_attention.linear_proj", "self_attention.linear_qkv"]
    if num_experts is None:
        linears += ["mlp.linear_fc1", "mlp.linear_fc2"]
    for layer in range(num_layers):
        for name in linears:
            items.append(ShardedObject(f"decoder.layers.{name}._extra_state/shard_{layer}_{num_layers}", [None]))
        for e in range(num_experts or 0):
            for name in ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2"):
                items.append(ShardedObject(f"decoder.layers.{name}._extra_state/shard_{layer}.{e}_{num_layers}."
                                           f"{num_experts}", [None]))
    return items


def megatron_metadata() -> dict:
    """metadata.json of a Megatron-LM torch_dist checkpoint."""
    return {"sharded_backend": SHARDED_BACKEND, "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}


def _is_megatron_model_key(key: str) -> bool:
    return not key.startswith(("optimizer.", "rng_state", "rerun_state_machine_state", COMMON_STATE_KEY)) \
        and "_extra_state" not in key


def read_common_state(checkpoint_dir: str) -> dict:
    """Megatron's common state (args, iteration, checkpoint_version, opt_param_scheduler, ...):
    the `common_state` object of the DCP files, or a `common.pt` file (older Megatron-LM)."""
    saved = serialization.saved_keys(checkpoint_dir)
    keys = [key for key in saved if key == COMMON_STATE_KEY or key.startswith(COMMON_STATE_KEY + "/")]
    if not keys:
        from teratron.dist_checkpointing.safe_load import read_common_state as read_common_file

        return read_common_file(checkpoint_dir)
    # Megatron's args hold its enums: read as inert records, nothing of Megatron imported or run
    common = serialization.load_full(checkpoint_dir, lambda key: key == keys[0], foreign=("megatron.",))[keys[0]]
    if isinstance(common, list) and len(common) == 1:  # Megatron saves it as a one-item list
        common = common[0]
    if not isinstance(common, dict):
        raise storage.DamagedCheckpointError(f"{checkpoint_dir}: Megatron-LM's common state is a "
                                             f"{type(common).__name__}, not a dict; the checkpoint is damaged")
    return common


def load_megatron_checkpoint(checkpoint_dir: str, model_chunks, num_layers: int, optimizer=None,
                             source: str = "--load", common: dict | None = None) -> dict:
    """Load a torch_dist folder into `model_chunks` (any layout; a collective over the ranks) and,
    given an `optimizer`, its optimizer state (written by teratron in Megatron's model-space
    names); returns the common state (`common`: the caller's `read_common_state` of the folder)."""
    saved = serialization.saved_keys(checkpoint_dir)
    common = read_common_state(checkpoint_dir) if common is None else common
    layouts = param_layouts(model_chunks)
    items = model_sharded_items(model_chunks)
    experts, hybrid = _saved_experts(saved), hybrid_layout(model_chunks)
    refresh_masters = False
    if optimizer is not None:
        where = f"{source} {checkpoint_dir}"
        if "optimizer" not in common:
            layout = "dp_reshardable" if any(key.startswith("optimizer.distributed.") for key in saved) else None
            raise ValueError(_layout_refusal(where, layout))
        optimizer_common, step = _megatron_optimizer_common(common["optimizer"], optimizer, where)
        optimizer_items, refresh_masters, missing = prepare_for_load(optimizer, layouts,
                                                                     _teratron_view(saved, num_layers, hybrid))
        report_fresh_states(where, missing)
        items += optimizer_items
    mla = mla_layers(items)
    ways = [_megatron_boxes(item, saved, num_layers, experts, hybrid, mla) for item in items]
    # The same tensors under other names, not read: every rank's (another stage's layers are another rank's)
    twins = set().union(*serialization.all_gather_objects({box.key for found in ways for way in found[1:]
                                                           for box in way}))
    # the first way of each; a missing one under its own name, which the load names
    items = [box for found, item in zip(ways, items) for box in (found[0] if found else [item])]
    serialization.load(items, checkpoint_dir,
                       unexpected_filter=lambda key: _is_megatron_model_key(key) and key not in twins)
    if optimizer is not None:
        load_optimizer_common_state(optimizer, optimizer_common, where)
        set_step_count(optimizer, step)
        if refresh_masters:
            optimizer.reload_model_params()
    return common

