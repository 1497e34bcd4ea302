"""Hugging Face GPT-2 <-> teratron: the model of README's "Training on your data" recipe (learned
absolute positions, LayerNorm with biases, exact-GeLU MLP, biases on every linear layer, tied
embeddings; the tanh GeLU with --openai-gelu) exports as GPT2LMHeadModel and GPT-2 imports
("gelu", "gelu_new", "gelu_pytorch_tanh"; the Hub's files without the "transformer." prefix too).
A tiny random teratron model exports with transformers' logits equal to teratron's, a tiny random
transformers GPT-2 imports with its logits (fp32, 1e-4), and `teratron train` (the recipe's
flags at tiny sizes, a tiny GPT-2 BPE written here) -> export-hf gives a folder that transformers'
AutoTokenizer and AutoModelForCausalLM load as is: the same token ids, and `generate` gives the
engine's greedy tokens."""

import json
import os
import pathlib
import stat

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from convert.hf_testing import (VOCAB, convert, hf_logits, hf_tensors, ids_and_positions, read_config,
                                recipe_flags, save_random_hf_model, write_tiny_gpt2_bpe)
from teratron.convert.hf import from_hf
from teratron.convert.hf_config import hf_config_from_model_args
from teratron.convert.safetensors_io import SINGLE_FILENAME
from teratron.dist_checkpointing import save_checkpoint, storage
from teratron.dist_checkpointing.model_args import GDP_DEFAULTS, VARIANT_DEFAULTS, gpt_config_from_model_args
from teratron.inference.config import InferenceConfig
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.loading import load_for_inference
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt.builder import build_gpt_model
from teratron.tokenizers import GPT2BPETokenizer, HuggingFaceTokenizer
from teratron.transformer.mlp import openai_gelu

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
HF_GPT2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_inner=48, n_positions=64,
               activation_function="gelu", layer_norm_epsilon=1e-5, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
# The recipe's model, tiny: Megatron's GPT defaults.
RECIPE_ARGS = dict(num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=4,
                   kv_channels=8, normalization="LayerNorm", norm_epsilon=1e-5, swiglu=False, add_bias_linear=True,
                   add_qkv_bias=False, qk_layernorm=False, position_embedding_type="learned_absolute",
                   rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False, use_rope_scaling=False,
                   untie_embeddings_and_output_weights=False, max_position_embeddings=64, vocab_size=VOCAB,
                   padded_vocab_size=128)


@pytest.mark.parametrize("tied, activation", [(True, "gelu"), (False, "gelu"), (True, "gelu_new"),
                                               (False, "gelu_pytorch_tanh")])
def test_hf_gpt2_imports_and_exports(tied, activation, tmp_path):
    """from_hf's logits equal transformers'; import-hf -> export-hf gives back the same tensors and
    the model fields of config.json (a tanh GeLU written as "gelu_new"), and transformers loads the
    export with the same logits."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    reference = save_random_hf_model("GPT2Config", "GPT2LMHeadModel",
                                     dict(HF_GPT2, tie_word_embeddings=tied, activation_function=activation),
                                     src, "10MB")
    model, config = from_hf(str(src))
    with torch.no_grad():
        assert_close(model(*ids_and_positions()), reference, rtol=0, atol=1e-4)
    assert config.normalization == "LayerNorm" and config.ffn_hidden_size == 48 and config.add_bias_linear
    assert config.activation_func is (F.gelu if activation == "gelu" else openai_gelu)

    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    convert("export-hf", "--load", str(ckpt), "--out", str(out))
    original, exported = hf_tensors(src), hf_tensors(out)
    assert set(original) == set(exported) and ("lm_head.weight" in exported) == (not tied)
    for name in original:
        assert torch.equal(original[name], exported[name]), name
    src_config, out_config = read_config(src), read_config(out)
    for field in ("model_type", "architectures", "n_layer", "n_embd", "n_head", "n_inner", "n_positions",
                  "vocab_size", "layer_norm_epsilon", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert out_config[field] == src_config[field], field
    assert out_config["activation_function"] == ("gelu" if activation == "gelu" else "gelu_new")
    assert storage.read_metadata(storage.resolve_checkpoint_dir(str(ckpt)))["model_args"]["openai_gelu"] == (
        activation != "gelu")
    assert_close(hf_logits(str(out)), reference, rtol=0, atol=1e-4)


def _without_lm_head_prefix(src):
    """Rewrite the tied model's files as GPT2Model saves them (the Hub's GPT-2): no "transformer."."""
    tensors = load_file(src / SINGLE_FILENAME)
    assert "lm_head.weight" not in tensors
    save_file({name.removeprefix("transformer."): t for name, t in tensors.items()}, src / SINGLE_FILENAME,
              metadata={"format": "pt"})
    return tensors


def test_hub_gpt2_names_without_the_transformer_prefix_import(tmp_path):
    """The Hub's GPT-2 files (gelu_new, h.0.attn.c_attn.weight, wte.weight, no lm_head) import with
    transformers' logits and export under GPT2LMHeadModel's names; files mixing both spellings are
    refused by the header check."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    reference = save_random_hf_model("GPT2Config", "GPT2LMHeadModel", dict(HF_GPT2, activation_function="gelu_new"),
                                     src, "10MB")
    prefixed = _without_lm_head_prefix(src)
    assert "h.0.attn.c_attn.weight" in hf_tensors(src) and "wte.weight" in hf_tensors(src)
    model, _ = from_hf(str(src))
    with torch.no_grad():
        assert_close(model(*ids_and_positions()), reference, rtol=0, atol=1e-4)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    convert("export-hf", "--load", str(ckpt), "--out", str(out))
    exported = hf_tensors(out)
    assert set(exported) == set(prefixed)
    for name in prefixed:
        assert torch.equal(exported[name], prefixed[name]), name
    assert_close(hf_logits(str(out)), reference, rtol=0, atol=1e-4)

    mixed = {name.removeprefix("transformer.") if ".h.0." in name else name: t for name, t in prefixed.items()}
    save_file(mixed, src / SINGLE_FILENAME, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r": transformer\.h\.0\.attn\.c_attn\.bias is missing \(and 11 more\)"):
        from_hf(str(src))


def test_older_gpt2_files_with_mask_buffers_import(tmp_path):
    """Files saved by older transformers carry each layer's causal mask (attn.bias, attn.masked_bias):
    buffers, not weights; the import skips them."""
    src = tmp_path / "hf"
    reference = save_random_hf_model("GPT2Config", "GPT2LMHeadModel", HF_GPT2, src, "10MB")
    tensors = load_file(src / SINGLE_FILENAME)
    for i in range(2):
        tensors[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
        tensors[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, src / SINGLE_FILENAME, metadata={"format": "pt"})
    model, _ = from_hf(str(src))
    with torch.no_grad():
        assert_close(model(*ids_and_positions()), reference, rtol=0, atol=1e-4)


def _random_recipe_checkpoint(root, model_args):
    """A checkpoint of the recipe's model with every parameter random (norms and biases too); its
    logits for `ids_and_positions()` over the real vocabulary."""
    torch.manual_seed(0)
    model = build_gpt_model(gpt_config_from_model_args(model_args)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        logits = model(*ids_and_positions())[..., :VOCAB]
    save_checkpoint(str(root), 1, [model], metadata={"model_args": model_args})
    return logits


@pytest.mark.parametrize("tied, tanh", [(True, False), (False, False), (True, True)])
def test_recipe_model_exports_as_gpt2(tied, tanh, tmp_path, capsys):
    """GPT-2's c_attn is q | k | v (Megatron's QKV interleaves them per head), its Conv1D weights
    [in, out]: transformers' logits equal teratron's; the exact GeLU is 'gelu', the tanh one
    (--openai-gelu) 'gelu_new'."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    reference = _random_recipe_checkpoint(ckpt, dict(RECIPE_ARGS, untie_embeddings_and_output_weights=not tied,
                                                     openai_gelu=tanh))
    capsys.readouterr()
    convert("export-hf", "--load", str(ckpt), "--out", str(out))
    assert "NOTE: the checkpoint records no tokenizer" in capsys.readouterr().out
    config = read_config(out)
    assert (config["model_type"], config["architectures"], config["activation_function"], config["n_inner"],
            config["tie_word_embeddings"]) == ("gpt2", ["GPT2LMHeadModel"], "gelu_new" if tanh else "gelu", 128, tied)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert isinstance(model, transformers.GPT2LMHeadModel)
    assert_close(hf_logits(str(out)), reference, rtol=0, atol=1e-4)
    back, _ = from_hf(str(out))
    with torch.no_grad():
        assert_close(back(*ids_and_positions()), reference, rtol=0, atol=1e-4)


def test_gpt2_refusals(tmp_path):
    src = tmp_path / "hf"
    save_random_hf_model("GPT2Config", "GPT2LMHeadModel", HF_GPT2, src, "10MB")
    config = read_config(src)
    for change, words in (
            ({"activation_function": "relu"},
             "activation_function='relu'; teratron's MLP computes the exact GeLU or its tanh approximation, so only "
             "'gelu_new', 'gelu_pytorch_tanh', 'gelu' convert"),
            ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
            ({"scale_attn_weights": False}, "scale_attn_weights=False"),
            ({"n_inner": 40}, r"transformer.h.0.mlp.c_fc.bias in model.safetensors has shape \[48\] but config.json")):
        (src / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=words):
            from_hf(str(src))
    for change, words in (({"swiglu": True}, "swiglu=True"), ({"num_query_groups": 2}, "num_query_groups=2"),
                          ({"normalization": "RMSNorm"}, "normalization=RMSNorm"),
                          ({"add_bias_linear": False}, "add_bias_linear=False")):
        with pytest.raises(ValueError, match=f"learned absolute positions, as Hugging Face's GPT-2, but {words}"):
            hf_config_from_model_args({**RECIPE_ARGS, **change})
    with pytest.raises(ValueError, match="neither Llama-shaped .* nor GPT-2-shaped"):
        hf_config_from_model_args({**RECIPE_ARGS, "position_embedding_type": "rope"})


def _engine_greedy(ckpt, prompt_ids, new_tokens):
    model, tokenizer = load_for_inference(ckpt, device="cpu")
    engine = DynamicInferenceEngine(model, tokenizer, InferenceConfig(buffer_size_gb=0.01, block_size=4,
                                                                      max_seq_length=32))
    greedy = SamplingParams(temperature=0, num_tokens_to_generate=new_tokens)
    return engine.generate([prompt_ids], greedy)[0].token_ids


def test_trained_recipe_model_exports_and_generates_with_transformers(tmp_path, capsys):
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import build_run_config
    from teratron.training.training import pretrain

    vocab_file, merge_file = write_tiny_gpt2_bpe(tmp_path / "bpe")
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "out"
    flags = recipe_flags("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file)
    pretrain(build_run_config(parse_train_args([*flags, "--save", ckpt, "--save-interval", "2", "--load", ckpt])))
    old_umask = os.umask(0o022)
    try:
        convert("export-hf", "--load", ckpt, "--out", str(out))
    finally:
        os.umask(old_umask)
    assert sorted(os.listdir(out)) == sorted(["config.json", "generation_config.json", SINGLE_FILENAME, "merges.txt",
                                              "tokenizer.json", "tokenizer_config.json", "vocab.json"])
    for name in os.listdir(out):  # the tokenizer's and config files as the safetensors shard: readable by others
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o644, name

    ours = GPT2BPETokenizer(vocab_file, merge_file)
    eod = ours.eod
    config, generation = read_config(out), json.loads((out / "generation_config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["n_positions"]) == ("gpt2", 269, 32)
    for fields in (config, generation):
        assert (fields["bos_token_id"], fields["eos_token_id"], fields["pad_token_id"]) == (eod, eod, eod) == (268,) * 3

    text = "the cat sat on the mat, then the cat ate ünïcode"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = ours.tokenize(text)
    assert tokenizer(text)["input_ids"] == ids == HuggingFaceTokenizer(str(out)).tokenize(text)
    assert len(ids) < len(text.encode())  # merges were applied
    assert tokenizer.decode(ids) == text and tokenizer.eos_token_id == tokenizer.pad_token_id == eod

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    prompt = ours.tokenize("The cat sat on")
    with torch.no_grad():
        hf_new = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)[0, len(prompt):].tolist()
    engine_new = _engine_greedy(ckpt, prompt, 20)
    assert len(set(hf_new)) > 1 and hf_new == engine_new

    block = README.read_text().split("<!-- export-hf")[1].split("```python\n")[1].split("```")[0]
    capsys.readouterr()
    exec(block.replace('"hf/gpt-125m"', repr(str(out))), {})  # noqa: S102 - our own README's code
    assert capsys.readouterr().out == tokenizer.decode(prompt + engine_new) + "\n"

    # And back: import-hf of the export holds the trained model (its model args, padded alike).
    convert("import-hf", "--hf-path", str(out), "--save", str(tmp_path / "back"))
    trained = storage.read_metadata(storage.resolve_checkpoint_dir(ckpt))["model_args"]
    back = storage.read_metadata(storage.resolve_checkpoint_dir(str(tmp_path / "back")))["model_args"]
    back = {**VARIANT_DEFAULTS, **GDP_DEFAULTS, "mtp_num_layers": None, "multi_latent_attention": False,
            "quick_geglu": False, "squared_relu": False, **back}  # an import leaves out what is absent
    assert {k: back[k] for k in trained} == trained
