"""Hugging Face conversion: tiny random Llama, Mistral, Qwen2 and Qwen3 models built offline with
transformers. Imported logits equal transformers' (fp32, 1e-4); import-hf -> (a tensor-parallel
load and re-save) -> export-hf gives back the same weights, config and tokenizer files, and
transformers loads the export with the same logits."""

import filecmp
import json
import os

import pytest
import torch
from torch.testing import assert_close

from convert.hf_testing import (TOKENIZER_FILES, VOCAB, convert, finetune, hf_logits,
                                hf_tensors, ids_and_positions, read_config, save_random_hf_model)
from dist import run_distributed
from teratron import parallel_state as ps
from teratron import cli
from teratron.convert import cli as convert_cli
from teratron.convert.hf import from_hf
from teratron.convert.hf_mapping import teratron_to_hf
from teratron.convert.safetensors_io import INDEX_FILENAME
from teratron.dist_checkpointing import load_checkpoint, load_full, save_checkpoint, storage
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.dist_checkpointing.model_state import is_model_key
from teratron.models.gpt.builder import build_gpt_model

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, attention_bias=True, mlp_bias=True)),
    # Llama 3.x RoPE scaling; head 8 and base 1000 give wavelengths 6.3, 35, 199 and 1117 against
    # the bounds 64 / 4 = 16 and 64 / 1: one pair kept, one blended, two divided by the factor.
    "llama3_scaling": ("LlamaConfig", "LlamaForCausalLM", dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="llama3", rope_theta=1000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    # A window of 4 tokens (each query sees itself and 3 before) on sequences of 12: it bites.
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, num_key_value_heads=4)),
}


def make_hf_model(family, path, max_shard_size="10MB"):
    config_cls, model_cls, extra = FAMILIES[family]
    return save_random_hf_model(config_cls, model_cls, {**COMMON, **extra}, path, max_shard_size)


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
    assert config.window_size == ((3, 0) if family == "mistral_window" else None)
    if family == "llama3_scaling":  # the scaling changes the logits, by far more than the tolerance
        unscaled, _ = from_hf(str(src))
        unscaled.rotary_pos_emb.inv_freq.copy_(1.0 / 1000.0 ** (torch.arange(0, 8, 2) / 8))
        with torch.no_grad():
            assert (unscaled(ids, positions) - reference).abs().max() > 0.1

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
    if family == "llama3_scaling":
        assert read_config(out)["rope_parameters"] == read_config(src)["rope_parameters"]


def _tp2_reload_and_save(ckpt, resaved):
    """Load the imported checkpoint under TP = 2 (vocab padded to 2 x 128), check logits, re-save."""
    ps.initialize_model_parallel(2)
    model_args = storage.read_metadata(storage.resolve_checkpoint_dir(ckpt))["model_args"]
    model = build_gpt_model(gpt_config_from_model_args(model_args, padded_vocab_size=256, tensor_model_parallel_size=2))
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
    with pytest.raises(ValueError, match="rope type 'linear' \\(rope_scaling\\) is not supported by teratron's "
                                         "RoPE for llama; only default and llama3 rotary embeddings convert"):
        (src / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}))
        from_hf(str(src))
    with pytest.raises(ValueError, match="rope_scaling of type llama3 lacks factor"):
        (src / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "llama3"}}))
        from_hf(str(src))
    with pytest.raises(ValueError, match="Llama 3 RoPE scaling with factor=8.0, low_freq_factor=4.0, "
                                         "high_freq_factor=4.0"):
        (src / "config.json").write_text(json.dumps({**config, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0}}))
        from_hf(str(src))
    with pytest.raises(ValueError, match="model_type 'gpt_neox' is not convertible; supported: llama, .*, gpt2"):
        (src / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
        from_hf(str(src))
    with pytest.raises(ValueError, match="converts the sliding windows of mistral and mixtral only"):
        (src / "config.json").write_text(json.dumps({**config, "use_sliding_window": True, "sliding_window": 8}))
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


def test_damaged_inputs_and_failed_writes(tmp_path, monkeypatch):
    """Damaged HF files and a checkpoint without model args refuse naming the file; an import or
    export that fails while writing leaves no partial output behind."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    make_hf_model("llama", src, max_shard_size="20KB")
    config_text, index_text = (src / "config.json").read_text(), (src / INDEX_FILENAME).read_text()
    (src / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        from_hf(str(src))
    (src / "config.json").write_text(json.dumps({k: v for k, v in json.loads(config_text).items()
                                                 if k != "hidden_size"}))
    with pytest.raises(ValueError, match="config.json lacks hidden_size"):
        from_hf(str(src))
    (src / "config.json").write_text(config_text)
    (src / INDEX_FILENAME).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=f"{INDEX_FILENAME}: not a safetensors index"):
        from_hf(str(src))
    (src / INDEX_FILENAME).write_text(index_text)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr("teratron.convert.hf.serialization.save", fail)
        with pytest.raises(OSError, match="disk full"):
            convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
        assert not ckpt.exists()
        ckpt.mkdir()  # an empty folder given as --save stays, empty
        with pytest.raises(OSError, match="disk full"):
            convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
        assert ckpt.is_dir() and not os.listdir(ckpt)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    with monkeypatch.context() as m:
        m.setattr("teratron.convert.hf.save_hf_weights", fail)
        with pytest.raises(OSError, match="disk full"):
            convert("export-hf", "--load", str(ckpt), "--out", str(out))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]

    iteration_dir = storage.resolve_checkpoint_dir(str(ckpt))
    metadata = storage.read_metadata(iteration_dir)
    state = load_full(iteration_dir, is_model_key)
    del state["decoder.final_layernorm.weight"]
    with pytest.raises(ValueError, match="decoder.final_layernorm.weight is missing"):
        teratron_to_hf(state, metadata["model_args"], "llama")
    del metadata["model_args"]
    storage.write_metadata(iteration_dir, metadata)
    with pytest.raises(ValueError, match="records no model_args"):
        convert("export-hf", "--load", str(ckpt), "--out", str(out))


FINETUNE_FLAGS = {
    "llama": ("--rotary-base", "500000"),
    "llama3_scaling": ("--rotary-base", "1000", "--disable-bias-linear", "--max-position-embeddings", "128",
                       "--use-rope-scaling", "--rope-scaling-factor", "4",
                       "--rope-scaling-original-max-position-embeddings", "64"),
}


@pytest.mark.parametrize("family", sorted(FINETUNE_FLAGS))
def test_finetune_an_imported_model_and_export_it(family, tmp_path):
    """import-hf -> `teratron train --load --finetune` (flags matching the model, Megatron's
    --use-rope-scaling for Llama 3's RoPE) -> export-hf: transformers loads the trained weights
    and agrees with teratron's own logits for them."""
    src, ckpt, trained, out = (tmp_path / n for n in ("hf", "ckpt", "trained", "out"))
    make_hf_model(family, src)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    finetune(ckpt, trained, "--num-layers", "2", "--ffn-hidden-size", "40", *FINETUNE_FLAGS[family])
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
