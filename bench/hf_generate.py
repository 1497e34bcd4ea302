# Copied verbatim from the project's shared material (../shared/bench/hf_generate.py): the Hugging Face generation anchor every inference benchmark runs in the same job; kept here because only the repository travels to the GPU machine.
"""Inference anchors on one GPU: Hugging Face transformers generation at the benchmark shape
(random bf16 weights), the way a user would run it. Prints one RESULT line per workload.
  (b) batch-1 decode: prompt 512, 256 new tokens, static cache + torch.compile
  (a) offline throughput: N requests of 512 prompt / 256 output tokens, static-cache batches of B
  (a') the same requests through transformers' continuous batching (generate_batch), if present"""
import os, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM, GenerationConfig
from transformers.generation import CompileConfig

L, H, FFN, NH, V = 24, 2048, 5632, 16, 50304
N, B, P, O = int(os.environ.get("N", 256)), int(os.environ.get("B", 64)), 512, 256
cfg = LlamaConfig(hidden_size=H, intermediate_size=FFN, num_hidden_layers=L, num_attention_heads=NH,
                  num_key_value_heads=NH, vocab_size=V, max_position_embeddings=4096, tie_word_embeddings=False)
torch.manual_seed(0)
model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.bfloat16).cuda().eval()
params = sum(p.numel() for p in model.parameters())
prompts = torch.randint(0, V, (N, P), device="cuda")
gen = dict(do_sample=False, min_new_tokens=O, max_new_tokens=O, pad_token_id=0, eos_token_id=None)

def timed(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); out = fn(); torch.cuda.synchronize()
    return out, time.perf_counter() - t

with torch.no_grad():
    # transformers compiles its decoding step when the cache is static and a CompileConfig is set
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    one = lambda: model.generate(prompts[:1], **gen)
    for _ in range(3): timed(one)
    _, t = timed(one)
    roof = 4.8e12 / (params * 2)
    print(f"RESULT hf batch-1 decode static+compile: {O / t:.0f} tok/s (incl. prefill); HBM roofline {roof:.0f} tok/s; ratio {O / t / roof:.2f}")
    batch = lambda i: model.generate(prompts[i:i + B], **gen)
    timed(lambda: batch(0))
    _, t = timed(lambda: [batch(i) for i in range(0, N, B)])
    print(f"RESULT hf static batched B={B}: {N * O / t:.0f} output tok/s ({N} requests {P}/{O}, {t:.1f} s)")
    if hasattr(model, "generate_batch"):
        try:
            model.generation_config.cache_implementation = None
            model.generation_config.compile_config = None
            cb = GenerationConfig(max_new_tokens=O, min_new_tokens=O, do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  num_blocks=4096, block_size=128, max_batch_tokens=8192)
            reqs = [p.tolist() for p in prompts]
            model.generate_batch(inputs=reqs[:8], generation_config=cb)
            _, t = timed(lambda: model.generate_batch(inputs=reqs, generation_config=cb))
            print(f"RESULT hf continuous batching generate_batch: {N * O / t:.0f} output tok/s ({t:.1f} s)")
        except Exception as e:
            print(f"RESULT hf continuous batching failed: {type(e).__name__}: {str(e)[:200]}")
    else:
        print("RESULT hf continuous batching: not in this transformers")
