"""One decoder layer of each kind of the hybrid benchmark (bench/hybrid_bench.sh), compiled as
`--torch-compile` compiles it, forward + backward alone: where a hybrid iteration's time goes.

    python bench/hybrid_layer_profile.py [--seq-length 2048] [--micro-batch-size 4] [--kinds M - *]
                                         [--profile]

Layers: `M` the Mamba-2 layer (norm + mixer), `-` the MLP layer, `*` the attention layer, `D` the
dense benchmark model's layer (attention + MLP), all at the benchmark model's sizes (hidden 2,048,
16 heads, SwiGLU 5,632; Mamba state 128, head 64, 8 groups), bf16. Prints a RESULT line per
layer (ms per forward + backward, the median of --repeats timings of --iters steps each) and, with
--profile, the layer's kernels by device time. The weights' gradients accumulate in plain autograd
(the benchmark's --gradient-accumulation-fusion is not modelled).
"""

import argparse
import statistics

import torch

from teratron.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from teratron.models.hybrid.hybrid_layer_specs import hybrid_layer_specs
from teratron.transformer.rope import RotaryEmbedding
from teratron.transformer.spec_utils import build_module
from teratron.transformer.transformer_config import TransformerConfig


def config(pattern: str):
    return TransformerConfig(
        num_layers=len(pattern), hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=16,
        hybrid_layer_pattern=pattern if pattern != "D" else None, mamba_state_dim=128, mamba_head_dim=64,
        mamba_num_groups=8, normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)


def build(kind: str):
    """One layer of `kind` ('M', '-', '*' or 'D'), on the GPU, compiled."""
    cfg = config(kind)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm") if kind == "D" else hybrid_layer_specs(cfg)[0]
    layer = build_module(spec, config=cfg, layer_number=1).cuda()
    layer.compile()
    return layer


def step_of(layer, args):
    hidden = torch.randn(args.seq_length, args.micro_batch_size, 2048, device="cuda", dtype=torch.bfloat16,
                         requires_grad=True)
    upstream = torch.randn_like(hidden)
    positions = torch.arange(args.seq_length, device="cuda")[None]
    rotary = RotaryEmbedding(kv_channels=128).cuda()(positions)  # what the attention layers get (RoPE)

    def step():
        out, _ = layer(hidden, rotary_pos_emb=rotary)
        out.backward(upstream)
        hidden.grad = None

    return step


def time_step(step, args) -> float:
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    timings = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            step()
        end.record()
        torch.cuda.synchronize()
        timings.append(start.elapsed_time(end) / args.iters)
    return statistics.median(timings)


def profile(step, name: str, rows: int):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(f"PROFILE {name} (3 steps)", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=90), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--kinds", nargs="+", default=["M", "-", "*", "D"])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hybrid_layer_profile: needs a CUDA GPU")
    torch.manual_seed(0)
    names = {"M": "Mamba-2 layer", "-": "MLP layer", "*": "attention layer", "D": "dense layer (attention + MLP)"}
    for kind in args.kinds:
        step = step_of(build(kind), args)
        ms = time_step(step, args)
        print(f"RESULT {names[kind]}: {ms:.3f} ms forward+backward (seq {args.seq_length}, micro-batch "
              f"{args.micro_batch_size}, bf16, {torch.cuda.get_device_name()})", flush=True)
        if args.profile:
            profile(step, names[kind], args.rows)


if __name__ == "__main__":
    main()
