"""`teratron convert import-hf` checks its input before writing anything: every tensor's name and
shape against config.json, and every safetensors file's header. Each bad folder is one
`teratron: error:` line (exit 2) naming the tensor or file, and `--save` is never created. The
folders are written here by hand (safetensors + config.json; no transformers)."""

import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from teratron import cli
from teratron.convert.hf import from_hf
from teratron.convert.safetensors_io import INDEX_FILENAME, SINGLE_FILENAME
from teratron.dist_checkpointing import load_full, storage
from teratron.dist_checkpointing.model_state import is_model_key

# A one-layer Llama: vocab 11, hidden 8, MLP 12, 2 query heads and 1 key/value head of 4 channels.
CONFIG = dict(model_type="llama", vocab_size=11, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, rms_norm_eps=1e-5,
              tie_word_embeddings=False)
L = "model.layers.0."
SHAPES = {  # HF Llama's layout: Linear weights are [out, in]
    "model.embed_tokens.weight": (11, 8), "model.norm.weight": (8,), "lm_head.weight": (11, 8),
    L + "input_layernorm.weight": (8,), L + "post_attention_layernorm.weight": (8,),
    L + "self_attn.q_proj.weight": (8, 8), L + "self_attn.k_proj.weight": (4, 8),
    L + "self_attn.v_proj.weight": (4, 8), L + "self_attn.o_proj.weight": (8, 8),
    L + "mlp.gate_proj.weight": (12, 8), L + "mlp.up_proj.weight": (12, 8), L + "mlp.down_proj.weight": (8, 12),
}


def write_hf(path, config=None, shapes=None):
    """A folder with config.json and model.safetensors of random tensors; returns the tensors."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config or CONFIG))
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in (shapes or SHAPES).items()}
    save_file(tensors, str(path / SINGLE_FILENAME))
    return tensors


def import_hf_cli(src, save, capsys):
    """`teratron convert import-hf`: (exit status, stderr lines)."""
    status = cli.main(["convert", "import-hf", "--hf-path", str(src), "--save", str(save)])
    return status, capsys.readouterr().err.strip().splitlines()


def test_a_consistent_folder_imports(tmp_path, capsys):
    """The hand-made folder is right: it imports, and the MLP weights land where they belong."""
    tensors = write_hf(tmp_path / "hf")
    status, _ = import_hf_cli(tmp_path / "hf", tmp_path / "ckpt", capsys)
    assert status == 0
    state = load_full(storage.resolve_checkpoint_dir(str(tmp_path / "ckpt")), is_model_key)
    assert torch.equal(state["decoder.layers.0.mlp.linear_fc2.weight"], tensors[L + "mlp.down_proj.weight"])
    assert torch.equal(state["decoder.layers.0.mlp.linear_fc1.weight"],
                       torch.cat([tensors[L + "mlp.gate_proj.weight"], tensors[L + "mlp.up_proj.weight"]]))
    # A tied model may carry a copy of the embedding as lm_head.
    tied = write_hf(tmp_path / "tied", {**CONFIG, "tie_word_embeddings": True})
    model, _ = from_hf(str(tmp_path / "tied"))
    assert torch.equal(model.embedding.word_embeddings.weight, tied["model.embed_tokens.weight"])


def disagreements():
    """name -> (config, shapes, the phrase the error line must contain)."""
    down = L + "mlp.down_proj.weight"
    sizes = "config.json (hidden_size, intermediate_size, heads, vocab_size, ...)"
    return {
        "intermediate size": ({**CONFIG, "intermediate_size": 16}, SHAPES,
                              f"{down} in model.safetensors has shape [8, 12] but {sizes} gives [8, 16] (and 2 more)"),
        "hidden size": ({**CONFIG, "hidden_size": 16}, SHAPES,
                        f"lm_head.weight in model.safetensors has shape [11, 8] but {sizes} gives [11, 16]"),
        "down_proj shape": (CONFIG, {**SHAPES, down: (8, 10)}, f"{down} in model.safetensors has shape [8, 10]"),
        "down_proj transposed": (CONFIG, {**SHAPES, down: (12, 8)}, f"{down} in model.safetensors has shape [12, 8]"),
        "vocabulary": (CONFIG, {**SHAPES, "model.embed_tokens.weight": (12, 8)}, "model.embed_tokens.weight in "
                       "model.safetensors has shape [12, 8]"),
        "key/value heads": ({**CONFIG, "num_key_value_heads": 2}, SHAPES,
                            f"{L}self_attn.k_proj.weight in model.safetensors has shape [4, 8]"),
        "missing tensor": (CONFIG, {k: v for k, v in SHAPES.items() if "o_proj" not in k},
                           f"{L}self_attn.o_proj.weight is missing"),
        "more layers in config": ({**CONFIG, "num_hidden_layers": 2}, SHAPES,
                                  "model.layers.1.input_layernorm.weight is missing (and 8 more)"),
        "unexpected tensor": (CONFIG, {**SHAPES, L + "mlp.extra.weight": (3,)},
                              f"1 tensors have no teratron counterpart, e.g. {L}mlp.extra.weight"),
    }


def test_weights_that_disagree_with_config_are_refused_before_writing(tmp_path, capsys):
    for i, (name, (config, shapes, phrase)) in enumerate(disagreements().items()):
        src, save = tmp_path / f"hf{i}", tmp_path / f"ckpt{i}"
        write_hf(src, config, shapes)
        status, lines = import_hf_cli(src, save, capsys)
        assert status == 2, name
        assert len(lines) == 1 and lines[0].startswith(f"teratron: error: --hf-path {src}: "), (name, lines)
        assert phrase in lines[0], (name, lines[0])
        assert not save.exists(), name
        with pytest.raises(ValueError, match="disagree|missing|counterpart"):
            from_hf(str(src))


def damage(data: bytes):
    """name -> a damaged copy of a safetensors file's bytes."""
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_len])
    first = next(k for k in header if k != "__metadata__")
    header[first]["shape"] = [d + 1 for d in header[first]["shape"]]  # disagrees with its byte range
    reshaped = json.dumps(header).encode()
    return {
        "truncated": data[:-7],
        "cut in the header": data[:header_len // 2],
        "empty": b"",
        "not safetensors": b"PK\x03\x04 a zip file, say" * 8,
        "shape against offsets": struct.pack("<Q", len(reshaped)) + reshaped + data[8 + header_len:],
    }


def test_damaged_safetensors_files_are_one_line_naming_the_file(tmp_path, capsys):
    write_hf(tmp_path / "good")
    data = (tmp_path / "good" / SINGLE_FILENAME).read_bytes()
    for i, (name, damaged) in enumerate(damage(data).items()):
        src, save = tmp_path / f"hf{i}", tmp_path / f"ckpt{i}"
        write_hf(src)
        (src / SINGLE_FILENAME).write_bytes(damaged)
        status, lines = import_hf_cli(src, save, capsys)
        assert status == 2, name
        assert len(lines) == 1 and lines[0].startswith(
            f"teratron: error: {src / SINGLE_FILENAME}: not a readable safetensors file"), (name, lines)
        assert not save.exists(), name


def test_a_sharded_folder_whose_index_and_files_disagree(tmp_path, capsys):
    """The index places a tensor in a shard that does not hold it; a shard is damaged."""
    src = tmp_path / "hf"
    tensors = write_hf(src)
    os.unlink(src / SINGLE_FILENAME)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:6], "model-00002-of-00002.safetensors": names[6:]}
    for filename, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(src / filename))
    weight_map = {n: f for f, members in shards.items() for n in members}
    moved = names[0]
    weight_map[moved] = "model-00002-of-00002.safetensors"
    (src / INDEX_FILENAME).write_text(json.dumps({"weight_map": weight_map}))
    status, lines = import_hf_cli(src, tmp_path / "ckpt", capsys)
    assert status == 2 and len(lines) == 1, lines
    assert lines[0] == (f"teratron: error: {src / 'model-00002-of-00002.safetensors'}: has no tensor {moved}, "
                        f"which {INDEX_FILENAME} places there; restore the file or the index")
    weight_map[moved] = "model-00001-of-00002.safetensors"
    (src / INDEX_FILENAME).write_text(json.dumps({"weight_map": weight_map}))
    second = src / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:-1])
    status, lines = import_hf_cli(src, tmp_path / "ckpt", capsys)
    assert status == 2 and len(lines) == 1 and lines[0].startswith(f"teratron: error: {second}: "), lines
    assert not (tmp_path / "ckpt").exists()


def test_export_refuses_a_checkpoint_whose_tensors_disagree_with_its_model_args(tmp_path, capsys, monkeypatch):
    """A checkpoint imported without the shape check (as before it existed) holding a down_proj of
    the wrong shape: export-hf refuses in one line and writes no folder."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    write_hf(src, shapes={**SHAPES, L + "mlp.down_proj.weight": (8, 10)})
    with monkeypatch.context() as m:
        m.setattr("teratron.convert.hf.check_hf_tensors", lambda *args: None)
        assert import_hf_cli(src, ckpt, capsys)[0] == 0
    status = cli.main(["convert", "export-hf", "--load", str(ckpt), "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert f"{L}mlp.down_proj.weight would have shape [8, 10] but the model args in metadata.json give [8, 12]" \
        in lines[0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]
