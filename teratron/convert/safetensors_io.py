"""Hugging Face weight folders: safetensors files, sharded with a `model.safetensors.index.json`.

Reading goes shard by shard (`HFWeights.read_shard`: the named tensors of one file, in their
stored dtype), so a converter holds one shard at a time; writing splits the tensors into shards
of at most `max_shard_bytes` with the index, as transformers' `save_pretrained(max_shard_size=)`
does. Written files are readable by others (0666 less the umask, as `open` creates files;
safetensors' own writer makes them 0600).
"""

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


# safetensors' dtype names (the header's) -> torch dtypes.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class HFWeights:
    """The tensors of a Hugging Face folder's safetensors files. Opening reads every file's header
    (names, shapes, dtypes; a damaged, truncated or inconsistent file refuses here, naming it), so a
    model is checked before any data is read; `read(name)` loads one tensor, `read_shard` the
    named tensors of one file (`shard_files` in order); `rename` gives tensors other names."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.files = _weight_map(path)  # tensor name -> file name
        self.stored = {}  # tensor name -> its name in the file, where `rename` changed it
        self.shapes, self.dtypes = {}, {}  # tensor name -> shape / torch dtype, from the headers
        for filename in self.shard_files():
            with _open(path, filename) as f:
                stored = set(f.keys())
                for name in (n for n, file in self.files.items() if file == filename):
                    if name not in stored:
                        raise ValueError(f"{os.path.join(path, filename)}: has no tensor {name}, which "
                                         f"{INDEX_FILENAME} places there; restore the file or the index")
                    header = f.get_slice(name)
                    self.shapes[name] = tuple(header.get_shape())
                    self.dtypes[name] = _DTYPES.get(header.get_dtype())
                    if self.dtypes[name] is None:
                        raise ValueError(f"{os.path.join(path, filename)}: {name} is stored as {header.get_dtype()}, "
                                         "which teratron does not read; save the model in bf16, fp16 or fp32")

    def rename(self, names: dict) -> None:
        """Know each tensor of `names` (current name -> new name) by its new name from now on."""
        for old, new in names.items():
            self.files[new], self.shapes[new], self.dtypes[new] = (self.files.pop(old), self.shapes.pop(old),
                                                                   self.dtypes.pop(old))
            self.stored[new] = self.stored.pop(old, old)

    def shard_files(self) -> list:
        return sorted(set(self.files.values()))

    def read(self, name: str) -> torch.Tensor:
        with _open(self.path, self.files[name]) as f:
            return f.get_tensor(self.stored.get(name, name))

    def read_shard(self, filename: str, names) -> dict:
        """name -> tensor (as stored) of `names`, all in file `filename`."""
        with _open(self.path, filename) as f:
            return {name: f.get_tensor(self.stored.get(name, name)) for name in names}

    def meta_shard(self, filename: str, names) -> dict:
        """`read_shard` on the meta device: the shapes and dtypes, no data."""
        return {name: torch.empty(self.shapes[name], dtype=self.dtypes[name], device="meta") for name in names}


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


def readable_by_others(file: str) -> None:
    """Give `file` the mode `open` would have (0666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file, 0o666 & ~umask)


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
        _save_shard(shards[0], os.path.join(path, SINGLE_FILENAME))
        return [SINGLE_FILENAME]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_shard(shard, os.path.join(path, filename))
        weight_map.update(dict.fromkeys(shard, filename))
        names.append(filename)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, INDEX_FILENAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names + [INDEX_FILENAME]


def _save_shard(tensors: dict, file: str) -> None:
    save_file(tensors, file, metadata={"format": "pt"})
    readable_by_others(file)
