"""The OpenAI-compatible server over a fake engine (server_testing.FakeEngine: the engine's API,
answers known in advance), driven by the official `openai` client and by raw HTTP."""

import http.client
import json
import time

import openai
import pytest

from inference.server_testing import FakeEngine, running_server, write_byte_tokenizer
from teratron.inference.async_engine import AsyncInferenceEngine
from teratron.inference.chat_template import ChatTemplate
from teratron.inference.openai_api import ServedModel
from teratron.inference.server import MAX_REQUEST_BYTES, SHUTDOWN_TIMEOUT_S, OpenAIServer
from teratron.tokenizers import HuggingFaceTokenizer

MODEL_ID = "tiny-ckpt"
MAX_SEQ = 64


@pytest.fixture
def tokenizer_dir(tmp_path):
    write_byte_tokenizer(tmp_path / "hf")
    return str(tmp_path / "hf")


def _server(tokenizer_dir, chat=True, **engine_kwargs):
    tokenizer = HuggingFaceTokenizer(tokenizer_dir)
    engine = FakeEngine(tokenizer, **engine_kwargs)
    served = ServedModel(MODEL_ID, tokenizer, MAX_SEQ, ChatTemplate.from_hf_dir(tokenizer_dir) if chat else None,
                         stop_token_ids=(258,))
    async_engine = AsyncInferenceEngine(engine)
    return engine, async_engine, OpenAIServer(async_engine, served).build_app()


@pytest.fixture
def server(tokenizer_dir):
    engine, async_engine, app = _server(tokenizer_dir)
    with running_server(app) as url:
        yield url, engine, async_engine


@pytest.fixture
def client(server):
    with _client(server[0]) as openai_client:
        yield openai_client


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30,
                         http_client=openai.DefaultHttpxClient(trust_env=False))  # no proxy for 127.0.0.1


def _request(url, method, path, body=None, raw=None, headers=None):
    """(status, headers, body bytes) of one plain HTTP request."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    out = response.status, dict(response.getheaders()), response.read()
    conn.close()
    return out


def _ids(text):
    return list(text.encode())  # the byte tokenizer: id = byte, for these ASCII texts


def test_completion_with_openai_client(server, client):
    url, engine, _ = server
    result = client.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=5, temperature=0, seed=3,
                                       top_p=0.5, extra_body={"top_k": 4})
    expected = FakeEngine.letters(_ids("Hello"), 5)
    assert result.choices[0].text == expected and result.choices[0].finish_reason == "length"
    assert result.model == MODEL_ID and result.object == "text_completion" and result.id.startswith("cmpl-")
    assert (result.usage.prompt_tokens, result.usage.completion_tokens, result.usage.total_tokens) == (5, 5, 10)
    assert engine.prompts[-1] == _ids("Hello")
    params = engine.params[-1]
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.num_tokens_to_generate) == \
        (0.0, 0.5, 4, 3, 5)
    assert params.stop_token_ids == (258,) and not params.return_log_probs

    # a token-id prompt, the default max_tokens (16), a stop string
    stop = expected[2]
    result = client.completions.create(model=MODEL_ID, prompt=[72, 105], stop=[stop])
    full = FakeEngine.letters([72, 105], 16)
    assert engine.prompts[-1] == [72, 105] and engine.params[-1].num_tokens_to_generate == 16
    assert result.choices[0].text == full[:full.index(stop)] and result.choices[0].finish_reason == "stop"


def test_chat_completion_with_openai_client(server, client, tokenizer_dir):
    url, engine, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    result = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=4)
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    prompt = HuggingFaceTokenizer(tokenizer_dir).tokenize(rendered)
    assert prompt.count(257) == 3 and prompt.count(258) == 2  # <|im_start|>, <|im_end|> are single tokens
    assert engine.prompts[-1] == prompt
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == FakeEngine.letters(prompt, 4)
    assert choice.finish_reason == "length" and result.object == "chat.completion"
    assert result.usage.prompt_tokens == len(prompt) and result.usage.completion_tokens == 4

    # without max_tokens the answer may fill the context; content given as text parts
    client.chat.completions.create(model=MODEL_ID, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}])
    assert engine.prompts[-1] == HuggingFaceTokenizer(tokenizer_dir).tokenize(
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    assert engine.params[-1].num_tokens_to_generate == MAX_SEQ - len(engine.prompts[-1])
    result = client.chat.completions.create(model=MODEL_ID, messages=messages, max_completion_tokens=3)
    assert engine.params[-1].num_tokens_to_generate == 3 and result.usage.completion_tokens == 3


def test_streaming_with_openai_client(server, client):
    url, engine, _ = server
    chunks = list(client.completions.create(model=MODEL_ID, prompt="abc", max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts == list(FakeEngine.letters(_ids("abc"), 6))
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None] * 5 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == 3

    stream = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}],
                                            max_tokens=3, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == FakeEngine.letters(engine.prompts[-1], 3)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_streaming_raw_server_sent_events(server):
    url, _, _ = server
    status, headers, body = _request(url, "POST", "/v1/completions",
                                     {"prompt": "abc", "max_tokens": 3, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == FakeEngine.letters(_ids("abc"), 3)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]


def test_logprobs(server, client):
    url, engine, _ = server
    result = client.completions.create(model=MODEL_ID, prompt="ab", max_tokens=2, logprobs=2)
    letters = FakeEngine.letters(_ids("ab"), 3)
    lp = result.choices[0].logprobs
    assert lp.tokens == list(letters[:2]) and lp.token_logprobs == pytest.approx([-0.1, -0.2])
    assert lp.text_offset == [0, 1]
    assert lp.top_logprobs == [{letters[0]: pytest.approx(-0.1), letters[1]: pytest.approx(-1.1)},
                               {letters[1]: pytest.approx(-0.2), letters[2]: pytest.approx(-1.2)}]
    assert engine.params[-1].return_log_probs and engine.params[-1].top_n_logprobs == 2

    result = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "q"}],
                                            max_tokens=2, logprobs=True, top_logprobs=1)
    letters = FakeEngine.letters(engine.prompts[-1], 2)
    content = result.choices[0].logprobs.content
    assert [t.token for t in content] == list(letters) and [t.logprob for t in content] == pytest.approx([-0.1, -0.2])
    assert [t.bytes for t in content] == [[ord(c)] for c in letters]
    assert [[(x.token, x.logprob) for x in t.top_logprobs] for t in content] == \
        [[(letters[0], pytest.approx(-0.1))], [(letters[1], pytest.approx(-0.2))]]

    # streamed: each chunk carries its own token's log-probability and offset
    chunks = list(client.completions.create(model=MODEL_ID, prompt="ab", max_tokens=2, logprobs=0, stream=True))
    assert [c.choices[0].logprobs.token_logprobs for c in chunks] == [[pytest.approx(-0.1)], [pytest.approx(-0.2)]]
    assert [c.choices[0].logprobs.text_offset for c in chunks] == [[0], [1]]


def test_models_and_health(server, client):
    url, _, _ = server
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID] and models.data[0].owned_by == "teratron"
    status, _, body = _request(url, "GET", "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}


def _error(url, path, body=None, raw=None, method="POST"):
    status, _, data = _request(url, method, path, body, raw)
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    return status, error


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "a", "temperature": -1}, "temperature", "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature", "number"),
    ({"prompt": "a", "top_p": 0}, "top_p", "(0.0, 1.0]"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"prompt": "a", "max_tokens": MAX_SEQ}, "max_tokens", f"at most {MAX_SEQ - 1} new tokens"),
    ({"prompt": "a" * MAX_SEQ}, "prompt", "no room"),
    ({"prompt": "a", "n": 2}, "n", "not supported"),
    ({"prompt": "a", "echo": True}, "echo", "not supported"),
    ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"prompt": "a", "best_of": 3}, "best_of", "not supported"),
    ({"prompt": "a", "logprobs": 21}, "logprobs", "between 0 and 20"),
    ({"prompt": "a", "stop": ["x", ""]}, "stop", "non-empty"),
    ({"prompt": "a", "stream": "yes"}, "stream", "true or false"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": "a", "seed": 1.5}, "seed", "integer"),
    ({"prompt": "a", "frobnicate": 1}, "frobnicate", "Unrecognized"),
    ({"prompt": ["a", "b"]}, "prompt", "one per request"),
    ({"prompt": [1, 300]}, "prompt", "outside the vocabulary"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": 5}, "prompt", "string"),
    ({}, "prompt", "string"),
])
def test_invalid_completion_parameters_are_400(server, body, param, words):
    url, engine, _ = server
    status, error = _error(url, "/v1/completions", body)
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]
    assert engine.prompts == []  # nothing reached the engine


@pytest.mark.parametrize("body, param, words", [
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.[0].role", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.[0].content", "text parts"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10_000}, "max_completion_tokens",
     "too many"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2, "max_tokens": 2}, "max_tokens",
     "not both"),
])
def test_invalid_chat_parameters_are_400(server, body, param, words):
    url, _, _ = server
    status, error = _error(url, "/v1/chat/completions", body)
    assert status == 400 and error["param"] == param and words in error["message"]


def test_malformed_requests(server, client):
    url, _, _ = server
    status, error = _error(url, "/v1/completions", raw=b'{"prompt": "a",')
    assert status == 400 and "not valid JSON" in error["message"]
    status, error = _error(url, "/v1/completions", raw=b'["a"]')
    assert status == 400 and "JSON object" in error["message"]
    status, error = _error(url, "/v1/completions", raw=b"\xff\xfe")
    assert status == 400
    status, error = _error(url, "/v1/completions", raw=b'{"prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}')
    assert status == 413 and str(MAX_REQUEST_BYTES) in error["message"]
    status, error = _error(url, "/v1/completions", {"prompt": "a", "model": "gpt-4"})
    assert status == 404 and error["code"] == "model_not_found"
    status, error = _error(url, "/v1/engines", {})
    assert status == 404 and error["type"] == "not_found_error"
    status, error = _error(url, "/v1/completions", method="GET")
    assert status == 405
    with pytest.raises(openai.BadRequestError, match="'n'=2 is not supported"):
        client.completions.create(model=MODEL_ID, prompt="a", n=2)
    assert client.completions.create(model=MODEL_ID, prompt="a", max_tokens=1).choices[0].text


def test_engine_refusal_is_400(tokenizer_dir):
    engine, _, app = _server(tokenizer_dir, max_prompt=3)
    with running_server(app) as url:
        status, error = _error(url, "/v1/completions", {"prompt": "abcd"})
        assert status == 400 and "at most 3 fit" in error["message"]


def test_no_chat_template_is_400(tokenizer_dir):
    _, _, app = _server(tokenizer_dir, chat=False)
    with running_server(app) as url:
        status, error = _error(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert status == 400 and "no chat template" in error["message"]


def test_chat_template_errors_are_400(tmp_path):
    templates = {"refuses": "{{ raise_exception('Conversation roles must alternate') }}",
                 "escapes": "{{ messages.__class__.__mro__[1].__subclasses__() }}",
                 "breaks": "{{ messages[0]['content'] + 1 }}"}
    for name, template in templates.items():
        write_byte_tokenizer(tmp_path / name, chat_template=template)
        _, _, app = _server(str(tmp_path / name))
        with running_server(app) as url:
            status, error = _error(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
            assert status == 400 and error["param"] == "messages", name
            if name == "refuses":
                assert error["message"] == "Conversation roles must alternate"


def test_errors_do_not_bring_the_server_down(server, client, monkeypatch):
    url, engine, async_engine = server
    # a step that raises: the request in it gets a 500, the engine goes on
    status, error = _error(url, "/v1/completions", {"prompt": [FakeEngine.FAIL_ID, 1]})
    assert status == 500 and error["type"] == "server_error"
    assert async_engine.num_requests == 0 and engine.aborted == [0]
    # the same while streaming: an error event, then [DONE]
    status, _, body = _request(url, "POST", "/v1/completions", {"prompt": [FakeEngine.FAIL_ID], "stream": True})
    events = body.decode().split("\n\n")
    assert status == 200 and [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == \
        list(FakeEngine.letters([FakeEngine.FAIL_ID], 2))
    assert json.loads(events[2][6:])["error"]["type"] == "server_error" and events[3:] == ["data: [DONE]", ""]
    # an exception in a handler (here the served tokenizer's, which the fake engine shares) is a 500
    with monkeypatch.context() as patch:
        patch.setattr(engine.tokenizer, "tokenize", lambda text: 1 / 0)
        status, error = _error(url, "/v1/completions", {"prompt": "a"})
    assert status == 500 and "ZeroDivisionError" in error["message"]
    assert client.completions.create(model=MODEL_ID, prompt="ok", max_tokens=2).choices[0].text == \
        FakeEngine.letters(_ids("ok"), 2)
    assert _request(url, "GET", "/health")[0] == 200


def _wait_until(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnecting_client_frees_its_request(tokenizer_dir, stream):
    engine, async_engine, app = _server(tokenizer_dir, step_seconds=0.01)
    with running_server(app) as url:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "abc", "max_tokens": 60, "stream": stream}),
                     headers={"Content-Type": "application/json"})
        _wait_until(lambda: engine.steps >= 3)
        if stream:
            response = conn.getresponse()
            assert response.readline().startswith(b"data: ")
        conn.sock.close()  # the client goes away mid-generation
        conn.close()
        _wait_until(lambda: engine.aborted == [0])
        _wait_until(lambda: async_engine.num_requests == 0 and not engine.has_unfinished_requests())
        assert engine.steps < 60
        with _client(url) as client:
            assert client.completions.create(model=MODEL_ID, prompt="ok", max_tokens=2).choices[0].text


def test_a_stop_cancels_a_request_still_running_after_the_grace_period(tokenizer_dir):
    """Ctrl+C or SIGTERM while a long request runs: the server stops within 2 x SHUTDOWN_TIMEOUT_S (and
    an engine step), not aiohttp's default two minutes; the request is aborted in the engine and its
    client sees the connection end."""
    engine, _, app = _server(tokenizer_dir, step_seconds=1.0)  # 60 tokens: a minute to finish
    with running_server(app) as url:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "abc", "max_tokens": 60}),
                     headers={"Content-Type": "application/json"})
        _wait_until(lambda: engine.steps >= 1)
        stopping = time.monotonic()
    stopped_after = time.monotonic() - stopping
    # The documented "about 5 s" (2 x SHUTDOWN_TIMEOUT_S), plus up to 3 s for the engine's step and load.
    assert SHUTDOWN_TIMEOUT_S - 0.5 < stopped_after < 5 + 3, stopped_after
    assert engine.aborted == [0] and engine.steps < 60
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        conn.getresponse()
    conn.close()
