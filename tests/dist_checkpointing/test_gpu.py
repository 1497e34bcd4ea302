"""Sharded checkpoints of CUDA tensors over NCCL: resharding (TP, PP/VPP, DP with the distributed
optimizer) and an async save from GPU memory (nccl_checkpoint_check.py under torchrun)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_resharding_over_nccl():
    script = os.path.join(os.path.dirname(__file__), "nccl_checkpoint_check.py")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", script],
                   check=True, timeout=600)
