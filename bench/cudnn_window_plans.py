"""Every cuDNN execution plan of the sliding-window band (`cudnn_window_attention`), forward and
backward, timed at the sliding-window benchmark's shape (window 1,024 at 16,384, 16 heads x 128,
bf16): whether a plan other than the one teratron builds (heuristic A's first) is faster.

    python bench/cudnn_window_plans.py        (one GPU, the cuDNN frontend installed)

Prints PLANS <kind>: <count>, then one PLAN line per plan (ms per call, 20 calls after 3).
"""
import torch

from teratron.transformer import cudnn_window_attention as cwa

SEQ, BATCH, HEADS, HEAD_DIM, WINDOW = 16384, 1, 16, 128, 1024


def layer_tensor():
    """[b, n, s, h] laid out [s, b, n, h], as the attention layer passes q, k and v."""
    return torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)


def built_with_every_plan(kind, tensors):
    """The band's graph as `cudnn_window_attention` describes it, built with every plan."""
    cudnn = cwa._cudnn()
    graph, described = cwa.operation_graph(kind, cwa.left_bound(WINDOW, SEQ), HEAD_DIM ** -0.5, False, tensors)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    return graph, described


def time_plan(graph, pack, index, handle):
    """ms per call of plan `index` (20 calls after 3)."""
    workspace = torch.empty(max(graph.get_workspace_size_plan_at_index(index), 1), device="cuda", dtype=torch.uint8)
    for _ in range(3):
        graph.execute_plan_at_index(pack, workspace, index=index, handle=handle)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.execute_plan_at_index(pack, workspace, index=index, handle=handle)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 20


def main():
    q, k, v, dout = (layer_tensor() for _ in range(4))
    out, stats = cwa._like_layer(q, BATCH, HEADS, SEQ, HEAD_DIM), cwa._stats_like(q)
    dq, dk, dv = cwa._gradients_like(q, k, v)
    handle = cwa._handle(q.device)
    for kind, tensors in (("forward", dict(q=q, k=k, v=v, o=out, stats=stats)),
                          ("backward", dict(q=q, k=k, v=v, o=out, dO=dout, stats=stats, dQ=dq, dK=dk, dV=dv))):
        graph, described = built_with_every_plan(kind, tensors)
        pack = {described[name]: t for name, t in tensors.items()}
        count = graph.get_execution_plan_count()
        print(f"PLANS {kind}: {count} (index 0: heuristic A's first, what teratron builds)", flush=True)
        for index in range(count):
            try:
                print(f"PLAN {kind} {index} {graph.get_plan_name_at_index(index)}: "
                      f"{time_plan(graph, pack, index, handle):.4f} ms", flush=True)
            except Exception as error:  # a plan that cannot run these tensors
                print(f"PLAN {kind} {index}: failed ({str(error).splitlines()[0][:150]})", flush=True)


if __name__ == "__main__":
    main()
