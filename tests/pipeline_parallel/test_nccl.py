"""The pipeline schedules over NCCL on 2 or 4 GPUs (nccl_pipeline_check.py under torchrun)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_pipeline_schedules_over_nccl():
    script = os.path.join(os.path.dirname(__file__), "nccl_pipeline_check.py")
    gpus = 4 if torch.cuda.device_count() >= 4 else 2
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", script],
                   check=True, timeout=600)
