"""Writes the Megatron-written checkpoints of tests/dist_checkpointing/fixtures/megatron_core/ with
Megatron Core itself (not part of the test suite; the files it wrote are committed).

    git --git-dir=<Megatron-LM mirror> archive HEAD megatron | tar -x -C /tmp/mlm
    PYTHONPATH=/tmp/mlm python tests/dist_checkpointing/megatron/make_megatron_fixture.py OUT_DIR

On the CPU with gloo (Megatron Core's saver assumes a GPU in two places, shimmed below; needs
psutil). For TP 1 and TP 2 it builds Megatron's GPTModel (local layer spec: RMSNorm, SwiGLU, GQA,
RoPE, untied embeddings; and at TP 1 the same with MoE layers, `moe_tp1`, and with one
multi-token-prediction depth, `mtp_tp1`, whose logits it stores too as `mtp_logits`), saves it with `dist_checkpointing.save` the way Megatron-LM's
`save_checkpoint` lays out a torch_dist checkpoint (args, checkpoint_version and iteration beside
the model), and stores the logits of a fixed batch from Megatron's own forward (`logits.pt`), which
teratron must reproduce from the checkpoint.
"""

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, HEADS, GROUPS, FFN, LAYERS, VOCAB, SEQ = 32, 4, 2, 48, 2, 64, 8
# The MoE model: 4 experts of 24 on every layer, top-2 softmax routing (Megatron's SequentialMLP).
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_token_dispatcher_type="allgather")


def tokens() -> torch.Tensor:
    return torch.arange(2 * SEQ).view(2, SEQ) * 7 % VOCAB


def rank_main(rank: int, world: int, out: str, port: int, moe: bool = False, mtp: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.synchronize = lambda *a, **k: None  # the saver syncs the device
    torch.cuda.current_device = lambda: "cpu"      # and gathers its failure flags there
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel, gpt_model
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # the CUDA RNG tracker (dropout is 0)
    torch.manual_seed(1)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, ffn_hidden_size=FFN, use_cpu_initialization=True,
                               normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                               tensor_model_parallel_size=world, init_method_std=0.2,
                               **(MOE if moe else {}), **({"mtp_num_layers": 1} if mtp else {}))
    spec = get_gpt_layer_local_spec(num_experts=MOE["num_moe_experts"] if moe else None, normalization="RMSNorm")
    from megatron.core.transformer import multi_token_prediction
    # Without Transformer Engine its inference linears' check fails on TE's placeholder classes
    multi_token_prediction.is_inference_column_parallel_linear = lambda module: False
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp else None
    model = GPTModel(config, spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False, mtp_block_spec=mtp_spec)
    model.eval()
    depths = []  # the MTP depths' final hidden states [s, b, h], as Megatron's loss sees them
    process_mtp_loss = gpt_model.process_mtp_loss

    def keep_depths(hidden_states, **kwargs):
        depths.extend(torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)[1:])
        return process_mtp_loss(hidden_states, **kwargs)

    gpt_model.process_mtp_loss = keep_depths
    with torch.no_grad():
        ids = tokens()
        positions = torch.arange(SEQ).expand(2, SEQ)
        causal = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True = masked (Megatron's default mask is on CUDA)
        logits = model(ids, positions, causal)  # [b, s, V/tp]
        mtp_logits = [model.output_layer(h)[0].transpose(0, 1) for h in depths]  # [b, s, V/tp] each
    gpt_model.process_mtp_loss = process_mtp_loss
    gathered = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(gathered, logits)
    args = argparse.Namespace(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                              group_query_attention=True, num_query_groups=GROUPS, ffn_hidden_size=FFN,
                              seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB,
                              normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                              position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                              tensor_model_parallel_size=world, pipeline_model_parallel_size=1,
                              params_dtype=torch.float32, ckpt_format="torch_dist")
    name = f"moe_tp{world}" if moe else f"mtp_tp{world}" if mtp else f"tp{world}"
    folder = os.path.join(out, name, "iter_0000005")
    os.makedirs(folder, exist_ok=True)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 5, "model": model.sharded_state_dict()}
    dist_checkpointing.save(state, folder)
    if rank == 0:
        with open(os.path.join(out, name, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("5")
        batch = {"tokens": ids, "logits": torch.cat(gathered, dim=-1)}
        if mtp:  # at TP 1: the whole vocabulary
            batch["mtp_logits"] = torch.stack(mtp_logits)  # [depths, b, s, V]
        torch.save(batch, os.path.join(out, name, "logits.pt"))
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1]
    for world, port, moe, mtp in ((1, 29561, False, False), (2, 29562, False, False), (1, 29563, True, False),
                                  (1, 29564, False, True)):
        mp.spawn(rank_main, args=(world, out, port, moe, mtp), nprocs=world)
    with open(os.path.join(out, "SOURCE.json"), "w") as f:
        json.dump({"writer": "megatron.core dist_checkpointing.save (tests/dist_checkpointing/megatron/"
                             "make_megatron_fixture.py)", "megatron_lm_commit": "d98e8a64dd"}, f, indent=1)


if __name__ == "__main__":
    main()
