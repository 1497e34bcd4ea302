"""GPT <-> hybrid checkpoints (`teratron convert gpt-to-hybrid | hybrid-to-gpt`), Megatron's
`gpt_hybrid_conversion` on teratron checkpoints.

A GPT layer is an attention half and an MLP half; a hybrid pattern lists such halves as layers of
their own (`*` attention, `+` multi-latent attention for an MLA model, `-` MLP, `E` MoE) among Mamba
layers (`M`). gpt-to-hybrid puts GPT layer i's attention half (its input norm and self-attention) on
the pattern's i-th `*` (`+`) layer and its MLP
half (pre-MLP norm and MLP or MoE) on the i-th `-` / `E` layer; the pattern must hold exactly as
many of each as the GPT model has layers, and `E` exactly when the GPT model is MoE. Mamba layers
have no GPT counterpart: they start from Mamba-2's initialisation (`--seed`), or Gated Delta
Product's with `--spec ... gdp_stack_spec` (`--gdp-num-householder`). The embedding, final norm and
output layer are kept. hybrid-to-gpt is the inverse: it drops the M layers (saying so) and refuses
Gated DeltaNet layers (`G`), which a GPT layer cannot hold.

The pattern `*-*-...` (each GPT layer split in two) computes exactly what the GPT model does. The
output is a model-only checkpoint (iteration 0; no optimizer, scheduler or RNG state): train it
with `--load OUT --finetune` and the pattern's flags.
"""

import os
import re

import torch

from teratron.dist_checkpointing import serialization, storage
from teratron.dist_checkpointing.checkpoint import save_model_tensors
from teratron.dist_checkpointing.model_args import (GDP_DEFAULTS, VARIANT_DEFAULTS, gpt_config_from_model_args,
                                                    model_args_from_config)
from teratron.dist_checkpointing.model_state import is_model_key
from teratron.dist_checkpointing.safe_load import read_common_state
from teratron.models.gpt.builder import build_gpt_model
from teratron.models.hybrid import Symbols, parse_hybrid_pattern
from teratron.models.hybrid.hybrid_layer_allocation import gdp_layers_of_spec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_ATTENTION_HALF = ("input_layernorm.", "self_attention.")
_MLP_HALF = ("pre_mlp_layernorm.", "mlp.")
_HYBRID_FIELDS = ("hybrid_layer_pattern", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")
_HYBRID_DEFAULTS = {**{name: VARIANT_DEFAULTS[name] for name in _HYBRID_FIELDS}, **GDP_DEFAULTS}


def _positions(layers: str, symbols: str) -> list:
    return [i for i, symbol in enumerate(layers) if symbol in symbols]


def _attention_symbol(model_args: dict) -> str:
    return Symbols.MLA if model_args.get("multi_latent_attention") else Symbols.ATTENTION


def _gpt_layer_places(layers: str, model_args: dict, where: str) -> tuple:
    """(the hybrid layer of each GPT layer's attention half, ... of its MLP half)."""
    if Symbols.GDN in layers:
        raise ValueError(f"{where}: the pattern has Gated DeltaNet layers (G), which a GPT layer cannot hold; use "
                         "M, *, +, - and E")
    attention_symbol = _attention_symbol(model_args)
    kind = "multi-latent" if attention_symbol == Symbols.MLA else "standard"
    if ({Symbols.ATTENTION, Symbols.MLA} - {attention_symbol}) & set(layers):
        raise ValueError(f"{where}: the GPT model's attention is {kind}; use '{attention_symbol}' for its "
                         "attention layers")
    mlp_symbol = Symbols.MOE if model_args.get("num_experts") else Symbols.MLP
    other = Symbols.MLP if mlp_symbol == Symbols.MOE else Symbols.MOE
    if other in layers:
        raise ValueError(f"{where}: the pattern has {'MoE (E)' if other == Symbols.MOE else 'dense MLP (-)'} layers "
                         f"but the GPT model's MLPs are {'MoE' if mlp_symbol == Symbols.MOE else 'dense'}; use "
                         f"'{mlp_symbol}'")
    attention, mlp = _positions(layers, attention_symbol), _positions(layers, mlp_symbol)
    gpt_layers = model_args["num_layers"]
    if len(attention) != gpt_layers or len(mlp) != gpt_layers:
        raise ValueError(f"{where}: the pattern has {len(attention)} attention ({attention_symbol}) and {len(mlp)} "
                         f"MLP ('{mlp_symbol}') layers; the GPT model has {gpt_layers} layers, so give {gpt_layers} of "
                         "each")
    return attention, mlp


def _to_hybrid_key(key: str, attention: list, mlp: list) -> str:
    match = _LAYER.match(key)
    if match is None:
        return key
    layer, rest = int(match.group(1)), match.group(2)
    place = attention[layer] if rest.startswith(_ATTENTION_HALF) else mlp[layer]
    return f"decoder.layers.{place}.{rest}"


def _to_gpt_key(key: str, gpt_layer_of: dict):
    """The GPT key of a hybrid key, or None for a Mamba layer's."""
    match = _LAYER.match(key)
    if match is None:
        return key
    layer = gpt_layer_of.get(int(match.group(1)))
    return None if layer is None else f"decoder.layers.{layer}.{match.group(2)}"


def _source(load: str) -> tuple:
    folder = os.path.abspath(storage.resolve_checkpoint_dir(load))
    metadata = storage.read_metadata(folder)
    storage.verify_files(folder, metadata)
    model_args = metadata.get("model_args")
    if not model_args:
        raise ValueError(f"--load {folder}: metadata.json records no model_args; translate a checkpoint saved by "
                         "`teratron train`, import-hf or merge")
    return folder, metadata, model_args


def _check_gpt(model_args: dict, folder: str) -> None:
    refused = [name for name, why in (("hybrid_layer_pattern", "it is hybrid already"),
                                      ("mtp_num_layers", "multi-token prediction layers"))
               if model_args.get(name)]
    freq = model_args.get("moe_layer_freq", 1)
    if model_args.get("num_experts") and freq != 1:
        refused.append("moe_layer_freq")
    if refused:
        raise ValueError(f"--load {folder}: a GPT model without {', '.join(refused)} translates to a hybrid one; "
                         f"this checkpoint sets {', '.join(refused)}")


def gpt_to_hybrid(load: str, save: str, pattern: str, mamba: dict | None = None, seed: int = 1234) -> str:
    """Write the hybrid model of `pattern` holding the GPT checkpoint `load`'s weights (see the
    module docstring) as iteration 0 of the new save directory `save`; `mamba`: the M layers' flag
    values (mamba_state_dim, ..., Megatron's `spec` and gdp_num_householder; Megatron's defaults
    otherwise). Returns its folder."""
    folder, metadata, model_args = _source(load)
    _check_gpt(model_args, folder)
    if Symbols.MTP_SEPARATOR in pattern:
        raise ValueError(f"--hybrid-layer-pattern {pattern!r}: multi-token-prediction depths ('/') are not "
                         "translated; give the decoder's layers only")
    layers = parse_hybrid_pattern(pattern).layers
    attention, mlp = _gpt_layer_places(layers, model_args, f"--hybrid-layer-pattern {pattern!r}")
    hybrid_args = {**model_args, **_HYBRID_DEFAULTS, **(mamba or {}), "hybrid_layer_pattern": layers,
                   "num_layers": len(layers)}
    source = serialization.load_full(folder, is_model_key)
    dtype = next(iter(source.values())).dtype
    torch.manual_seed(seed)
    config = gpt_config_from_model_args(hybrid_args, params_dtype=dtype)
    built = build_gpt_model(config).state_dict()
    record = model_args_from_config(config)  # as a run records its model: GDP's resolved heads, the spec
    hybrid_args.update({name: record[name] for name in (*GDP_DEFAULTS, "mamba_num_heads")})
    tensors = {_to_hybrid_key(key, attention, mlp): value for key, value in source.items()}
    _check_keys(tensors, built, lambda key: _LAYER.match(key) and layers[int(_LAYER.match(key).group(1))] == "M",
                folder)
    tensors.update({key: value for key, value in built.items() if key not in tensors and "_extra_state" not in key})
    note = {"gpt_to_hybrid": {"source": folder, "pattern": layers, "seed": seed}}
    return _write(save, tensors, hybrid_args, metadata, folder, note)


def hybrid_to_gpt(load: str, save: str) -> str:
    """Write the GPT model of the hybrid checkpoint `load`'s attention and MLP layers (its Mamba
    layers dropped) as iteration 0 of the new save directory `save`. Returns its folder."""
    folder, metadata, model_args = _source(load)
    layers = model_args.get("hybrid_layer_pattern")
    if not layers:
        raise ValueError(f"--load {folder}: not a hybrid model (no hybrid_layer_pattern); nothing to translate")
    if Symbols.MTP_SEPARATOR in layers:
        raise ValueError(f"--load {folder}: the hybrid pattern {layers!r} has multi-token-prediction depths ('/'), "
                         "which a GPT model cannot take in this translation")
    gpt_layers = layers.count(_attention_symbol(model_args))
    attention, mlp = _gpt_layer_places(layers, {**model_args, "num_layers": gpt_layers}, f"--load {folder}")
    gpt_layer_of = {**{place: i for i, place in enumerate(attention)}, **{place: i for i, place in enumerate(mlp)}}
    gpt_args = {**model_args, **_HYBRID_DEFAULTS, "num_layers": gpt_layers}
    tensors = {}
    for key, value in serialization.load_full(folder, is_model_key).items():
        gpt_key = _to_gpt_key(key, gpt_layer_of)
        if gpt_key is not None:
            tensors[gpt_key] = value
    dropped = layers.count(Symbols.MAMBA)
    if dropped:
        kind = "Gated Delta Product" if gdp_layers_of_spec(model_args.get("spec")) else "Mamba"
        print(f"NOTE: {dropped} {kind} layer(s) of {layers} have no GPT counterpart and are dropped", flush=True)
    built = build_gpt_model(gpt_config_from_model_args(gpt_args)).state_dict()
    _check_keys(tensors, built, lambda key: False, folder)
    return _write(save, tensors, gpt_args, metadata, folder, {"hybrid_to_gpt": {"source": folder, "pattern": layers}})


def _check_keys(tensors: dict, built: dict, fresh, folder: str) -> None:
    """The translated tensors are exactly the target model's, less the `fresh` ones, shapes alike."""
    wanted = {key for key in built if "_extra_state" not in key and not fresh(key)}
    missing, extra = sorted(wanted - set(tensors)), sorted(set(tensors) - set(built))
    shapes = [f"{key} {tuple(tensors[key].shape)} vs {tuple(built[key].shape)}" for key in sorted(wanted & set(tensors))
              if tensors[key].shape != built[key].shape]
    if missing or extra or shapes:
        raise ValueError(f"--load {folder}: the translated weights do not fit the target model (missing: "
                         f"{missing[:3]}, unexpected: {extra[:3]}, shapes: {shapes[:3]}); the checkpoint's model args "
                         "and tensors disagree")


def _write(save: str, tensors: dict, model_args: dict, source_metadata: dict, source_folder: str, note: dict) -> str:
    """`tensors` as iteration 0 of the new save directory `save` (model only), with the source's
    common state less its optimizer, scheduler and data position, its tokenizer record and its
    Hugging Face side files."""
    if os.path.exists(save):
        raise FileExistsError(f"--save {save}: already exists; translate into a new folder")
    common = read_common_state(source_folder)
    for name in ("optimizer", "opt_param_scheduler"):
        common.pop(name, None)
    common.update(iteration=0, consumed_train_samples=0, consumed_valid_samples=0)
    record = {key: source_metadata[key] for key in ("tokenizer",) if key in source_metadata}
    metadata = {"model_args": model_args, **record, "has_optimizer": False, "has_rng": False, **note}
    return save_model_tensors(save, 0, tensors, common, metadata, source_folder)
