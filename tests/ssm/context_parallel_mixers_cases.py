"""test_context_parallel_mixers' check with the mixers' Triton kernels (the convolution, the scans, the
gated norm) in Triton's interpreter: the all-to-all'd scan inputs reach the kernels as strided views.
Run by test_context_parallel_mixers.py with TRITON_INTERPRET=1."""

import os

from dist import run_distributed
from ssm.test_context_parallel_mixers import check_every_layout


def main():
    assert os.environ.get("TRITON_INTERPRET") == "1", "needs the interpreter (the mixers' Triton path)"
    results = run_distributed(check_every_layout, 4, seq=32, chunk=16, mixers=("mamba", "gated delta net"))
    failures = [failure for rank_failures, _ in results for failure in rank_failures]
    assert failures == [], failures
    print(f"checked {results[0][1]} layouts")


if __name__ == "__main__":
    main()
