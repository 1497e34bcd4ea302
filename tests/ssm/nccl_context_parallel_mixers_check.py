"""Run under torchrun on 2 GPUs (test_context_parallel_mixers.py): Mamba-2's and Gated DeltaNet's
mixers at CP 2 over NCCL, on their Triton kernels in fp32, plain rows and packed documents: every
rank's output and input gradient against those rows of the mixer over the whole sequence on one GPU."""

import os

import torch
import torch.distributed as dist

from teratron.packed_seq_params import PackedSeqParams
from teratron.process_groups import ProcessGroupCollection
from teratron.ssm import GatedDeltaNet
from teratron.ssm.mamba_mixer import MambaMixer
from teratron.transformer.context_parallel import cp_token_index
from teratron.transformer.transformer_config import TransformerConfig

S, B, H = 1024, 2, 256


def _config():
    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
                             hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", mamba_state_dim=64,
                             mamba_head_dim=64, mamba_num_groups=2, linear_key_head_dim=64, linear_value_head_dim=64,
                             linear_num_key_heads=2, linear_num_value_heads=4)


def _mixer(kind, groups):
    torch.manual_seed(5)
    mixer = MambaMixer(_config(), pg_collection=groups) if kind == "mamba" else \
        GatedDeltaNet(_config(), pg_collection=groups)
    return mixer.cuda()


def _run(mixer, x, upstream, packed):
    x = x.clone().requires_grad_()
    out = mixer(x, attention_mask=packed)[0]
    out.backward(upstream)
    return out.detach(), x.grad


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, cp = dist.get_rank(), ProcessGroupCollection(cp=dist.new_group([0, 1]))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, upstream = (torch.randn(S, B, H, device="cuda", generator=gen) for _ in range(2))
    packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=torch.tensor([0, 300, 1024, 1500, 2048],
                                                                           dtype=torch.int32, device="cuda"))
    index = cp_token_index(S, 2, rank, device="cuda")
    failures = []
    for kind in ("mamba", "gated delta net"):
        for mask in (None, packed):
            expected, expected_dx = _run(_mixer(kind, ProcessGroupCollection()), x, upstream, mask)
            out, dx = _run(_mixer(kind, cp), x.index_select(0, index), upstream.index_select(0, index), mask)
            for what, got, wanted in (("out", out, expected), ("dx", dx, expected_dx)):
                wanted = wanted.index_select(0, index)
                if not torch.allclose(got, wanted, rtol=1e-4, atol=1e-4 * wanted.abs().max().item()):
                    failures.append(f"{kind} {'documents' if mask else 'rows'} {what}: "
                                    f"{(got - wanted).abs().max().item()}")
    dist.destroy_process_group()
    assert not failures, failures


if __name__ == "__main__":
    main()
