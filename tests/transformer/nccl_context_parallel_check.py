"""Run under torchrun on 2 GPUs (test_context_parallel_gpu.py): DotProductAttention at CP 2 over
NCCL with each of p2p, all_gather and a2a, plain and with packed documents, in bf16; every rank's
output and q, k, v gradients against those rows of fp32 attention over the whole sequence."""

import os

import torch
import torch.distributed as dist

from teratron.packed_seq_params import PackedSeqParams, document_ids
from teratron.process_groups import ProcessGroupCollection
from teratron.transformer import context_parallel as cp
from teratron.transformer.dot_product_attention import DotProductAttention
from teratron.transformer.transformer_config import TransformerConfig

S, B, HEADS, GROUPS, HN = 1024, 2, 8, 4, 64


def main():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, group = dist.get_rank(), dist.new_group([0, 1])
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(S, B, HEADS, HN, device="cuda", generator=gen)
    k, v = (torch.randn(S, B, GROUPS, HN, device="cuda", generator=gen) for _ in range(2))
    dout = torch.randn(S, B, HEADS * HN, device="cuda", generator=gen)
    packed = PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=torch.tensor([0, 300, 1024, 1500, 2048],
                                                                           dtype=torch.int32, device="cuda"))
    failures = []
    for mask in (None, packed):
        documents = document_ids(packed, B, S, "cuda") if mask is not None else torch.zeros(B, S, device="cuda")
        allowed = (documents[:, :, None] == documents[:, None, :]) & torch.ones(S, S, dtype=torch.bool,
                                                                                 device="cuda").tril()
        expected, grads = _reference(q, k, v, dout, allowed.unsqueeze(1))
        index = cp.cp_token_index(S, 2, rank, device="cuda")
        for comm_type in ("p2p", "all_gather", "a2a"):
            config = TransformerConfig(num_layers=1, hidden_size=HEADS * HN, num_attention_heads=HEADS,
                                       num_query_groups=GROUPS, attention_dropout=0.0, context_parallel_size=2,
                                       cp_comm_type=comm_type, bf16=True, params_dtype=torch.bfloat16)
            attention = DotProductAttention(config, 1, pg_collection=ProcessGroupCollection(cp=group))
            local = [t.index_select(0, index).to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
            out = attention(*local, mask)
            out.backward(dout.index_select(0, index).to(torch.bfloat16))
            got = [out] + [t.grad for t in local]
            wanted = [expected.index_select(0, index)] + [g.index_select(0, index) for g in grads]
            for what, a, b in zip(("out", "dq", "dk", "dv"), got, wanted):
                if not torch.allclose(a.float(), b, rtol=2e-2, atol=2e-2):
                    failures.append(f"{comm_type} {'documents' if mask else 'causal'} {what}: "
                                    f"{(a.float() - b).abs().max().item()}")
    dist.destroy_process_group()
    assert not failures, failures


def _reference(q, k, v, dout, allowed):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(HEADS // GROUPS, 1), vh.repeat_interleave(HEADS // GROUPS, 1)
    scores = (qh @ kh.transpose(-1, -2) / HN ** 0.5).masked_fill(~allowed, float("-inf"))
    out = (torch.softmax(scores, -1) @ vh).permute(2, 0, 1, 3).reshape(S, B, -1)
    out.backward(dout)
    return out.detach(), [q.grad, k.grad, v.grad]


if __name__ == "__main__":
    main()
