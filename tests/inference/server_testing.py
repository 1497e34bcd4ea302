"""Helpers of the server tests: a byte-level Hugging Face tokenizer with a chat template, a fake
engine that honours DynamicInferenceEngine's API, and a server running on 127.0.0.1 in a thread."""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from teratron.inference.server import serve

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB = 256 + len(SPECIAL_TOKENS)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_level_chars() -> list:
    """The character byte-level BPE writes for each byte: printable Latin-1 bytes stand for
    themselves, the others for chr(256), chr(257), ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def write_byte_tokenizer(folder, chat_template=CHATML) -> None:
    """A tokenizer.json whose id of a byte is its value (any text round-trips) plus SPECIAL_TOKENS
    (256, 257, 258), and a tokenizer_config.json naming the end-of-text token and holding
    `chat_template`."""
    chars = _byte_level_chars()
    assert sorted(chars) == sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(chars)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    _save(tokenizer, folder, chat_template)


WORDS = 256  # t0 .. t255
WORD_VOCAB = WORDS + len(SPECIAL_TOKENS) + 4  # and the chat roles and <unk>


def write_word_tokenizer(folder, chat_template=CHATML) -> None:
    """A tokenizer whose tokens are whole words "t0" .. "t255" (ids 0-255), SPECIAL_TOKENS
    (256-258), the chat roles and <unk>, decoded joined by spaces: unlike bytes, every token
    sequence has its own text, so comparing texts compares tokens."""
    words = [f"t{i}" for i in range(WORDS)] + list(SPECIAL_TOKENS) + ["user", "assistant", "system", "<unk>"]
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    _save(tokenizer, folder, chat_template)


def _save(tokenizer, folder, chat_template) -> None:
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


@dataclass
class FakeOutput:
    request_id: int
    prompt_token_ids: list
    token_ids: list = field(default_factory=list)
    new_token_ids: list = field(default_factory=list)
    text: str = ""
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    log_probs: list | None = None
    top_n_logprobs: list | None = None


LETTERS = "abcdefghijklmnopqrstuvwxyz"


class FakeEngine:
    """DynamicInferenceEngine's API with a made-up model: a request's k-th token is the letter
    LETTERS[(sum(prompt) + k) % 26], with log-probability -(k + 1) / 10 and its next letter as the
    runner-up. Stop strings end a request with the text cut before them. A prompt holding FAIL_ID
    makes the third step of its request raise; one longer than `max_prompt` is refused
    (ValueError)."""

    FAIL_ID = 7

    def __init__(self, tokenizer, step_seconds: float = 0.0, max_prompt: int = 1000):
        self.tokenizer, self.step_seconds, self.max_prompt = tokenizer, step_seconds, max_prompt
        self.requests = {}  # id -> (prompt ids, params, output)
        self.aborted, self.prompts, self.params = [], [], []
        self.next_id = 0
        self.steps = 0

    @staticmethod
    def letters(prompt_ids, count: int) -> str:
        return "".join(LETTERS[(sum(prompt_ids) + k) % 26] for k in range(count))

    def add_request(self, prompt_token_ids, sampling_params) -> int:
        if len(prompt_token_ids) > self.max_prompt:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; at most {self.max_prompt} fit")
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.requests[request_id] = (list(prompt_token_ids), sampling_params, FakeOutput(request_id, prompt_token_ids))
        self.prompts.append(list(prompt_token_ids))
        self.params.append(sampling_params)
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id) -> None:
        self.aborted.append(request_id)
        self.requests[request_id][2].finish_reason = "abort"

    def step(self) -> list:
        time.sleep(self.step_seconds)
        self.steps += 1
        if any(self.FAIL_ID in prompt and len(out.token_ids) == 2 and out.finish_reason != "abort"
               for prompt, _, out in self.requests.values()):
            raise RuntimeError("the fake engine fails on purpose")
        outputs = [dataclasses.replace(self._advance(request_id)) for request_id in list(self.requests)]
        for out in outputs:
            if out.finished:
                del self.requests[out.request_id]
        return outputs

    def _advance(self, request_id) -> FakeOutput:
        prompt, params, out = self.requests[request_id]
        if out.finish_reason == "abort":
            out.new_token_ids, out.new_text, out.finished = [], "", True
            return out
        k = len(out.token_ids)
        letter = LETTERS[(sum(prompt) + k) % 26]
        token = self.tokenizer.tokenize(letter)[0]
        out.new_token_ids = [token]
        out.token_ids = out.token_ids + [token]
        text = out.text + letter
        stops = [text.index(s) for s in params.stop if s in text]
        if stops:
            text, out.finished, out.finish_reason = text[:min(stops)], True, "stop"
        elif len(out.token_ids) == params.num_tokens_to_generate:
            out.finished, out.finish_reason = True, "length"
        out.new_text, out.text = text[len(out.text):], text
        if params.return_log_probs:
            runner_up = self.tokenizer.tokenize(LETTERS[(sum(prompt) + k + 1) % 26])[0]
            out.log_probs = (out.log_probs or []) + [-(k + 1) / 10]
            top = dict(list({token: -(k + 1) / 10, runner_up: -(k + 1) / 10 - 1}.items())[:params.top_n_logprobs])
            out.top_n_logprobs = (out.top_n_logprobs or []) + [top]
        return out


def default_ctrl_c() -> None:
    """Popen's preexec_fn for a server a test stops with SIGINT: a shell that starts the suite in
    the background (without job control) ignores SIGINT, and processes inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def running_server(app: web.Application):
    """Serve `app` (server.serve) on 127.0.0.1 at a free port from a thread of its own; yields the
    base URL and stops the server (and the app's engine) on exit."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server", daemon=True)
    thread.start()
    listening = concurrent.futures.Future()

    async def start():
        return asyncio.create_task(serve(app, "127.0.0.1", 0, listening.set_result))

    async def stop(task):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    serving = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
    try:
        host, port = listening.result(timeout=60)[0][:2]
        yield f"http://{host}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(stop(serving), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=60)
        loop.close()
