"""Measure what autograd keeps for one micro-batch, to check the activation model on a device.

    python -m teratron.estimate.measure [teratron train flags]

builds the model exactly as `teratron train` does (one process, the current device: CUDA when
present; with --torch-compile the layers compiled, their autograd functions saving through the
same hooks), runs one training micro-batch forward under `saved_tensors_hooks` and prints the
bytes of the distinct storages autograd keeps (parameters excluded) next to the estimate's bytes
for that micro-batch with the device's probed kernels. The tests run it on CPU; on a GPU it checks
the CUDA kernels' assumptions at full size.

With --fine-grained-activation-offloading the count is what stays on the device: the offloader
hands the tensors it leaves in place to the enclosing hooks (these), and
`transformer.activation_offload.stats` holds what it copied to the host.
"""

import sys
import weakref

import torch


def saved_activation_bytes(run, device: torch.device) -> int:
    """Bytes of the storages autograd keeps after one micro-batch forward through the model of
    `run` (a RunConfig without pipeline parallelism: first stage = last stage; under context
    parallelism this rank's tokens)."""
    from teratron.models.gpt.builder import build_gpt_model
    from teratron.process_groups import get_pg_rank, get_pg_size
    from teratron.tensor_parallel import model_parallel_cuda_manual_seed
    from teratron.transformer.context_parallel import cp_token_index
    from teratron.transformer.torch_compile import compile_transformer_layers

    training = run.training
    torch.manual_seed(training.seed)
    model = build_gpt_model(run.model).to(device)
    if training.torch_compile:  # as `teratron train` does; hooks see what the compiled layers save
        torch._dynamo.reset()  # what earlier models compiled (their sizes would make these dynamic)
        compile_transformer_layers(model)
    model_parallel_cuda_manual_seed(training.seed)
    model.train()
    saved = []

    def pack(t):
        saved.append(weakref.ref(t))
        return t

    cp = model.pg_collection.cp  # under context parallelism: this rank's tokens
    positions = cp_token_index(training.seq_length, get_pg_size(cp), get_pg_rank(cp), device=device)
    positions = positions.repeat(training.micro_batch_size, 1)
    ids = torch.randint(0, run.model.vocab_size, positions.shape, device=device,
                        generator=torch.Generator(device).manual_seed(training.seed))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, positions, None, labels=ids)
    # What the graph still holds (side branches autograd already dropped are gone), by storage.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (ref() for ref in saved) if t is not None}
    loss.sum().backward()
    return sum(n for ptr, n in storages.items() if ptr not in params)


def main(argv=None) -> int:
    from teratron.estimate.report import estimate_from_run, resolve_vocab_size
    from teratron.training.arguments import parse_train_args
    from teratron.training.config import run_config_from_args
    from teratron.transformer.activation_offload import stats

    args = parse_train_args(sys.argv[1:] if argv is None else argv)
    args.lr = args.lr or 0.0
    if args.train_samples is None:
        args.train_iters = args.train_iters or 1
    if args.pipeline_model_parallel_size != 1 or args.tensor_model_parallel_size != 1:
        raise ValueError("measure runs one process: drop --tensor/--pipeline-model-parallel-size "
                         "(tests/estimate measure TP ranks under gloo)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    run = run_config_from_args(args, 1, resolve_vocab_size(args), cuda=device.type == "cuda")
    stats.reset()
    measured = saved_activation_bytes(run, device)
    estimated = estimate_from_run(run, device.type).stages[0].chunk_activations[0]
    print(f"activations of one micro-batch on {device.type}: measured {measured / 2**30:.4f} GiB, "
          f"estimated {estimated / 2**30:.4f} GiB ({(estimated - measured) / measured:+.2%})")
    if stats.offloaded:
        print(f"offloaded to the host: {sum(stats.offloaded.values()) / 2**30:.4f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
