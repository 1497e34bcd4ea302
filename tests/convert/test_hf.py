"""Hugging Face conversion: tiny random Llama, Mistral, Qwen2 and Qwen3 models built offline with
transformers. Imported logits equal transformers' (fp32, 1e-4); import-hf -> (a tensor-parallel
load and re-save) -> export-hf gives back the same weights, config and tokenizer files, and
transformers loads the export with the same logits."""

import filecmp
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")

from dist import run_distributed  # noqa: E402
from teratron import parallel_state as ps  # noqa: E402
from teratron import cli  # noqa: E402
from teratron.convert import cli as convert_cli  # noqa: E402
from teratron.convert.hf import from_hf  # noqa: E402
from teratron.convert.safetensors_io import INDEX_FILENAME  # noqa: E402
from teratron.dist_checkpointing import load_checkpoint, save_checkpoint, storage  # noqa: E402
from teratron.dist_checkpointing.model_args import build_gpt_model, transformer_config  # noqa: E402
from teratron.training.arguments import ArgumentParser  # noqa: E402

VOCAB, SEQ = 101, 12
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, num_key_value_heads=4)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def ids_and_positions():
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    return ids, torch.arange(SEQ).expand(2, SEQ)


def make_hf_model(family, path, max_shard_size="10MB"):
    """A random tiny HF model (every weight random, norms and biases included) saved to `path`."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
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


def convert(*argv):
    """`teratron convert ...`; user errors raise (the CLI would print them as one line)."""
    return convert_cli.run(convert_cli.add_arguments(ArgumentParser(prog="teratron convert")).parse_args(list(argv)))


def hf_tensors(path):
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(os.path.join(path, f)).items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_export_round_trip(family, tmp_path):
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    reference = make_hf_model(family, src, max_shard_size="20KB" if family == "llama" else "10MB")
    if family == "llama":
        assert os.path.isfile(src / INDEX_FILENAME)  # the import reads a sharded folder

    model, config = from_hf(str(src))
    ids, positions = ids_and_positions()
    with torch.no_grad():
        assert_close(model(ids, positions), reference, rtol=0, atol=1e-4)
    assert config.qk_layernorm == (family == "qwen3") and config.num_query_groups == FAMILIES[family][2].get(
        "num_key_value_heads", 2)

    assert cli.main(["convert", "import-hf", "--hf-path", str(src), "--save", str(ckpt),
                     "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]) == 0
    assert storage.read_tracker(str(ckpt)) == 0
    assert cli.main(["convert", "export-hf", "--load", str(ckpt), "--out", str(out), "--max-shard-size", "30KB"]) == 0
    assert os.path.isfile(out / INDEX_FILENAME)
    original, exported = hf_tensors(src), hf_tensors(out)
    assert set(original) == set(exported)
    for name in original:
        assert torch.equal(original[name], exported[name]), name
    for name in TOKENIZER_FILES:
        assert filecmp.cmp(src / name, out / name, shallow=False)
    assert_close(hf_logits(str(out)), reference, rtol=0, atol=1e-4)


def _tp2_reload_and_save(ckpt, resaved):
    """Load the imported checkpoint under TP = 2 (vocab padded to 2 x 128), check logits, re-save."""
    ps.initialize_model_parallel(2)
    model_args = storage.read_metadata(storage.resolve_checkpoint_dir(ckpt))["model_args"]
    config = transformer_config(model_args, tensor_model_parallel_size=2)
    model = build_gpt_model(model_args, config, padded_vocab_size=256)
    model.parallel_output = False
    load_checkpoint(storage.resolve_checkpoint_dir(ckpt), [model], load_optimizer=False)
    with torch.no_grad():
        logits = model(*ids_and_positions())[..., :VOCAB]
    save_checkpoint(resaved, 7, [model], metadata={"model_args": {**model_args, "padded_vocab_size": 256}})
    return logits


def test_tensor_parallel_load_and_export(tmp_path):
    """import-hf -> TP = 2 load (logits as transformers') -> TP = 2 save -> export-hf -> transformers."""
    src, ckpt, resaved, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "resaved", tmp_path / "out"
    reference = make_hf_model("qwen3", src)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt), "--tensor-model-parallel-size", "2")
    logits = run_distributed(_tp2_reload_and_save, 2, str(ckpt), str(resaved))
    for rank_logits in logits:
        assert_close(rank_logits, reference, rtol=0, atol=1e-4)
    convert("export-hf", "--load", str(resaved), "--out", str(out))
    assert_close(hf_logits(str(out)), reference, rtol=0, atol=1e-4)


def test_refusals(tmp_path):
    src = tmp_path / "hf"
    make_hf_model("llama", src)
    config = json.loads((src / "config.json").read_text())
    with pytest.raises(ValueError, match="rope type 'llama3'"):
        (src / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
        from_hf(str(src))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        (src / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
        from_hf(str(src))
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_query_groups \\(2\\) is not divisible"):
        convert("import-hf", "--hf-path", str(src), "--save", str(tmp_path / "c"), "--tensor-model-parallel-size", "4")
    assert not (tmp_path / "c").exists()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_hf(str(tmp_path))
    with pytest.raises(ValueError, match="--max-shard-size"):
        convert_cli.parse_size("lots")
    assert cli.main(["convert", "export-hf", "--load", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2


def test_finetune_an_imported_model_and_export_it(tmp_path):
    """import-hf -> `teratron train --load --finetune` (flags matching the model) -> export-hf:
    transformers loads the trained weights and agrees with teratron's own logits for them."""
    from teratron.training.arguments import parse_train_args
    from teratron.training.training import pretrain

    src, ckpt, trained, out = (tmp_path / n for n in ("hf", "ckpt", "trained", "out"))
    make_hf_model("llama", src)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
             "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "40", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
             "--norm-epsilon", "1e-5", "--position-embedding-type", "rope", "--rotary-base", "500000",
             "--untie-embeddings-and-output-weights", "--seq-length", "16", "--max-position-embeddings", "64",
             "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-2", "--eval-iters", "0",
             "--num-workers", "0", "--no-progress-bar", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--load", str(ckpt), "--finetune", "--save", str(trained)]
    pretrain(parse_train_args(flags))
    assert storage.read_tracker(str(trained)) == 2
    convert("export-hf", "--load", str(trained), "--out", str(out))
    changed = hf_tensors(out)["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(changed, hf_tensors(src)["model.layers.0.mlp.up_proj.weight"])
    model, _ = from_hf(str(out))
    with torch.no_grad():
        ours = model(*ids_and_positions())
    assert_close(hf_logits(str(out)), ours, rtol=0, atol=1e-4)
    for name in TOKENIZER_FILES:  # the HF files travel with the trained checkpoint
        assert filecmp.cmp(src / name, out / name, shallow=False)
