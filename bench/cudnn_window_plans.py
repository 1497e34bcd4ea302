"""Every cuDNN execution plan of the sliding-window band (`cudnn_window_attention`), forward and
backward, timed at the sliding-window benchmark's shape (window 1,024 at 16,384, 16 heads x 128,
bf16): whether a plan other than the one teratron builds (heuristic A's first) is faster.

    python bench/cudnn_window_plans.py        (one GPU, the cuDNN frontend installed)

Prints PLANS <kind>: <count>, then one PLAN line per plan (ms per call, 20 calls after 3).
"""
import torch
from teratron.transformer import cudnn_window_attention as cwa

s, b, n, h, window = 16384, 1, 16, 128, 1024
cudnn = cwa._cudnn()
dev = torch.device("cuda")


def layer(shape_heads, dtype=torch.bfloat16):
    return torch.randn(s, b, shape_heads, h, device=dev, dtype=dtype).permute(1, 2, 0, 3)


q, k, v = layer(n), layer(n), layer(n)
out = cwa._like_layer(q, b, n, s, h); stats = cwa._stats_like(q)
dout = layer(n); dq, dk, dv = cwa._gradients_like(q, k, v)
scale = h ** -0.5
bound = cwa.left_bound(window, s)


def build_all(kind, tensors):
    io_type = cudnn.data_type.BFLOAT16
    graph = cudnn.pygraph(io_data_type=io_type, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=cwa._handle(dev))

    def described(name):
        t = tensors[name]
        return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()),
                            data_type=cudnn.data_type.FLOAT if t.dtype == torch.float32 else io_type)

    band = dict(attn_scale=scale, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                diagonal_band_left_bound=bound, diagonal_band_right_bound=0)
    if kind == "forward":
        inputs = {x: described(x) for x in ("q", "k", "v")}
        outputs = dict(zip(("o", "stats"), graph.sdpa(name="sdpa", **inputs, generate_stats=True, **band)))
    else:
        inputs = {x: described(x) for x in ("q", "k", "v", "o", "dO", "stats")}
        outputs = dict(zip(("dQ", "dK", "dV"), graph.sdpa_backward(name="sdpa_backward", **inputs,
                                                                  use_deterministic_algorithm=False, **band)))
    for name, output in outputs.items():
        t = tensors[name]
        output.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride()))
        if t.dtype == torch.float32:
            output.set_data_type(cudnn.data_type.FLOAT)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    return graph, {**inputs, **outputs}


for kind, tensors in (("forward", dict(q=q, k=k, v=v, o=out, stats=stats)),
                      ("backward", dict(q=q, k=k, v=v, o=out, dO=dout, stats=stats, dQ=dq, dK=dk, dV=dv))):
    graph, described = build_all(kind, tensors)
    pack = {described[x]: t for x, t in tensors.items()}
    count = graph.get_execution_plan_count()
    print(f"PLANS {kind}: {count}", flush=True)
    for i in range(count):
        try:
            ws = torch.empty(max(graph.get_workspace_size_plan_at_index(i), 1), device=dev, dtype=torch.uint8)
            for _ in range(3):
                graph.execute_plan_at_index(pack, ws, index=i, handle=cwa._handle(dev))
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.execute_plan_at_index(pack, ws, index=i, handle=cwa._handle(dev))
            stop.record(); torch.cuda.synchronize()
            name = graph.get_plan_name_at_index(i) if hasattr(graph, "get_plan_name_at_index") else "?"
            print(f"PLAN {kind} {i} {name}: {start.elapsed_time(stop) / 20:.4f} ms", flush=True)
        except Exception as e:
            print(f"PLAN {kind} {i}: failed {str(e).splitlines()[0][:150]}", flush=True)
