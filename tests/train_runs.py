"""`teratron train` as the tests run it, one process or torchrun ranks (gloo on CPU), and the check
that two runs trained alike.

    records, stdout = train(argv, tmp_path, "name", nproc=2)   # every --metrics-file record
    assert_same_losses(reference, training_records(records), "name")
"""

import json
import os
import subprocess
import sys

import numpy
import pytest


def env() -> dict:
    """One thread per rank (the CI machine has two cores) and unbuffered output."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def train(argv: list, cwd, name: str, nproc: int | None = None, timeout: int = 300) -> tuple:
    """Run `teratron train argv` in `cwd` (under torchrun with `nproc` ranks), its metrics going to
    `cwd/<name>.jsonl`; returns (every metrics record, stdout). A failed run fails the test with
    its command and output."""
    launcher = [sys.executable, "-m", "teratron"]
    if nproc:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
                    "-m", "teratron"]
    path = cwd / f"{name}.jsonl"
    cmd = launcher + ["train"] + list(argv) + ["--metrics-file", str(path)]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env())
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return [json.loads(line) for line in path.read_text().splitlines()], proc.stdout


def training_records(records: list) -> list:
    """The training iterations' records (evaluation records carry no learning rate)."""
    return [r for r in records if "lr" in r]


def assert_same_losses(reference: list, run: list, name: str, keys=("lm_loss", "grad_norm")) -> None:
    """`run`'s iterations equal the last ones of `reference` in `keys` (to fp32 rounding of sums)."""
    assert [r["iteration"] for r in run] == [r["iteration"] for r in reference[-len(run):]], name
    for a, b in zip(reference[-len(run):], run):
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5), (name, a["iteration"], key, a[key], b[key])


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that never comes counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def write_documents(prefix: str) -> None:
    """An indexed dataset at `prefix` (.bin, .idx) of 400 documents of 2..12 tokens, each ending with
    the NullTokenizer's EOD (99): rows of --seq-length 16 hold several."""
    from teratron.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(0)
    with IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.uint16) as builder:
        for _ in range(400):
            builder.add_item(list(rng.integers(1, 99, size=int(rng.integers(1, 12)))) + [99])
            builder.end_document()
        builder.finalize(f"{prefix}.idx")
