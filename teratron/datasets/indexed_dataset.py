"""Megatron's indexed dataset: token ids in a flat `.bin`, their layout in a `.idx`, byte-compatible.

`.idx` (little-endian): magic `MMIDIDX\\x00\\x00` | version u64 = 1 | dtype code u8 | sequence count
N u64 | document count D u64 | lengths i32[N] | byte pointers i64[N] | document indices i64[D] |
(multimodal only) modes i8[N]. A document is the run of sequences between two document indices.
"""

import os
import struct
from enum import Enum
from typing import Dict, List, Optional, Tuple, Type, Union

import numpy
import torch

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8  # magic, version, dtype code, N, D
# Sequences per vectorized step of the layout check: about 50 MiB of temporaries, whatever N.
_LAYOUT_CHUNK = 1 << 22


class DType(Enum):
    """The numpy dtypes an indexed dataset may store, by their on-disk code."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: Type[numpy.number]) -> int:
        name = numpy.dtype(value).name
        if name not in cls.__members__:
            raise ValueError(f"dtype {name} cannot be stored in an indexed dataset "
                             f"(use one of {', '.join(cls.__members__)})")
        return cls[name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> Type[numpy.number]:
        return getattr(numpy, cls(value).name)

    @staticmethod
    def size(key: Union[int, Type[numpy.number]]) -> int:
        if isinstance(key, int):
            key = DType.dtype_from_code(key)
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[numpy.number]:
        """uint16 when every id of a vocabulary of this size fits, else int32 (Megatron's rule)."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


def get_content_signature(path_prefix: str) -> Dict[str, int]:
    """Size and modification time (ns) of the `.bin` and `.idx`: what the caches derived from a
    dataset are keyed by, so writing the dataset again (`preprocess` replaces both files)
    invalidates them."""
    signature = {}
    for suffix, path in (("bin", get_bin_path(path_prefix)), ("idx", get_idx_path(path_prefix))):
        stat = os.stat(path)
        signature[f"{suffix}_bytes"] = stat.st_size
        signature[f"{suffix}_mtime_ns"] = stat.st_mtime_ns
    return signature


class _IndexReader:
    """The `.idx` file, memory-mapped; its header and size are checked on open, its pointers and
    lengths against the `.bin` by `check_layout`."""

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        self.idx_path = idx_path
        if not os.path.isfile(idx_path):
            raise ValueError(f"{idx_path}: index file not found; pass the prefix of an existing "
                             f"dataset (the path without .bin/.idx)")
        file_bytes = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(_HEADER_BYTES)
        if len(header) < len(_INDEX_HEADER) or header[: len(_INDEX_HEADER)] != _INDEX_HEADER:
            raise ValueError(f"{idx_path}: bad magic, not a Megatron indexed dataset index "
                             f"(expected it to start with {_INDEX_HEADER!r})")
        if len(header) < _HEADER_BYTES:
            raise ValueError(f"{idx_path}: truncated index header ({file_bytes} bytes); rewrite the dataset")
        version, code, self.sequence_count, self.document_count = struct.unpack(
            "<QBQQ", header[len(_INDEX_HEADER):])
        if version != 1:
            raise ValueError(f"{idx_path}: index version {version} is not supported (only 1)")
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError:
            raise ValueError(f"{idx_path}: unknown dtype code {code} "
                             f"(known: {', '.join(f'{d.value}={d.name}' for d in DType)})") from None
        self.dtype_size = DType.size(self.dtype)

        n, d = self.sequence_count, self.document_count
        expected = _HEADER_BYTES + n * (4 + 8) + d * 8 + (n if multimodal else 0)
        if file_bytes < expected:
            raise ValueError(f"{idx_path}: truncated index: {file_bytes} bytes, {expected} expected for "
                             f"{n} sequences and {d} document indices"
                             + ("" if not multimodal else " with multimodal modes"))

        buffer = numpy.memmap(idx_path, mode="r", order="C")
        offset = _HEADER_BYTES
        self.sequence_lengths = numpy.frombuffer(buffer, numpy.int32, n, offset)
        offset += n * 4
        self.sequence_pointers = numpy.frombuffer(buffer, numpy.int64, n, offset)
        offset += n * 8
        self.document_indices = numpy.frombuffer(buffer, numpy.int64, d, offset)
        offset += d * 8
        self.sequence_modes = numpy.frombuffer(buffer, numpy.int8, n, offset) if multimodal else None

        if d < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise ValueError(f"{idx_path}: corrupt document indices (must run from 0 to the "
                             f"sequence count {n}); rewrite the dataset")

    def __len__(self) -> int:
        return self.sequence_count

    def data_bytes(self) -> int:
        """Bytes of `.bin` the index addresses: the end of its last sequence."""
        if self.sequence_count == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype_size

    def check_layout(self, bin_path: str, bin_bytes: int) -> None:
        """The sequences must lie back to back from byte 0 to the end of the `.bin`, as every
        writer (Megatron's and ours) lays them out, so one pointer or length edited into the index
        breaks the chain here, at open, not mid-run. Vectorized, `_LAYOUT_CHUNK` sequences a step."""
        end = 0  # where the sequences checked so far end, in bytes
        for start in range(0, self.sequence_count, _LAYOUT_CHUNK):
            lengths = self.sequence_lengths[start:start + _LAYOUT_CHUNK].astype(numpy.int64)
            pointers = self.sequence_pointers[start:start + _LAYOUT_CHUNK]
            if lengths.min() < 0:
                i = start + int(numpy.argmax(lengths < 0))
                raise ValueError(f"{self.idx_path}: sequence {i} has length {self.sequence_lengths[i]} "
                                 f"< 0: the index is damaged; rewrite the dataset (teratron preprocess)")
            starts = end + numpy.concatenate(([0], numpy.cumsum(lengths[:-1] * self.dtype_size)))
            if not numpy.array_equal(pointers, starts):
                i = int(numpy.argmax(pointers != starts))
                raise ValueError(f"{self.idx_path}: sequence {start + i} starts at byte {pointers[i]} but "
                                 f"the sequences before it end at byte {starts[i]}: the index was edited "
                                 f"or damaged; rewrite the dataset (teratron preprocess)")
            end = int(starts[-1]) + int(lengths[-1]) * self.dtype_size
        if end != bin_bytes:
            raise ValueError(f"{bin_path}: the index addresses {end} bytes but the file has {bin_bytes}: "
                             f"a truncated, padded or mismatched .bin; rewrite the dataset "
                             f"(teratron preprocess)")


class _MMapBinReader:
    def __init__(self, bin_path: str) -> None:
        # numpy cannot map an empty file; an empty dataset has nothing to read anyway.
        self._buffer = (numpy.memmap(bin_path, mode="r", order="C")
                        if os.path.getsize(bin_path) > 0 else numpy.empty(0, numpy.uint8))

    def read(self, dtype, count: int, offset: int) -> numpy.ndarray:
        return numpy.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)


class _FileBinReader:
    def __init__(self, bin_path: str) -> None:
        self._bin_path = bin_path

    def read(self, dtype, count: int, offset: int) -> numpy.ndarray:
        sequence = numpy.empty(count, dtype=dtype)
        with open(self._bin_path, "rb", buffering=0) as f:
            f.seek(offset)
            f.readinto(sequence)
        return sequence


class IndexedDataset(torch.utils.data.Dataset):
    """Read a Megatron `.bin/.idx` pair. Item `i` is sequence `i` (a numpy array, with its mode
    when multimodal); `document_indices` groups sequences into documents."""

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        super().__init__()
        self._initialize(path_prefix, multimodal, mmap)
        self.index.check_layout(get_bin_path(path_prefix), self.bin_bytes)

    def _initialize(self, path_prefix: str, multimodal: bool, mmap: bool) -> None:
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        bin_path = get_bin_path(path_prefix)
        self.index = _IndexReader(get_idx_path(path_prefix), multimodal)
        if not os.path.isfile(bin_path):
            raise ValueError(f"{bin_path}: data file not found (its index exists); "
                             f"rewrite the dataset")
        self.bin_bytes = os.path.getsize(bin_path)
        self.content_signature = get_content_signature(path_prefix)
        self.bin_reader = _MMapBinReader(bin_path) if mmap else _FileBinReader(bin_path)

    def __getstate__(self) -> Tuple[str, bool, bool]:
        return self.path_prefix, self.multimodal, self.mmap

    def __setstate__(self, state: Tuple[str, bool, bool]) -> None:
        # A copy in a data-loader worker: the process that pickled it checked the layout.
        self._initialize(*state)

    def __len__(self) -> int:
        return len(self.index)

    def _read(self, pointer: int, count: int) -> numpy.ndarray:
        if count < 0 or pointer < 0 or pointer + count * self.index.dtype_size > self.bin_bytes:
            raise ValueError(f"{get_bin_path(self.path_prefix)}: read of {count} tokens at byte "
                             f"{pointer} is outside the file ({self.bin_bytes} bytes)")
        return self.bin_reader.read(self.index.dtype, count, pointer)

    def __getitem__(self, idx):
        if isinstance(idx, (int, numpy.integer)):
            return self.get(idx)
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("IndexedDataset slices must be contiguous (step 1)")
            lengths = self.index.sequence_lengths[start:stop]
            if len(lengths) == 0:
                sequences = []
            else:
                flat = self._read(int(self.index.sequence_pointers[start]), int(lengths.sum()))
                sequences = numpy.split(flat, numpy.cumsum(lengths)[:-1])
            if self.multimodal:
                return sequences, self.index.sequence_modes[start:stop]
            return sequences
        raise TypeError(f"IndexedDataset index must be an int or a slice, not {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None):
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end when length is None)."""
        pointer = int(self.index.sequence_pointers[idx])
        sequence_length = int(self.index.sequence_lengths[idx])
        if length is None:
            length = sequence_length - offset
        if offset < 0 or offset + length > sequence_length:
            raise IndexError(f"tokens [{offset}, {offset + length}) of sequence {idx} are outside "
                             f"its {sequence_length} tokens")
        sequence = self._read(pointer + offset * self.index.dtype_size, length)
        if self.multimodal:
            return sequence, self.index.sequence_modes[idx]
        return sequence

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> numpy.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    @property
    def sequence_modes(self) -> Optional[numpy.ndarray]:
        """Per-sequence modes (multimodal datasets only, else None)."""
        return self.index.sequence_modes

    @property
    def dtype(self) -> Type[numpy.number]:
        return self.index.dtype

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.isfile(get_idx_path(path_prefix)) and os.path.isfile(get_bin_path(path_prefix))


def _write_index(f, dtype, sequence_lengths: numpy.ndarray, document_indices: numpy.ndarray,
                 sequence_modes: Optional[numpy.ndarray]) -> None:
    pointers = numpy.zeros(len(sequence_lengths), dtype=numpy.int64)
    numpy.cumsum(sequence_lengths[:-1] * numpy.int64(DType.size(dtype)), out=pointers[1:])
    f.write(_INDEX_HEADER)
    f.write(struct.pack("<QBQQ", 1, DType.code_from_dtype(dtype), len(sequence_lengths),
                        len(document_indices)))
    f.write(sequence_lengths.astype("<i4").tobytes())
    f.write(pointers.astype("<i8").tobytes())
    f.write(document_indices.astype("<i8").tobytes())
    if sequence_modes is not None:
        f.write(sequence_modes.astype(numpy.int8).tobytes())


class IndexedDatasetBuilder:
    """Write a `.bin/.idx` pair. Data goes to a temporary file beside `bin_path`; `finalize` writes
    the index the same way and renames both into place, so a crash never leaves a half dataset.
    Use as a context manager (or call `discard`) to remove the temporary file on failure."""

    def __init__(self, bin_path: str, dtype: Type[numpy.number] = numpy.int32,
                 multimodal: bool = False) -> None:
        self.bin_path = bin_path
        self.dtype = numpy.dtype(dtype).type
        DType.code_from_dtype(self.dtype)  # refuse a dtype the format cannot store, before writing
        self.multimodal = multimodal
        self._tmp_bin_path = f"{bin_path}.{os.getpid()}.tmp"
        try:
            self.data_file = open(self._tmp_bin_path, "wb")
        except OSError as err:
            raise ValueError(f"{bin_path}: cannot write the dataset ({err.strerror}); "
                             f"choose a writable output path") from None
        self.sequence_lengths: List[int] = []
        self.document_indices: List[int] = [0]
        self.sequence_modes: Optional[List[int]] = [] if multimodal else None

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()

    def _to_array(self, tokens) -> numpy.ndarray:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        array = numpy.asarray(tokens)
        if array.size and array.dtype != self.dtype and numpy.issubdtype(array.dtype, numpy.integer):
            info = numpy.iinfo(self.dtype) if numpy.issubdtype(self.dtype, numpy.integer) else None
            if info is not None and (array.min() < info.min or array.max() > info.max):
                bad = array.max() if array.max() > info.max else array.min()
                raise ValueError(f"{self.bin_path}: token id {bad} does not fit the dataset dtype "
                                 f"{numpy.dtype(self.dtype).name}; use a wider dtype (int32)")
        return numpy.ascontiguousarray(array.reshape(-1), dtype=self.dtype)

    def add_item(self, tensor, mode: int = 0) -> None:
        """Append one sequence (close its document with `end_document`)."""
        array = self._to_array(tensor)
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(array.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def add_document(self, tensor, lengths: List[int], modes: Optional[List[int]] = None) -> None:
        """Append a whole document: its tokens back to back, split into sequences by `lengths`."""
        array = self._to_array(tensor)
        lengths = [int(n) for n in lengths]
        if sum(lengths) != array.size:
            raise ValueError(f"add_document: lengths sum to {sum(lengths)} but the document has "
                             f"{array.size} tokens")
        if modes is not None and len(modes) != len(lengths):
            raise ValueError(f"add_document: {len(modes)} modes for {len(lengths)} sequences")
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def end_document(self) -> None:
        """Close the document made of the sequences added since the last one."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append every document of another dataset (same dtype and modality)."""
        index = _IndexReader(get_idx_path(path_prefix), multimodal=self.multimodal)
        if index.dtype != self.dtype:
            raise ValueError(f"{get_idx_path(path_prefix)}: dtype {numpy.dtype(index.dtype).name} "
                             f"differs from the builder's {numpy.dtype(self.dtype).name}; "
                             f"merge only datasets written with the same tokenizer")
        bin_path = get_bin_path(path_prefix)
        if not os.path.isfile(bin_path):
            raise ValueError(f"{bin_path}: data file not found (its index exists); rewrite the dataset")
        index.check_layout(bin_path, os.path.getsize(bin_path))
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(index.sequence_lengths.tolist())
        self.document_indices.extend((index.document_indices[1:] + offset).tolist())
        if self.multimodal:
            self.sequence_modes.extend(index.sequence_modes.tolist())
        with open(bin_path, "rb") as f:
            remaining = index.data_bytes()
            while remaining:
                chunk = f.read(min(remaining, 1 << 24))
                self.data_file.write(chunk)
                remaining -= len(chunk)

    def finalize(self, idx_path: str) -> None:
        """Write the index and move both files into place: the old index goes first and the new
        one comes last, so a crash in between leaves no index rather than a mismatched one."""
        self.data_file.close()
        tmp_idx_path = f"{idx_path}.{os.getpid()}.tmp"
        try:
            with open(tmp_idx_path, "wb") as f:
                _write_index(
                    f, self.dtype,
                    numpy.asarray(self.sequence_lengths, dtype=numpy.int64),
                    numpy.asarray(self.document_indices, dtype=numpy.int64),
                    None if self.sequence_modes is None else numpy.asarray(self.sequence_modes),
                )
            if os.path.exists(idx_path):
                os.unlink(idx_path)
            os.replace(self._tmp_bin_path, self.bin_path)
            os.replace(tmp_idx_path, idx_path)
        except OSError as err:
            self.discard()
            if os.path.exists(tmp_idx_path):
                os.unlink(tmp_idx_path)
            raise ValueError(f"{idx_path}: cannot write the dataset index ({err.strerror}); "
                             f"choose a writable output path") from None

    def discard(self) -> None:
        """Drop what was written so far (the final paths are left untouched)."""
        self.data_file.close()
        if os.path.exists(self._tmp_bin_path):
            os.unlink(self._tmp_bin_path)

