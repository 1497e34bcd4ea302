"""`teratron train`'s flags (Megatron `pretrain_gpt.py` names and defaults), parsed from the
command line and `--config` YAML.

    args = parse_train_args(argv)                               # flags over YAML over demo defaults
    run = run_config_from_args(args, world_size, vocab_size)    # training/config.py: typed, checked

`--config run.yaml` holds the same keys as the flags (dashes or underscores, no leading
`--`); flags on the command line override it. A switch is `key: true`; a YAML list gives a
many-value flag its values, and a one-value flag (`moe-layer-freq: [0, 1, 1]`) the list itself.
Without --data-path, --mock-data or --train-data-path, `teratron train` runs the embedded demo,
whose shape and schedule are defaults that flags and YAML still override. The parsed namespace
is only the input of `run_config_from_args`: the rules and derived values live in the configs.
"""

import argparse
import ast
import functools
import os

import yaml

from teratron.models.hybrid.hybrid_layer_allocation import HYBRID_SPECS_MODULE
from teratron.training import megatron_flags
from teratron.training.rerun import ERROR_INJECTION_TYPES, RERUN_MODES
from teratron.transformer.activation_offload import OFFLOAD_MODULES
from teratron.transformer.transformer_config import RECOMPUTE_MODULES

_DATA_SOURCE_FLAGS = ("data_path", "mock_data", "train_data_path", "valid_data_path", "test_data_path")


# The longest --moe-layer-freq list: checked before `[1] * N` is built.
_MAX_LAYER_PATTERN = 1 << 16


def moe_freq_type(text: str):
    """--moe-layer-freq as Megatron reads it: an int, or a Python list expression of 0/1 such as
    "[1,0,1,0]" or "([1]*3+[0])*2". Only int/list literals, `+`, `*` and parentheses are
    accepted: the expression is evaluated from its syntax tree, never by eval()."""
    text = str(text).strip()
    if "[" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is neither an int nor a list such as '[1,0,1,0]'") \
                from None
    try:
        value = _layer_pattern_value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as e:
        detail = e.msg if isinstance(e, SyntaxError) else str(e)
        raise argparse.ArgumentTypeError(f"{text!r}: {detail}; write a list of 0/1 built from [..], "
                                         "+ and * such as '([1]*3+[0])*2'") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list; write e.g. '[1,0,1,0]' or an int")
    return value


def _layer_pattern_value(node):
    """An int or a list of ints from an expression of int/list literals, + and *."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        items = [_layer_pattern_value(e) for e in node.elts]
        if any(isinstance(i, list) for i in items):
            raise ValueError("nested lists are not allowed")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _layer_pattern_value(node.left), _layer_pattern_value(node.right)
        lists = [v for v in (left, right) if isinstance(v, list)]
        if isinstance(node.op, ast.Add) and len(lists) == 1:
            raise ValueError("+ joins two lists or two ints")
        if isinstance(node.op, ast.Mult) and len(lists) == 2:
            raise ValueError("* repeats a list an int number of times")
        length = sum(len(v) for v in lists)
        if isinstance(node.op, ast.Mult) and lists:
            length *= max(right if lists[0] is left else left, 0)
        if length > _MAX_LAYER_PATTERN:
            raise ValueError(f"the pattern is longer than {_MAX_LAYER_PATTERN} layers")
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError(f"{ast.unparse(node)!r} is not allowed")


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so the CLI prints one line."""

    def error(self, message):
        raise ValueError(message)


def _add_network_args(parser):
    g = parser.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers.")
    g.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size.")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="MLP hidden size; default 4 * hidden (8/3 * hidden rounded down to 64 with --swiglu).")
    g.add_argument("--num-attention-heads", type=int, default=None, help="Number of attention heads.")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Per-head projection size; default hidden-size // num-attention-heads.")
    g.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="Key/value groups with --group-query-attention.")
    g.add_argument("--seq-length", "--encoder-seq-length", type=int, default=None,
                   help="Sequence length of a training sample (--encoder-seq-length: Megatron's other spelling).")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Size of the learned position table; default --seq-length.")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "yarn", "none"],
                   help="Position encoding (yarn: RoPE with YaRN, set by the --rotary-scaling-factor, --mscale "
                        "and --yarn-* flags).")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base.")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="Fraction of each head RoPE rotates.")
    g.add_argument("--rotary-interleaved", action="store_true", help="Rotate even/odd pairs (RoFormer style).")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x RoPE scaling (--position-embedding-type rope): long wavelengths divided by "
                        "--rope-scaling-factor, short ones kept, a blend between.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="Llama 3.x RoPE scaling factor.")
    g.add_argument("--rope-scaling-low-freq-factor", type=float, default=1.0,
                   help="Llama 3.x RoPE scaling: wavelengths over original / this are divided by the factor.")
    g.add_argument("--rope-scaling-high-freq-factor", type=float, default=4.0,
                   help="Llama 3.x RoPE scaling: wavelengths under original / this keep their frequency.")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=8192,
                   help="Llama 3.x RoPE scaling: the context length of the model before scaling.")
    g.add_argument("--use-rotary-position-embeddings", action="store_const", const="rope",
                   dest="position_embedding_type", help="Megatron's older spelling of --position-embedding-type rope.")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="No learned position table: allowed with --position-embedding-type rope, which has none "
                        "(Megatron's deprecated flag; use --position-embedding-type).")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"],
                   help="Normalisation layer.")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the norms.")
    g.add_argument("--apply-layernorm-1p", action="store_true", dest="layernorm_zero_centered_gamma",
                   help="Norm weights stored as gamma - 1 (zero-centred, so weight decay pulls them to 1).")
    g.add_argument("--fp32-residual-connection", action="store_true",
                   help="Keep the residual stream in fp32 (also between pipeline stages).")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                   help="Add the residual to the normed input instead of the input (BERT's order).")
    g.add_argument("--qk-layernorm", action="store_true", help="Normalise queries and keys per head.")
    g.add_argument("--attention-output-gate", action="store_true",
                   help="Gated attention (Qwen3-Next): each head's output times sigmoid of a gate projected with q.")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (gated SiLU).")
    g.add_argument("--quick-geglu", action="store_true",
                   help="Gated MLP with quick GELU, x * sigmoid(1.702 x) (gpt-oss's experts).")
    g.add_argument("--openai-gelu", action="store_true",
                   help="GELU's tanh approximation in the MLP (GPT-2's \"gelu_new\") instead of the exact GeLU.")
    g.add_argument("--squared-relu", action="store_true",
                   help="Squared ReLU, relu(x)^2, in the (ungated) MLP (Nemotron-H's \"relu2\").")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="No biases in the linear layers.")
    g.add_argument("--add-qkv-bias", action="store_true", help="Bias on the QKV projection only.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Separate input embedding and output layer weights.")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the vocabulary to a multiple of this times the TP size.")
    g.add_argument("--padded-vocab-size", type=int, default=None,
                   help="The padded vocabulary itself (at least the tokenizer's, a multiple of the TP size); "
                        "default from --make-vocab-size-divisible-by.")
    g.add_argument("--init-method-std", type=float, default=0.02, help="Std of the normal weight init.")
    g.add_argument("--embedding-init-method-std", type=float, default=None,
                   help="Std of the embedding's normal init; default --init-method-std.")
    g.add_argument("--no-initialization", action="store_false", dest="perform_initialization",
                   help="Leave the weights uninitialised (they come from --load).")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="Initialise the weights on the CPU, then move them to the device.")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout on hidden states.")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities.")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="Scale Q*K^T by 1/layer-number (fp16 stability).")
    g.add_argument("--no-attention-softmax-in-fp32", action="store_false", dest="attention_softmax_in_fp32",
                   help="Run the attention softmax in the compute dtype.")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", default=True,
                   help="Megatron's switch, accepted: the softmax runs in fp32 by default here.")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"],
                   help="Activation recomputation.")
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"],
                   help="Which layers --recompute-granularity full recomputes.")
    g.add_argument("--recompute-num-layers", type=int, default=None, help="Layers per recompute unit.")
    g.add_argument("--recompute-activations", action="store_const", const="selective", dest="recompute_granularity",
                   help="Megatron's older spelling of --recompute-granularity selective.")
    g.add_argument("--recompute-modules", nargs="+", default=None, choices=RECOMPUTE_MODULES, metavar="MODULE",
                   help="What --recompute-granularity selective recomputes: core_attn (default), mlp, layernorm, "
                        "moe, mla_up_proj.")
    g.add_argument("--fine-grained-activation-offloading", action="store_true",
                   help="Copy what --offload-modules save for backward to host memory, overlapped with compute.")
    g.add_argument("--offload-modules", nargs="+", default=None, choices=OFFLOAD_MODULES, metavar="MODULE",
                   help=f"Submodules whose saved activations are offloaded: {', '.join(OFFLOAD_MODULES)}.")
    g.add_argument("--min-offloaded-tensor-size", type=int, default=1024 * 1024,
                   help="Storages of fewer elements stay on the device.")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "flash", "fused", "unfused", "local"],
                   help="Core attention kernel: SDPA's choice, SDPA flash, SDPA cuDNN, or the reference path.")
    g.add_argument("--torch-compile", action="store_true", default=None,
                   help="torch.compile every transformer layer (fuses norms, RoPE, SwiGLU, residual adds); "
                        "the default on CUDA.")
    g.add_argument("--no-torch-compile", action="store_false", dest="torch_compile",
                   help="Eager layers (the default on CPU).")
    for flag, dest, what in (("--apply-rope-fusion", "apply_rope_fusion", "RoPE"),
                             ("--bias-swiglu-fusion", "bias_activation_fusion", "bias + activation (SwiGLU/GeLU)"),
                             ("--bias-dropout-fusion", "bias_dropout_fusion", "bias + dropout + residual add")):
        g.add_argument(flag, action="store_true", dest=dest, help=f"One compiled kernel for {what}.")
        g.add_argument(flag.replace("--", "--no-", 1).replace("apply-rope", "rope"), action="store_false",
                       dest=dest, help=argparse.SUPPRESS)
    g.add_argument("--bias-gelu-fusion", action="store_true", dest="bias_activation_fusion", help=argparse.SUPPRESS)
    g.add_argument("--gradient-accumulation-fusion", action="store_true", default=None,
                   help="Weight-gradient GEMMs add straight into the fp32 main_grad buffers (no bf16 dW pass); "
                        "the default on CUDA.")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false", dest="gradient_accumulation_fusion",
                   help="Weight gradients in the params dtype, added into main_grad by DDP's hook (the default "
                        "on CPU).")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="Fuse the output layer with the cross entropy (token chunks; no full logits).")
    g.add_argument("--cross-entropy-fusion-impl", default="native", choices=["native", "te"],
                   help="Fused cross entropy implementation; only 'native' is available.")

    _add_moe_args(parser)
    _add_hybrid_args(parser)
    _add_attention_variant_args(parser)
    _add_mla_args(parser)
    _add_mtp_args(parser)
    _add_qk_clip_args(parser)


def _add_mtp_args(parser):
    g = parser.add_argument_group("multi-token prediction")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="Multi-token-prediction depths (DeepSeek-V3's MTP), on the last pipeline stage; "
                        "depth k predicts the token k + 1 after each position.")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=None,
                   help="Weight of the MTP loss (its mean over depths) in the gradient; default 0.1.")
    g.add_argument("--freeze-base-model-for-mtp", action="store_true",
                   help="Train only the MTP layers; every other parameter stays as loaded.")


def window_size_type(text: str) -> tuple:
    """--window-size as Megatron reads it: two ints "LEFT,RIGHT", optionally in () or []."""
    parts = str(text).strip().strip("()[]").split(",")
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not two ints such as '4096,0'") from None


def _add_attention_variant_args(parser):
    g = parser.add_argument_group("attention and MLP variants")
    g.add_argument("--window-size", type=window_size_type, default=None, metavar="LEFT,RIGHT",
                   help="Sliding-window attention: a query sees LEFT keys before it (and RIGHT after it, "
                        "hidden anyway by the causal mask); -1 is unbounded.")
    g.add_argument("--window-attn-skip-freq", type=moe_freq_type, default=None,
                   help="Layers with full attention besides the windowed ones: N makes every N-th layer full, "
                        "or a 0/1 list per layer (1 = windowed) such as '([1]*3+[0])*2'.")
    g.add_argument("--softmax-type", default="vanilla", choices=["vanilla", "off-by-one", "learnable"],
                   help="Attention softmax: plain, with an extra zero logit, or with a learned logit per head "
                        "(an attention sink).")
    g.add_argument("--no-rope-freq", type=moe_freq_type, default=None,
                   help="NoPE layers (RoPE skipped): N skips it in every N-th layer, or a 0/1 list per layer "
                        "(1 = skip) such as '[0,0,0,1]*2'.")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="Gated MLPs: clamp the gate to at most this and the linear half to [-this, this] "
                        "(gpt-oss's clamped SwiGLU).")
    g.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="Gated MLPs: act(gate) * (linear + this) (1 for gpt-oss).")


# Multi-latent attention's flags and Megatron's defaults for them (the YaRN ones: None keeps
# MLATransformerConfig's); without --multi-latent-attention they must keep these values, except
# the YaRN ones (model_args.YARN_ARGS: flag dest -> field) with --position-embedding-type yarn.
MLA_FLAG_DEFAULTS = dict(q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                         rope_type=None, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
                         yarn_original_max_position_embeddings=None, yarn_beta_fast=None, yarn_beta_slow=None)


def _add_mla_args(parser):
    g = parser.add_argument_group("multi-latent attention and YaRN")
    d = MLA_FLAG_DEFAULTS
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="Multi-latent attention (DeepSeek-V2/V3): low-rank queries, keys and values, decoupled RoPE.")
    g.add_argument("--q-lora-rank", type=int, default=d["q_lora_rank"],
                   help="Rank of the query compression (None: queries projected straight from the hidden state).")
    g.add_argument("--kv-lora-rank", type=int, default=d["kv_lora_rank"], help="Rank of the key/value compression.")
    g.add_argument("--qk-head-dim", type=int, default=d["qk_head_dim"],
                   help="Per-head query/key size without the RoPE part.")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=d["qk_pos_emb_head_dim"],
                   help="Per-head size of the RoPE part of queries and keys (one RoPE key for all heads).")
    g.add_argument("--v-head-dim", type=int, default=d["v_head_dim"], help="Per-head value size.")
    g.add_argument("--rope-type", default=d["rope_type"], choices=["rope", "yarn"],
                   help="RoPE of MLA's positional part (default yarn).")
    g.add_argument("--rotary-scaling-factor", type=float, default=d["rotary_scaling_factor"],
                   help="YaRN's context-extension factor.")
    g.add_argument("--mscale", type=float, default=d["mscale"], help="YaRN mscale (scales the rotated channels).")
    g.add_argument("--mscale-all-dim", type=float, default=d["mscale_all_dim"],
                   help="YaRN mscale_all_dim (scales the rotated channels down and the softmax up).")
    g.add_argument("--yarn-original-max-position-embeddings", type=int,
                   default=d["yarn_original_max_position_embeddings"],
                   help="YaRN: context length of the original model (default 4096).")
    g.add_argument("--yarn-beta-fast", type=float, default=d["yarn_beta_fast"],
                   help="YaRN: RoPE pairs turning more often than this over the original length keep "
                        "their frequency (default 32).")
    g.add_argument("--yarn-beta-slow", type=float, default=d["yarn_beta_slow"],
                   help="YaRN: pairs turning less often than this are interpolated (default 1).")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help="YaRN of --position-embedding-type yarn: round the ramp's bounds out to whole pairs "
                        "(the default).")
    g.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int", help="Keep the ramp's bounds fractional (gpt-oss).")


def _add_qk_clip_args(parser):
    g = parser.add_argument_group("QK-clip and the max attention logit (teratron.optimizer.qk_clip)")
    g.add_argument("--qk-clip", action="store_true",
                   help="After each optimizer step, scale the query and key weights of every head whose largest "
                        "attention logit exceeded --qk-clip-threshold so that it would meet it (MuonClip); logs "
                        "the max logit.")
    g.add_argument("--qk-clip-alpha", type=float, default=0.5,
                   help="The query's share of the clip, in (0, 1): queries scale by eta**alpha, keys by "
                        "eta**(1-alpha), eta = threshold / max logit.")
    g.add_argument("--qk-clip-threshold", type=float, default=100, help="The largest attention logit a head keeps.")
    g.add_argument("--log-max-attention-logit", action="store_true",
                   help="Log the largest pre-softmax attention logit of the model (max_attention_logit in the "
                        "metrics file; the largest since the last log line) without clipping.")


def _add_hybrid_args(parser):
    g = parser.add_argument_group("hybrid models (teratron.models.hybrid; docs/hybrid.md)")
    g.add_argument("--hybrid-layer-pattern", "--hybrid-override-pattern", dest="hybrid_layer_pattern", default=None,
                   help="One symbol per layer: M Mamba-2, G Gated DeltaNet, * attention, - MLP, E MoE; '|' between "
                        "pipeline stages (e.g. 'M-M*-|M-M*-'). Sets --num-layers.")
    g.add_argument("--is-hybrid-model", action="store_true",
                   help="A hybrid model (Megatron's switch; the pattern implies it).")
    g.add_argument("--mamba-state-dim", type=int, default=128, help="Mamba-2 state size per group (N).")
    g.add_argument("--mamba-head-dim", type=int, default=64, help="Mamba-2 head size (P).")
    g.add_argument("--mamba-num-groups", type=int, default=8, help="Mamba-2 groups sharing B and C.")
    g.add_argument("--mamba-num-heads", type=int, default=None,
                   help="Mamba-2 heads; default 2 * hidden size / head size.")
    g.add_argument("--spec", nargs="+", default=None, metavar=("MODULE", "NAME"),
                   help="Megatron's layer-spec choice; teratron takes its two hybrid stacks: "
                        f"'{HYBRID_SPECS_MODULE} gdp_stack_spec' (the M layers are Gated Delta Product mixers) "
                        f"or '{HYBRID_SPECS_MODULE} hybrid_stack_spec' (Mamba-2, the default).")
    g.add_argument("--gdp-num-householder", type=int, default=3,
                   help="Gated Delta Product: rank-one state updates (Householder substeps) per token.")
    g.add_argument("--linear-conv-kernel-dim", type=int, default=4,
                   help="Gated DeltaNet: taps of the causal convolution over q, k, v.")
    g.add_argument("--linear-key-head-dim", type=int, default=128, help="Gated DeltaNet: query/key head size.")
    g.add_argument("--linear-value-head-dim", type=int, default=128, help="Gated DeltaNet: value head size.")
    g.add_argument("--linear-num-key-heads", type=int, default=16, help="Gated DeltaNet: query/key heads.")
    g.add_argument("--linear-num-value-heads", type=int, default=32,
                   help="Gated DeltaNet: value heads (a multiple of the key heads).")


def _add_moe_args(parser):
    g = parser.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None, help="Experts per MoE layer (None: dense MLP).")
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1,
                   help="Which layers are MoE: N makes every N-th layer from the first MoE, or a 0/1 list "
                        "per layer such as '[1,0,1,0]' or '([1]*3+[0])*2'.")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="Expert MLP hidden size; default --ffn-hidden-size.")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="Hidden size of the shared experts (None: none).")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="Run the shared experts after the router (Megatron's overlap order).")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="Scale the shared experts' output per token by a learned sigmoid gate (Qwen2-MoE).")
    g.add_argument("--moe-router-topk", type=int, default=2, help="Experts each token is routed to.")
    g.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"],
                   help="Router score function.")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="Softmax over all experts before the top-k (softmax scores).")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="Multiply the routing weights by this.")
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="Expert groups of group-limited routing.")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="Groups a token may choose experts from (group-limited routing).")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none",
                            "quantile_balancing"],
                   help="Load balancing; several types take one --moe-aux-loss-coeff each.")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                   help="Auxiliary loss weight, one per --moe-router-load-balancing-type.")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="Router z-loss weight.")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="Aux-loss-free balancing by a per-expert bias (sigmoid scores).")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3,
                   help="Step of the expert-bias update per iteration.")
    g.add_argument("--moe-router-quantile-balancing-ema", type=float, default=0.0,
                   help="EMA weight of the previous quantile-balancing bias (0: no memory).")
    g.add_argument("--moe-router-dtype", default=None, choices=["fp32", "fp64"],
                   help="Precision of the router logits and weights; default the compute dtype.")
    g.add_argument("--moe-input-jitter-eps", type=float, default=None,
                   help="Multiply the router input by U(1-eps, 1+eps) noise while training.")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="Random routing (benchmarks only).")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="Expert capacity as a multiple of the balanced load (None: dropless).")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Pad every expert's input to its capacity.")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"],
                   help="Which tokens an over-capacity expert keeps: highest weight or earliest.")
    g.add_argument("--moe-apply-probs-on-input", action="store_true",
                   help="Weight the expert input instead of its output (top-1).")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"],
                   help="How tokens reach their experts.")
    g.add_argument("--moe-grouped-gemm", action="store_true", help="Grouped GEMM over local experts.")
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="Recompute the MoE layers (deprecated in Megatron: --recompute-modules moe).")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="Log aux losses, tokens per expert and load imbalance of every MoE layer.")


def _add_parallel_args(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size.")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size.")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Layers per virtual stage (interleaved 1F1B); with an uneven first/last split, "
                        "of the evenly split stages.")
    g.add_argument("--virtual-pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
                   type=int, default=None, dest="virtual_pipeline_model_parallel_size",
                   help="Model chunks (virtual stages) per pipeline rank (interleaved 1F1B).")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   dest="microbatch_group_size_per_vp_stage",
                   help="Interleaved 1F1B: micro-batches run back to back on each virtual stage; "
                        "default the PP size.")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Layers on the first pipeline stage (uneven split).")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Layers on the last pipeline stage (uneven split).")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="Count the embedding as one layer of the first stage in the even split.")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="Count the loss (final norm + output layer) as one layer of the last stage.")
    g.add_argument("--pipeline-model-parallel-layout", default=None,
                   help="Layers of every (virtual) stage, e.g. 'Ett|tt|tmL' (E embedding, t layer, "
                        "m MTP layer, L loss, | between stages, x*N repeats); sets the number of "
                        "virtual stages.")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="CP size: every sequence split over this many ranks (attention exchanges keys/values).")
    g.add_argument("--cp-comm-type", nargs="+", default=None, choices=["p2p", "all_gather", "a2a", "a2a+p2p"],
                   help="Context-parallel attention exchange, one value or one per layer: p2p (ring; the default), "
                        "all_gather, a2a (Ulysses), a2a+p2p (with --hierarchical-context-parallel-sizes).")
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
                   help="a2a+p2p: the a2a group size, then the p2p ring size (their product is the CP size).")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP size.")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="TP size of the experts (default: --tensor-model-parallel-size).")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Shard norm/dropout activations along the sequence over TP.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard optimizer state over data-parallel ranks (ZeRO-1).")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="Shard params, grads and optimizer states over data parallelism with PyTorch FSDP2 "
                        "(optim_grads_params).")
    g.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                   dest="torch_fsdp2_reshard_after_forward",
                   help="--use-torch-fsdp2 keeps each layer's params gathered from forward to backward (optim_grads).")
    g.add_argument("--init-model-with-meta-device", action="store_true",
                   help="FSDP: build the model on the meta device and fill each rank's shards one layer at a time "
                        "(a model larger than one device).")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Shard over data parallelism as --data-parallel-sharding-strategy says (run on FSDP2).")
    g.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="--use-megatron-fsdp: no_shard (DDP), optim (the distributed optimizer), optim_grads, "
                        "optim_grads_params (FSDP2; params gathered per layer).")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="FSDP: hybrid sharding over this many instances (shard inside one, replicate across); "
                        "without FSDP only 1.")
    g.add_argument("--overlap-grad-reduce", action="store_true", help="Overlap the grad reduce with backward.")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="Overlap the param all-gather with forward (distributed optimizer).")
    g.add_argument("--ddp-bucket-size", type=int, default=None, help="Grad bucket size in elements.")
    g.add_argument("--ddp-copy-engine-collectives", action="store_true", dest="copy_engine_collectives",
                   help="Distributed optimizer on one NVLink node: reduce-scatter and all-gather by "
                        "copy-engine pulls from symmetric memory instead of NCCL kernels.")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="Average grads inside the collective.")
    g.add_argument("--ddp-pad-buckets-for-high-nccl-busbw", action="store_true",
                   dest="pad_buckets_for_high_nccl_busbw",
                   help="Pad grad buckets to a multiple of 2^16 x DP (faster NCCL at large DP).")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="fp32 grad buffers and reduction with bf16/fp16 params.")
    g.add_argument("--distributed-backend", default=None, choices=["nccl", "gloo"],
                   help="torch.distributed backend; default nccl on GPU, gloo on CPU.")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="Timeout of collectives.")


def _add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None, help="Samples per micro-batch per rank.")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per optimizer step; default micro-batch-size * data-parallel size.")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Grow the global batch from START by INCREMENT over SAMPLES samples.")
    g.add_argument("--train-iters", type=int, default=None, help="Optimizer steps to train.")
    g.add_argument("--train-samples", type=int, default=None,
                   help="Samples to train instead of --train-iters: its whole global batches (the schedule's "
                        "lengths are then --lr-*-samples).")
    g.add_argument("--seed", type=int, default=1234, help="Random seed (init, dropout, data order).")
    g.add_argument("--deterministic-mode", "--deterministic", action="store_true", dest="deterministic_mode",
                   help="Deterministic algorithms only (bit-reproducible CPU runs).")
    g.add_argument("--batch-invariant-mode", action="store_true",
                   help="A token's forward result does not depend on the rest of the batch (GEMMs in fixed-shape "
                        "row tiles; slower).")
    g.add_argument("--bf16", action="store_true", help="bf16 params and compute, fp32 master weights.")
    g.add_argument("--fp16", action="store_true", help="fp16 params and compute with loss scaling.")
    g.add_argument("--loss-scale", type=float, default=None, help="Static loss scale (fp16); default dynamic.")
    g.add_argument("--initial-loss-scale", type=float, default=2**32, help="Initial dynamic loss scale.")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="Minimum dynamic loss scale.")
    g.add_argument("--loss-scale-window", type=float, default=1000, help="Steps between loss-scale raises.")
    g.add_argument("--hysteresis", type=int, default=2, help="Overflows tolerated before lowering the scale.")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad",
                   help="Do not check the loss and grad norm for NaN/Inf (no re-run, no stop).")
    g.add_argument("--skip-nan-steps", action="store_true",
                   help="On a NaN/Inf loss skip the optimizer step instead of stopping.")
    g.add_argument("--rerun-mode", choices=RERUN_MODES, default="validate_results",
                   help="validate_results: re-run a step the checks reject, on the same data; continue if the "
                        "re-run differs and passes, else save and exit 16. report_determinism_stats (Megatron's "
                        "parser: report_stats): re-run every step and report the spread. disabled: no re-runs.")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="Re-run a step whose loss is 10x the largest of the first 100 (not fatal).")
    g.add_argument("--check-for-large-grads", action="store_true",
                   help="Re-run a step whose local gradient norm is 10x the largest of the first 100 (not fatal).")
    g.add_argument("--result-rejected-tracker-filename", default=None,
                   help="Append a line per rejected result and re-run verdict to this file (Megatron's format).")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="Tests: inject a fault into one validated step in this many (0: never).")
    g.add_argument("--error-injection-type", choices=ERROR_INJECTION_TYPES, default="transient_error",
                   help="The injected fault: transient_error (the re-run is clean), persistent_error (the re-run "
                        "fails too), correct_result (rejected, the re-run agrees).")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="Divide the step's summed loss by its tokens over all micro-batches and data-parallel "
                        "ranks (not the mean of micro-batch means).")

    g = parser.add_argument_group("CUDA graphs (docs/performance.md)")
    g.add_argument("--cuda-graph-impl", default="none", choices=["none", "local", "transformer_engine"],
                   help="CUDA graph capture: 'local' is teratron's own; 'transformer_engine' is refused.")
    g.add_argument("--cuda-graph-scope", default="full", choices=["full", "attn", "full_iteration"],
                   help="With 'local': 'full' captures each transformer layer, 'full_iteration' the forward "
                        "and backward of all micro-batches of a step.")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=3,
                   help="Eager training steps before the CUDA graphs are captured.")
    g.add_argument("--enable-cuda-graph", action="store_true",
                   help="Deprecated: --cuda-graph-impl local.")
    g.add_argument("--external-cuda-graph", action="store_true",
                   help="Deprecated: Transformer Engine graphs (refused).")


def _add_fp8_args(parser):
    g = parser.add_argument_group("FP8 linear layers (teratron.fp8; needs --bf16 or --fp16)")
    g.add_argument("--fp8-format", dest="fp8", default=None, choices=["e4m3", "hybrid"],
                   help="FP8 GEMMs in the transformer layers' linears: e4m3 everywhere, or hybrid "
                        "(e5m2 output gradients).")
    g.add_argument("--fp8-recipe", default="delayed", choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"],
                   help="Scaling: tensorwise (current amax) or delayed (amax history); the others are not supported.")
    g.add_argument("--fp8-margin", type=int, default=0, help="Scale = fp8_max / (amax * 2**margin).")
    g.add_argument("--fp8-interval", type=int, default=1, help="Deprecated and ignored (as in Megatron).")
    g.add_argument("--fp8-amax-history-len", type=int, default=1, help="Amax history length (delayed recipe).")
    g.add_argument("--fp8-amax-compute-algo", default="most_recent", choices=["most_recent", "max"],
                   help="Amax from the history: the most recent or the max (delayed recipe).")
    g.add_argument("--no-fp8-wgrad", "--disable-fp8-wgrad", action="store_false", dest="fp8_wgrad",
                   help="Weight gradients in the params dtype instead of FP8.")
    g.add_argument("--first-last-layers-bf16", action="store_true",
                   help="Keep the first and last transformer layers out of FP8.")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                   help="Leading layers kept in bf16 with --first-last-layers-bf16.")
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                   help="Trailing layers kept in bf16 with --first-last-layers-bf16.")
    g.add_argument("--tp-only-amax-red", action="store_true",
                   help="Reduce amaxes over TP only (teratron always does; see docs/performance.md).")


def _add_optimizer_args(parser):
    g = parser.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "lion", "muon"],
                   help="Optimizer (adam is AdamW).")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor of the decay.")
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"], help="Decay shape.")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Decay length; default --train-iters.")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="Linear warm-up steps.")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="Warm-up as a fraction of decay.")
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at the start of warm-up.")
    g.add_argument("--lr-wsd-decay-style", default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"], help="WSD's final decay.")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="Length of WSD's final decay.")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="Decay length in samples (with --train-samples); default --train-samples.")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="Linear warm-up samples (with --train-samples).")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="Length of WSD's final decay in samples (with --train-samples).")
    g.add_argument("--weight-decay", type=float, default=0.01, help="Weight decay.")
    g.add_argument("--start-weight-decay", type=float, default=None, help="Initial weight decay (increment).")
    g.add_argument("--end-weight-decay", type=float, default=None, help="Final weight decay (increment).")
    g.add_argument("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"],
                   help="How the weight decay moves from start to end.")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="On resume, follow this command line's schedule (lr, min lr, warm-up, decay, weight decay), "
                        "not the checkpoint's.")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler", action="store_true",
                   dest="use_checkpoint_opt_param_scheduler",
                   help="On resume, keep the checkpoint's schedule. Without either flag a schedule that differs "
                        "from the checkpoint's is refused.")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    g.add_argument("--clip-grad", type=float, default=1.0, help="Global grad-norm clip (0: off).")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="Separate peak learning rate for the input embedding and output layer.")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="Learning rate floor of --decoupled-lr; default --min-lr.")
    g.add_argument("--apply-wd-to-qk-layernorm", action="store_true",
                   help="Apply weight decay to the q/k layernorm weights too.")
    g.add_argument("--no-weight-decay-cond-type", default=None, choices=["apply_wd_to_qk_layernorm"],
                   help="Megatron's other spelling of --apply-wd-to-qk-layernorm.")
    g.add_argument("--lion-beta1", type=float, default=0.95, help="Lion: momentum/gradient interpolation.")
    g.add_argument("--lion-beta2", type=float, default=0.98, help="Lion: momentum EMA coefficient.")

    g = parser.add_argument_group("muon optimizer (--optimizer muon)")
    g.add_argument("--muon-momentum", type=float, default=0.9, help="Muon momentum.")
    g.add_argument("--muon-no-split-qkv", action="store_false", dest="muon_split_qkv",
                   help="Orthogonalise the fused QKV weight as one matrix instead of Q, K, V apart.")
    g.add_argument("--muon-use-nesterov", "--muon-nesterov", action="store_true", dest="muon_nesterov",
                   help="Nesterov momentum.")
    g.add_argument("--muon-scale-mode", default="spectral", choices=["spectral", "unit_rms_norm", "shape_scaling"],
                   help="How the orthogonalised update is scaled.")
    g.add_argument("--muon-fp32-matmul-prec", default="medium", choices=["medium", "high", "highest"],
                   help="Newton-Schulz precision: medium runs it in bf16, high/highest in fp32.")
    g.add_argument("--muon-num-ns-steps", type=int, default=5, help="Newton-Schulz iterations.")
    g.add_argument("--muon-coefficient-type", default="quintic", choices=["simple", "quintic", "polar_express"],
                   help="Newton-Schulz polynomial.")
    g.add_argument("--muon-tp-mode", default="blockwise", choices=["blockwise", "duplicated", "distributed"],
                   help="Tensor-parallel weights: each shard alone, the gathered matrix, or distributed.")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0, help="Extra factor on the update.")
    g.add_argument("--muon-scalar-optimizer", default="adam", choices=["adam", "lion"],
                   help="Optimizer of the params Muon leaves out (embeddings, output layer, 1-D).")

    g = parser.add_argument_group("optimizer CPU offload")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="Keep fp32 master weights and optimizer states on the CPU and step them there.")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="Fraction (by parameter count) offloaded with --optimizer-cpu-offload.")
    g.add_argument("--no-pin-cpu-params", action="store_false", dest="pin_cpu_params",
                   help="Offloaded master weights in pageable instead of pinned host memory.")


def _add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Dataset prefixes, optionally weighted: 'PREFIX' or 'W1 PREFIX1 W2 PREFIX2'.")
    g.add_argument("--split", default=None, help="Train/valid/test shares of --data-path, e.g. 969,30,1.")
    g.add_argument("--train-data-path", nargs="*", default=None, help="Training dataset prefixes.")
    g.add_argument("--valid-data-path", nargs="*", default=None, help="Validation dataset prefixes.")
    g.add_argument("--test-data-path", nargs="*", default=None, help="Test dataset prefixes.")
    g.add_argument("--mock-data", action="store_true", help="Synthetic data; no files needed.")
    g.add_argument("--data-cache-path", default=None, help="Where dataset indices are cached.")
    g.add_argument("--mid-level-dataset-surplus", type=float, default=0.005,
                   help="Extra share of samples each blended dataset builds, so the blend never runs out.")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="Read .bin files instead of memory-mapping them.")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes.")
    g.add_argument("--reset-position-ids", action="store_true", help="Restart positions after each EOD.")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="No attention across EOD (documents as packed sequences, no s x s mask; Mamba and Gated "
                        "DeltaNet layers start each document from zero states).")
    g.add_argument("--eod-mask-loss", action="store_true", help="No loss on EOD tokens.")
    g.add_argument("--sequence-packing", action="store_true",
                   help="Each document (cut to --seq-length) is a sample; a step's --global-batch-size samples are "
                        "balanced over the data-parallel ranks by tokens and packed into rows of --seq-length "
                        "without padding between them (THD). Needs --micro-batch-size 1 and "
                        "--calculate-per-token-loss.")


def _add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="Checkpoint folder to write.")
    g.add_argument("--save-interval", "--persistent-save-interval", type=int, default=None,
                   help="Iterations between checkpoints.")
    g.add_argument("--ckpt-format", default=None,
                   help="The layout --save writes: teratron (the default: every file's checksum, the model args, "
                        "tokenizer and RNG states recorded) or torch_dist (Megatron-LM's, which Megatron-LM loads; "
                        "docs/checkpoints.md).")
    g.add_argument("--overwrite", action="store_true",
                   help="Let --save write into a folder holding checkpoints of a run this one does not resume "
                        "(its saves replace them).")
    g.add_argument("--no-save-optim", action="store_true", help="Save without optimizer/scheduler state.")
    g.add_argument("--no-save-rng", action="store_true", help="Save without RNG states.")
    g.add_argument("--load", default=None, help="Checkpoint folder to resume from.")
    g.add_argument("--no-load-optim", action="store_true", help="Load without optimizer/scheduler state.")
    g.add_argument("--no-load-rng", action="store_true", help="Load without RNG states.")
    g.add_argument("--allow-tokenizer-change", action="store_true",
                   help="Load a checkpoint trained with another tokenizer or vocabulary size: the embedding and "
                        "output rows are padded or trimmed to this run's vocabulary (refused otherwise).")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="Stop with an error when --load holds no checkpoint (instead of starting from scratch).")
    g.add_argument("--finetune", action="store_true",
                   help="Load only the model weights and start at iteration 0.")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="Take the architecture flags from --load's checkpoint (a teratron or Megatron-LM save); a "
                        "flag given with another value than the checkpoint's is refused.")
    g.add_argument("--use-mp-args-from-checkpoint-args", action="store_true",
                   help="With --use-checkpoint-args: also the tensor-, pipeline-, virtual-pipeline- and "
                        "expert-parallel sizes the checkpoint was saved with.")
    g.add_argument("--async-save", action="store_true",
                   help="Write checkpoints on a background thread while training continues.")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Stop (after saving) at iterations divisible by this.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On SIGTERM, save and stop after the current iteration, without evaluating first.")
    g.add_argument("--watchdog-timeout", type=float, default=None,
                   help="Seconds a training step may run (the first step of a process excepted): past it, "
                        "each live rank names the ranks that stopped responding, prints its Python stack and "
                        "exits with status 124.")


def _add_logging_args(parser):
    g = parser.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines.")
    g.add_argument("--eval-interval", type=int, default=1000, help="Iterations between evaluations.")
    g.add_argument("--eval-iters", type=int, default=100, help="Batches per evaluation (0: no evaluation).")
    g.add_argument("--metrics-file", default=None, help="Append one JSON object per logged iteration and per evaluation.")
    g.add_argument("--tensorboard-dir", default=None, help="Write TensorBoard scalars here.")
    g.add_argument("--no-progress-bar", action="store_false", dest="progress_bar",
                   help="No tqdm progress bar (it only shows on a terminal anyway).")
    g.add_argument("--log-straggler", action="store_true",
                   help="Every log interval, log each rank's step time up to its gradient reduction and "
                        "name the slowest and fastest ranks.")
    g.add_argument("--straggler-minmax-count", type=int, default=1,
                   help="With --log-straggler: how many slowest and fastest ranks to name.")
    g.add_argument("--config-logger-dir", default="",
                   help="Write the run's whole configuration as JSON into this folder, one file per run.")
    g = parser.add_argument_group("OpenTelemetry (teratron.training.telemetry; pip install teratron[otel])")
    g.add_argument("--otel-enabled", action="store_true",
                   help="Export traces and metrics over OTLP (OTEL_EXPORTER_OTLP_ENDPOINT; default localhost).")
    g.add_argument("--otel-service-name", default=None,
                   help="The service name (default OTEL_SERVICE_NAME, else teratron).")
    g.add_argument("--otel-span-groups", default=None,
                   help="Comma list of span groups or presets: default (job, checkpoint, evaluate), per_step "
                        "(+ model_init, load_checkpoint, step, forward_backward, optimizer), all (+ microbatch).")


def _add_profiling_args(parser):
    g = parser.add_argument_group("profiling (teratron.training.profiling)")
    g.add_argument("--profile", action="store_true",
                   help="Profile iterations [--profile-step-start, --profile-step-end): nsys mode "
                        "(cudaProfilerStart/Stop) unless --use-pytorch-profiler.")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="With --profile: torch.profiler, writing a chrome trace and a kernel table to --profile-dir.")
    g.add_argument("--profile-step-start", type=int, default=10, help="First profiled iteration (1-based).")
    g.add_argument("--profile-step-end", type=int, default=12, help="The iteration profiling stops before.")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="Global ranks to profile.")
    g.add_argument("--profile-dir", default=None,
                   help="Where --use-pytorch-profiler writes; default <--tensorboard-dir>/profile.")


def _add_demo_args(parser):
    g = parser.add_argument_group("embedded demo (no data flags)")
    g.add_argument("--demo-dir", default=None,
                   help="Demo output folder: checkpoints, loss.png, samples.txt (default runs/demo).")
    g.add_argument("--demo-samples", type=int, default=None,
                   help="Lines the demo samples after training (default 4).")


def build_train_parser(prog="teratron train") -> ArgumentParser:
    from teratron.tokenizers import add_tokenizer_args

    parser = ArgumentParser(prog=prog, description="Pretrain a GPT model (Megatron pretrain_gpt.py flags).",
                            allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file of flag values; flags override it.")
    _add_network_args(parser)
    _add_parallel_args(parser)
    _add_training_args(parser)
    _add_fp8_args(parser)
    _add_optimizer_args(parser)
    _add_data_args(parser)
    add_tokenizer_args(parser)
    _add_checkpoint_args(parser)
    _add_logging_args(parser)
    _add_profiling_args(parser)
    _add_demo_args(parser)
    megatron_flags.add_megatron_flags(parser, set(parser._option_string_actions))
    return parser


# A --config file larger than this is not a run description.
_MAX_CONFIG_BYTES = 1 << 20


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors/aliases: a few hundred bytes of nested aliases expand to gigabytes."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError(f"alias *{self.peek_event().anchor} found; aliases are not allowed, write "
                                 "the values out")
        return super().compose_node(parent, index)


def config_file_to_argv(path: str, parser: ArgumentParser) -> list:
    """Turn a YAML mapping of flag names to values into command-line tokens."""
    try:
        if os.path.getsize(path) > _MAX_CONFIG_BYTES:
            raise ValueError(f"--config {path}: larger than {_MAX_CONFIG_BYTES} bytes; a run description "
                             "is a short mapping of flags")
        with open(path) as f:
            data = yaml.load(f, Loader=_NoAliasLoader)
    except FileNotFoundError:
        raise FileNotFoundError(f"--config {path}: no such file") from None
    except OSError as e:
        raise OSError(f"--config {path}: cannot read it ({e.strerror}); pass a YAML file") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    argv = []
    for key, value in data.items():
        option = flag(str(key).lstrip("-"))
        action = parser._option_string_actions.get(option)
        if action is None or option == "--config":
            raise ValueError(f"--config {path}: unknown key {key!r}; keys are flag names such as "
                             "num-layers or num_layers")
        if value is None:
            continue
        if action.nargs == 0:
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} is a switch; give true or false")
            if value:
                argv.append(option)
            elif action.default is None and "--no-" + option[2:] in parser._option_string_actions:
                argv.append("--no-" + option[2:])  # a switch whose default depends on the device: false turns it off
        elif isinstance(value, list) and action.nargs is None:
            argv += [option, str(value)]  # one value that is a list: --moe-layer-freq "[0, 1, 1]"
        elif isinstance(value, list):
            argv += [option] + [str(v) for v in value]
        else:
            argv += [option, str(value)]
    return argv


def demo_argv() -> list:
    """The embedded demo's run: a small GPT on the shipped English text, ~3 minutes on 2 cores."""
    return [
        "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--micro-batch-size", "16", "--global-batch-size", "16", "--train-iters", "600",
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.05",
        "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
        "--log-interval", "50", "--eval-interval", "200", "--eval-iters", "5",
        "--split", "98,2,0", "--num-workers", "0",
    ]


def parse_train_args(argv, defaults=None) -> argparse.Namespace:
    """Flags over --config YAML over `defaults` (flags too). `args.demo` says whether this is the
    demo run (no data flags given); its shape and schedule are the defaults unless `defaults` is
    given (`teratron estimate` passes [])."""
    parser = build_train_parser()
    first = parser.parse_args(argv)
    config_argv = config_file_to_argv(first.config, parser) if first.config else []
    given = parser.parse_args(config_argv + argv)
    demo = not any(getattr(given, name) for name in _DATA_SOURCE_FLAGS)
    if defaults is None:
        defaults = demo_argv() if demo else []
    if given.train_samples is not None and "--train-iters" in defaults:  # the length is given in samples
        i = defaults.index("--train-iters")
        defaults = defaults[:i] + defaults[i + 2:]
    args = parser.parse_args(list(defaults) + config_argv + argv) if defaults else given
    args.demo = demo
    if args.use_checkpoint_args or args.use_mp_args_from_checkpoint_args:
        _take_checkpoint_args(args, _explicit_dests(config_argv + argv))
    args.megatron_flags = megatron_flags.check(_megatron_flags_given(args))
    return args


def _explicit_dests(argv) -> frozenset:
    """The destinations `argv` sets itself (defaults aside)."""
    parser = build_train_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(parser.parse_args(argv)))


def _take_checkpoint_args(args, explicit: frozenset) -> None:
    """--use-checkpoint-args: the architecture flags (with --use-mp-args-from-checkpoint-args also the
    parallel sizes) become --load's checkpoint's. Megatron lets the checkpoint's values override the
    command line's with a log line; here a flag given with another value is refused, naming both."""
    from teratron.training.checkpoint_args import checkpoint_flag_values

    if not args.use_checkpoint_args:
        raise ValueError("--use-mp-args-from-checkpoint-args takes the parallel sizes along with the architecture; "
                         "add --use-checkpoint-args")
    if args.load is None:
        raise ValueError("--use-checkpoint-args takes the architecture flags from --load's checkpoint; add --load DIR")
    checkpoint_dir, taken = checkpoint_flag_values(args.load, args.use_mp_args_from_checkpoint_args)
    if explicit & {"num_layers_per_virtual_pipeline_stage", "pipeline_model_parallel_layout"}:
        taken.pop("virtual_pipeline_model_parallel_size", None)  # the command line's own split of the layers
    conflicts = [flag_values(dest, ("checkpoint", value), ("command line", getattr(args, dest)))
                 for dest, value in taken.items()
                 if dest in explicit and _contradicts(dest, value, getattr(args, dest), taken.get("num_layers"))]
    if conflicts:
        raise ValueError(f"--use-checkpoint-args: the command line contradicts --load {checkpoint_dir}: "
                         f"{'; '.join(conflicts)}; drop the conflicting flags (the checkpoint gives them)")
    for dest, value in taken.items():
        if dest not in explicit:
            setattr(args, dest, value)


def _contradicts(dest: str, saved, given, num_layers) -> bool:
    """Whether a flag given contradicts the checkpoint's value (lists and tuples alike; --moe-layer-freq
    by the layers it makes MoE; --spec by the M layers it builds). The position table's size may change
    and MTP layers may be added: the load checks and reports both."""
    from teratron.dist_checkpointing.model_args import canonical_moe_layer_freq
    from teratron.models.hybrid.hybrid_layer_allocation import gdp_layers_of_spec

    if dest == "max_position_embeddings" or (dest == "mtp_num_layers" and saved is None):
        return False
    if dest == "spec":  # None and Mamba-2's hybrid_stack_spec are the same layers
        return gdp_layers_of_spec(saved) != gdp_layers_of_spec(given)
    saved, given = (list(v) if isinstance(v, tuple) else v for v in (saved, given))
    if dest == "moe_layer_freq" and num_layers and saved != given:
        return canonical_moe_layer_freq(num_layers, saved) != canonical_moe_layer_freq(num_layers, given)
    return saved != given


def _megatron_flags_given(args) -> dict:
    """The Megatron-only flags given (spelling -> value), and teratron's own flags that the table
    notes (--ckpt-format) when given."""
    given = dict(args.megatron_flags or {})
    for flag_name, own_values in megatron_flags.OWN_FLAGS_WITH_NOTES.items():
        value = getattr(args, flag_name[2:].replace("-", "_"))
        if value is not None and value not in own_values:
            given[flag_name] = value
    return given


@functools.cache
def flags_by_dest() -> dict:
    """Each flag destination -> the flag that sets it (the positive spelling where a --no- twin
    exists: --torch-compile; --disable-bias-linear for add_bias_linear, whose only flag turns
    it off)."""
    flags = {}
    for action in build_train_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--") and (action.dest not in flags or flags[action.dest].startswith("--no-")):
                flags[action.dest] = option
                break
    return flags


@functools.cache
def inverted_dests() -> frozenset:
    """Destinations whose only flag sets them False (--disable-bias-linear, --no-mmap-bin-files)."""
    parser = build_train_parser()
    setting_true = {a.dest for a in parser._actions if not isinstance(a, argparse._StoreFalseAction)}
    return frozenset(a.dest for a in parser._actions
                     if isinstance(a, argparse._StoreFalseAction) and a.dest not in setting_true)


@functools.cache
def switch_dests() -> frozenset:
    """Destinations that only switches (flags taking no value) set: --swiglu, --disable-bias-linear."""
    actions = [a for a in build_train_parser()._actions if a.option_strings]
    valued = {a.dest for a in actions if a.nargs != 0}
    return frozenset(a.dest for a in actions if a.nargs == 0 and a.dest not in valued)


def flag_values(dest: str, *labelled) -> str:
    """A flag destination's values as the command line spells them:
    flag_values("num_layers", ("saved", 2), ("now", 4)) -> '--num-layers (saved 2, now 4)';
    flag_values("add_bias_linear", ("saved", False), ("now", True)) -> '--disable-bias-linear (saved on, now off)'."""
    shown = ", ".join(f"{label} {_flag_state(dest, value)}" for label, value in labelled)
    return f"{flags_by_dest().get(dest, dest)} ({shown})"


def _flag_state(dest: str, value) -> str:
    if isinstance(value, bool) and dest in switch_dests():
        return "on" if value != (dest in inverted_dests()) else "off"
    if value is None:
        return "unset"
    return str(list(value) if isinstance(value, tuple) else value)


def flag(name: str) -> str:
    """The command-line flag of a flag destination (and of the config field named like it):
    num_layers -> --num-layers."""
    return "--" + name.replace("_", "-")
