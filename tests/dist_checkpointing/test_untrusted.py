"""Checkpoints from someone else: loading runs no code, damage is found and named in one line,
and checkpoints written before these checks still load.

- A real pickle payload (an object whose unpickling creates a marker file) planted in common.pt,
  in a .distcp file or in .metadata, with metadata.json's checksums updated as an attacker
  would, is refused by `teratron train --load`, `teratron merge` and `teratron convert
  export-hf`: exit 2, one `teratron: error:` line naming the file, no marker, nothing written.
- A changed byte, a truncated or missing file, or a common.pt that is not teratron's is one line
  naming the file.
- A checkpoint written by teratron f04e738 (a pickled argparse.Namespace in common.pt, a numpy
  RNG array in the .distcp, no checksums) resumes the recorded loss curve, merges and exports.
"""

import io
import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from teratron import cli
from teratron.dist_checkpointing import load_full, storage
from teratron.dist_checkpointing.safe_load import read_dcp_metadata
from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.training import pretrain

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoint_f04e738")
TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "30", "--make-vocab-size-divisible-by",
        "8", "--num-layers", "1", "--hidden-size", "16", "--ffn-hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-2",
        "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
        "--no-progress-bar", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--seed", "7", "--deterministic"]
# MoE, so that export-hf reads common.pt too (the run's aux-loss coefficient).
MOE = TINY + ["--num-experts", "2", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear"]


class Payload:
    """Unpickling this calls open(marker, "w"): code that runs merely by loading the file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A save directory of a tiny MoE run (iteration 2), written by this teratron."""
    save = str(tmp_path_factory.mktemp("base") / "ckpt")
    pretrain(build_run_config(parse_train_args(MOE + ["--train-iters", "2", "--save", save, "--save-interval", "2"])))
    return save


def _copy(checkpoint, tmp_path) -> tuple:
    save = shutil.copytree(checkpoint, tmp_path / "ckpt")
    return str(save), storage.iteration_dir(str(save), 2)


def _resign(folder):
    """Record the files' new checksums, as someone who crafts a checkpoint would."""
    metadata = storage.read_metadata(folder)
    metadata["files"] = storage.record_files(folder)
    storage.write_metadata(folder, metadata)


def _rewrite_dcp(folder, replace: dict):
    """Rewrite the folder's DCP files with PyTorch's default planner, some entries replaced (an
    object entry is torch.save'd into the .distcp file)."""
    state = {**load_full(folder, lambda key: True), **replace}
    for name in os.listdir(folder):
        if name.endswith(".distcp") or name == ".metadata":
            os.remove(os.path.join(folder, name))
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), planner=DefaultSavePlanner(flatten_state_dict=False),
             no_dist=True)


def _replace_tensor_bytes(folder, key, payload: bytes):
    """Put `payload` where the .distcp file holds tensor `key` (DCP reads each tensor with torch.load)."""
    metadata = read_dcp_metadata(os.path.join(folder, ".metadata"))
    [(index, info)] = [(i, s) for i, s in metadata.storage_data.items() if i.fqn == key]
    path = os.path.join(folder, info.relative_path)
    data = open(path, "rb").read()
    open(path, "wb").write(data[:info.offset] + payload + data[info.offset + info.length:])
    for i, s in metadata.storage_data.items():  # this entry's length changed, the ones after it moved
        if s.relative_path == info.relative_path and s.offset >= info.offset:
            shift = 0 if i == index else len(payload) - info.length
            length = len(payload) if i == index else s.length
            metadata.storage_data[i] = type(s)(s.relative_path, s.offset + shift, length)
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def _pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def plant(folder, where, command, marker) -> str:
    """Put the payload where `command` reads it; returns the planted file's name."""
    if where == "common.pt":
        path = os.path.join(folder, "common.pt")
        common = torch.load(path, weights_only=False)  # the test's own file
        torch.save({**common, "args": Payload(marker)}, path)
    elif where == ".metadata":
        path = os.path.join(folder, ".metadata")
        metadata = read_dcp_metadata(path)
        metadata.planner_data = Payload(marker)
        with open(path, "wb") as f:
            pickle.dump(metadata, f)
    elif command == "train":  # a .distcp entry each command reads: training, this rank's RNG state
        _rewrite_dcp(folder, {"rng_state.0": Payload(marker)})
    elif command == "export-hf":  # export, every model entry (a tensor or an object)
        _rewrite_dcp(folder, {"decoder.final_layernorm.weight": Payload(marker)})
    else:  # merge refuses model objects before reading them: a tensor's bytes
        _replace_tensor_bytes(folder, "decoder.final_layernorm.weight", _pickled(Payload(marker)))
    _resign(folder)
    return where


def _run(command, save, tmp_path) -> int:
    out = str(tmp_path / "out")
    argv = {"train": ["train", *MOE, "--train-iters", "4", "--load", save],
            "merge": ["merge", "--inputs", save, save, "--weights", "1", "1", "--output", out],
            "export-hf": ["convert", "export-hf", "--load", save, "--out", out]}[command]
    return cli.main(argv)


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("teratron: error: "), err
    assert "Traceback" not in out + err
    return lines[0]


@pytest.mark.parametrize("command", ["train", "merge", "export-hf"])
@pytest.mark.parametrize("where", ["common.pt", ".distcp", ".metadata"])
def test_a_pickle_payload_never_runs(checkpoint, tmp_path, capsys, where, command):
    save, folder = _copy(checkpoint, tmp_path)
    marker = str(tmp_path / "payload-ran")
    planted = plant(folder, where, command, marker)
    capsys.readouterr()
    assert _run(command, save, tmp_path) == 2
    line = _one_error_line(capsys)
    assert planted in line and "pickled io.open" in line and "could run code" in line, line
    assert not os.path.exists(marker)
    assert not (tmp_path / "out").exists()


def _flip_byte(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _truncate(path):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])


def _garbage_signed(path):
    open(path, "wb").write(b"not a torch file" * 8)
    _resign(os.path.dirname(path))


DAMAGE = {  # name -> (file, change, phrase of the one-line error)
    "flipped shard byte": ("__0_0.distcp", _flip_byte, "its bytes changed since it was saved (sha256"),
    "truncated shard": ("__0_0.distcp", _truncate, "bytes where"),
    "missing shard": ("__0_0.distcp", os.remove, "missing (metadata.json lists it)"),
    "truncated common.pt": ("common.pt", _truncate, "bytes where"),
    "missing common.pt": ("common.pt", os.remove, "missing (metadata.json lists it)"),
    "common.pt not a torch file": ("common.pt", _garbage_signed, "cannot be read as checkpoint data"),
    "damaged .metadata": (".metadata", _garbage_signed, "cannot be read"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damage_is_one_line_naming_the_file(checkpoint, tmp_path, capsys, damage):
    name, change, phrase = DAMAGE[damage]
    save, folder = _copy(checkpoint, tmp_path)
    change(os.path.join(folder, name))
    commands = ["train", "merge", "export-hf"] if damage == "flipped shard byte" else ["train"]
    for command in commands:
        capsys.readouterr()
        assert _run(command, save, tmp_path) == 2, command
        line = _one_error_line(capsys)
        assert os.path.join(folder, name) in line and phrase in line, (command, line)
        assert not (tmp_path / "out").exists()


def _fixture_copy(tmp_path) -> str:
    return str(shutil.copytree(os.path.join(FIXTURE, "save"), tmp_path / "old"))


def test_a_checkpoint_saved_before_checksums_resumes_merges_and_exports(tmp_path, capsys):
    run = json.load(open(os.path.join(FIXTURE, "run.json")))
    save = _fixture_copy(tmp_path)
    old = storage.iteration_dir(save, 2)
    assert "files" not in storage.read_metadata(old)
    assert cli.main(["merge", "--inputs", old, old, "--weights", "1", "1", "--output", str(tmp_path / "m")]) == 0
    assert cli.main(["convert", "export-hf", "--load", old, "--out", str(tmp_path / "hf")]) == 0
    # Model, optimizer, scheduler, data position and the dropout RNG (numpy's state an array there)
    # all resume: iterations 3 and 4 repeat the losses f04e738 logged (written maybe on another CPU).
    losses = dict(pretrain(build_run_config(parse_train_args(run["argv"] + ["--load", save, "--save", save]))).loss_history)
    assert sorted(losses) == [3, 4]
    for iteration in (3, 4):
        assert losses[iteration] == pytest.approx(run["lm_loss"][str(iteration)], rel=1e-5)
    assert "files" in storage.read_metadata(storage.iteration_dir(save, 4))
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", storage.TRACKER_FILENAME]


@pytest.mark.parametrize("change, phrase", [(_truncate, "cannot be read as checkpoint data"),
                                            (os.remove, "common.pt: missing, or without the optimizer")])
def test_old_checkpoint_with_a_damaged_common_file_is_one_line(tmp_path, capsys, change, phrase):
    run = json.load(open(os.path.join(FIXTURE, "run.json")))
    save = _fixture_copy(tmp_path)
    change(os.path.join(storage.iteration_dir(save, 2), "common.pt"))
    assert cli.main(["train", *run["argv"], "--load", save]) == 2
    assert phrase in _one_error_line(capsys)


def test_megatron_classes_load_as_inert_records(tmp_path, monkeypatch):
    """Megatron-LM's common state pickles its own enums (its args' AttnBackend, ...). Reading it,
    every global under `megatron.` becomes an inert ForeignObject (its name and arguments), never
    imported or called, even while such a module is importable; any other global is still refused."""
    import enum
    import sys
    import types

    from teratron.dist_checkpointing.safe_load import ForeignObject, UnsafeCheckpointError, load_torch_file

    marker = tmp_path / "ran"
    enums = types.ModuleType("megatron.core.transformer.enums")
    enums.AttnBackend = enum.Enum("AttnBackend", {"flash": 1, "auto": 5}, module=enums.__name__)
    code = types.ModuleType("megatron.training.evil")
    code.run = lambda path: open(path, "w").close()
    code.run.__module__, code.run.__qualname__ = code.__name__, "run"
    for module in (enums, code):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    for package in ("megatron", "megatron.core", "megatron.core.transformer", "megatron.training"):
        monkeypatch.setitem(sys.modules, package, types.ModuleType(package))  # pickle imports the parents

    class Payload:
        def __reduce__(self):
            return code.run, (str(marker),)

    saved = io.BytesIO()
    torch.save({"attention_backend": enums.AttnBackend.auto, "hook": Payload(), "lr": 1e-3}, saved)
    saved.seek(0)
    state = load_torch_file(saved, "common_state", foreign=("megatron.",))
    assert not marker.exists()
    backend, hook = state["attention_backend"], state["hook"]
    assert isinstance(backend, ForeignObject) and isinstance(hook, ForeignObject)
    assert (backend.name, backend.value) == ("megatron.core.transformer.enums.AttnBackend", 5)
    assert (hook.name, hook.args, state["lr"]) == ("megatron.training.evil.run", (str(marker),), 1e-3)
    saved.seek(0)
    with pytest.raises(UnsafeCheckpointError, match="megatron.core.transformer.enums.AttnBackend"):
        load_torch_file(saved, "common.pt")  # teratron's own files: no foreign classes at all

    class Elsewhere:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    saved = io.BytesIO()
    torch.save({"attention_backend": enums.AttnBackend.auto, "hook": Elsewhere()}, saved)
    saved.seek(0)
    with pytest.raises(UnsafeCheckpointError, match=r"holds a pickled (posix|os)\.system"):
        load_torch_file(saved, "common_state", foreign=("megatron.",))
    assert not marker.exists()
