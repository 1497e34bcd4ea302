"""Hugging Face weight folders: safetensors files, sharded with a `model.safetensors.index.json`."""

import json
import os

from safetensors import safe_open
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


def open_hf_weights(path: str):
    """(names, read(name) -> tensor) over the folder's safetensors files, read lazily."""
    index = os.path.join(path, INDEX_FILENAME)
    if os.path.isfile(index):
        weight_map = _read_weight_map(index)
    elif os.path.isfile(os.path.join(path, SINGLE_FILENAME)):
        with safe_open(os.path.join(path, SINGLE_FILENAME), "pt") as f:
            weight_map = {name: SINGLE_FILENAME for name in f.keys()}
    else:
        raise FileNotFoundError(f"--hf-path {path}: no {SINGLE_FILENAME} or {INDEX_FILENAME}; save the model "
                                "with safetensors (save_pretrained(..., safe_serialization=True))")
    for filename in set(weight_map.values()):
        if not os.path.isfile(os.path.join(path, filename)):
            raise FileNotFoundError(f"--hf-path {path}: {filename}, listed in {INDEX_FILENAME}, is missing")

    def read(name):
        with safe_open(os.path.join(path, weight_map[name]), "pt") as f:
            return f.get_tensor(name)

    return list(weight_map), read


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
