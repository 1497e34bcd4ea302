import argparse
import gzip
import hashlib
import json
import os

import numpy
import pytest

from teratron.datasets import preprocess
from teratron.datasets.indexed_dataset import IndexedDataset


class FakeTokenizer:
    """Characters to ids 1..99; eod 0."""

    vocab_size = 100
    eod = 0

    def tokenize(self, text):
        return [ord(c) % 99 + 1 for c in text]


def parse(*argv):
    return preprocess.add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def records(n=150):
    out = []
    for i in range(n):
        text = f"doc {i} " + "xyz" * (i % 7)
        if i % 10 == 3:
            text = ["first sentence.", "", f"second {i}"]  # a list of sentences
        if i % 25 == 4:
            text = ""  # an empty document
        out.append({"text": text, "title": f"t{i}", "other": i})
    return out


def expected_documents(recs, key, append_eod):
    tok = FakeTokenizer()
    docs = []
    for r in recs:
        sentences = r[key] if isinstance(r[key], list) else [r[key]]
        seqs = [tok.tokenize(s) for s in sentences if tok.tokenize(s)]
        if seqs and append_eod:
            seqs[-1] = seqs[-1] + [tok.eod]
        docs.append(seqs)
    return docs


def digest(prefix):
    return [hashlib.sha256(open(prefix + s, "rb").read()).hexdigest() for s in (".bin", ".idx")]


def run(tmp_path, input_path, out_name, *extra, tokenizer=FakeTokenizer()):
    args = parse("--input", str(input_path), "--output-prefix", str(tmp_path / out_name), *extra)
    assert preprocess.run(args, tokenizer=tokenizer) == 0
    return str(tmp_path / out_name)


def test_end_to_end_and_parallel_runs_agree(tmp_path):
    recs = records()
    src = tmp_path / "in.jsonl"
    write_jsonl(src, recs)
    out = run(tmp_path, src, "w1", "--json-keys", "text", "title", "--append-eod")
    for key in ("text", "title"):
        ds = IndexedDataset(f"{out}_{key}_document")
        assert ds.dtype == numpy.uint16
        docs = expected_documents(recs, key, append_eod=True)
        assert ds.document_indices.tolist() == [0] + numpy.cumsum([len(d) for d in docs]).tolist()
        assert [s.tolist() for s in ds[0:len(ds)]] == [s for d in docs for s in d]
    reference = digest(f"{out}_text_document")

    assert digest(run(tmp_path, src, "w2", "--append-eod", "--workers", "2") + "_text_document") == reference
    parts = run(tmp_path, src, "p2", "--append-eod", "--workers", "2", "--partitions", "2")
    assert digest(parts + "_text_document") == reference
    gz = tmp_path / "in.jsonl.gz"
    write_jsonl(gz, recs, opener=gzip.open)
    assert digest(run(tmp_path, gz, "gz", "--append-eod", "--partitions", "2", "--workers", "2")
                  + "_text_document") == reference
    # Nothing but the outputs is left in the folder (no temporary or partition files).
    outputs = {f"{p}_{k}_document.{s}" for p in ("w1",) for k in ("text", "title") for s in ("bin", "idx")}
    outputs |= {f"{p}_text_document.{s}" for p in ("w2", "p2", "gz") for s in ("bin", "idx")}
    assert set(os.listdir(tmp_path)) == outputs | {"in.jsonl", "in.jsonl.gz"}
    # Without --append-eod the documents carry no EOD.
    plain = IndexedDataset(run(tmp_path, src, "noeod") + "_text_document")
    assert [s.tolist() for s in plain[0:len(plain)]] == [
        s for d in expected_documents(recs, "text", append_eod=False) for s in d]


def test_real_byte_level_tokenizer(tmp_path):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"text": "héllo"}, {"text": "world"}])
    args = parse("--input", str(src), "--output-prefix", str(tmp_path / "bl"), "--append-eod",
                 "--tokenizer-type", "ByteLevelTokenizer")
    assert preprocess.run(args) == 0
    ds = IndexedDataset(str(tmp_path / "bl_text_document"))
    assert ds.dtype == numpy.uint16
    assert ds[0].tolist() == list("héllo".encode("utf-8")) + [256]
    assert ds[1].tolist() == list(b"world") + [256]


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_input_names_the_problem_and_writes_nothing(tmp_path, workers):
    good = [{"text": f"line {i}"} for i in range(80)]
    cases = {
        "bad_json": (good[:70] + ['{"text": "oops"'] + good[70:], r"bad_json\.jsonl:71: not valid JSON"),
        "no_key": (good[:5] + [{"body": "x"}] + good[5:], r"no_key\.jsonl:6: no key 'text' \(keys: 'body'\)"),
        "not_text": (good[:2] + [{"text": 5}], r"not_text\.jsonl:3: 'text' must be a string"),
    }
    for name, (lines, message) in cases.items():
        src = tmp_path / f"{name}.jsonl"
        write_jsonl(src, lines)
        outdir = tmp_path / f"out_{name}_{workers}"
        outdir.mkdir()
        args = parse("--input", str(src), "--output-prefix", str(outdir / "x"), "--workers", str(workers),
                     "--partitions", str(workers))
        with pytest.raises(ValueError, match=message):
            preprocess.run(args, tokenizer=FakeTokenizer())
        assert os.listdir(outdir) == [], name
    with pytest.raises(ValueError, match=r"--input .*missing\.jsonl: file not found"):
        preprocess.run(parse("--input", str(tmp_path / "missing.jsonl"), "--output-prefix", "x"),
                       tokenizer=FakeTokenizer())
    with pytest.raises(ValueError, match=r"--output-prefix .*: directory .*nowhere does not exist"):
        preprocess.run(parse("--input", str(src), "--output-prefix", str(tmp_path / "nowhere" / "x")),
                       tokenizer=FakeTokenizer())
    with pytest.raises(ValueError, match="--workers 3 must be a multiple of --partitions 2"):
        preprocess.run(parse("--input", str(src), "--output-prefix", "x", "--workers", "3", "--partitions", "2"),
                       tokenizer=FakeTokenizer())


@pytest.mark.parametrize("workers", [1, 2])
def test_append_eod_with_a_tokenizer_without_eos_is_one_line(tmp_path, capsys, workers):
    """A Hugging Face tokenizer.json without an EOS token under --append-eod: exit 2, one line that
    names the fix, no output files (before: two tracebacks, exit 1). With eos_token set in a
    tokenizer_config.json beside it, the same command appends that id."""
    from teratron import cli

    folder = tmp_path / "tok"
    folder.mkdir()
    vocab = {"<unk>": 0, "hi": 1, "there": 2, "</end>": 3}
    (folder / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
        "pre_tokenizer": {"type": "Whitespace"}}))
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"text": "hi there"}, {"text": "there hi hi"}] * 4)
    out = tmp_path / "out"
    out.mkdir()
    argv = ["preprocess", "--input", str(src), "--output-prefix", str(out / "x"), "--append-eod",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder),
            "--workers", str(workers), "--partitions", str(workers)]
    assert cli.main(argv) == 2
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("teratron: error: --append-eod: HuggingFaceTokenizer has "
                                                   "no eos token: set eos_token in a tokenizer_config.json"), err
    assert "drop --append-eod" in lines[0] and os.listdir(out) == []

    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</end>"}))
    assert cli.main(argv) == 0
    ds = IndexedDataset(str(out / "x_text_document"))
    assert [ds[i].tolist() for i in range(2)] == [[1, 2, 3], [2, 1, 1, 3]]
