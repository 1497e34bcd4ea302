"""Run under torchrun on 2 or 4 GPUs: the pipeline schedules over NCCL equal the single-GPU run.

    torchrun --nproc-per-node=4 tests/pipeline_parallel/nccl_pipeline_check.py

Cases whose TP x PP does not divide the number of GPUs are left out.
Same cases and checks as test_schedules.py (which runs them on CPU with gloo), here with CUDA
tensors, NCCL's batched p2p on its own streams, and deferred waits (overlap_p2p_comm).
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for dist.py

import test_schedules as T  # noqa: E402  (this folder is sys.path[0] when run as a script)

CASES = [
    (dict(num_layers=4, pipeline_model_parallel_size=2), dict(tied=True, per_token=True)),
    (dict(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          overlap_p2p_comm=True, batch_p2p_comm=False), {}),
    (dict(num_layers=4, pipeline_model_parallel_size=4), dict(tied=True, per_token=True)),
    (dict(num_layers=8, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
          overlap_p2p_comm=True, batch_p2p_comm=False), {}),
    (dict(num_layers=5, pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|t|tL",
          overlap_p2p_comm=True, batch_p2p_comm=False), dict(ddp=True)),
    (dict(num_layers=4, tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
          variable_seq_lengths=True), dict(tied=True)),
]


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    world = dist.get_world_size()
    data = T.make_data(world // 2 * T.NUM_MICROBATCHES)
    for config_kwargs, options in CASES:
        if world % (config_kwargs["pipeline_model_parallel_size"] * config_kwargs.get("tensor_model_parallel_size", 1)):
            continue
        result = T.pipelined_training(config_kwargs, data, device="cuda", **options)
        results = [None] * world
        dist.all_gather_object(results, result)
        if dist.get_rank() == 0:
            mp = config_kwargs["pipeline_model_parallel_size"] * config_kwargs.get("tensor_model_parallel_size", 1)
            ref_losses, ref_grads = T.reference({"num_layers": config_kwargs["num_layers"]},
                                                data[:, :world // mp * T.NUM_MICROBATCHES],
                                                tied=options.get("tied", False), device="cuda")
            T.check_against_reference(results, ref_losses, ref_grads)
            print(f"ok: {config_kwargs} {options}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
