"""Hugging Face weight folders: safetensors files, sharded with a `model.safetensors.index.json`."""

import json
import os
from contextlib import contextmanager

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX_FILENAME = "model.safetensors.index.json"
SINGLE_FILENAME = "model.safetensors"


def _read_weight_map(index: str) -> dict:
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); expected JSON with a "
                         "'weight_map' of tensor name -> file") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' is not a JSON object of tensor name -> file")
    return weight_map


class HFWeights:
    """The tensors of a Hugging Face folder's safetensors files. Opening reads every file's header
    (names, shapes; a damaged, truncated or inconsistent file refuses here, naming it), so a model
    is checked before any data is read; `read(name)` loads one tensor."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files = _weight_map(path)  # tensor name -> file name
        self.shapes = {}  # tensor name -> shape, from the headers
        for filename in sorted(set(self.files.values())):
            with _open(path, filename) as f:
                stored = set(f.keys())
                for name in (n for n, file in self.files.items() if file == filename):
                    if name not in stored:
                        raise ValueError(f"{os.path.join(path, filename)}: has no tensor {name}, which "
                                         f"{INDEX_FILENAME} places there; restore the file or the index")
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())

    def read(self, name: str) -> torch.Tensor:
        with _open(self.path, self.files[name]) as f:
            return f.get_tensor(name)


def _weight_map(path: str) -> dict:
    index = os.path.join(path, INDEX_FILENAME)
    if os.path.isfile(index):
        weight_map = _read_weight_map(index)
    elif os.path.isfile(os.path.join(path, SINGLE_FILENAME)):
        with _open(path, SINGLE_FILENAME) as f:
            weight_map = {name: SINGLE_FILENAME for name in f.keys()}
    else:
        raise FileNotFoundError(f"--hf-path {path}: no {SINGLE_FILENAME} or {INDEX_FILENAME}; save the model "
                                "with safetensors (save_pretrained(..., safe_serialization=True))")
    for filename in set(weight_map.values()):
        if not isinstance(filename, str) or not os.path.isfile(os.path.join(path, filename)):
            raise FileNotFoundError(f"--hf-path {path}: {filename}, listed in {INDEX_FILENAME}, is missing")
    return weight_map


@contextmanager
def _open(path: str, filename: str):
    """`safe_open` of one file of the folder; its errors name the file."""
    file = os.path.join(path, filename)
    try:
        with safe_open(file, "pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); the file is damaged or "
                         "truncated: download or save the model again") from None


def save_hf_weights(tensors: dict, path: str, max_shard_bytes: int) -> list:
    """Write `tensors` as safetensors shards of at most max_shard_bytes (a single larger tensor
    gets its own shard) plus the index; returns the file names."""
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SINGLE_FILENAME), metadata={"format": "pt"})
        return [SINGLE_FILENAME]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
        names.append(filename)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX_FILENAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names + [INDEX_FILENAME]
