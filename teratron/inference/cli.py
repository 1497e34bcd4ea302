"""`teratron generate` and `teratron serve`: a checkpoint's model, its tokenizer and the engine.

    teratron generate --load CKPT --prompt TEXT [--max-tokens N] [--temperature T] [--top-p P]
                      [--top-k K] [--seed S] [--stop STR ...]
    teratron serve --load CKPT [--host 127.0.0.1] [--port 8000]   (stops on Ctrl+C or SIGTERM)

Both take the checkpoint of `teratron train` or `teratron convert import-hf` (`load_for_inference`:
no tokenizer flags), `--bf16` / `--fp16` (default: the saved dtype), and Megatron's inference
flags for the engine (InferenceConfig; its defaults where not given):
`--inference-dynamic-batching-buffer-size-gb`, `--inference-dynamic-batching-block-size`,
`--inference-max-requests`, `--inference-max-seq-length`,
`--inference-dynamic-batching-prefix-caching`. Sampling defaults are SamplingParams'.
"""

import asyncio
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
}
# Flag dest -> SamplingParams field.
SAMPLING_FLAGS = {"max_tokens": "num_tokens_to_generate", "temperature": "temperature", "top_p": "top_p",
                  "top_k": "top_k", "seed": "seed", "stop": "stop"}


def _add_model_arguments(parser):
    parser.add_argument("--load", required=True,
                        help="Checkpoint: a `teratron train --save` folder (its latest iteration), an iter_* "
                             "folder, or a `teratron convert import-hf` folder.")
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


def _engine(args):
    """(DynamicInferenceEngine, tokenizer) of --load with the engine flags."""
    from teratron.inference.config import InferenceConfig
    from teratron.inference.engines.dynamic_engine import DynamicInferenceEngine
    from teratron.inference.loading import load_for_inference

    config = InferenceConfig(**_set_flags(args, ENGINE_FLAGS))  # before loading: bad flags fail fast
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    model, tokenizer = load_for_inference(args.load, dtype=dtype)
    return DynamicInferenceEngine(model, tokenizer, config), tokenizer


def run_generate(args) -> int:
    from teratron.inference.loading import generation_stop_token_ids
    from teratron.inference.sampling_params import SamplingParams

    params = SamplingParams(**_set_flags(args, SAMPLING_FLAGS), stop_token_ids=generation_stop_token_ids(args.load))
    engine, tokenizer = _engine(args)
    prompt_ids = tokenizer.tokenize(args.prompt)
    if not prompt_ids:
        raise ValueError(f"--prompt {args.prompt!r} tokenizes to no tokens; give text to continue")
    request_id = engine.add_request(prompt_ids, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                sys.stdout.write(output.new_text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def model_id(load: str) -> str:
    """The served model's name: its checkpoint folder's (the save directory's, given an iter_ folder)."""
    from teratron.dist_checkpointing import storage

    path = os.path.abspath(load)
    if path == os.path.abspath(storage.resolve_checkpoint_dir(load)) and os.path.basename(path).startswith("iter_"):
        path = os.path.dirname(path)
    return os.path.basename(path)


def run_serve(args) -> int:
    from teratron.inference.async_engine import AsyncInferenceEngine
    from teratron.inference.loading import generation_stop_token_ids, load_chat_template
    from teratron.inference.openai_api import ServedModel
    from teratron.inference.server import OpenAIServer, serve

    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in [1, 65535]")
    engine, tokenizer = _engine(args)
    served = ServedModel(model_id(args.load), tokenizer, engine.max_seq_length, load_chat_template(args.load),
                         generation_stop_token_ids(args.load))
    app = OpenAIServer(AsyncInferenceEngine(engine), served).build_app()
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
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
