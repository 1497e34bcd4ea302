"""The tokenizer an exported model was trained with, as Hugging Face files, and its special ids.

    trained = trained_tokenizer(checkpoint_dir, metadata, common, hf_side)   # None: hf_side's files are it
    ids = token_ids(trained)               # {bos_token_id, eos_token_id, pad_token_id} for config.json
    write_tokenizer(trained, out, max_length)

An imported checkpoint keeps its Hugging Face files in ROOT/hf/ (training runs fine-tuned from it
copy them along); they go out as they came, unless a run trained the model on with another
vocabulary (a tokenizer whose fingerprint differs; a NullTokenizer run fed it the imported ids).
Otherwise the tokenizer section of the run that saved the checkpoint (Megatron's tokenizer flags,
recorded in common.pt) builds the tokenizer, which is written as:
- GPT2BPETokenizer: vocab.json and merges.txt (GPT-2's encoder.json and vocab.bpe), a
  tokenizer_config.json of class GPT2Tokenizer with <|endoftext|> as its bos, eos, unk and pad
  token (GPT-2's own use it for the first three), and tokenizer.json, the same byte-level BPE for
  the `tokenizers` library (which teratron's import and transformers' fast path read);
- HuggingFaceTokenizer: the tokenizer files beside its tokenizer.json, plus a
  tokenizer_config.json naming the eos token where there is none;
- NullTokenizer and the other types: no files; a NOTE says so.
The ids go into config.json and generation_config.json: eos is the EOD id the run separated
documents with, bos the tokenizer's (GPT-2's is its EOD), pad the tokenizer's, else the EOD
(which transformers' generate falls back to). Files are written, and copied, through `open`, so
they get its mode (0644 under umask 022) whatever the source's.
"""

import argparse
import json
import os
import shutil
from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from teratron.inference.loading import build_run_tokenizer, run_tokenizer_flags, same_vocabulary
from teratron.tokenizers import HuggingFaceTokenizer, MegatronTokenizer
from teratron.tokenizers.gpt2_bpe import EOD_TOKEN, default_gpt2_files

# The tokenizer files of a Hugging Face model folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
GENERATION_CONFIG = "generation_config.json"
MERGES_HEADER = "#version: 0.2"


@dataclass
class TrainedTokenizer:
    """The tokenizer of the run that saved a checkpoint: its flags and what they build."""
    flags: argparse.Namespace
    tokenizer: MegatronTokenizer


def _hf_files_are_it(hf_side: str, flags, metadata: dict) -> bool:
    """Whether ROOT/hf/'s tokenizer files are the model's: no run recorded a tokenizer, the run fed
    token ids (NullTokenizer), or it trained with the same vocabulary."""
    if not any(os.path.isfile(os.path.join(hf_side, name)) for name in TOKENIZER_FILES):
        return False
    if flags is None or flags.tokenizer_type == "NullTokenizer":
        return True
    trained_with = metadata.get("tokenizer")
    if not trained_with or not os.path.isfile(os.path.join(hf_side, "tokenizer.json")):
        return True
    return same_vocabulary(trained_with, HuggingFaceTokenizer(hf_side).fingerprint())


def trained_tokenizer(checkpoint_dir: str, metadata: dict, common: dict, hf_side: str) -> TrainedTokenizer | None:
    """The run's tokenizer to export, or None when the files in `hf_side` describe the model (or
    nothing records a tokenizer)."""
    flags = run_tokenizer_flags(common)
    if flags is None or _hf_files_are_it(hf_side, flags, metadata):
        return None
    return TrainedTokenizer(flags, build_run_tokenizer(flags, checkpoint_dir))


def _optional(tokenizer, name: str):
    try:
        return getattr(tokenizer, name)
    except (AttributeError, NotImplementedError):
        return None


def token_ids(trained: TrainedTokenizer) -> dict:
    """config.json's and generation_config.json's special ids of the run's tokenizer."""
    tokenizer = trained.tokenizer
    eod = _optional(tokenizer, "eod")
    bos = eod if trained.flags.tokenizer_type == "GPT2BPETokenizer" else _optional(tokenizer, "bos")
    pad = _optional(tokenizer, "pad")
    return {"bos_token_id": bos, "eos_token_id": eod, "pad_token_id": eod if pad is None else pad}


def _write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)


def _merges(trained: TrainedTokenizer) -> list:
    """GPT-2's merge pairs, as GPT2BPETokenizer read them (the first line is a header)."""
    merge_file = trained.flags.merge_file or default_gpt2_files()[1]
    with open(merge_file, encoding="utf-8") as f:
        return [tuple(line.split()) for line in f.read().split("\n")[1:] if line]


def _write_gpt2(trained: TrainedTokenizer, out: str, max_length: int) -> None:
    vocab, merges = trained.tokenizer.vocab, _merges(trained)
    _write_json(os.path.join(out, "vocab.json"), vocab)
    with open(os.path.join(out, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join([MERGES_HEADER, *(" ".join(pair) for pair in merges)]) + "\n")
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(bpe.to_str())
    _write_json(os.path.join(out, "tokenizer_config.json"), {
        "tokenizer_class": "GPT2Tokenizer", "bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN, "unk_token": EOD_TOKEN,
        "pad_token": EOD_TOKEN, "add_prefix_space": False, "model_max_length": max_length})


def _copy_hf(trained: TrainedTokenizer, out: str, max_length: int) -> None:
    """The HuggingFaceTokenizer's tokenizer.json (a file, or a folder's) and the files beside it."""
    path = trained.flags.tokenizer_model
    folder, tokenizer_json = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) \
        else (os.path.dirname(path), path)
    shutil.copyfile(tokenizer_json, os.path.join(out, "tokenizer.json"))
    for name in TOKENIZER_FILES[1:]:
        if os.path.isfile(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(folder, name), os.path.join(out, name))
    if not os.path.isfile(os.path.join(out, "tokenizer_config.json")):
        eos = trained.tokenizer.inv_vocab[trained.tokenizer.eod]
        _write_json(os.path.join(out, "tokenizer_config.json"), {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "model_max_length": max_length})


def write_tokenizer(trained: TrainedTokenizer, out: str, max_length: int) -> None:
    """The run's tokenizer files (see the module's docstring) and a generation_config.json with
    its ids into the folder `out`; a NOTE line when the tokenizer has no files to write."""
    kind = trained.flags.tokenizer_type
    if kind == "GPT2BPETokenizer":
        _write_gpt2(trained, out, max_length)
    elif kind == "HuggingFaceTokenizer":
        _copy_hf(trained, out, max_length)
    else:
        eos = token_ids(trained)["eos_token_id"]
        reason = "its text is the token ids" if kind == "NullTokenizer" else "teratron writes no files for it"
        print(f"NOTE: the model was trained with --tokenizer-type {kind} ({reason}); the export has no tokenizer "
              f"files: give transformers token ids (eos_token_id {eos})", flush=True)
    _write_json(os.path.join(out, GENERATION_CONFIG), token_ids(trained))
