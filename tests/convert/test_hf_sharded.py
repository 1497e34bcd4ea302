"""Sharded Hugging Face folders (`model.safetensors.index.json` and many shard files): read shard
by shard into a checkpoint (import-hf) or straight into a model of any TP/PP/EP layout
(`load_hf_weights`), never every shard at once; bf16 stays bf16; exports write shards of at most
--max-shard-size with the index, readable by others, and transformers loads them."""

import itertools
import json
import os
import stat
import weakref

import pytest
import torch
import transformers
from torch.testing import assert_close

from convert.hf_testing import (VOCAB, convert, hf_logits, hf_tensors, ids_and_positions, read_config,
                                save_random_hf_model)
from convert.test_hf_moe import FAMILIES as MOE_FAMILIES, MOE
from dist import run_distributed
from teratron import parallel_state as ps
from teratron.convert import hf as convert_hf
from teratron.convert.hf import from_hf, load_hf_weights
from teratron.convert.hf_config import model_args_from_hf
from teratron.convert.safetensors_io import INDEX_FILENAME, SINGLE_FILENAME, HFWeights
from teratron.dist_checkpointing import load_full, serialization, storage
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args
from teratron.dist_checkpointing.model_state import is_model_key, model_sharded_items
from teratron.models.gpt.builder import build_model_chunks

LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def save_llama(path, max_shard_size):
    """The same random tiny Llama whatever the shard size (save_random_hf_model seeds it); its logits."""
    return save_random_hf_model("LlamaConfig", "LlamaForCausalLM", LLAMA, path, max_shard_size)


def shard_files(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def checkpoint_state(ckpt):
    return load_full(storage.resolve_checkpoint_dir(str(ckpt)), is_model_key)


def test_a_sharded_folder_imports_equal_to_the_single_file(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    reference = save_llama(single, "10MB")
    save_llama(sharded, "10KB")
    assert shard_files(single) == [SINGLE_FILENAME] and len(shard_files(sharded)) >= 6
    assert os.path.isfile(sharded / INDEX_FILENAME)
    for name in ("single", "sharded"):
        convert("import-hf", "--hf-path", str(tmp_path / name), "--save", str(tmp_path / f"ckpt_{name}"))
    one, many = checkpoint_state(tmp_path / "ckpt_single"), checkpoint_state(tmp_path / "ckpt_sharded")
    assert set(one) == set(many)
    for key in one:
        assert torch.equal(one[key], many[key]), key
    model, _ = from_hf(str(sharded))
    with torch.no_grad():
        assert_close(model(*ids_and_positions()), reference, rtol=0, atol=1e-4)
    # A model the folder does not describe is refused, naming the tensor.
    other = build_model_chunks(gpt_config_from_model_args(
        {**model_args_from_hf(read_config(sharded), "cfg"), "ffn_hidden_size": 48}))
    with pytest.raises(ValueError, match=r"^--hf-path .*: decoder.layers.0.mlp.linear_fc1.weight has shape \[80, 32\] "
                                         r"in the files but \[96, 32\] in the model; build the model from"):
        load_hf_weights(str(sharded), other)


class LiveTensors:
    """Tracks the HF tensors `HFWeights.read_shard` returns until they are freed: the peak bytes
    alive at once, and the most shards with a tensor alive at once."""

    def __init__(self):
        self.live, self.tokens = {}, itertools.count()
        self.peak_bytes = self.peak_shards = self.reads = 0

    def track(self, shard: dict, filename: str) -> dict:
        self.reads += 1
        for tensor in shard.values():
            token = next(self.tokens)
            self.live[token] = (filename, tensor.nbytes)
            weakref.finalize(tensor, self.live.pop, token)
        self.peak_bytes = max(self.peak_bytes, sum(nbytes for _, nbytes in self.live.values()))
        self.peak_shards = max(self.peak_shards, len({filename for filename, _ in self.live.values()}))
        return shard


def instrument(monkeypatch):
    live = LiveTensors()
    read_shard = HFWeights.read_shard
    monkeypatch.setattr(HFWeights, "read_shard",
                        lambda self, filename, names: live.track(read_shard(self, filename, names), filename))
    return live


def test_the_import_and_the_load_hold_one_shard_at_a_time(tmp_path, monkeypatch):
    """Counted on the tensors the shard reader returns: every shard is read once; alive at once
    are at most the shard being read, the one before it (rows spanning the two) and, for
    import-hf, the tensor the checkpoint writer still has in hand: under twice the largest shard,
    far from the whole model; both equal the one-piece read."""
    src = tmp_path / "hf"
    save_llama(src, "10KB")
    files = shard_files(src)
    total = sum(t.nbytes for t in hf_tensors(src).values())
    largest = max(sum(t.nbytes for t in hf_tensors_of(src, f).values()) for f in files)
    unsharded, _ = from_hf(str(src))  # before instrumenting
    for load in ("import", "model"):
        live = instrument(monkeypatch)
        if load == "import":
            convert("import-hf", "--hf-path", str(src), "--save", str(tmp_path / "ckpt"))
            state = checkpoint_state(tmp_path / "ckpt")
        else:
            model, _ = from_hf(str(src))
            state = model.state_dict()
        assert live.reads == len(files) >= 6
        assert live.peak_shards <= (3 if load == "import" else 2), (load, vars(live))
        assert live.peak_bytes <= 2 * largest < total / 2, (load, vars(live))
        for key, tensor in unsharded.state_dict().items():
            assert torch.equal(state[key][:tensor.shape[0]], tensor), key
        monkeypatch.undo()


def hf_tensors_of(path, filename):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, filename))


def test_bf16_weights_stay_bf16(tmp_path, monkeypatch):
    """A bf16 folder imports as bf16 (the checkpoint's dtypes; every tensor the stream gives is
    bf16, none upcast on the way), bit-equal to the fp32 import cast to bf16; from_hf with
    params_dtype bf16 holds the same bits."""
    src, bf16 = tmp_path / "hf", tmp_path / "hf_bf16"
    save_llama(src, "10MB")
    transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(
        bf16, max_shard_size="10KB")
    assert {t.dtype for t in hf_tensors(bf16).values()} == {torch.bfloat16}
    streamed = []
    stream = convert_hf.stream_hf_to_teratron

    def recording(*args, **kwargs):
        for key, tensor in stream(*args, **kwargs):
            streamed.append(tensor.dtype)
            yield key, tensor
    monkeypatch.setattr(convert_hf, "stream_hf_to_teratron", recording)
    for name in ("hf", "hf_bf16"):
        convert("import-hf", "--hf-path", str(tmp_path / name), "--save", str(tmp_path / f"ckpt_{name}"))
    assert streamed and set(streamed[len(streamed) // 2:]) == {torch.bfloat16}  # the second import's
    checkpoint_dir = storage.resolve_checkpoint_dir(str(tmp_path / "ckpt_hf_bf16"))
    saved = serialization.read_metadata(checkpoint_dir).state_dict_metadata
    assert {md.properties.dtype for md in saved.values() if hasattr(md, "properties")} == {torch.bfloat16}
    fp32, half = checkpoint_state(tmp_path / "ckpt_hf"), checkpoint_state(tmp_path / "ckpt_hf_bf16")
    for key in fp32:
        assert torch.equal(half[key], fp32[key].to(torch.bfloat16)), key
    model, _ = from_hf(str(bf16), params_dtype=torch.bfloat16)
    for key, tensor in model.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, half[key][:tensor.shape[0]]), key


def _load_in_layouts(src):
    """On 2 ranks, the sharded Qwen2-MoE folder loaded straight into TP 2 (expert-TP 2), EP 2 and
    PP 2 models: every box of this rank's parameters equals the single-process load's, and the
    TP 2 and EP 2 logits equal transformers'."""
    model_args = model_args_from_hf(read_config(src), "cfg", 128, 2)
    full = {item.key: item.data for item in model_sharded_items([from_hf(src)[0]])}
    logits = []
    for tp, ep, pp in ((2, 1, 1), (1, 2, 1), (1, 1, 2)):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=tp)
        config = gpt_config_from_model_args(
            model_args, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=tp, moe_token_dispatcher_type="alltoall" if ep > 1 else "allgather",
            num_layers_in_first_pipeline_stage=2 if pp > 1 else None)
        chunks = build_model_chunks(config)
        for chunk in chunks:  # start from garbage: every value must come from the files
            for tensor in chunk.state_dict().values():
                tensor.fill_(7.0)
        load_hf_weights(src, chunks)
        for box in model_sharded_items(chunks):
            region = tuple(slice(o, o + n) for o, n in zip(box.global_offset, box.data.shape))
            rows = full[box.key].shape[0]
            if box.resizable_rows and box.global_offset[0] + box.data.shape[0] > rows:  # the vocabulary's padding
                real = max(0, rows - box.global_offset[0])
                assert not box.data[real:].any(), box.key
                region, data = (slice(box.global_offset[0], rows),) + region[1:], box.data[:real]
            else:
                data = box.data
            assert torch.equal(data, full[box.key][region]), (tp, ep, pp, box.key)
        if pp == 1:
            chunks[0].parallel_output = False
            with torch.no_grad():
                logits.append(chunks[0](*ids_and_positions())[..., :VOCAB])
        ps.destroy_model_parallel()
    return logits


def test_load_straight_into_parallel_layouts(tmp_path):
    src = tmp_path / "hf"
    config_cls, model_cls, extra = MOE_FAMILIES["qwen2_moe"]
    reference = save_random_hf_model(config_cls, model_cls, {**MOE, **extra}, src, max_shard_size="20KB")
    assert len(shard_files(src)) >= 4
    for rank_logits in (t for per_rank in run_distributed(_load_in_layouts, 2, str(src)) for t in per_rank):
        assert_close(rank_logits, reference, rtol=0, atol=1e-4)


def test_export_writes_readable_shards_with_the_index(tmp_path):
    """--max-shard-size 20KB: several shards, each at most 20 KB unless one tensor is larger, the
    index naming every tensor and the total; files 0644 and the folder 0755 under umask 022, even
    from a source whose tokenizer file was 0600; transformers loads the shards with the same
    logits."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    reference = save_llama(src, "10MB")
    os.chmod(src / "tokenizer.json", 0o600)
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    old_umask = os.umask(0o022)
    try:
        convert("export-hf", "--load", str(ckpt), "--out", str(out), "--max-shard-size", "20KB")
    finally:
        os.umask(old_umask)
    files = shard_files(out)
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / INDEX_FILENAME).read_text())
    tensors = hf_tensors(out)
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for f in files:
        sizes = [t.nbytes for t in hf_tensors_of(out, f).values()]
        assert sum(sizes) <= 20_000 or len(sizes) == 1, f
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755
    for name in os.listdir(out):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o644, name
    assert_close(hf_logits(str(out)), reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_modes_follow_the_umask(tmp_path, umask):
    """Files get the mode `open` would give them (safetensors' writer alone gives 0600)."""
    src, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    save_llama(src, "10MB")
    convert("import-hf", "--hf-path", str(src), "--save", str(ckpt))
    old_umask = os.umask(umask)
    try:
        convert("export-hf", "--load", str(ckpt), "--out", str(out))
    finally:
        os.umask(old_umask)
    assert {stat.S_IMODE(os.stat(out / name).st_mode) for name in os.listdir(out)} == {0o666 & ~umask}
