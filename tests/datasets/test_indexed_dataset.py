import hashlib
import json
import os
import pickle
import shutil
import struct

import numpy
import pytest
import torch

from teratron.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

# .bin/.idx files written by Megatron-LM's IndexedDatasetBuilder; manifest.json names the commit.
FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "megatron_idx")
MANIFEST = json.load(open(os.path.join(FIXTURES, "manifest.json")))
BY_PREFIX = {d["prefix"]: d for d in MANIFEST["datasets"]}


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def sequences_of(entry):
    """The manifest's documents as (list of sequences, list of modes or None) per document."""
    docs = []
    for doc in entry["documents"]:
        if entry["multimodal"]:
            docs.append(([seq for seq, _ in doc], [mode for _, mode in doc]))
        elif doc and isinstance(doc[0], list):
            docs.append((doc, None))
        else:
            docs.append(([doc], None))
    return docs


def expected_documents(prefix):
    entry = BY_PREFIX[prefix]
    if prefix != "sample_merged":
        return sequences_of(entry)
    parts = entry["documents"]
    merged = []
    for name in parts["add_index"]:
        merged += sequences_of(BY_PREFIX[name]) if name in BY_PREFIX else \
            sequences_of({"multimodal": False, "documents": parts[name]})
    return merged


def write_documents(prefix, entry_dtype, multimodal, docs, use_add_item):
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=getattr(numpy, entry_dtype),
                                    multimodal=multimodal)
    for seqs, modes in docs:
        if use_add_item:
            for k, seq in enumerate(seqs):
                builder.add_item(torch.tensor(seq), 0 if modes is None else modes[k])
            builder.end_document()
        else:
            builder.add_document(torch.tensor(sum(seqs, []), dtype=torch.int64), [len(s) for s in seqs], modes)
    builder.finalize(get_idx_path(prefix))


@pytest.mark.parametrize("prefix", sorted(BY_PREFIX))
def test_reads_megatron_fixtures(prefix):
    entry = BY_PREFIX[prefix]
    ds = IndexedDataset(os.path.join(FIXTURES, prefix), multimodal=entry["multimodal"])
    assert ds.dtype == getattr(numpy, entry["dtype"])
    docs = expected_documents(prefix)
    flat = [seq for seqs, _ in docs for seq in seqs]
    assert len(ds) == len(flat)
    assert ds.document_indices.tolist() == [0] + list(numpy.cumsum([len(s) for s, _ in docs]))
    assert ds.sequence_lengths.tolist() == [len(s) for s in flat]
    for i, seq in enumerate(flat):
        item = ds[i]
        tokens = item[0] if entry["multimodal"] else item
        assert tokens.dtype == ds.dtype and tokens.tolist() == seq
    if entry["multimodal"]:
        assert ds.sequence_modes.tolist() == [m for _, modes in docs for m in modes]
        seqs, modes = ds[1:4]
        assert [s.tolist() for s in seqs] == flat[1:4] and modes.tolist() == ds.sequence_modes[1:4].tolist()
    else:
        assert ds.sequence_modes is None
        assert [s.tolist() for s in ds[1:len(ds)]] == flat[1:]
        assert ds[2:2] == []
        longest = max(range(len(flat)), key=lambda i: len(flat[i]))
        assert ds.get(longest, offset=1, length=2).tolist() == flat[longest][1:3]
        assert ds.get(longest, offset=2).tolist() == flat[longest][2:]
    # File reads (no mmap) and pickling (DataLoader workers) give the same data.
    plain = pickle.loads(pickle.dumps(IndexedDataset(os.path.join(FIXTURES, prefix),
                                                     multimodal=entry["multimodal"], mmap=False)))
    for i in range(len(flat)):
        item = plain[i]
        assert (item[0] if entry["multimodal"] else item).tolist() == flat[i]


@pytest.mark.parametrize("prefix", ["sample", "sample_sent", "sample_mm"])
@pytest.mark.parametrize("use_add_item", [False, True])
def test_writer_is_byte_identical(tmp_path, prefix, use_add_item):
    entry = BY_PREFIX[prefix]
    out = str(tmp_path / prefix)
    write_documents(out, entry["dtype"], entry["multimodal"], sequences_of(entry), use_add_item)
    for suffix, key in ((".bin", "bin"), (".idx", "idx")):
        assert os.path.getsize(out + suffix) == entry[key]["bytes"]
        assert sha256(out + suffix) == entry[key]["sha256"]
    assert sorted(os.listdir(tmp_path)) == [f"{prefix}.bin", f"{prefix}.idx"]


def test_merge_is_byte_identical(tmp_path):
    entry = BY_PREFIX["sample_merged"]
    names = entry["documents"]["add_index"]
    for name in names:
        source = BY_PREFIX.get(name) or {"multimodal": False, "documents": entry["documents"][name]}
        write_documents(str(tmp_path / name), entry["dtype"], False, sequences_of(source), False)
    out = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(get_bin_path(out), dtype=numpy.uint16)
    for name in names:
        builder.add_index(str(tmp_path / name))
    builder.finalize(get_idx_path(out))
    assert sha256(out + ".bin") == entry["bin"]["sha256"]
    assert sha256(out + ".idx") == entry["idx"]["sha256"]


def test_dtype_codes_and_choice():
    assert [DType.code_from_dtype(getattr(numpy, n)) for n in
            ("uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16")] == list(range(1, 9))
    assert DType.dtype_from_code(8) is numpy.uint16 and DType.size(4) == 4
    assert DType.optimal_dtype(50257) is numpy.uint16
    assert DType.optimal_dtype(65500) is numpy.int32 and DType.optimal_dtype(None) is numpy.int32
    with pytest.raises(ValueError, match="dtype uint32 cannot be stored"):
        IndexedDatasetBuilder("unused.bin", dtype=numpy.uint32)


def test_empty_documents_and_dataset(tmp_path):
    out = str(tmp_path / "e")
    builder = IndexedDatasetBuilder(get_bin_path(out), dtype=numpy.uint16)
    builder.add_document([], [])
    builder.add_document([7, 8], [2])
    builder.end_document()
    builder.finalize(get_idx_path(out))
    ds = IndexedDataset(out)
    assert ds.document_indices.tolist() == [0, 0, 1, 1] and ds[0].tolist() == [7, 8]
    empty = str(tmp_path / "none")
    IndexedDatasetBuilder(get_bin_path(empty), dtype=numpy.int32).finalize(get_idx_path(empty))
    assert len(IndexedDataset(empty)) == 0


def test_builder_rejects_bad_input(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "b.bin"), dtype=numpy.uint16)
    with pytest.raises(ValueError, match="token id 70000 does not fit .*uint16"):
        builder.add_item(torch.tensor([1, 70000]))
    with pytest.raises(ValueError, match="lengths sum to 3 but the document has 2 tokens"):
        builder.add_document([1, 2], [3])
    builder.discard()
    assert os.listdir(tmp_path) == []
    # A failure inside the context leaves nothing behind, and no final file appears.
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(str(tmp_path / "c.bin"), dtype=numpy.uint16) as b:
            b.add_item([1, 2, 3])
            raise RuntimeError("crash mid-write")
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="cannot write the dataset"):
        IndexedDatasetBuilder(str(tmp_path / "no_such_dir" / "x.bin"))
    # Merging datasets of different dtypes is refused.
    src = str(tmp_path / "src")
    write_documents(src, "int32", False, [([[1, 2]], None)], False)
    merger = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=numpy.uint16)
    with pytest.raises(ValueError, match="dtype int32 differs from the builder's uint16"):
        merger.add_index(src)
    merger.discard()


def corrupt(tmp_path, name, edit_idx=None, edit_bin=None):
    prefix = str(tmp_path / name)
    shutil.copyfile(os.path.join(FIXTURES, "sample.bin"), prefix + ".bin")
    shutil.copyfile(os.path.join(FIXTURES, "sample.idx"), prefix + ".idx")
    for path, edit in ((prefix + ".idx", edit_idx), (prefix + ".bin", edit_bin)):
        if edit is not None:
            data = bytearray(open(path, "rb").read())
            open(path, "wb").write(edit(data))
    return prefix


def test_corruption_raises_naming_the_file(tmp_path):
    n = len(BY_PREFIX["sample"]["documents"])  # 8 sequences (lengths 6 4 2 21 4 31 10 2), uint16
    lengths_at = 34
    pointers_at = lengths_at + 4 * n

    def set_length(d, i, value):
        return d[:lengths_at + 4 * i] + struct.pack("<i", value) + d[lengths_at + 4 * (i + 1):]

    def set_pointer(d, i, value):
        return d[:pointers_at + 8 * i] + struct.pack("<q", value) + d[pointers_at + 8 * (i + 1):]

    cases = {
        "bad magic": (lambda d: b"NOTMAGIC!" + d[9:], None, r"\.idx: bad magic"),
        "version": (lambda d: d[:9] + struct.pack("<Q", 2) + d[17:], None, r"\.idx: index version 2"),
        "dtype": (lambda d: d[:17] + bytes([9]) + d[18:], None, r"\.idx: unknown dtype code 9"),
        "short header": (lambda d: d[:20], None, r"\.idx: truncated index header"),
        "truncated": (lambda d: d[:-5], None, r"\.idx: truncated index"),
        "count": (lambda d: d[:18] + struct.pack("<Q", n + 1) + d[26:], None, r"\.idx: truncated index"),
        "doc indices": (lambda d: d[:-8] + struct.pack("<q", n - 1), None, r"\.idx: corrupt document indices"),
        "short bin": (None, lambda d: d[:-2], r"\.bin: the index addresses 160 bytes but the file has 158"),
        "padded bin": (None, lambda d: d + b"\x00\x00", r"\.bin: the index addresses 160 bytes but the file has 162"),
        "pointer": (lambda d: set_pointer(d, n - 1, 10_000), None,
                    r"\.idx: sequence 7 starts at byte 10000 but the sequences before it end at byte 156"),
        "length": (lambda d: set_length(d, n - 1, 1000), None,
                   r"\.bin: the index addresses 2156 bytes but the file has 160"),
        # Edits that stay inside the file: before the layout check they read wrong tokens silently.
        "pointer in range": (lambda d: set_pointer(d, 1, 2), None,
                             r"\.idx: sequence 1 starts at byte 2 but the sequences before it end at byte 12"),
        "middle length": (lambda d: set_length(d, 0, 1), None,
                          r"\.idx: sequence 1 starts at byte 12 but the sequences before it end at byte 2"),
        "last length shorter": (lambda d: set_length(d, n - 1, 1), None,
                                r"\.bin: the index addresses 158 bytes but the file has 160"),
        "negative length": (lambda d: set_length(d, 2, -3), None, r"\.idx: sequence 2 has length -3 < 0"),
    }
    for name, (edit_idx, edit_bin, message) in cases.items():
        prefix = corrupt(tmp_path, name.replace(" ", "_"), edit_idx, edit_bin)
        with pytest.raises(ValueError, match=message) as info:
            IndexedDataset(prefix)
        assert prefix in str(info.value), name
    # A merge refuses a damaged input before copying anything.
    merger = IndexedDatasetBuilder(str(tmp_path / "merged.bin"), dtype=numpy.uint16)
    with pytest.raises(ValueError, match=r"pointer_in_range\.idx: sequence 1 starts at byte 2"):
        merger.add_index(str(tmp_path / "pointer_in_range"))
    merger.discard()
    prefix = corrupt(tmp_path, "mid")
    os.unlink(prefix + ".bin")
    with pytest.raises(ValueError, match=r"mid\.bin: data file not found"):
        IndexedDataset(prefix)
    with pytest.raises(ValueError, match=r"nothing\.idx: index file not found"):
        IndexedDataset(str(tmp_path / "nothing"))
    # Reading a text dataset as multimodal needs the modes it does not have.
    with pytest.raises(ValueError, match=r"sample\.idx: truncated index"):
        IndexedDataset(os.path.join(FIXTURES, "sample"), multimodal=True)
