"""`teratron analyze-routing` on a hand-made recording of 2 MoE layers, 4 experts, top-2, 4 tokens
in 2 forward calls; every expected number is worked out by hand in the comments."""

import csv

import pytest
import torch
from safetensors.torch import save_file

from teratron import cli
from teratron.transformer.moe.router_replay import _FORMAT

LAYER_1 = [[0, 1], [0, 2], [0, 1], [3, 0]]  # assignments 0:4 1:2 2:1 3:1 of 8; top-1 0,0,0,3
LAYER_3 = [[2, 0], [3, 1], [2, 3], [1, 2]]  # assignments 0:1 1:2 2:3 3:2 of 8; top-1 2,3,2,1


@pytest.fixture
def recording(tmp_path):
    path = tmp_path / "routing.safetensors"
    tensors = {}
    for layer, indices in ((1, LAYER_1), (3, LAYER_3)):
        for call in (0, 1):  # tokens 0-1 in call 0, 2-3 in call 1
            tensors[f"layers.{layer}.calls.{call}"] = torch.tensor(indices[2 * call:2 * call + 2], dtype=torch.int32)
    save_file(tensors, str(path), metadata=_FORMAT)
    return path


def test_table_csv_and_plot(recording, tmp_path, capsys):
    out_csv, out_png = tmp_path / "routing.csv", tmp_path / "routing.png"
    assert cli.main(["analyze-routing", str(recording), "--csv", str(out_csv), "--plot", str(out_png)]) == 0
    first, last = list(csv.DictReader(open(out_csv)))
    values = {key: float(v) for key, v in first.items()}
    assert [values[f"expert_{e}"] for e in range(4)] == [0.5, 0.25, 0.125, 0.125]
    # entropy: .5*1 + .25*2 + 2 * .125*3 = 1.75; Gini: ordered-pair |differences| sum 2.5 / (2 * 4 * 1)
    assert values["entropy_bits"] == pytest.approx(1.75, abs=1e-12)
    assert values["max_share"] == 0.5 and values["gini"] == pytest.approx(0.3125, abs=1e-12)
    # top-1 pairs 0->2, 0->3, 0->2, 3->1: H(next) over 2:.5 3:.25 1:.25 = 1.5 bits;
    # H(next | this) = P(0) H(2/3, 1/3) + P(3) * 0 = .75 * 0.9182958...; best predictor 0->2, 3->1: 3 of 4
    assert values["next_entropy_bits"] == pytest.approx(1.5, abs=1e-12)
    assert values["conditional_entropy_bits"] == pytest.approx(0.75 * 0.9182958340544896, abs=1e-12)
    assert values["top1_prediction_accuracy"] == 0.75
    assert [float(last[f"expert_{e}"]) for e in range(4)] == [0.125, 0.25, 0.375, 0.25]
    # .125*3 + 2 * .25*2 + .375*log2(8/3); Gini 1.5 / 8; the last layer predicts nothing
    assert float(last["entropy_bits"]) == pytest.approx(0.375 + 1 + 0.375 * 1.4150374992788437, abs=1e-12)
    assert float(last["gini"]) == pytest.approx(0.1875, abs=1e-12)
    assert last["layer"] == "3" and last["tokens"] == "4" and last["top1_prediction_accuracy"] == ""
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:6] == ["1", "4", "1.750", "0.500", "0.312", "|"]
    assert lines[1].split()[6:] == ["1.500", "0.689", "0.750"]
    assert lines[2].split()[-3:] == ["-", "-", "-"]


def test_a_file_that_is_no_recording_is_one_line(tmp_path, capsys):
    path = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(1)}, str(path))
    assert cli.main(["analyze-routing", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"teratron: error: {path} is not a router replay file")
    assert cli.main(["analyze-routing", str(tmp_path / "missing")]) == 2
    assert "cannot read the recording" in capsys.readouterr().err
