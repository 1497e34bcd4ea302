"""Where a decode step of the inference engine spends its time: the benchmark-shape model in
bf16, B requests with 512-token prompts, decoding. For each batch size B: the device time of one
replay of the decode CUDA graph (CUDA events, the mean of 50), the wall time of a whole engine
step (scheduling, metadata, replay, sampling, detokenizing), and the host time of a step (wall
minus device). Then the kernels of one eager decode step at the largest B under torch.profiler.

    PYTHONPATH=. python bench/inference_profile.py [--tiny] [--batch-sizes 1,64,256]
"""

import argparse
import time

import torch

from bench.inference import build_model
from teratron.inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from teratron.tokenizers import NullTokenizer


def decode_engine(model, batch: int, prompt_tokens: int, steps: int, num_cuda_graphs: int, max_requests=None):
    """An engine with `batch` requests past their prefill, each with `steps` + 8 tokens to go."""
    config = InferenceConfig(buffer_size_gb=48.0 if torch.cuda.is_available() else 0.05,
                             max_requests=max_requests or batch,
                             max_tokens_per_step=8192, num_cuda_graphs=num_cuda_graphs, max_seq_length=2048)
    engine = DynamicInferenceEngine(model, NullTokenizer(model.vocab_size), config)
    params = SamplingParams(temperature=0, num_tokens_to_generate=steps + 16, ignore_eod=True)
    for _ in range(batch):
        engine.add_request(torch.randint(0, 100, (prompt_tokens,)).tolist(), params)
    while any(r.num_computed < len(r.prompt_token_ids) for r in engine.running) or engine.waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    return engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--mixed", action="store_true",
                        help="profile steps mixing prefill chunks with the decode of --batch-sizes' last size instead")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    model = build_model(args.tiny, torch.device("cuda" if cuda else "cpu"))
    prompt_tokens = 8 if args.tiny else 512
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.mixed:
        return profile_mixed(model, batches[-1], prompt_tokens, cuda)
    for batch in batches:
        engine = decode_engine(model, batch, prompt_tokens, args.steps, 1 if cuda else 0)
        device_ms = float("nan")
        if engine.cuda_graphs is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.steps):  # replays of the last prepared step (same inputs)
                engine.cuda_graphs.replay(batch)
            end.record()
            torch.cuda.synchronize()
            device_ms = start.elapsed_time(end) / args.steps
        begin = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall_ms = (time.perf_counter() - begin) * 1e3 / args.steps
        print(f"RESULT decode batch {batch}: graph replay {device_ms:.3f} ms device; engine step {wall_ms:.3f} ms "
              f"wall ({batch / wall_ms * 1e3:.0f} tok/s); host {wall_ms - device_ms:.3f} ms a step")
        del engine
    engine = decode_engine(model, batches[-1], prompt_tokens, 8, 0)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(4):
            engine.step()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(f"eager decode steps at batch {batches[-1]} (4 steps):")
    print(prof.key_averages().table(sort_by=key, row_limit=20))


def profile_mixed(model, batch: int, prompt_tokens: int, cuda: bool) -> None:
    """Steps where `batch` - 8 requests decode while 8 new prompts are prefilled (max_tokens_per_step
    8192: one step): wall time and kernels of the offline workload's eager steps."""
    engine = decode_engine(model, batch - 8, prompt_tokens, 40, 16 if cuda else 0, max_requests=batch)
    params = SamplingParams(temperature=0, num_tokens_to_generate=8, ignore_eod=True)
    for _ in range(8):
        engine.add_request(torch.randint(0, 100, (prompt_tokens,)).tolist(), params)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            begin = time.perf_counter()
            engine.step()
            if cuda:
                torch.cuda.synchronize()
            print(f"RESULT mixed step ({len(engine.context.chunks)} chunks, "
                  f"{sum(c.end - c.start for c in engine.context.chunks)} tokens): "
                  f"{(time.perf_counter() - begin) * 1e3:.1f} ms wall")
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=22))


if __name__ == "__main__":
    main()
