"""What the Triton kernel tests share: a cases script run in Triton's interpreter, and the `gpu` mark."""

import os
import subprocess
import sys

import pytest
import torch


def run_in_the_interpreter(test_file: str, script: str) -> str:
    """The last line the cases script beside `test_file` prints when run with TRITON_INTERPRET=1 (in a
    subprocess: Triton reads the variable when the kernels are defined); fails the test if the script fails."""
    path = os.path.join(os.path.dirname(test_file), script)
    result = subprocess.run([sys.executable, path], env={**os.environ, "TRITON_INTERPRET": "1"},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split("\n")[-2]


def gpu_test(test):
    """Marked `gpu` (conftest.py leaves CUDA visible) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))
