"""Helpers of the Hugging Face conversion tests: tiny random HF models saved offline, their
logits, and the `teratron convert` command run in-process."""

import json
import os

import torch
import transformers
from safetensors.torch import load_file

from teratron.convert import cli as convert_cli
from teratron.tokenizers.gpt2_bpe import EOD_TOKEN, bytes_to_unicode
from teratron.training.arguments import ArgumentParser

VOCAB, SEQ = 101, 12
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def ids_and_positions():
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    return ids, torch.arange(SEQ).expand(2, SEQ)


def save_random_hf_model(config_cls: str, model_cls: str, config_kwargs: dict, path, max_shard_size: str):
    """A tiny HF model with every weight random (norms, biases and saved buffers such as
    DeepSeek's expert bias included) saved to `path` with tokenizer files; returns its logits for
    `ids_and_positions()`."""
    config = getattr(transformers, config_cls)(**config_kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            t.copy_(torch.randn_like(t) * 0.3)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hi": 1},
                                                "unk_token": "<unk>"}}, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    with torch.no_grad():
        return model(ids_and_positions()[0]).logits


def hf_logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids_and_positions()[0]).logits


def hf_tensors(path):
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(os.path.join(path, f)).items()}


def read_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def convert(*argv):
    """`teratron convert ...`; user errors raise (the CLI would print them as one line)."""
    parser = convert_cli.add_arguments(ArgumentParser(prog="teratron convert"))
    return convert_cli.run(parser.parse_args(list(argv)))


# The shape flags the Llama-style test models share.
LLAMA_SHAPE = ("--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups",
               "2", "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5", "--position-embedding-type",
               "rope", "--untie-embeddings-and-output-weights", "--max-position-embeddings", "64")


def finetune(ckpt, trained, *model_flags, shape=LLAMA_SHAPE):
    """`teratron train --load ckpt --finetune --save trained`: 2 iterations on mock data of the
    imported tiny model, whose shape the `shape` flags and `model_flags` give."""
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import build_run_config
    from teratron.training.training import pretrain

    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), *shape,
             "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-2", "--eval-iters", "0",
             "--num-workers", "0", "--no-progress-bar", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--load", str(ckpt), "--finetune", "--save", str(trained), *model_flags]
    pretrain(build_run_config(parse_train_args(flags)))


# A tiny GPT-2 byte-level BPE: the 256 byte tokens (id = byte), these merges in order, then the EOD.
TINY_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("a", "t"), ("Ġ", "c"), ("Ġc", "at"), ("Ġ", "s"),
               ("Ġs", "at"), ("o", "n"), ("Ġ", "on"), ("Ġ", "m"), ("Ġm", "at")]


def write_tiny_gpt2_bpe(folder):
    """GPT-2-format encoder.json and vocab.bpe of the tiny BPE in `folder`; (vocab file, merge file)."""
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    for left, right in TINY_MERGES:
        vocab[left + right] = len(vocab)
    vocab[EOD_TOKEN] = len(vocab)
    os.makedirs(folder, exist_ok=True)
    vocab_file, merge_file = os.path.join(folder, "encoder.json"), os.path.join(folder, "vocab.bpe")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(f"{left} {right}" for left, right in TINY_MERGES) + "\n")
    return vocab_file, merge_file


def recipe_flags(*tokenizer_flags):
    """README's "Training on your data" flags at tiny sizes (no --bf16: fp32 on the CPU), mock data
    and no checkpoint flags, with the tokenizer `tokenizer_flags` give."""
    return ["--mock-data", *tokenizer_flags, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "6e-4", "--min-lr", "6e-5",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--adam-beta2", "0.95",
            "--clip-grad", "1.0", "--eval-iters", "0", "--num-workers", "0", "--no-progress-bar"]
