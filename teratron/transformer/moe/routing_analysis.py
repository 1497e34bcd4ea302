"""`teratron analyze-routing`: MoE routing statistics of router replay recordings
(`save_router_replay` files, one per rank; several files pool their tokens).

Per MoE layer: each expert's share of the (token, top-k slot) assignments; how concentrated that
load is (entropy in bits, log2(experts) when even; the largest share; the Gini coefficient, 0 when
even); and, from each layer to the next MoE layer, how well a token's top-1 expert here predicts
its top-1 expert there, over the same tokens (the same forward calls): the conditional entropy
H(next | this) in bits next to H(next), and the accuracy of the best predictor (each expert here
mapped to the expert most of its tokens pick next). Top-1 is column 0 of the recorded [T, k]
(the router's top-k comes sorted by score)."""

import csv
import math
from collections import Counter

import torch

from teratron.transformer.moe.router_replay import load_router_replay


def load_recordings(paths) -> dict:
    """{layer_number: [T, k] of every call of every file, in call order}."""
    pooled = {}
    for path in paths:
        for layer, calls in load_router_replay(path).items():
            pooled.setdefault(layer, []).extend(calls)
    return {layer: torch.cat(calls) for layer, calls in sorted(pooled.items())}


def entropy_bits(counts) -> float:
    total = sum(counts)
    return -sum(c / total * math.log2(c / total) for c in counts if c)


def gini(shares) -> float:
    """Mean absolute difference over all ordered pairs / (2 x mean)."""
    n = len(shares)
    return sum(abs(a - b) for a in shares for b in shares) / (2 * n * sum(shares))


def expert_shares(indices: torch.Tensor, num_experts: int) -> list:
    counts = torch.bincount(indices.reshape(-1), minlength=num_experts)
    return (counts.double() / counts.sum()).tolist()


def transition(this_top1: torch.Tensor, next_top1: torch.Tensor) -> dict:
    """H(next), H(next | this) and the best predictor's accuracy for paired top-1 choices [T]."""
    if this_top1.shape != next_top1.shape:
        raise ValueError(f"consecutive layers recorded different token counts ({this_top1.numel()} vs "
                         f"{next_top1.numel()}); pass recordings of the same forward calls")
    pairs = Counter(zip(this_top1.tolist(), next_top1.tolist()))
    given = {}
    for (a, b), count in pairs.items():
        given.setdefault(a, []).append(count)
    total = this_top1.numel()
    return {"next_entropy_bits": entropy_bits(list(Counter(next_top1.tolist()).values())),
            "conditional_entropy_bits": sum(sum(c) / total * entropy_bits(c) for c in given.values()),
            "top1_prediction_accuracy": sum(max(c) for c in given.values()) / total}


def analyze(routing: dict, num_experts=None) -> list:
    """One row per layer: its load statistics and (but the last) the transition to the next."""
    if not routing:
        raise ValueError("the recordings hold no MoE layer; record with set_router_replay_action(RECORD)")
    num_experts = num_experts or 1 + max(int(indices.max()) for indices in routing.values())
    layers = sorted(routing)
    rows = []
    for i, layer in enumerate(layers):
        indices = routing[layer]
        shares = expert_shares(indices, num_experts)
        row = {"layer": layer, "tokens": indices.shape[0], "topk": indices.shape[1],
               "entropy_bits": entropy_bits(shares), "max_share": max(shares), "gini": gini(shares),
               "shares": shares}
        if i + 1 < len(layers):
            row.update(transition(indices[:, 0], routing[layers[i + 1]][:, 0]))
        rows.append(row)
    return rows


def table(rows) -> str:
    num_experts = len(rows[0]["shares"])
    lines = [f"{'layer':>5} {'tokens':>7} {'entropy':>8} {'(max ' + format(math.log2(num_experts), '.2f') + ')':>11} "
             f"{'max share':>9} {'gini':>6} | {'H(next)':>8} {'H(next|this)':>12} {'top-1 pred':>10}"]
    for r in rows:
        nxt = f"{'-':>8} {'-':>12} {'-':>10}"  # the last layer predicts nothing
        if "next_entropy_bits" in r:
            nxt = (f"{r['next_entropy_bits']:8.3f} {r['conditional_entropy_bits']:12.3f} "
                   f"{r['top1_prediction_accuracy']:10.3f}")
        lines.append(f"{r['layer']:5d} {r['tokens']:7d} {r['entropy_bits']:8.3f} {'':>11} {r['max_share']:9.3f} "
                     f"{r['gini']:6.3f} | {nxt}")
    return "\n".join(lines)


def write_csv(rows, path) -> None:
    """One row per layer: the statistics, then expert_<e> shares."""
    scalar = ["layer", "tokens", "topk", "entropy_bits", "max_share", "gini", "next_entropy_bits",
              "conditional_entropy_bits", "top1_prediction_accuracy"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(scalar + [f"expert_{e}" for e in range(len(rows[0]["shares"]))])
        for r in rows:
            writer.writerow([r.get(key, "") for key in scalar] + r["shares"])


def plot(rows, path) -> None:
    """A heat map of each layer's expert shares (PNG or any format matplotlib writes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 0.4 * len(rows[0]["shares"]) + 2), 0.4 * len(rows) + 1.5))
    image = ax.imshow([r["shares"] for r in rows], aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(rows)), [str(r["layer"]) for r in rows])
    ax.set_title("share of top-k assignments per expert")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_arguments(parser):
    parser.add_argument("recordings", nargs="+", help="router replay files (save_router_replay), one per rank")
    parser.add_argument("--num-moe-experts", type=int, default=None,
                        help="Experts per layer (default: the largest recorded index + 1).")
    parser.add_argument("--csv", default=None, help="Write the per-layer statistics and expert shares here.")
    parser.add_argument("--plot", default=None, help="Write a heat map of the expert shares here (e.g. routing.png).")
    return parser


def run(args) -> int:
    for path in args.recordings:
        try:
            open(path, "rb").close()
        except OSError as e:
            raise OSError(f"{path}: cannot read the recording ({e.strerror}); pass a save_router_replay file") from e
    rows = analyze(load_recordings(args.recordings), args.num_moe_experts)
    print(table(rows))
    if args.csv:
        write_csv(rows, args.csv)
    if args.plot:
        plot(rows, args.plot)
    return 0
