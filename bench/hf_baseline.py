# Copied unchanged from the project's shared material (../shared/bench/hf_baseline.py), the
# Hugging Face baseline of ARCHITECTURE.md's performance anchors; kept in the repository because
# only the repository travels to the GPU machine. `teratron bench` runs it with COMPILE=1 and
# MBS/ACC/STEPS set to its own batch layout.
"""Baseline: Hugging Face transformers Llama trained the way most users would (bf16 autocast,
fused AdamW, SDPA attention), on the benchmark shape of ARCHITECTURE.md. Run on one CUDA GPU:

    python hf_baseline.py            # eager
    COMPILE=1 python hf_baseline.py  # torch.compile

Prints tokens/s and TFLOP/s using 8.62 GFLOP/token, which is what Megatron's own formula gives for
this shape, so the figures compare directly with Megatron-style TFLOP/s/GPU logs."""
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

L, H, FFN, NH, V, S = 24, 2048, 5632, 16, 50304, 2048
MBS, ACC = int(os.environ.get("MBS", 4)), int(os.environ.get("ACC", 8))
STEPS, WARM = int(os.environ.get("STEPS", 8)), 2
FLOP_PER_TOKEN = 8.62e9
COMPILE = os.environ.get("COMPILE", "0") == "1"

cfg = LlamaConfig(hidden_size=H, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=NH,
                  num_key_value_heads=NH, vocab_size=V, max_position_embeddings=S,
                  tie_word_embeddings=False)
torch.manual_seed(0)
model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").cuda()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
fwd = torch.compile(model) if COMPILE else model


def step():
    for _ in range(ACC):
        x = torch.randint(0, V, (MBS, S), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(input_ids=x, labels=x).loss
        (loss / ACC).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(WARM):
    step()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(STEPS):
    step()
torch.cuda.synchronize()
dt = (time.perf_counter() - t0) / STEPS
tok_s = MBS * ACC * S / dt
print(f"hf_baseline compile={COMPILE} tokens/s={tok_s:.0f} TFLOP/s={tok_s * FLOP_PER_TOKEN / 1e12:.1f} "
      f"MFU={tok_s * FLOP_PER_TOKEN / 989e12:.3f} peak_mem_GiB={torch.cuda.max_memory_allocated() / 2**30:.1f}")
