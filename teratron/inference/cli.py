"""`teratron generate` and `teratron serve`: a checkpoint's model, its tokenizer and the engine.

    teratron generate --load CKPT --prompt TEXT [--max-tokens N] [--temperature T] [--top-p P]
                      [--top-k K] [--seed S] [--stop STR ...]
    teratron serve --load CKPT [--host 127.0.0.1] [--port 8000]   (stops on Ctrl+C or SIGTERM)
    torchrun --nproc-per-node 2 -m teratron serve --load CKPT --tensor-model-parallel-size 2
    teratron generate --load CKPT --draft-load SMALL_CKPT --num-speculative-tokens 4 --prompt TEXT
    teratron generate --load MTP_CKPT --num-speculative-tokens 2 --prompt TEXT   (its MTP layers draft)

Both take the checkpoint of `teratron train` or `teratron convert import-hf` (`load_for_inference`:
no tokenizer flags), `--bf16` / `--fp16` (default: the saved dtype), and Megatron's inference
flags for the engine (InferenceConfig; its defaults where not given):
`--inference-dynamic-batching-buffer-size-gb`, `--inference-dynamic-batching-block-size`,
`--inference-max-requests`, `--inference-max-seq-length`,
`--inference-dynamic-batching-prefix-caching`, `--inference-dynamic-batching-max-tokens` (tokens a
step computes: chunked prefill), `--inference-dynamic-batching-num-cuda-graphs` (decode CUDA graphs;
0 for none). Sampling defaults are SamplingParams'.

Speculative decoding: `--draft-load` loads a draft model the same way as `--load` (its tokenizer
must be the target's) and `--num-speculative-tokens` (>= 1) sets the draft tokens verified per
step. Without `--draft-load` a checkpoint with multi-token-prediction layers (trained with
`--mtp-num-layers`) drafts for itself, one token per MTP depth at most (`MTPProposer`);
`--num-speculative-tokens` on another checkpoint needs `--draft-load`.

Tensor parallelism: `--tensor-model-parallel-size N` under torchrun with N processes, one per TP
rank (gloo on CPU, NCCL on CUDA: `parallel_state.initialize_distributed`, as `teratron train`).
Every rank runs the same engine calls, so every rank samples the same tokens. `generate`: every
rank generates, rank 0 prints. `serve`: rank 0 serves HTTP and drives its engine through a
`BroadcastingEngine`; the other ranks replay its calls (`run_follower`, ignoring SIGINT and
SIGTERM: they stop when rank 0 stops, or when it is gone). At TP 1 none of this runs.
"""

import asyncio
import contextlib
import ipaddress
import os
import signal
import sys

import torch

# Flag dest -> InferenceConfig field.
ENGINE_FLAGS = {
    "inference_dynamic_batching_buffer_size_gb": "buffer_size_gb",
    "inference_dynamic_batching_block_size": "block_size",
    "inference_max_requests": "max_requests",
    "inference_max_seq_length": "max_seq_length",
    "inference_dynamic_batching_prefix_caching": "prefix_caching",
    "inference_dynamic_batching_prefix_caching_mamba_gb": "prefix_caching_mamba_gb",
    "inference_dynamic_batching_mamba_memory_ratio": "mamba_memory_ratio",
    "inference_dynamic_batching_max_tokens": "max_tokens_per_step",
    "inference_dynamic_batching_num_cuda_graphs": "num_cuda_graphs",
    "num_speculative_tokens": "num_speculative_tokens",
}
# Flag dest -> SamplingParams field.
SAMPLING_FLAGS = {"max_tokens": "num_tokens_to_generate", "temperature": "temperature", "top_p": "top_p",
                  "top_k": "top_k", "seed": "seed", "stop": "stop"}


def _add_model_arguments(parser):
    parser.add_argument("--load", required=True,
                        help="Checkpoint: a `teratron train --save` folder (its latest iteration), an iter_* "
                             "folder, or a `teratron convert import-hf` folder.")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="Split the model over this many processes (launch with torchrun, one per rank).")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="Run the model in bfloat16.")
    precision.add_argument("--fp16", action="store_true", help="Run the model in float16.")
    engine = parser.add_argument_group("inference engine")
    engine.add_argument("--inference-dynamic-batching-buffer-size-gb", type=float, default=None,
                        help="KV-cache memory in GiB.")
    engine.add_argument("--inference-dynamic-batching-block-size", type=int, default=None,
                        help="Tokens per KV-cache block.")
    engine.add_argument("--inference-max-requests", type=int, default=None,
                        help="Requests running at once; more wait.")
    engine.add_argument("--inference-max-seq-length", type=int, default=None,
                        help="Longest prompt plus generated tokens of one request (default: the model's).")
    engine.add_argument("--inference-dynamic-batching-prefix-caching", action="store_true", default=None,
                        help="Share the KV cache of identical prompt prefixes between requests.")
    engine.add_argument("--inference-dynamic-batching-prefix-caching-mamba-gb", type=float, default=None,
                        help="With prefix caching on a hybrid model: GiB for the Mamba / Gated DeltaNet layers' "
                             "states at cached block boundaries (without it their requests reuse no prefix).")
    engine.add_argument("--inference-dynamic-batching-mamba-memory-ratio", type=float, default=None,
                        help="Hybrid models: the share of the buffer for the running requests' Mamba / Gated DeltaNet "
                             "states, which caps how many run (default: those of --inference-max-requests requests).")
    engine.add_argument("--inference-dynamic-batching-max-tokens", type=int, default=None,
                        help="Tokens one engine step computes, decode and prefill chunks together (chunked prefill).")
    engine.add_argument("--inference-dynamic-batching-num-cuda-graphs", type=int, default=None,
                        help="Decode steps replay CUDA graphs captured for up to this many batch sizes (-1: every "
                             "size up to --inference-max-requests; 0: none). CUDA only; not for MoE models.")
    engine.add_argument("--cache-mla-latents", action="store_true",
                        help="Multi-latent attention models: cache each token's latent instead of per-head keys and "
                             "values, attending with the up projections absorbed.")
    engine.add_argument("--batch-invariant-mode", action="store_true",
                        help="A request's tokens and log-probabilities do not depend on the requests batched with "
                             "it (GEMMs in fixed-shape row tiles; slower).")
    speculative = parser.add_argument_group("speculative decoding")
    speculative.add_argument("--draft-load", default=None,
                             help="Checkpoint of a draft model with the same tokenizer, loaded as --load is.")
    speculative.add_argument("--num-speculative-tokens", type=int, default=0,
                             help="Draft tokens proposed and verified per step (>= 1 with --draft-load); without "
                                  "it a checkpoint with MTP layers drafts with them (at most one per depth).")
    return parser


def add_generate_arguments(parser):
    _add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="Text to continue.")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=None, help="The most new tokens.")
    sampling.add_argument("--temperature", type=float, default=None, help="0 is greedy.")
    sampling.add_argument("--top-p", type=float, default=None, help="Nucleus sampling (1 keeps every token).")
    sampling.add_argument("--top-k", type=int, default=None, help="Sample among the k likeliest (0: all).")
    sampling.add_argument("--seed", type=int, default=None, help="Seed of the request's sampling.")
    sampling.add_argument("--stop", nargs="+", default=None, help="Strings that end the text.")
    return parser


def add_serve_arguments(parser):
    _add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address to listen on (default: this machine only; the API has no authentication).")
    parser.add_argument("--port", type=int, default=8000, help="TCP port.")
    return parser


def _set_flags(args, table: dict) -> dict:
    return {field: getattr(args, dest) for dest, field in table.items() if getattr(args, dest) is not None}


def _check_model_flags(args) -> None:
    from teratron.inference.loading import mtp_num_layers

    if args.tensor_model_parallel_size < 1:
        raise ValueError(f"--tensor-model-parallel-size {args.tensor_model_parallel_size} must be >= 1")
    if args.draft_load is None and args.num_speculative_tokens != 0 and not mtp_num_layers(args.load):
        raise ValueError(f"--num-speculative-tokens {args.num_speculative_tokens} needs a draft model: give "
                         "--draft-load CKPT, load a checkpoint with MTP layers (--mtp-num-layers), or leave the "
                         "flag out")
    if args.draft_load is not None and args.num_speculative_tokens < 1:
        raise ValueError(f"--draft-load needs --num-speculative-tokens N >= 1 (draft tokens per step), got "
                         f"{args.num_speculative_tokens}")


@contextlib.contextmanager
def _tensor_parallel(args):
    """torch.distributed and the TP groups for --tensor-model-parallel-size under torchrun (one
    process per TP rank); nothing at TP 1. Only what was started here is torn down."""
    from teratron import parallel_state

    tp, world = args.tensor_model_parallel_size, parallel_state.world_size_from_env()
    if world != tp:
        raise ValueError(f"--tensor-model-parallel-size {tp} with {world} process{'es' * (world > 1)}: inference "
                         f"runs one process per TP rank; launch `torchrun --nproc-per-node {tp}`")
    if tp == 1:
        yield
        return
    started = not torch.distributed.is_initialized()
    try:
        parallel_state.initialize_distributed()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if started:
            torch.distributed.destroy_process_group()


def _engine(args):
    """(DynamicInferenceEngine, tokenizer) of --load (and --draft-load) with the engine flags, at
    --tensor-model-parallel-size (inside `_tensor_parallel`)."""
    from teratron.inference.config import InferenceConfig
    from teratron.inference.engines.dynamic_engine import DynamicInferenceEngine
    from teratron.inference.loading import load_for_inference, same_vocabulary

    config = InferenceConfig(**_set_flags(args, ENGINE_FLAGS))  # before loading: bad flags fail fast
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    tp = args.tensor_model_parallel_size
    model, tokenizer = load_for_inference(args.load, tp, dtype=dtype, cache_mla_latents=args.cache_mla_latents,
                                          batch_invariant_mode=args.batch_invariant_mode)
    draft = None
    if args.draft_load is not None:
        draft, draft_tokenizer = load_for_inference(args.draft_load, tp, dtype=dtype, flag="--draft-load",
                                                    batch_invariant_mode=args.batch_invariant_mode)
        if not same_vocabulary(draft_tokenizer.fingerprint(), tokenizer.fingerprint()):
            raise ValueError(f"--draft-load {args.draft_load}: its tokenizer differs from --load's; a draft model "
                             "must use the target's tokenizer")
    return DynamicInferenceEngine(model, tokenizer, config, draft_model=draft), tokenizer


def run_generate(args) -> int:
    from teratron import parallel_state
    from teratron.inference.loading import generation_stop_token_ids
    from teratron.inference.sampling_params import SamplingParams

    _check_model_flags(args)
    params = SamplingParams(**_set_flags(args, SAMPLING_FLAGS), stop_token_ids=generation_stop_token_ids(args.load))
    with _tensor_parallel(args):
        engine, tokenizer = _engine(args)
        prompt_ids = tokenizer.tokenize(args.prompt)
        if not prompt_ids:
            raise ValueError(f"--prompt {args.prompt!r} tokenizes to no tokens; give text to continue")
        write = sys.stdout.write if parallel_state.get_tensor_model_parallel_rank() == 0 else lambda text: None
        request_id = engine.add_request(prompt_ids, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id:
                    write(output.new_text)
                    sys.stdout.flush()
        write("\n")
    return 0


def model_id(load: str) -> str:
    """The served model's name: its checkpoint folder's (the save directory's, given an iter_ folder)."""
    from teratron.dist_checkpointing import storage

    path = os.path.abspath(load)
    if path == os.path.abspath(storage.resolve_checkpoint_dir(load)) and os.path.basename(path).startswith("iter_"):
        path = os.path.dirname(path)
    return os.path.basename(path)


def run_serve(args) -> int:
    _check_model_flags(args)
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in [1, 65535]")
    with _tensor_parallel(args):
        engine, tokenizer = _engine(args)
        if args.tensor_model_parallel_size == 1:
            _serve(args, engine, tokenizer, engine)
        else:
            _serve_tensor_parallel(args, engine, tokenizer)
    return 0


def _serve_tensor_parallel(args, engine, tokenizer) -> None:
    """Rank 0 serves and broadcasts its engine calls; the other ranks follow them. A follower
    stops when rank 0 does, not on signals of its own (torchrun passes Ctrl+C to every rank)."""
    from teratron import parallel_state
    from teratron.inference.tensor_parallel_serving import BroadcastingEngine, EngineCallChannel, run_follower

    channel = EngineCallChannel(torch.distributed.get_process_group_ranks(
        parallel_state.get_tensor_model_parallel_group()))
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        ignored = {stop: signal.signal(stop, signal.SIG_IGN) for stop in (signal.SIGINT, signal.SIGTERM)}
        try:
            run_follower(engine, channel)
        finally:
            for stop, handler in ignored.items():
                signal.signal(stop, handler)
        return
    leader = BroadcastingEngine(engine, channel)
    try:
        _serve(args, engine, tokenizer, leader)
    finally:
        leader.shutdown()  # the followers stop too, however rank 0 stops


def _serve(args, engine, tokenizer, driven) -> None:
    """Serve the engine over HTTP until Ctrl+C or SIGTERM; `driven` is what AsyncInferenceEngine
    steps (the engine itself, or at TP > 1 rank 0's BroadcastingEngine over it)."""
    from teratron.inference.async_engine import AsyncInferenceEngine
    from teratron.inference.loading import generation_stop_token_ids, load_chat_template
    from teratron.inference.openai_api import ServedModel
    from teratron.inference.server import OpenAIServer, serve

    served = ServedModel(model_id(args.load), tokenizer, engine.max_seq_length, load_chat_template(args.load),
                         generation_stop_token_ids(args.load))
    app = OpenAIServer(AsyncInferenceEngine(driven), served).build_app()
    if not _is_loopback(args.host):
        print(f"NOTE: --host {args.host}: the API is open to the network without authentication", flush=True)

    def announce(addresses):
        chat = "on" if served.chat_template is not None else "off (the model has no chat template)"
        print(f"teratron serve: model '{served.model_id}' (context {served.max_sequence_length} tokens, chat "
              f"{chat}) at http://{args.host}:{args.port}/v1; Ctrl+C stops", flush=True)

    async def serve_until_terminated():
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
        await serve(app, args.host, args.port, announce)

    try:
        asyncio.run(serve_until_terminated())
    except asyncio.CancelledError:  # SIGTERM (a service manager stopping it): shut down cleanly
        print("teratron serve: stopped", flush=True)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
