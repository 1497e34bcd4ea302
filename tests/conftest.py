import os
import sys

import pytest
import torch

# Tests import their helpers (tests/dist.py) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(int(os.environ.get("TERATRON_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request, monkeypatch):
    """Tests without the `gpu` mark run on the CPU on any machine, as in CI: CUDA is hidden from
    them, from the ranks they fork and from the processes they start (otherwise their layers
    would put params on a GPU the machine has, beside CPU inputs and references)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
