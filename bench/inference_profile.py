"""Where a batch-1 decode step of the inference engine spends its time (issue 19's gap): the
benchmark-shape model in bf16, one request with a 512-token prompt, 64 decode steps under
torch.profiler; prints the ops by device time and by host time, and the step's wall time.

    PYTHONPATH=. python bench/inference_profile.py [--tiny]
"""

import argparse
import time

import torch

from bench.inference import build_model
from teratron.inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from teratron.tokenizers import NullTokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.tiny, device)
    engine = DynamicInferenceEngine(model, NullTokenizer(model.vocab_size), InferenceConfig(buffer_size_gb=4.0))
    prompt = torch.randint(0, 100, (8 if args.tiny else 512,)).tolist()
    params = SamplingParams(temperature=0, num_tokens_to_generate=args.steps + 8, ignore_eod=True)
    engine.add_request(prompt, params)
    for _ in range(4):  # the prefill and warm-up decode steps
        engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    print(f"RESULT decode step wall time {wall * 1e3:.2f} ms ({1 / wall:.0f} tok/s at batch 1)")
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
