"""Reading checkpoint files without running code: people load checkpoints they downloaded.

Unpickling calls whatever a file names, so no file of a checkpoint is unpickled without an
allow-list:

    load_torch_file(source, where)   common.pt and the small objects inside .distcp files (RNG
                                     states): torch.load(weights_only=True), i.e. tensors and plain
                                     data, plus the argparse.Namespace and numpy arrays that older
                                     teratron checkpoints hold (data only: none of them runs code);
                                     with `foreign` module prefixes (Megatron-LM's `megatron.`),
                                     the classes those modules name load as inert ForeignObject
                                     records of what was pickled (Megatron's enums in its args)
    read_dcp_metadata(path)          .metadata: torch.distributed.checkpoint's metadata classes only
    CheckpointReader                 DCP's FileSystemReader reading .metadata that way (DCP itself
                                     reads the tensors with weights_only=True)

A file naming anything else is refused with UnsafeCheckpointError, one line naming the file and
what it asked for; a file that does not parse raises DamagedCheckpointError.
"""

import argparse
import collections
import functools
import os
import pathlib
import pickle
import re
import signal
import warnings

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner

from teratron.dist_checkpointing.storage import COMMON_FILENAME, DamagedCheckpointError

DCP_METADATA_FILENAME = ".metadata"


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks the unpickler for something other than checkpoint data."""


def unsafe_error(where: str, name: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"{where}: holds a pickled {name}, which is not checkpoint data; unpickling it "
                                 "could run code, so teratron refuses to load it (use checkpoints teratron wrote)")


def _numpy_array_globals() -> list:
    """What a pickled uint32 numpy array (the numpy RNG state of older checkpoints) names."""
    reconstruct = np.zeros(1).__reduce__()[0]
    uint32 = np.dtype(np.uint32)
    return [reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype, type(uint32)]


_PLAIN_DATA_EXTRAS = [argparse.Namespace, signal.Signals, *_numpy_array_globals()]


class ForeignObject:
    """A value another program pickled from one of its own classes (Megatron-LM's args hold its
    enums, e.g. megatron.core.transformer.enums.AttnBackend), kept as data: the class's dotted
    `name`, the `args` it was rebuilt from (an enum's: its value) and any pickled `state`. Nothing
    of that program is imported or run."""

    name = "?"

    def __new__(cls, *args):
        value = super().__new__(cls)
        value.args, value.state = args, None
        return value

    def __init__(self, *args):
        pass

    def __setstate__(self, state):
        self.state = state

    @property
    def value(self):
        """An enum's value (the one argument it is rebuilt from)."""
        return self.args[0] if len(self.args) == 1 else self.args

    def __eq__(self, other):
        return isinstance(other, ForeignObject) and (self.name, self.args, self.state) == \
            (other.name, other.args, other.state)

    def __hash__(self):
        return hash((self.name, repr(self.args)))

    def __repr__(self):
        return f"{self.name}{self.args!r}"


@functools.cache
def _foreign_class(name: str) -> type:
    """The stand-in class for the pickled global `name`."""
    return type(name.rsplit(".", 1)[-1], (ForeignObject,), {"name": name, "__module__": __name__})
# torch's two wordings: a global not allowed, and one from a module it blocks outright (os, posix, ...)
_REFUSED_GLOBAL = re.compile(r"(?:Unsupported global: GLOBAL|load unsupported GLOBAL) ([\w.]+)")


def refused_global(error: Exception):
    """The name torch.load(weights_only=True) refused to unpickle, if that is why it failed."""
    found = _REFUSED_GLOBAL.search(str(error))
    return found.group(1) if found else None


def load_torch_file(source, where: str, foreign: tuple = ()):
    """torch.load of a file or stream with the plain-data allow-list; globals under the `foreign`
    module prefixes load as ForeignObjects. `where` names it in errors."""
    stand_ins = []
    start = source.tell() if hasattr(source, "seek") else None
    while True:  # torch names one refused global at a time: stand each foreign one in, then read again
        try:
            with torch.serialization.safe_globals(_PLAIN_DATA_EXTRAS + stand_ins), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns about pickle protocols it then reads fine
                if start is not None:
                    source.seek(start)
                return torch.load(source, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise DamagedCheckpointError(f"{where}: missing; the checkpoint is incomplete") from None
        except pickle.UnpicklingError as e:
            refused = refused_global(e)
            if refused and refused.startswith(foreign) and (_foreign_class(refused), refused) not in stand_ins:
                stand_ins.append((_foreign_class(refused), refused))
                continue
            raise (unsafe_error(where, refused) if refused else _damaged(where, e)) from None
        except Exception as e:  # noqa: BLE001 - a truncated zip, a bad header: the file is damaged
            raise _damaged(where, e) from None


def _damaged(where: str, error: Exception) -> DamagedCheckpointError:
    detail = re.sub(r".*WeightsUnpickler error:|Check the documentation.*", "", str(error), flags=re.S)
    detail = " ".join(detail.split())
    return DamagedCheckpointError(f"{where}: cannot be read as checkpoint data ({type(error).__name__}: "
                                  f"{detail[:160]}); the file is damaged or was not written by teratron")


def read_common_state(checkpoint_dir: str) -> dict:
    """common.pt of a checkpoint folder ({} when it has none, as imports do)."""
    path = os.path.join(checkpoint_dir, COMMON_FILENAME)
    if not os.path.lexists(path):
        return {}
    common = load_torch_file(path, path)
    if not isinstance(common, dict):
        raise DamagedCheckpointError(f"{path}: holds a {type(common).__name__}, not teratron's common state; the "
                                     "file is damaged or was not written by teratron")
    return common


def _metadata_globals() -> dict:
    """(module, name) -> object for everything a DCP .metadata pickle names: dataclasses and enums
    of plain values, torch.Size, and the path DCP records the checkpoint under (and the save plans
    Megatron-LM adds)."""
    objects = [dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.TensorStorageMetadata,
               dcp_metadata.BytesStorageMetadata, dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties,
               dcp_metadata.StorageMeta, dcp_metadata._MEM_FORMAT_ENCODING, dcp_filesystem._StorageInfo,
               torch.Size, torch.serialization._get_layout, collections.OrderedDict,
               # Megatron-LM keeps its save plans in .metadata too (planner_data)
               dcp_planner.SavePlan, dcp_planner.WriteItem, dcp_planner.WriteItemType, dcp_planner.TensorWriteData]
    allowed = {(o.__module__, o.__qualname__): o for o in objects}
    for path_class in (pathlib.PosixPath, pathlib.PurePosixPath):
        allowed[("pathlib", path_class.__name__)] = path_class
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    allowed = _metadata_globals()

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module, name):
        found = self.allowed.get((module, name))
        if found is None and module == "torch":  # torch.float32, torch.strided, torch.contiguous_format
            value = getattr(torch, name, None)
            found = value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None
        if found is None:
            raise unsafe_error(self.where, f"{module}.{name}")
        return found


def read_dcp_metadata(path: str):
    """torch.distributed.checkpoint's Metadata from a .metadata file, through the allow-list."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except (UnsafeCheckpointError, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - any other unpickling failure means a damaged file
        raise DamagedCheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e}); the checkpoint is "
                                     "damaged") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise DamagedCheckpointError(f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata; the "
                                     "checkpoint is damaged")
    return metadata


class CheckpointReader(FileSystemReader):
    """DCP's file reader with .metadata read through the allow-list."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_dcp_metadata(os.path.join(self.path, DCP_METADATA_FILENAME))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
