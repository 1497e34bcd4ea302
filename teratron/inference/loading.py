"""A checkpoint -> (model, tokenizer) ready to serve; nothing else about the run is needed.

    model, tokenizer = load_for_inference("ckpt")                 # a `teratron train --save` folder,
                                                                 # an iter_* folder, or an import-hf save
    chat_template = load_chat_template("ckpt")                   # None when the model has none

Any training layout loads (the sharded format reshards on load) into one stage of the model at
`tensor_model_parallel_size`, built by the one model builder from the model args metadata.json
records, in eval mode, without optimizer or RNG state.

The tokenizer comes from the checkpoint, so serving needs no tokenizer flags:
- an import (`teratron convert import-hf`) keeps the Hugging Face tokenizer files and chat template
  in ROOT/hf/ (training runs fine-tuned from it copy them along): a HuggingFaceTokenizer of them,
  adding the special tokens (e.g. BOS) to prompts as transformers does;
- a `teratron train` checkpoint records its run description in common.pt; its tokenizer section
  (Megatron's tokenizer flags) builds the tokenizer the model was trained with.
When both exist, the hf/ files win if the run trained with the same vocabulary (the fingerprint
metadata.json records), since they also carry the chat template.
"""

import argparse
import json
import os

import torch

from teratron.dist_checkpointing import load_checkpoint, serialization, storage
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.dist_checkpointing.model_state import TIED_KEY
from teratron.dist_checkpointing.safe_load import read_common_state
from teratron.inference.chat_template import ChatTemplate
from teratron.models.gpt.builder import build_gpt_model
from teratron.process_groups import ProcessGroupCollection
from teratron.tensor_parallel.utils import pad_vocab_size
from teratron.tokenizers import HuggingFaceTokenizer, build_tokenizer

GENERATION_CONFIG = "generation_config.json"


def load_for_inference(checkpoint_dir: str, tensor_model_parallel_size: int = 1, dtype: torch.dtype | None = None,
                       device=None, flag: str = "--load", cache_mla_latents: bool = False,
                       batch_invariant_mode: bool = False):
    """(GPTModel in eval mode, tokenizer) of the checkpoint in `checkpoint_dir` (a save directory,
    whose latest iteration loads, or an iteration folder). `dtype`: the parameters' (default: the
    saved weights'); `device`: where they live (default: CUDA when available, else the CPU);
    `flag`: the option the path came from, for error messages; `cache_mla_latents`: a
    multi-latent-attention model caches its latents (MLATransformerConfig.cache_mla_latents);
    `batch_invariant_mode`: a request's results do not depend on the others in its batch.
    Tensor parallelism needs torch.distributed initialised with that many ranks per group."""
    folder = storage.resolve_checkpoint_dir(checkpoint_dir, flag)
    metadata = storage.read_metadata(folder)
    model_args = metadata.get("model_args")
    if not model_args:
        raise ValueError(f"{flag} {folder}: metadata.json records no model_args, so the model cannot be rebuilt; "
                         "load a checkpoint saved by `teratron train`, import-hf or merge")
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or saved_dtype(folder)
    if cache_mla_latents and not model_args.get("multi_latent_attention"):
        raise ValueError(f"--cache-mla-latents: the model of {flag} {folder} has no multi-latent attention; "
                         "drop the flag")
    overrides = dict(cache_mla_latents=True) if cache_mla_latents else {}
    if batch_invariant_mode:
        overrides["batch_invariant_mode"] = True
    model = _build_model(model_args, tensor_model_parallel_size, dtype, device, folder, flag, **overrides)
    _, common = load_checkpoint(folder, [model], optimizer=None, load_optimizer=False, load_rng=False)
    return model.to(device).eval(), _load_tokenizer(folder, metadata, common, flag)


def mtp_num_layers(checkpoint_dir: str, flag: str = "--load") -> int:
    """The multi-token-prediction depths of the checkpoint's model (0: none), from its metadata."""
    folder = storage.resolve_checkpoint_dir(checkpoint_dir, flag)
    return (storage.read_metadata(folder).get("model_args") or {}).get("mtp_num_layers") or 0


def saved_dtype(checkpoint_dir: str) -> torch.dtype:
    """The dtype the checkpoint's word embeddings were saved in."""
    entry = serialization.read_metadata(checkpoint_dir).state_dict_metadata.get(TIED_KEY)
    return entry.properties.dtype if entry is not None else torch.float32


def _pg_collection(tp: int, folder: str) -> ProcessGroupCollection:
    """Groups of one at TP 1; else the current topology's, set up here when there is none yet."""
    from teratron import parallel_state

    if tp < 1:
        raise ValueError(f"--tensor-model-parallel-size {tp} must be >= 1")
    if tp == 1:
        return ProcessGroupCollection()
    if not torch.distributed.is_initialized():
        raise ValueError(f"loading {folder} with tensor-model-parallel size {tp} needs one process per rank: "
                         "launch with torchrun (torch.distributed initialised)")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    if parallel_state.get_tensor_model_parallel_world_size() != tp:
        raise ValueError(f"tensor-model-parallel size {tp} differs from the initialised topology's "
                         f"({parallel_state.get_tensor_model_parallel_world_size()}); use one")
    return pg


def _build_model(model_args: dict, tp: int, dtype: torch.dtype, device: torch.device, folder: str, flag: str,
                 **overrides):
    pg = _pg_collection(tp, folder)
    padded = model_args.get("padded_vocab_size")
    if not padded or padded % tp:  # the vocabulary rows are resharded on load: any padding loads
        padded = pad_vocab_size(model_args["vocab_size"] or padded, 128, tp)
    try:
        config = gpt_config_from_model_args(
            model_args, padded_vocab_size=padded, tensor_model_parallel_size=tp, params_dtype=dtype,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, perform_initialization=False,
            use_cpu_initialization=device.type == "cpu", **overrides)
    except KeyError as e:
        raise ValueError(f"{flag} {folder}: metadata.json's model_args lack {e}; the checkpoint is damaged or from "
                         "an older teratron: save it again with `teratron train`") from None
    if device.type == "cuda" and device.index is not None:  # the layers allocate on the current device
        torch.cuda.set_device(device)
    return build_gpt_model(config, pg_collection=pg)


def hf_dir(checkpoint_dir: str) -> str:
    """ROOT/hf/ of an iteration folder: the imported Hugging Face config and tokenizer files."""
    return os.path.join(storage.checkpoint_root(checkpoint_dir), storage.HF_DIRNAME)


def run_tokenizer_flags(common: dict):
    """The tokenizer flags of the run that saved the checkpoint, as an argparse.Namespace (None: an import)."""
    args = common.get("args")
    if isinstance(args, argparse.Namespace):  # checkpoints before the run description: the flags
        args = vars(args)
    elif isinstance(args, dict) and isinstance(args.get("tokenizer"), dict):  # a RunConfig's record
        args = args["tokenizer"]
    if not isinstance(args, dict) or not args.get("tokenizer_type"):
        return None
    return argparse.Namespace(**args)


def _load_tokenizer(folder: str, metadata: dict, common: dict, flag: str):
    run_flags = run_tokenizer_flags(common)
    hf_tokenizer = None
    if os.path.isfile(os.path.join(hf_dir(folder), "tokenizer.json")):
        include_special = run_flags is None or bool(getattr(run_flags, "tokenizer_hf_include_special_tokens", False))
        hf_tokenizer = HuggingFaceTokenizer(hf_dir(folder), include_special_tokens=include_special)
        trained_with = metadata.get("tokenizer")
        if run_flags is None or not trained_with or same_vocabulary(trained_with, hf_tokenizer.fingerprint()):
            return hf_tokenizer
    if run_flags is None:
        raise ValueError(f"{flag} {folder}: the checkpoint has no tokenizer (no {storage.HF_DIRNAME}/tokenizer.json "
                         "beside it and no run description in common.pt); import the model with `teratron convert "
                         "import-hf`, or load a checkpoint that `teratron train` saved")
    return build_run_tokenizer(run_flags, folder, flag)


def build_run_tokenizer(run_flags, folder: str, flag: str = "--load"):
    """The tokenizer `run_tokenizer_flags` describe; one line naming the checkpoint when its files are gone."""
    try:
        return build_tokenizer(run_flags)
    except (ValueError, OSError) as e:
        raise ValueError(f"{flag} {folder}: the tokenizer the model was trained with (--tokenizer-type "
                         f"{run_flags.tokenizer_type}) cannot be built: {e}; put its files back where the run "
                         "read them") from None


def same_vocabulary(a: dict, b: dict) -> bool:
    """Whether two tokenizer fingerprints (MegatronTokenizer.fingerprint) make the same ids."""
    return (a.get("class"), a.get("sha256")) == (b.get("class"), b.get("sha256"))


def load_chat_template(checkpoint_dir: str):
    """The chat template of an imported model (hf/chat_template.jinja, or tokenizer_config.json's
    chat_template), or None."""
    return ChatTemplate.from_hf_dir(hf_dir(storage.resolve_checkpoint_dir(checkpoint_dir)))


def generation_stop_token_ids(checkpoint_dir: str) -> tuple:
    """The end-of-sequence ids of an imported model's generation_config.json (transformers'
    generate stops at any of them; a chat model's end-of-turn token is often one), or ()."""
    path = os.path.join(hf_dir(storage.resolve_checkpoint_dir(checkpoint_dir)), GENERATION_CONFIG)
    if not os.path.isfile(path):
        return ()
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a JSON object ({e}); restore the model's {GENERATION_CONFIG}") from None
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id {eos!r} must be a token id or a list of them")
    return tuple(ids)
