"""`--use-checkpoint-args`: the architecture flags of --load's checkpoint (Megatron's
`load_args_from_checkpoint`).

A teratron checkpoint (`teratron train --save`, `teratron convert import-hf`, `teratron merge`)
records its model args in metadata.json under the flags' destination names
(`dist_checkpointing.model_args`); a Megatron-LM torch_dist checkpoint keeps its whole argument
namespace in its common state. `checkpoint_flag_values` reads either as flag values of
`teratron train` (destination -> value); `arguments.parse_train_args` puts them in place of the
command line's.

Taken: everything that shapes the model's weights or forward math (layers, sizes, heads and
groups, MLP, norm, biases, position embedding and RoPE, tied embeddings, MoE, MLA, MTP, attention
variants, a hybrid model's layers and sizes and its M layers' kind -- Megatron's `--spec ...
gdp_stack_spec` and `--gdp-num-householder` for Gated Delta Product; Megatron's
`--apply-layernorm-1p` too), and the position table's size unless the command line gives one. Not
taken: the vocabulary (the tokenizer flags give it; its padding follows
--make-vocab-size-divisible-by and TP), the sequence length, dropout and every training setting.
"""

import os

from teratron.dist_checkpointing import storage
from teratron.dist_checkpointing.megatron_format import is_megatron_checkpoint, read_common_state
from teratron.dist_checkpointing.model_args import (GDP_SPEC, MLA_ARGS, MODEL_ARG_NAMES, MOE_DEFAULTS,
                                                    ROPE_SCALING_ARGS, YARN_ARGS)
from teratron.models.hybrid.hybrid_layer_allocation import HYBRID_SPECS_MODULE, gdp_layers_of_spec

# Model args a run does not take: the vocabulary is the tokenizer's, its padding the layout's.
_NOT_TAKEN = ("vocab_size", "padded_vocab_size")

# --use-mp-args-from-checkpoint-args: the parallel sizes, as a teratron layout record and Megatron's args name them.
PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "expert_model_parallel_size")


def checkpoint_flag_values(load: str, with_parallel_sizes: bool = False) -> tuple:
    """(the iteration folder --load's tracker names, its flag values: destination -> value)."""
    checkpoint_dir = _latest_checkpoint(load)
    if is_megatron_checkpoint(checkpoint_dir):
        megatron_args = read_common_state(checkpoint_dir).get("args")
        if megatron_args is None:
            raise ValueError(f"--load {checkpoint_dir}: the Megatron-LM checkpoint records no args; pass the "
                             "architecture flags instead of --use-checkpoint-args")
        saved = vars(megatron_args)
        values = architecture_flag_values(_megatron_model_args(saved))
        if "layernorm_zero_centered_gamma" in saved or "apply_layernorm_1p" in saved:  # its older destination
            values["layernorm_zero_centered_gamma"] = saved.get("layernorm_zero_centered_gamma",
                                                                saved.get("apply_layernorm_1p"))
        layout = saved
    else:
        metadata = storage.read_metadata(checkpoint_dir)
        if not metadata.get("model_args"):
            raise ValueError(f"--load {checkpoint_dir}: metadata.json records no model_args; pass the architecture "
                             "flags instead of --use-checkpoint-args")
        values, layout = architecture_flag_values(metadata["model_args"]), metadata.get("layout") or {}
    if with_parallel_sizes:
        values.update({name: layout[name] for name in PARALLEL_SIZES if name in layout})
    return checkpoint_dir, values


def _latest_checkpoint(load: str) -> str:
    try:
        iteration = storage.read_tracker(load)
    except ValueError as e:
        raise ValueError(f"--load {load}: {e}") from None
    if iteration is None:
        raise FileNotFoundError(f"--use-checkpoint-args: --load {load} holds no checkpoint (no "
                                f"{storage.TRACKER_FILENAME}); pass a checkpoint's save folder, or the architecture "
                                "flags without --use-checkpoint-args")
    checkpoint_dir = storage.iteration_dir(load, iteration)
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"--load {load}: the tracker names iteration {iteration} but {checkpoint_dir} is "
                                "missing; fix the tracker or restore the folder")
    return checkpoint_dir


def architecture_flag_values(model_args: dict) -> dict:
    """The flag values of a model record: its names less the vocabulary; the MoE, MLA, YaRN and
    RoPE-scaling settings only for a model that has them (the record holds defaults for the others);
    --group-query-attention from the query groups."""
    mla = bool(model_args.get("multi_latent_attention"))
    yarn = model_args.get("position_embedding_type") == "yarn"
    left_out = set(_NOT_TAKEN)
    if not model_args.get("num_experts"):
        left_out |= set(MOE_DEFAULTS) - {"num_experts"}
    if not model_args.get("use_rope_scaling"):
        left_out |= set(ROPE_SCALING_ARGS)
    position_args = set(MLA_ARGS) if mla else set(YARN_ARGS) if yarn else set()
    left_out |= (set(MLA_ARGS) | set(YARN_ARGS)) - position_args
    values = {name: value for name, value in model_args.items() if name in MODEL_ARG_NAMES and name not in left_out}
    if "num_query_groups" in values and "num_attention_heads" in values:
        values["group_query_attention"] = not mla and values["num_query_groups"] != values["num_attention_heads"]
    return values


def _megatron_model_args(saved: dict) -> dict:
    """Megatron-LM's saved args (a dict of its destinations) as a model record: the names it has,
    --norm-epsilon under its current destination, the query groups without --group-query-attention
    (Megatron keeps its default 1 then) as the heads, the old foundation models' disable_bias_linear,
    and a hybrid model's layers (`_megatron_hybrid_pattern`, `_megatron_spec`)."""
    model_args = {name: saved[name] for name in MODEL_ARG_NAMES if name in saved}
    pattern = _megatron_hybrid_pattern(saved)
    if pattern is not None:
        model_args["hybrid_layer_pattern"] = pattern
    if "spec" in saved:
        model_args["spec"] = _megatron_spec(saved["spec"])
    if "layernorm_epsilon" in saved:
        model_args["norm_epsilon"] = saved["layernorm_epsilon"]
    if "disable_bias_linear" in saved:
        model_args["add_bias_linear"] = not saved["disable_bias_linear"]
    if "num_attention_heads" in saved and "num_query_groups" in saved and not saved.get("group_query_attention"):
        model_args["num_query_groups"] = saved["num_attention_heads"]
    return model_args


def _megatron_hybrid_pattern(saved: dict):
    """The layers of a Megatron hybrid model's args (None: GPT): --hybrid-layer-pattern, or the
    older --hybrid-override-pattern with its MTP depths in --mtp-hybrid-override-pattern (repeated
    --mtp-num-layers times after '/', as Megatron joins them; none without MTP layers); without '|',
    which places layers on the pipeline stages of the run that saved it, not of this one."""
    pattern = saved.get("hybrid_layer_pattern") or saved.get("hybrid_override_pattern")
    if not pattern:
        return None
    mtp, depths = saved.get("mtp_hybrid_override_pattern"), saved.get("mtp_num_layers") or 0
    if mtp and depths > 0 and "/" not in pattern:
        pattern += f"/{mtp}" * depths
    return pattern.replace("|", "")


def _megatron_spec(spec):
    """Megatron's --spec as teratron records it: GDP_SPEC for its Gated Delta Product stacks, else None
    (its Mamba-2 hybrid stacks, a GPT layer spec, ...: layers teratron builds from the other args alone);
    another spec of Megatron's hybrid module is refused in one line (`gdp_layers_of_spec`)."""
    if not spec or spec[0] != HYBRID_SPECS_MODULE:
        return None
    return GDP_SPEC if gdp_layers_of_spec(spec) else None
