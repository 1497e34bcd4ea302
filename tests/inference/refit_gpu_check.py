"""refit_weights on CUDA tensors, one process per GPU under torchrun (run by test_refit.py's GPU
test over NCCL; `--backend gloo` runs it with every rank on the one GPU there is).

A TP = 2 bf16 model (built on the CPU from seed 7, moved to the GPU, its weights doubled: a change
any layout sees alike) is refitted into a TP = 1 fp32 model on every rank. Initialisation is
layout-invariant, so the expected weights are those of the TP = 1 model built from seed 7 in bf16,
doubled; the refitted model's logits must equal that model's on the GPU.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from teratron import parallel_state as ps
from teratron.inference.refit import refit_weights
from teratron.models.gpt.builder import build_gpt_model
from teratron.models.gpt.gpt_config import GPTModelConfig
from teratron.topology import Topology
from teratron.transformer.transformer_config import TransformerConfig


def config(tp: int, dtype: torch.dtype) -> GPTModelConfig:
    transformer = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                    ffn_hidden_size=96, gated_linear_unit=True, activation_func=F.silu,
                                    normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
                                    attention_dropout=0.0, tensor_model_parallel_size=tp, params_dtype=dtype,
                                    bf16=dtype == torch.bfloat16)
    return GPTModelConfig(transformer, vocab_size=100, max_position_embeddings=32, position_embedding_type="rope",
                          padded_vocab_size=128)


def main(backend: str) -> None:
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(backend)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(7)
    training = build_gpt_model(config(2, torch.bfloat16)).to(device)
    with torch.no_grad():
        for param in training.parameters():
            param.mul_(2)
    groups_of_one = Topology.build(tensor_model_parallel_size=1).pg_collection()
    torch.manual_seed(8)
    inference = build_gpt_model(config(1, torch.float32), pg_collection=groups_of_one).to(device).eval()
    refit_weights(inference, [training])

    torch.manual_seed(7)
    expected = build_gpt_model(config(1, torch.bfloat16), pg_collection=groups_of_one)
    with torch.no_grad():
        for param in expected.parameters():
            param.mul_(2)
    expected = expected.float().to(device).eval()
    want = expected.state_dict()
    for name, tensor in inference.state_dict().items():
        assert tensor.device == device, name
        assert torch.equal(tensor, want[name]), name
    tokens = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        assert torch.equal(inference(tokens, None), expected(tokens, None))
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"refit over {backend}: OK", flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl")
    main(parser.parse_args().backend)
