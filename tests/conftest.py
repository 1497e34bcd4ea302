import os
import sys

import torch

# Tests import their helpers (tests/dist.py) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(int(os.environ.get("TERATRON_TEST_THREADS", "1")))
