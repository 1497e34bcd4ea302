"""The train loop's checkpoint guard: an unwritable --save is found before training and nothing
is created. (Save/load round trips run end to end in tests/test_cli.py; the checkpoint format's
own tests live in tests/dist_checkpointing.)"""

import os

import pytest

from teratron.training.checkpointing import check_save_dir_writable


def test_unwritable_save_detected_without_creating_anything(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        check_save_dir_writable(str(blocker / "ckpt"))
    with pytest.raises(PermissionError, match="cannot write"):
        check_save_dir_writable("/proc/teratron-ckpt")
    check_save_dir_writable(str(tmp_path / "a" / "b"))
    assert not (tmp_path / "a").exists()
    assert os.listdir(tmp_path) == ["file"]
