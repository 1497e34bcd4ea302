"""OpenAI's completions and chat-completions requests and responses, without the HTTP.

    request = parse_completion(body, served)       # or parse_chat; RequestError (-> HTTP 400) if invalid
    response = Responses(request, served)
    response.final(output)                         # the whole answer, from the last RequestOutput
    response.chunks(output)                        # the streamed chunks one RequestOutput adds

Parameters: prompt (a string or a token-id list; one prompt), messages (chat, rendered by the
model's chat template), max_tokens (max_completion_tokens), temperature, top_p, top_k (an
extension), seed, stop, logprobs (top_logprobs in chat), stream (stream_options.include_usage), n
and echo at their defaults only. Parameters that change the answer and are not implemented
(penalties, logit_bias, tools, ...) are refused at any value but their default, and unknown
ones are refused by name: nothing is silently ignored.
"""

import math
import time
import uuid
from dataclasses import dataclass, field

from teratron.inference.chat_template import ChatTemplateError
from teratron.inference.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Accepted only at these values (the first is the default): what any other value asks for is not implemented.
_ONLY_DEFAULT = {
    "n": (1, None), "best_of": (1, None), "echo": (False, None), "suffix": (None,),
    "frequency_penalty": (0, None), "presence_penalty": (0, None), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False), "response_format": (None, {"type": "text"}),
}
_IGNORED = ("user", "metadata", "store", "service_tier")  # bookkeeping that does not change the answer
_SAMPLING_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                    "stream_options", "n", "frequency_penalty", "presence_penalty", "logit_bias", *_IGNORED)
COMPLETION_FIELDS = frozenset(_SAMPLING_FIELDS + ("prompt", "logprobs", "echo", "best_of", "suffix"))
CHAT_FIELDS = frozenset(_SAMPLING_FIELDS + ("messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                            "tools", "tool_choice", "functions", "function_call",
                                            "parallel_tool_calls", "response_format"))


class RequestError(ValueError):
    """An invalid request: HTTP `status` with OpenAI's error body."""

    def __init__(self, message: str, param=None, status: int = 400, code=None,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code, self.error_type = param, status, code, error_type

    def body(self) -> dict:
        return error_body(str(self), self.error_type, self.param, self.code)


def error_body(message: str, error_type: str, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass(frozen=True)
class ServedModel:
    """What the server serves: the model's id, its tokenizer and limits."""
    model_id: str
    tokenizer: object
    max_sequence_length: int
    """Prompt plus generated tokens of one request, at most."""
    chat_template: object = None
    """A ChatTemplate, or None: /v1/chat/completions answers 400."""
    stop_token_ids: tuple = ()
    """Token ids that end every request besides the tokenizer's end of document (e.g. end of turn)."""


@dataclass(frozen=True)
class GenerationRequest:
    chat: bool
    prompt_token_ids: list
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    """How many most likely tokens to return beside each generated one (None: no log-probabilities)."""
    created: int = field(default_factory=lambda: int(time.time()))


# --------------------------------------------------------------------------------------- parsing

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(body: dict, name: str, default, low: int, high: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise RequestError(f"'{name}' must be an integer {bound}, got {value!r}", param=name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or \
            value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise RequestError(f"'{name}' must be a number in {interval}, got {value!r}", param=name)
    return float(value)


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false, got {value!r}", param=name)
    return value


def _stop(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or \
            not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                           param="stop")
    return tuple(stop)


def _same(value, accepted) -> bool:
    """Equal, and true/false only where a boolean is meant (JSON's false is not 0)."""
    return value == accepted and isinstance(value, bool) == isinstance(accepted, bool)


def _check_fields(body: dict, allowed: frozenset, served: ServedModel) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    for name, accepted in _ONLY_DEFAULT.items():
        if name in body and not any(_same(body[name], value) for value in accepted):
            raise RequestError(f"'{name}'={body[name]!r} is not supported by this server (only {accepted[0]!r})",
                               param=name)
    model = body.get("model")
    if model is not None and model != served.model_id:
        raise RequestError(f"The model '{model}' does not exist; this server serves '{served.model_id}'",
                           param="model", status=404, code="model_not_found")


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("'stream_options' must be an object with 'include_usage' only", param="stream_options")
    return _boolean(options, "include_usage", False)


def _request(body: dict, served: ServedModel, chat: bool, prompt_ids: list, default_max_tokens, logprobs,
             max_tokens_name: str) -> GenerationRequest:
    """The sampling parameters every request has, checked against the prompt's length."""
    limit, used = served.max_sequence_length, len(prompt_ids)
    room = limit - used
    if room < 1:
        raise RequestError(f"the prompt has {used} tokens and the model's context is {limit}: no room for new "
                           "tokens; shorten the prompt", param="messages" if chat else "prompt")
    max_tokens = _integer(body, max_tokens_name, None, 1)
    max_tokens = default_max_tokens(room) if max_tokens is None else max_tokens
    if max_tokens > room:
        raise RequestError(f"'{max_tokens_name}'={max_tokens} is too many: the prompt has {used} tokens and the "
                           f"model's context is {limit}, so at most {room} new tokens fit", param=max_tokens_name)
    stream = _boolean(body, "stream", False)
    values = dict(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                  top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                  top_k=max(_integer(body, "top_k", 0, -1), 0),  # -1 (vLLM) or 0: every token
                  seed=_integer(body, "seed", None, -2**63, 2**63 - 1), stop=_stop(body))
    try:
        params = SamplingParams(**values, num_tokens_to_generate=max_tokens, stop_token_ids=served.stop_token_ids,
                                return_log_probs=logprobs is not None, top_n_logprobs=logprobs or 0)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return GenerationRequest(chat, prompt_ids, params, stream, _include_usage(body, stream), logprobs)


def _prompt_ids(body: dict, served: ServedModel) -> list:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = served.tokenizer.tokenize(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(i) for i in prompt):
        vocab = served.tokenizer.vocab_size
        bad = [i for i in prompt if not 0 <= i < vocab]
        if bad:
            raise RequestError(f"'prompt' holds token id {bad[0]}, outside the vocabulary [0, {vocab})",
                               param="prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(f"'prompt' holds {len(prompt)} prompts; this server takes one per request",
                           param="prompt")
    else:
        raise RequestError("'prompt' must be a string or a non-empty list of token ids", param="prompt")
    if not ids:
        raise RequestError("'prompt' is empty: give at least one token to continue", param="prompt")
    return ids


def parse_completion(body: dict, served: ServedModel) -> GenerationRequest:
    """A /v1/completions request."""
    _check_fields(body, COMPLETION_FIELDS, served)
    logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    return _request(body, served, False, _prompt_ids(body, served), lambda room: min(DEFAULT_COMPLETION_MAX_TOKENS, room),
                    logprobs, "max_tokens")


def _message_text(message, index: int) -> str:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{index}].content must be a string or a list of text parts (other parts are not "
                       "supported)", param=f"messages.[{index}].content")


def _messages(body: dict) -> list:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise RequestError(f"messages[{i}] must be an object whose role is one of {', '.join(CHAT_ROLES)}",
                               param=f"messages.[{i}].role")
        out.append({**message, "content": _message_text(message, i)})
    return out


def parse_chat(body: dict, served: ServedModel) -> GenerationRequest:
    """A /v1/chat/completions request, its messages rendered by the model's chat template."""
    _check_fields(body, CHAT_FIELDS, served)
    if served.chat_template is None:
        raise RequestError(f"the model '{served.model_id}' has no chat template (import a chat model with `teratron "
                           "convert import-hf`); use /v1/completions", param="messages")
    messages = _messages(body)
    logprobs = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    try:
        prompt_ids = served.chat_template.tokenize(served.chat_template.render(messages))
    except ChatTemplateError as e:
        raise RequestError(str(e), param="messages") from None
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        raise RequestError("give 'max_completion_tokens' or 'max_tokens', not both", param="max_tokens")
    max_tokens_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _request(body, served, True, prompt_ids, lambda room: room, (top or 0) if logprobs else None,
                    max_tokens_name)


# --------------------------------------------------------------------------------------- responses

def _usage(request: GenerationRequest, output) -> dict:
    prompt, completion = len(request.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Responses:
    """The response bodies of one request: the whole answer, or its stream of chunks."""

    def __init__(self, request: GenerationRequest, served: ServedModel):
        self.request, self.served = request, served
        self.id = f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.text_offset = 0  # characters streamed so far (completions' logprobs.text_offset)
        self.role_sent = False

    def _envelope(self, object_name: str, choices: list) -> dict:
        return {"id": self.id, "object": object_name, "created": self.request.created,
                "model": self.served.model_id, "choices": choices}

    def final(self, output) -> dict:
        """The non-streamed body from the request's last output."""
        logprobs = self._logprobs(output, 0)
        if self.request.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": output.text},
                      "logprobs": logprobs, "finish_reason": output.finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": output.text, "logprobs": logprobs, "finish_reason": output.finish_reason}
            body = self._envelope("text_completion", [choice])
        return {**body, "usage": _usage(self.request, output)}

    def chunks(self, output) -> list:
        """The chunks to stream for one output (its new text; the finish reason on the last one;
        then the usage if asked)."""
        first_new = len(output.token_ids) - len(output.new_token_ids)
        logprobs = self._logprobs(output, first_new)
        reason = output.finish_reason if output.finished else None
        out = []
        if self.request.chat:
            delta = {"content": output.new_text} if output.new_text or logprobs else {}
            if not self.role_sent:
                delta = {"role": "assistant", "content": "", **delta}
                self.role_sent = True
            if delta or reason:
                choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
                out.append(self._envelope("chat.completion.chunk", [choice]))
        elif output.new_text or logprobs or reason:
            choice = {"index": 0, "text": output.new_text, "logprobs": logprobs, "finish_reason": reason}
            out.append(self._envelope("text_completion", [choice]))
        if self.request.include_usage:
            for chunk in out:
                chunk["usage"] = None
            if output.finished:
                usage_object = "chat.completion.chunk" if self.request.chat else "text_completion"
                out.append({**self._envelope(usage_object, []), "usage": _usage(self.request, output)})
        return out

    def _token_text(self, token_id: int) -> str:
        return self.served.tokenizer.detokenize([token_id])

    def _logprobs(self, output, first: int):
        """Log-probabilities of output.token_ids[first:] in the endpoint's format, or None."""
        if self.request.logprobs is None or output.log_probs is None:
            return None
        ids, values = output.token_ids[first:], output.log_probs[first:]
        tops = (output.top_n_logprobs or [])[first:] if self.request.logprobs else [{}] * len(ids)
        if self.request.chat:
            return {"content": [{**self._chat_token(i, v), "top_logprobs": [self._chat_token(t, lp) for t, lp in
                                                                             top.items()]}
                                for i, v, top in zip(ids, values, tops)], "refusal": None}
        tokens = [self._token_text(i) for i in ids]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        top_logprobs = [{self._token_text(t): lp for t, lp in top.items()} for top in tops] \
            if self.request.logprobs else None
        return {"tokens": tokens, "token_logprobs": list(values), "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
