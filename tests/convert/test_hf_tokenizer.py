"""export-hf carries the tokenizer the model was trained with: a `teratron train` run's
HuggingFaceTokenizer files (with a tokenizer_config.json added where the run had none), no files
for a NullTokenizer run (one NOTE line), the run's tokenizer rather than an import's when a
fine-tune changed the vocabulary; config.json and generation_config.json carry its bos, eos (the
EOD) and pad ids, and transformers' AutoTokenizer gives teratron's ids. (GPT-2 BPE runs:
test_hf_gpt2.py; imports and NullTokenizer fine-tunes of them keep the imported files: test_hf.py.)"""

import filecmp
import json
import os

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from convert.hf_testing import (VOCAB, convert, finetune, read_config, recipe_flags,
                                save_random_hf_model, write_tiny_gpt2_bpe)
from teratron.dist_checkpointing import save_checkpoint
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args, model_args_from_config
from teratron.models.gpt.builder import build_gpt_model
from teratron.tokenizers import GPT2BPETokenizer, HuggingFaceTokenizer, build_tokenizer
from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config

WORDS = [f"w{i}" for i in range(VOCAB - 4)] + ["<s>", "</s>", "<pad>", "<unk>"]


def write_word_tokenizer(path):
    """A WordLevel tokenizer.json of VOCAB words (</s> is id VOCAB - 3) at `path`."""
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<s>", "</s>", "<pad>"])
    tokenizer.save(str(path))


def save_run_checkpoint(root, *tokenizer_flags):
    """A checkpoint as `teratron train` with the recipe's tiny model and `tokenizer_flags` saves it:
    the run description in common.pt, the model args and the tokenizer's fingerprint in
    metadata.json (random weights: no training needed to export)."""
    args = parse_train_args(recipe_flags(*tokenizer_flags))
    run = build_run_config(args, world_size=1)
    model_args = model_args_from_config(run.model)
    model = build_gpt_model(gpt_config_from_model_args(model_args))
    save_checkpoint(str(root), 2, [model], common={"args": run.to_dict()},
                    metadata={"model_args": model_args, "tokenizer": build_tokenizer(args).fingerprint()})


def token_ids(path):
    config, generation = read_config(path), json.loads((path / "generation_config.json").read_text())
    ids = [(c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) for c in (config, generation)]
    assert ids[0] == ids[1]
    return ids[0]


def test_a_hugging_face_tokenizer_folder_is_copied(tmp_path):
    folder, ckpt, out = tmp_path / "tok", tmp_path / "ckpt", tmp_path / "out"
    folder.mkdir()
    write_word_tokenizer(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))  # another model's: not copied
    save_run_checkpoint(ckpt, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder))
    convert("export-hf", "--load", str(ckpt), "--out", str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert filecmp.cmp(folder / name, out / name, shallow=False), name
    assert read_config(out)["model_type"] == "gpt2"
    assert token_ids(out) == (VOCAB - 4, VOCAB - 3, VOCAB - 2)
    ours, theirs = HuggingFaceTokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(str(out))
    text = "w5 w17 w3 w96"
    assert theirs(text)["input_ids"] == ours.tokenize(text) == [5, 17, 3, 96]
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == token_ids(out)
    transformers.AutoModelForCausalLM.from_pretrained(str(out))  # loads as is


def test_a_lone_tokenizer_json_gets_a_tokenizer_config(tmp_path):
    """--tokenizer-model FILE (any name) with no tokenizer_config.json beside it: exported as
    tokenizer.json with a tokenizer_config.json naming the eos token teratron found (</s>)."""
    folder, ckpt, out = tmp_path / "tok", tmp_path / "ckpt", tmp_path / "out"
    folder.mkdir()
    write_word_tokenizer(folder / "words.json")
    save_run_checkpoint(ckpt, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                        str(folder / "words.json"))
    convert("export-hf", "--load", str(ckpt), "--out", str(out))
    assert filecmp.cmp(folder / "words.json", out / "tokenizer.json", shallow=False)
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "model_max_length": 32}
    assert token_ids(out) == (None, VOCAB - 3, VOCAB - 3)
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    assert theirs("w1 w2")["input_ids"] == [1, 2] and theirs.eos_token_id == VOCAB - 3


def test_a_null_tokenizer_run_exports_no_tokenizer(tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    save_run_checkpoint(ckpt, "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB))
    capsys.readouterr()
    convert("export-hf", "--load", str(ckpt), "--out", str(out))
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("NOTE")]
    assert notes == [f"NOTE: the model was trained with --tokenizer-type NullTokenizer (its text is the token ids); "
                     f"the export has no tokenizer files: give transformers token ids (eos_token_id {VOCAB - 1})"]
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    assert token_ids(out) == (None, VOCAB - 1, VOCAB - 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert model.generation_config.eos_token_id == VOCAB - 1 and model.generation_config.bos_token_id is None


def test_a_tokenizer_whose_files_are_gone_refuses(tmp_path):
    vocab_file, merge_file = write_tiny_gpt2_bpe(tmp_path / "bpe")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    save_run_checkpoint(ckpt, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file,
                        "--merge-file", merge_file)
    os.remove(vocab_file)
    with pytest.raises(ValueError, match=r"^--load .*iter_0000002: the tokenizer the model was trained with "
                                         r"\(--tokenizer-type GPT2BPETokenizer\) cannot be built: .*; put its files "
                                         r"back where the run read them$"):
        convert("export-hf", "--load", str(ckpt), "--out", str(out))
    assert not out.exists()


def test_a_fine_tune_with_another_tokenizer_exports_that_one(tmp_path):
    """import-hf (a word-level tokenizer in hf/) -> fine-tuned with a GPT-2 BPE
    (--allow-tokenizer-change) -> the export has the BPE's files and ids, and its vocabulary."""
    src, ckpt, trained, out = (tmp_path / n for n in ("hf", "ckpt", "trained", "out"))
    save_random_hf_model("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=0), src,
        "10MB")
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    vocab_file, merge_file = write_tiny_gpt2_bpe(tmp_path / "bpe")
    finetune(ckpt, trained, "--num-layers", "2", "--ffn-hidden-size", "40", "--disable-bias-linear",
             "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file,
             "--allow-tokenizer-change")
    convert("export-hf", "--load", str(trained), "--out", str(out))
    bpe = GPT2BPETokenizer(vocab_file, merge_file)
    assert read_config(out)["vocab_size"] == bpe.vocab_size and token_ids(out) == (bpe.eod,) * 3
    assert json.loads((out / "vocab.json").read_text()) == bpe.vocab
    assert transformers.AutoTokenizer.from_pretrained(str(out))("the cat")["input_ids"] == bpe.tokenize("the cat")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        assert model(torch.tensor([[bpe.eod]])).logits.shape[-1] == bpe.vocab_size
