"""--config-logger-dir (teratron.training.config_logger): a run writes its whole RunConfig as one
JSON file (named by start time and start iteration); a resumed run adds its own; no temporary
file stays behind."""

import json
import os

from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.config_logger import config_file_name
from teratron.training.training import pretrain

TINY = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "1",
        "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--lr", "1e-3", "--eval-iters", "0", "--num-workers", "0",
        "--no-progress-bar", "--train-iters", "2"]


def test_each_run_writes_its_config_and_a_resume_adds_one(tmp_path):
    logged, save = tmp_path / "configs", str(tmp_path / "ckpt")
    first = build_run_config(parse_train_args(TINY + ["--save", save, "--config-logger-dir", str(logged)]), 1)
    pretrain(first)
    resumed = build_run_config(parse_train_args(TINY + ["--load", save, "--train-iters", "3", "--save", save,
                                                        "--override-opt_param-scheduler",
                                                        "--config-logger-dir", str(logged)]), 1)
    pretrain(resumed)
    names = sorted(os.listdir(logged))
    assert [name[-len("_iter0000000.json"):] for name in names] == ["_iter0000000.json", "_iter0000002.json"]
    assert json.loads((logged / names[0]).read_text()) == first.to_dict()
    assert json.loads((logged / names[1]).read_text()) == resumed.to_dict()
    assert json.loads((logged / names[1]).read_text())["training"]["train_iters"] == 3


def test_the_name_holds_the_utc_start_and_the_iteration():
    assert config_file_name(12, 0.0) == "run_config_19700101T000000Z_iter0000012.json"
