"""teratron's inference benchmark (issue 19): the dynamic engine at the benchmark shape of
ARCHITECTURE.md (the model `teratron bench` trains: 24 layers, hidden 2048, SwiGLU FFN 5632, 16
heads, vocab 50304, RoPE, RMSNorm, no biases, untied), random bf16 weights, one GPU. One RESULT
line per workload, in the style of bench/hf_generate.py (the anchor that runs in the same job):

  (a) offline throughput: --requests prompts of --prompt-tokens, --output-tokens each (greedy, end
      of document ignored), all queued at once; output tokens/s and the fraction reached of the
      workload's memory-bandwidth roofline
  (b) batch-1 decode: one request, prompt --prompt-tokens, --output-tokens new; tokens/s (with and
      without the prefill) against weights / bandwidth, the median of --repeats runs
  (c) Poisson arrivals at --rate requests/s through the async engine (the engine's own step loop
      when teratron.inference.async_engine is absent): time to first token and time per output
      token, p50 and p99
  (d) shared prefix: requests whose prompts share --prefix-fraction of their tokens, without and
      with prefix caching (--inference-dynamic-batching-prefix-caching); the speed-up

    PYTHONPATH=. python bench/inference.py [--workloads a,b,c,d] [--hf-results hf.log] [--results-md PATH]
    PYTHONPATH=. python bench/inference.py --tiny      # a 2-layer, hidden-64 model on the CPU, seconds

Every workload builds a fresh engine (nothing cached from the one before) and warms it up on
other prompts before the clock starts. The rooflines count HBM bytes at --bandwidth-tbs (4.8 TB/s,
the H200's datasheet): each step reads the weights once (every parameter, as hf_generate.py counts
them) for all its requests, and each request's step reads the keys and values of its context.
"""

import argparse
import asyncio
import gc
import math
import os
import random
import re
import shlex
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace

import numpy as np
import torch

from teratron.bench.report import results_entry
from teratron.bench.shapes import BENCHMARK_SHAPE, TINY_SHAPE, TRAINING
from teratron.inference.config import InferenceConfig
from teratron.inference.engines.dynamic_engine import DynamicInferenceEngine
from teratron.inference.sampling_params import SamplingParams
from teratron.models.gpt.builder import build_gpt_model
from teratron.tokenizers.null_tokenizer import NullTokenizer
from teratron.training.arguments import parse_train_args
from teratron.training.config import run_config_from_args

WORKLOADS = "abcd"

# Defaults at the benchmark shape on one H200, and with --tiny on the CPU. 256 requests of 768
# tokens hold 36 GiB of keys and values; 40 GiB keeps them all resident.
DEFAULTS = dict(
    requests=(1000, 8), prompt_tokens=(512, 16), output_tokens=(256, 8),
    max_requests=(256, 4), buffer_size_gb=(40.0, 0.01), block_size=(16, 4), max_tokens_per_step=(2048, 32),
    repeats=(3, 2), rate=(10.0, 200.0), poisson_requests=(200, 6),
    prefix_requests=(256, 8), prefix_output_tokens=(32, 4),
)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench/inference.py", description=__doc__.split("\n\n")[0])

    def sized(flag, what, type=int):  # noqa: A002 - argparse's name
        full, tiny = DEFAULTS[flag.removeprefix("--").replace("-", "_")]
        p.add_argument(flag, type=type, help=f"{what} (default {full:g}; {tiny:g} with --tiny)")

    p.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-64 fp32 model and a few short requests")
    p.add_argument("--workloads", default="a,b,c,d", help="which of a, b, c, d to run, in this order (default: all)")
    sized("--requests", "(a) requests")
    sized("--prompt-tokens", "prompt length of every workload")
    sized("--output-tokens", "(a), (b), (c) tokens each request makes")
    sized("--max-requests", "--inference-max-requests")
    sized("--buffer-size-gb", "--inference-dynamic-batching-buffer-size-gb", float)
    sized("--block-size", "--inference-dynamic-batching-block-size")
    sized("--max-tokens-per-step", "--inference-dynamic-batching-max-tokens: tokens one engine step computes")
    p.add_argument("--num-cuda-graphs", type=int, default=16,
                   help="--inference-dynamic-batching-num-cuda-graphs (default 16; 0: decode eagerly)")
    sized("--repeats", "(b) runs, the median reported")
    sized("--rate", "(c) mean arrivals per second", float)
    sized("--poisson-requests", "(c) requests")
    sized("--prefix-requests", "(d) requests")
    p.add_argument("--prefix-fraction", type=float, default=0.9, help="(d) shared part of each prompt (0.9)")
    sized("--prefix-output-tokens", "(d) tokens each request makes")
    p.add_argument("--bandwidth-tbs", type=float, default=4.8, help="HBM bandwidth of the rooflines, TB/s (4.8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-results", metavar="LOG", help="output of bench/hf_generate.py from the same job: "
                                                      "teratron / HF ratios printed and recorded")
    p.add_argument("--results-md", metavar="PATH", help="append a markdown entry (bench/RESULTS.md format)")
    args = p.parse_args(argv)
    args.argv = list(argv)
    for name, (full, tiny) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    chosen = args.workloads.replace(",", "")
    if not chosen or set(chosen) - set(WORKLOADS):
        p.error(f"--workloads {args.workloads!r}: give some of a, b, c, d, e.g. --workloads a,b")
    args.workloads = list(dict.fromkeys(chosen))  # in the order given
    if not 0 <= args.prefix_fraction < 1:
        p.error(f"--prefix-fraction {args.prefix_fraction}: give a fraction in [0, 1)")
    if args.hf_results and not os.path.isfile(args.hf_results):
        p.error(f"--hf-results {args.hf_results}: no such file; pass the log of bench/hf_generate.py")
    return args


# ------------------------------------------------------------------ the model

def build_model(tiny: bool, device: torch.device) -> torch.nn.Module:
    """The model `teratron bench` trains (its shape flags read by train's parser): random weights,
    bf16 on a GPU, fp32 on the CPU, eval mode. Built without train's CUDA defaults (compiled
    layers, gradient-accumulation fusion): training levers, off in the model the engine serves."""
    argv = (TINY_SHAPE if tiny else BENCHMARK_SHAPE) + TRAINING + ["--train-iters", "1"]
    args = parse_train_args(argv)
    config = run_config_from_args(args, 1, args.vocab_size, cuda=False).model
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    transformer = replace(config.transformer, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                          use_cpu_initialization=device.type == "cpu")
    return build_gpt_model(replace(config, transformer=transformer)).to(device).eval()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of one token's keys and values over all layers, in the model's dtype."""
    config = model.config
    element_size = next(model.parameters()).element_size()
    return 2 * config.num_layers * config.num_query_groups * config.kv_channels * element_size


def roofline_tokens_per_s(weight_bytes: float, kv_bytes_per_token: float, prompt: int, output: int, batch: int,
                          bandwidth: float) -> float:
    """Output tokens/s if HBM bytes were all that took time, at `bandwidth` bytes/s: each step makes
    one token for each of `batch` requests, reading the weights once plus the keys and values of
    each request's context (the j-th output token, j = 0..output-1, attends over prompt + j
    tokens). kv_bytes_per_token = 0 gives the weights-only roofline, bandwidth / weight_bytes at
    batch 1."""
    mean_context = prompt + (output - 1) / 2
    return batch * bandwidth / (weight_bytes + batch * mean_context * kv_bytes_per_token)


# ------------------------------------------------------------------ requests and timing

def random_prompts(count: int, length: int, vocab_size: int, generator: torch.Generator) -> list:
    return torch.randint(0, vocab_size, (count, length), generator=generator).tolist()


def shared_prefix_prompts(count: int, length: int, fraction: float, vocab_size: int,
                          generator: torch.Generator) -> list:
    """`count` prompts of `length` tokens: the same round(fraction * length) first tokens, then
    random tokens of their own."""
    prefix = random_prompts(1, round(fraction * length), vocab_size, generator)[0]
    return [prefix + rest for rest in random_prompts(count, length - len(prefix), vocab_size, generator)]


def poisson_arrivals(count: int, rate: float, seed: int) -> list:
    """Arrival times (s from the start) of a Poisson process of `rate` per second."""
    draw, t, times = random.Random(seed), 0.0, []
    for _ in range(count):
        t += draw.expovariate(rate)
        times.append(t)
    return times


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, num_tokens_to_generate=tokens, ignore_eod=True)


@dataclass
class RequestTiming:
    arrival: float
    first_token: float = math.nan
    last_token: float = math.nan
    tokens: int = 0

    def record(self, new_tokens: int, now: float) -> None:
        if new_tokens and self.tokens == 0:
            self.first_token = now
        if new_tokens:
            self.last_token, self.tokens = now, self.tokens + new_tokens

    @property
    def time_to_first_token(self) -> float:
        return self.first_token - self.arrival

    @property
    def time_per_output_token(self) -> float:
        """Mean gap between output tokens after the first (nan for one token)."""
        return (self.last_token - self.first_token) / (self.tokens - 1) if self.tokens > 1 else math.nan


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def on_fresh_engine(model, tokenizer, args, generator, work, **config):
    """work(engine) on a new engine warmed up on other prompts; its KV buffer is given back before
    this returns, so the next workload can allocate its own. config: InferenceConfig overrides."""
    settings = dict(buffer_size_gb=args.buffer_size_gb, block_size=args.block_size, max_requests=args.max_requests,
                    max_tokens_per_step=args.max_tokens_per_step, prefix_caching=False,
                    num_cuda_graphs=args.num_cuda_graphs)
    engine = DynamicInferenceEngine(model, tokenizer, InferenceConfig(**{**settings, **config}), seed=args.seed)
    engine.generate(random_prompts(min(4, args.max_requests), args.prompt_tokens, tokenizer.vocab_size, generator),
                    greedy(4))  # kernels chosen, workspaces allocated
    try:
        return work(engine)
    finally:
        del engine
        gc.collect()
        if device_of(model).type == "cuda":
            torch.cuda.empty_cache()


def run_to_end(engine: DynamicInferenceEngine, prompts: list, params: SamplingParams) -> tuple:
    """Queue every prompt, step until all finish. Returns (seconds, steps); raises if a request
    made fewer tokens than asked (the rooflines assume every one made them all)."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    device = device_of(engine.model)
    synchronize(device)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and len(output.token_ids) != params.num_tokens_to_generate:
                raise RuntimeError(f"request {output.request_id} finished ({output.finish_reason}) after "
                                   f"{len(output.token_ids)} of {params.num_tokens_to_generate} tokens")
        steps += 1
    synchronize(device)
    return time.perf_counter() - start, steps


def graph_replays(engine: DynamicInferenceEngine) -> int:
    """Decode steps the engine has run as CUDA-graph replays so far."""
    return 0 if engine.cuda_graphs is None else engine.cuda_graphs.num_replays


# ------------------------------------------------------------------ the workloads

def offline_throughput(model, tokenizer, args, generator) -> str:
    prompts = random_prompts(args.requests, args.prompt_tokens, tokenizer.vocab_size, generator)
    blocks_per_request = math.ceil((args.prompt_tokens + args.output_tokens) / args.block_size)

    def work(engine):
        if device_of(model).type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        replays = graph_replays(engine)
        seconds, steps = run_to_end(engine, prompts, greedy(args.output_tokens))
        # The most requests decoding at once: the engine's limit, or as many as its KV buffer holds whole.
        batch = min(args.max_requests, args.requests, engine.context.num_blocks // blocks_per_request)
        return seconds, steps, graph_replays(engine) - replays, batch, peak_memory(device_of(model))

    seconds, steps, replays, batch, peak = on_fresh_engine(model, tokenizer, args, generator, work)
    tokens = args.requests * args.output_tokens
    roof = roofline_tokens_per_s(weight_bytes(model), kv_bytes_per_token(model), args.prompt_tokens,
                                 args.output_tokens, batch, args.bandwidth_tbs * 1e12)
    return (f"RESULT teratron offline throughput: {tokens / seconds:.0f} output tok/s ({args.requests} requests "
            f"{args.prompt_tokens}/{args.output_tokens}, {seconds:.2f} s, {steps} steps ({replays} CUDA-graph "
            f"decode steps), "
            f"{tokens / steps:.1f} output tokens a step, peak {peak}); HBM roofline at batch {batch} "
            f"(weights + KV) {roof:.0f} tok/s; ratio {tokens / seconds / roof:.2f}")


def batch1_decode(model, tokenizer, args, generator) -> str:
    prompts = random_prompts(args.repeats, args.prompt_tokens, tokenizer.vocab_size, generator)
    params = greedy(args.output_tokens)

    def work(engine):
        timings = []
        for prompt in prompts:
            engine.add_request(prompt, params)
            synchronize(device_of(model))
            timing = RequestTiming(arrival=time.perf_counter())
            while engine.has_unfinished_requests():
                for output in engine.step():
                    timing.record(len(output.new_token_ids), time.perf_counter())
            timings.append(timing)
        return timings

    timings = on_fresh_engine(model, tokenizer, args, generator, work)
    total = statistics.median(t.tokens / (t.last_token - t.arrival) for t in timings)
    decode = statistics.median(1 / t.time_per_output_token for t in timings)
    roof = roofline_tokens_per_s(weight_bytes(model), 0, args.prompt_tokens, args.output_tokens, 1,
                                 args.bandwidth_tbs * 1e12)
    return (f"RESULT teratron batch-1 decode: {total:.0f} tok/s (incl. prefill), {decode:.0f} tok/s decode only "
            f"(prompt {args.prompt_tokens}, {args.output_tokens} new, median of {args.repeats}); HBM roofline "
            f"(weights) {roof:.0f} tok/s; ratio {total / roof:.2f} (incl. prefill), {decode / roof:.2f} (decode only)")


def poisson_serving(model, tokenizer, args, generator) -> str:
    prompts = random_prompts(args.poisson_requests, args.prompt_tokens, tokenizer.vocab_size, generator)
    arrivals = poisson_arrivals(args.poisson_requests, args.rate, args.seed)
    params = greedy(args.output_tokens)
    try:
        from teratron.inference.async_engine import AsyncInferenceEngine
    except ImportError:  # a tree without the server's async engine
        AsyncInferenceEngine = None
    driver = "engine step loop" if AsyncInferenceEngine is None else "async engine"

    def work(engine):
        if AsyncInferenceEngine is None:
            return serve_by_steps(engine, prompts, params, arrivals)
        return asyncio.run(serve_async(AsyncInferenceEngine(engine), prompts, params, arrivals))

    timings = on_fresh_engine(model, tokenizer, args, generator, work)
    ttft = [t.time_to_first_token * 1e3 for t in timings]
    tpot = [t.time_per_output_token * 1e3 for t in timings if t.tokens > 1]
    span = max(t.last_token for t in timings) - min(t.arrival for t in timings)
    return (f"RESULT teratron poisson {args.rate:g} req/s ({args.poisson_requests} requests "
            f"{args.prompt_tokens}/{args.output_tokens}, {driver}): TTFT p50 {np.percentile(ttft, 50):.1f} ms "
            f"p99 {np.percentile(ttft, 99):.1f} ms; TPOT p50 {np.percentile(tpot, 50):.2f} ms "
            f"p99 {np.percentile(tpot, 99):.2f} ms; {sum(t.tokens for t in timings) / span:.0f} output tok/s")


async def serve_async(async_engine, prompts: list, params: SamplingParams, arrivals: list) -> list:
    """Each prompt sent at its arrival time (s after the start) through AsyncInferenceEngine;
    arrival is the scheduled time, so a late event loop counts against the request."""
    async_engine.start()
    start = time.perf_counter()

    async def client(prompt, arrival):
        await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
        timing = RequestTiming(arrival=start + arrival)
        async for output in async_engine.generate(prompt, params):
            timing.record(len(output.new_token_ids), time.perf_counter())
        return timing

    try:
        return await asyncio.gather(*(client(p, a) for p, a in zip(prompts, arrivals)))
    finally:
        await async_engine.stop()


def serve_by_steps(engine: DynamicInferenceEngine, prompts: list, params: SamplingParams, arrivals: list) -> list:
    """The same arrivals through the engine's step loop: requests join between steps once due."""
    start, timings, pending = time.perf_counter(), {}, list(zip(prompts, arrivals))
    while pending or engine.has_unfinished_requests():
        while pending and start + pending[0][1] <= time.perf_counter():
            prompt, arrival = pending.pop(0)
            timings[engine.add_request(prompt, params)] = RequestTiming(arrival=start + arrival)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0][1] - time.perf_counter()))
            continue
        for output in engine.step():
            timings[output.request_id].record(len(output.new_token_ids), time.perf_counter())
    return list(timings.values())


def shared_prefix(model, tokenizer, args, generator) -> str:
    prompts = shared_prefix_prompts(args.prefix_requests, args.prompt_tokens, args.prefix_fraction,
                                    tokenizer.vocab_size, generator)
    params = greedy(args.prefix_output_tokens)

    def work(engine):  # warmed up on other prompts: the shared prefix is not cached before the clock starts
        before = engine.num_tokens_computed
        seconds, _ = run_to_end(engine, prompts, params)
        return seconds, engine.num_tokens_computed - before

    plain, plain_computed = on_fresh_engine(model, tokenizer, args, generator, work, prefix_caching=False)
    cached, cached_computed = on_fresh_engine(model, tokenizer, args, generator, work, prefix_caching=True)
    tokens = args.prefix_requests * args.prefix_output_tokens
    return (f"RESULT teratron shared prefix {args.prefix_fraction:.0%} ({args.prefix_requests} requests "
            f"{args.prompt_tokens}/{args.prefix_output_tokens}): without prefix caching {plain:.2f} s "
            f"({tokens / plain:.0f} output tok/s, {plain_computed} tokens computed), with {cached:.2f} s "
            f"({tokens / cached:.0f} output tok/s, {cached_computed} tokens computed); "
            f"speed-up {plain / cached:.2f}x")


RUNS = {"a": offline_throughput, "b": batch1_decode, "c": poisson_serving, "d": shared_prefix}


# ------------------------------------------------------------------ anchors and report

_HF_LINE = re.compile(r"^RESULT hf (.+?): ([\d.]+) (?:output )?tok/s", re.M)
_OURS = re.compile(r"^RESULT teratron (offline throughput|batch-1 decode): ([\d.]+) ")
# (our workload, the HF line's label starts with, target ratio from issue 19 or None)
_ANCHORS = [("offline throughput", "static batched", 3.0), ("offline throughput", "continuous batching", 10.0),
            ("batch-1 decode", "batch-1 decode", None)]


def hf_results(log: str) -> dict:
    """{label: tok/s} of bench/hf_generate.py's RESULT lines."""
    return {label: float(value) for label, value in _HF_LINE.findall(log)}


def anchor_ratios(ours: list, hf: dict) -> list:
    """RESULT lines: teratron's tok/s over each HF anchor's measured in the same job."""
    mine = {m.group(1): float(m.group(2)) for m in map(_OURS.match, ours) if m}
    lines = []
    for workload, prefix, target in _ANCHORS:
        for label, theirs in hf.items():
            if workload in mine and label.startswith(prefix):
                goal = f" (target >= {target:g}x)" if target else ""
                lines.append(f"RESULT ratio teratron {workload} / hf {label}: {mine[workload] / theirs:.2f}x{goal}")
    return lines


def peak_memory(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a on the CPU"
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB allocated"


def copy_bandwidth(device: torch.device, roofline_tbs: float) -> str:
    """A device-to-device copy of 2 GiB, bytes read plus written over the median of 10 copies:
    the ceiling that the datasheet bandwidth of the rooflines compares with on this card."""
    source = torch.randint(0, 255, (2**31,), dtype=torch.uint8, device=device)
    target, times = torch.empty_like(source), []
    for _ in range(13):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    del source, target
    torch.cuda.empty_cache()
    return (f"RESULT device copy bandwidth: {2 * 2**31 / statistics.median(times[3:]) / 1e12:.2f} TB/s "
            f"(read + write; the rooflines use {roofline_tbs:g} TB/s)")


def describe(args, model, device) -> list:
    """The entry's details: the model, the engine's settings, the software."""
    name = "tiny (2 layers, hidden 64), fp32" if args.tiny else "benchmark shape, bf16"
    parameters = sum(p.numel() for p in model.parameters())
    return [f"model: {name}, random weights, {parameters / 1e6:.1f} M parameters ({weight_bytes(model) / 1e9:.3f} GB), "
            f"keys and values {kv_bytes_per_token(model)} bytes a token",
            f"engine: max_requests {args.max_requests}, buffer {args.buffer_size_gb:g} GiB, block {args.block_size}, "
            f"max_tokens_per_step {args.max_tokens_per_step}; device {device}, torch {torch.__version__}"]


def write_entry(path: str, args, model, device, lines: list) -> None:
    hardware = (f"{torch.cuda.get_device_name(device)} x 1" if device.type == "cuda"
                else f"CPU ({os.cpu_count()} cores)")
    table = ["| workload | result |", "|---|---|"] + ["| {} | {} |".format(*line.removeprefix("RESULT ").split(": ", 1)) for line in lines]
    command = "PYTHONPATH=. python bench/inference.py " + shlex.join(args.argv)
    with open(path, "a") as f:
        f.write(results_entry(command, hardware, describe(args, model, device), table))


class Report(list):
    """The RESULT lines so far, each printed as it comes."""

    def add(self, line: str) -> None:
        print(line, flush=True)
        self.append(line)


def run_workloads(args, model, device, report: Report) -> bool:
    """Each workload's RESULT line (a failure's too: one GPU job measures all it can), then the
    anchor's lines and ratios. Returns whether every workload ran."""
    tokenizer = NullTokenizer(model.unpadded_vocab_size or model.vocab_size)
    generator = torch.Generator().manual_seed(args.seed)
    if device.type == "cuda":
        report.add(copy_bandwidth(device, args.bandwidth_tbs))
    ran = True
    for workload in args.workloads:
        try:
            report.add(RUNS[workload](model, tokenizer, args, generator))
        except Exception as e:  # noqa: BLE001 - reported, and the next workload runs
            ran = False
            report.add(f"RESULT teratron ({workload}) {RUNS[workload].__name__} failed: "
                       f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
    if args.hf_results:
        with open(args.hf_results) as f:
            hf = hf_results(f.read())
        for line in [f"RESULT hf {label}: {value:.0f} tok/s" for label, value in hf.items()] + anchor_ratios(report, hf):
            report.add(line)
    return ran


class Stopped(SystemExit):
    """SIGTERM arrived: `timeout` ends a job that runs long so; what was measured is kept."""


def _stop(signum, frame):
    raise Stopped(128 + signum)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    torch.manual_seed(args.seed)
    model = build_model(args.tiny, device)
    report = Report()
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        ran = run_workloads(args, model, device, report)
    except Stopped:
        report.add("RESULT teratron stopped: SIGTERM (the job's timeout) before the workloads not listed above ended")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.results_md:
            write_entry(args.results_md, args, model, device, report)
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
