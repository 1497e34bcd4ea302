"""Tuning aid for the scan kernels (one GPU): forward + backward time of `ssd_triton` by chunk size
and tile side (MAX_BLOCK) at the kernel benchmark's and the hybrid model's shapes, and of
`gated_delta_rule_triton`, each next to another version of the same kernel module when given,
then a per-kernel CUDA time table of each.

    python bench/ssm_profile.py [--ssd-against OLD_SSD.py ...] [--rule-against OLD_RULE.py ...]
                                [--chunks 64 128] [--blocks 16 32]

e.g. `git show REV:teratron/ssm/ssd_triton.py > /tmp/ssd_old.py` for the kernels at REV (the
module is loaded from the file; it imports the rest of teratron as installed). Prints TIME lines
(ms per forward + backward), the largest output difference from the PyTorch path, and PROFILE
tables. `bench/ssm_bench.py` reports the issue's targets; this is for choosing tiles and
comparing versions.
"""

import argparse
import types

import torch

import ssm_bench as bench
from teratron.ssm import gated_delta_rule_triton, ssd_triton

SCAN_SHAPES = {  # label -> (batch, seq, heads, groups): head 64, state 128
    "bench 32x64 g1 1x8192": (1, 8192, 32, 1),
    "hybrid 64x64 g8 1x8192": (1, 8192, 64, 8),
    "hybrid 64x64 g8 4x2048": (4, 2048, 64, 8),
}


def load_module(path, name):
    """The kernel module at `path` as module `name`, its custom ops renamed into namespace `name`:
    registering an op under a name taken (teratron::ssd_scan) replaces the first module's
    implementation, and every version would run the last one loaded."""
    with open(path) as f:
        source = f.read().replace('"teratron::', f'"{name}::')
    module = types.ModuleType(name)
    module.__file__ = path
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def shape_args(batch=1, seq=8192, heads=32, groups=1, chunk=128):
    return types.SimpleNamespace(seq_length=seq, batch=batch, heads=heads, head_dim=64, d_state=128, groups=groups,
                                 chunk_size=chunk, rule_heads=32, rule_head_dim=128, warmup=3, iters=10)


def timed(label, step_of, args):
    try:
        ms, peak = bench.time_step(step_of(), args)
        print(f"TIME {label}: {ms:.3f} ms, peak {peak:.2f} GiB", flush=True)
    except Exception as error:  # a tile that does not fit, reported and skipped
        print(f"TIME {label}: failed ({str(error).splitlines()[0][:160]})", flush=True)


def profile(label, step):
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    print(f"PROFILE {label} (3 steps)", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=50), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ssd-against", action="append", default=[], metavar="FILE",
                        help="Another ssd_triton.py to time beside the current one (repeatable).")
    parser.add_argument("--rule-against", action="append", default=[], metavar="FILE",
                        help="Another gated_delta_rule_triton.py to time beside the current one (repeatable).")
    parser.add_argument("--rule-blocks", type=int, nargs="+", default=[],
                        help="MAX_BLOCK values of the current gated_delta_rule_triton to time beside its own.")
    parser.add_argument("--rule-state-rows", type=int, nargs="+", default=[],
                        help="STATE_ROWS values of the current gated_delta_rule_triton to time beside its own "
                             "(its LAUNCH sets the state passings' warps and stages).")
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128], help="The scan's chunk sizes to time.")
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 32], help="The scan's MAX_BLOCK values to time.")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ssm_profile: needs a CUDA GPU")
    torch.manual_seed(0)
    scans = {"current": ssd_triton}
    for i, path in enumerate(args.ssd_against):
        scans[path] = load_module(path, f"ssd_triton_against_{i}")
    for label, (batch, seq, heads, groups) in SCAN_SHAPES.items():
        for version, module in scans.items():
            default_block = module.MAX_BLOCK
            for chunk in args.chunks:
                for block in args.blocks:
                    module.MAX_BLOCK = block
                    shape = shape_args(batch, seq, heads, groups, chunk)
                    timed(f"ssd {label} {version} chunk {chunk} MAX_BLOCK {block}",
                          lambda: bench.scan_step(module.ssd_triton, shape), shape)
            module.MAX_BLOCK = default_block
    hybrid = shape_args(1, 8192, 64, 8)
    difference = bench.largest_difference(ssd_triton.ssd_triton, bench.ssd_chunked, bench.scan_inputs(hybrid), 128)
    print(f"DIFF ssd_triton vs ssd_chunked (hybrid shape, bf16): {difference:.2e} of the largest output", flush=True)
    profile("ssd hybrid 64x64 g8 1x8192 chunk 128", bench.scan_step(ssd_triton.ssd_triton, hybrid))

    rules = {"current": gated_delta_rule_triton}
    for i, path in enumerate(args.rule_against):
        rules[path] = load_module(path, f"gated_delta_rule_triton_against_{i}")
    rule, rule_batched = shape_args(), shape_args(batch=4, seq=2048)
    default_block = gated_delta_rule_triton.MAX_BLOCK
    for block in args.rule_blocks:
        gated_delta_rule_triton.MAX_BLOCK = block
        timed(f"gated delta rule 32x128 1x8192 current MAX_BLOCK {block}",
              lambda: bench.rule_step(gated_delta_rule_triton.gated_delta_rule_triton, rule), rule)
    gated_delta_rule_triton.MAX_BLOCK = default_block
    default_rows = gated_delta_rule_triton.STATE_ROWS
    for rows in args.rule_state_rows:
        gated_delta_rule_triton.STATE_ROWS = rows
        timed(f"gated delta rule 32x128 1x8192 current STATE_ROWS {rows}",
              lambda: bench.rule_step(gated_delta_rule_triton.gated_delta_rule_triton, rule), rule)
        timed(f"gated delta rule 32x128 4x2048 current STATE_ROWS {rows}",
              lambda: bench.rule_step(gated_delta_rule_triton.gated_delta_rule_triton, rule_batched), rule_batched)
    gated_delta_rule_triton.STATE_ROWS = default_rows
    for version, module in rules.items():
        timed(f"gated delta rule 32x128 1x8192 {version}", lambda: bench.rule_step(module.gated_delta_rule_triton, rule),
              rule)
    for version, module in rules.items():
        difference = bench.largest_difference(module.gated_delta_rule_triton, bench.gated_delta_rule_chunked,
                                              bench.rule_inputs(rule), bench.RULE_CHUNK)
        print(f"DIFF gated_delta_rule_triton {version} vs chunked (bf16 v): {difference:.2e} of the largest output",
              flush=True)
        profile(f"gated delta rule 32x128 1x8192 chunk 64 {version}",
                bench.rule_step(module.gated_delta_rule_triton, rule))


if __name__ == "__main__":
    main()
