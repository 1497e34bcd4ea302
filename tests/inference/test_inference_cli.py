"""`teratron generate` and `teratron serve` end to end on an imported tiny Llama (a word-level
tokenizer, so texts compare tokens; a chat template): greedy text equals transformers' greedy generate; the served API over the real
engine (concurrent requests, chat, streaming, a disconnecting client); a draft model
(--draft-load) leaves greedy text unchanged; bad input is one line."""

import concurrent.futures
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import transformers

from convert.hf_testing import save_random_hf_model
from dist import free_ports
from inference.server_testing import (WORD_VOCAB, default_ctrl_c, running_server, write_byte_tokenizer,
                                     write_word_tokenizer)
from teratron import cli
from teratron.inference import cli as inference_cli
from teratron.inference.async_engine import AsyncInferenceEngine
from teratron.inference.cli import model_id
from teratron.inference.config import InferenceConfig
from teratron.inference.engines.dynamic_engine import DynamicInferenceEngine
from teratron.inference.loading import generation_stop_token_ids, load_chat_template, load_for_inference
from teratron.inference.openai_api import ServedModel
from teratron.inference.sampling_params import SamplingParams
from teratron.inference.server import OpenAIServer
from teratron.tokenizers import HuggingFaceTokenizer
from teratron.training.arguments import ArgumentParser

HF_CONFIG = dict(vocab_size=WORD_VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                 eos_token_id=[256, 258])
DRAFT_CONFIG = dict(HF_CONFIG, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)
ENGINE = InferenceConfig(buffer_size_gb=0.001, block_size=4, max_requests=4, max_tokens_per_step=32)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(checkpoint, HF folder) of a tiny random Llama with the word tokenizer and ChatML template."""
    root = tmp_path_factory.mktemp("imported")
    src, ckpt = root / "hf", root / "tiny-llama"
    save_random_hf_model("LlamaConfig", "LlamaForCausalLM", HF_CONFIG, src, "10MB")
    write_word_tokenizer(src)
    assert cli.main(["convert", "import-hf", "--hf-path", str(src), "--save", str(ckpt)]) == 0
    return str(ckpt), str(src)


@pytest.fixture(scope="module")
def drafts(imported, tmp_path_factory):
    """(a smaller random Llama with the same tokenizer, a copy of it with a byte tokenizer)."""
    root = tmp_path_factory.mktemp("drafts")
    src, ckpt, other_tokenizer = root / "hf", root / "draft", root / "draft-bytes"
    save_random_hf_model("LlamaConfig", "LlamaForCausalLM", DRAFT_CONFIG, src, "10MB")
    write_word_tokenizer(src)
    assert cli.main(["convert", "import-hf", "--hf-path", str(src), "--save", str(ckpt)]) == 0
    shutil.copytree(ckpt, other_tokenizer)
    write_byte_tokenizer(other_tokenizer / "hf")
    return str(ckpt), str(other_tokenizer)


def hf_greedy(src, prompt_ids, max_new_tokens):
    """transformers' greedy continuation (stopping at generation_config's eos ids, included)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=256)
    return out[0, len(prompt_ids):].tolist()


def expected_text(src, prompt_ids, generated) -> str:
    """The text a continuation adds to the prompt's (an end-of-sequence token ends it and is not text)."""
    tokenizer = HuggingFaceTokenizer(src)
    stops = [i for i, t in enumerate(generated) if t in (256, 258)]
    generated = generated[:stops[0]] if stops else generated
    return tokenizer.detokenize(prompt_ids + generated)[len(tokenizer.detokenize(prompt_ids)):]


def test_generate_greedy_equals_transformers(imported, capsys):
    ckpt, src = imported
    assert cli.main(["generate", "--load", ckpt, "--prompt", "t1 t2 t3", "--max-tokens", "12", "--temperature", "0",
                     "--inference-dynamic-batching-block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert out == expected_text(src, [1, 2, 3], hf_greedy(src, [1, 2, 3], 12)) + "\n"


@pytest.mark.parametrize("argv, words", [
    (["generate", "--load", "MISSING", "--prompt", "x"], "neither a checkpoint folder"),
    (["generate", "--load", "CKPT"], "--prompt"),
    (["generate", "--load", "CKPT", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["generate", "--load", "CKPT", "--prompt", "x", "--inference-dynamic-batching-block-size", "0"],
     "--inference-dynamic-batching-block-size"),
    (["generate", "--load", "CKPT", "--prompt", "x", "--max-tokens", "100"], "max_seq_length"),
    (["serve", "--load", "CKPT", "--inference-dynamic-batching-num-cuda-graphs", "-2"],
     "--inference-dynamic-batching-num-cuda-graphs"),
    (["serve", "--load", "CKPT", "--inference-dynamic-batching-max-tokens", "0"],
     "--inference-dynamic-batching-max-tokens"),
    (["generate", "--load", "CKPT", "--prompt", " ", "--max-tokens", "1"], "--prompt"),
    (["serve", "--load", "CKPT", "--port", "70000"], "--port 70000"),
    (["serve", "--load", "CKPT", "--port", "BUSY"], "cannot listen"),
    (["serve", "--load", "CKPT", "--bf16", "--fp16"], "not allowed with"),
    (["generate", "--load", "CKPT", "--prompt", "x", "--draft-load", "CKPT"], "--num-speculative-tokens N >= 1"),
    (["serve", "--load", "CKPT", "--draft-load", "CKPT", "--num-speculative-tokens", "0"],
     "--num-speculative-tokens N >= 1"),
    (["generate", "--load", "CKPT", "--prompt", "x", "--num-speculative-tokens", "2"], "--draft-load"),
    (["serve", "--load", "CKPT", "--num-speculative-tokens", "-1"], "--draft-load"),
    (["generate", "--load", "CKPT", "--prompt", "x", "--draft-load", "MISSING", "--num-speculative-tokens", "2"],
     "--draft-load"),
    (["generate", "--load", "CKPT", "--prompt", "x", "--draft-load", "BYTES", "--num-speculative-tokens", "2"],
     "its tokenizer differs from --load's"),
    (["serve", "--load", "CKPT", "--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size 0 must be"),
    (["generate", "--load", "CKPT", "--prompt", "x", "--tensor-model-parallel-size", "2"],
     "torchrun --nproc-per-node 2"),
])
def test_bad_input_is_one_line(imported, drafts, tmp_path, capsys, argv, words):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        values = {"MISSING": str(tmp_path / "missing"), "CKPT": imported[0], "BUSY": str(busy.getsockname()[1]),
                  "BYTES": drafts[1]}
        assert cli.main([values.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("teratron: error: ") and err.count("\n") == 1 and words in err, err


def test_generate_with_a_draft_model_gives_the_same_greedy_text(imported, drafts, capsys):
    """The target as its own draft (every draft token accepted) and a smaller random draft (some
    rejected): `generate`'s text equals plain decoding's; the engine really decodes speculatively."""
    ckpt, _ = imported
    argv = ["generate", "--load", ckpt, "--prompt", "t5 t6 t7", "--max-tokens", "12", "--temperature", "0",
            "--inference-dynamic-batching-buffer-size-gb", "0.001", "--inference-dynamic-batching-block-size", "4"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert len(plain.split()) == 12
    for draft, accepted_all in ((ckpt, True), (drafts[0], False)):
        speculative = argv + ["--draft-load", draft, "--num-speculative-tokens", "3"]
        assert cli.main(speculative) == 0
        assert capsys.readouterr().out == plain, draft
        args = inference_cli.add_generate_arguments(ArgumentParser()).parse_args(speculative[1:])
        engine, tokenizer = inference_cli._engine(args)
        assert engine.config.num_speculative_tokens == 3 and engine.draft is not None
        output = engine.generate([tokenizer.tokenize("t5 t6 t7")], SamplingParams(temperature=0,
                                                                                 num_tokens_to_generate=12))[0]
        assert output.text + "\n" == plain
        assert engine.num_draft_tokens_proposed > 0
        assert (engine.num_draft_tokens_accepted == engine.num_draft_tokens_proposed) == accepted_all


def test_model_id_is_the_checkpoint_folder(imported):
    ckpt, _ = imported
    assert model_id(ckpt) == model_id(os.path.join(ckpt, "iter_0000000")) == "tiny-llama"


@pytest.fixture(scope="module")
def served(imported):
    """(url, engine) of the server over the real engine."""
    ckpt, _ = imported
    model, tokenizer = load_for_inference(ckpt)
    engine = DynamicInferenceEngine(model, tokenizer, ENGINE)
    served_model = ServedModel(model_id(ckpt), tokenizer, engine.max_seq_length, load_chat_template(ckpt),
                               generation_stop_token_ids(ckpt))
    with running_server(OpenAIServer(AsyncInferenceEngine(engine), served_model).build_app()) as url:
        yield url, engine


def _post(url, path, body):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    out = response.status, response.read()
    conn.close()
    return out[0], json.loads(out[1]) if not body.get("stream") else out[1]


def test_served_completions_equal_transformers(imported, served):
    _, src = imported
    url, _ = served
    prompts = {"t1 t2 t3": [1, 2, 3], "t200": [200], "t9 t8 t7 t6 t5 t4 t3 t2 t1": [9, 8, 7, 6, 5, 4, 3, 2, 1],
               "t42 t42": [42, 42]}
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # one batch, continuous batching
        answers = list(pool.map(lambda p: _post(url, "/v1/completions", {"prompt": p, "max_tokens": 10,
                                                                         "temperature": 0}), prompts))
    for (prompt, prompt_ids), (status, body) in zip(prompts.items(), answers):
        generated = hf_greedy(src, prompt_ids, 10)
        assert status == 200 and body["choices"][0]["text"] == expected_text(src, prompt_ids, generated), prompt
        assert body["usage"]["completion_tokens"] == len(generated)


def test_served_chat_and_stream(imported, served):
    ckpt, src = imported
    url, _ = served
    messages = [{"role": "user", "content": "t7 t8"}]
    status, body = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0})
    template = load_chat_template(ckpt)
    prompt_ids = template.tokenize(template.render(messages))
    assert status == 200 and body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["choices"][0]["message"]["content"] == expected_text(src, prompt_ids, hf_greedy(src, prompt_ids, 8))

    status, raw = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                      "stream": True})
    events = raw.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    deltas = [json.loads(e.removeprefix("data: "))["choices"][0]["delta"] for e in events[:-2]]
    assert "".join(d.get("content", "") for d in deltas) == body["choices"][0]["message"]["content"]


def test_disconnect_frees_the_engine(imported):
    ckpt, src = imported
    prompt_ids = [5, 6]
    assert not {256, 258} & set(hf_greedy(src, prompt_ids, 60))  # it would run all 60 tokens
    model, tokenizer = load_for_inference(ckpt)
    engine = DynamicInferenceEngine(model, tokenizer, ENGINE)
    aborted, abort = [], engine.abort
    engine.abort = lambda request_id: (aborted.append(request_id), abort(request_id))
    served_model = ServedModel(model_id(ckpt), tokenizer, engine.max_seq_length)
    with running_server(OpenAIServer(AsyncInferenceEngine(engine), served_model).build_app()) as url:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt_ids, "max_tokens": 60,
                                                                 "stream": True, "temperature": 0}),
                     headers={"Content-Type": "application/json"})
        assert conn.getresponse().readline().startswith(b"data: ")
        conn.sock.close()  # gone after the first token
        conn.close()
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() or not aborted:
            assert time.monotonic() < deadline, "the request was not freed"
            time.sleep(0.01)
        assert aborted == [0] and engine.context.allocator.num_free == engine.context.num_blocks  # every block back


@pytest.mark.parametrize("stop, returncode, last_words", [(signal.SIGINT, 130, "teratron: interrupted"),
                                                          (signal.SIGTERM, 0, "teratron serve: stopped")])
def test_serve_command(imported, stop, returncode, last_words):
    """`teratron serve` in a process of its own: answers, then stops on Ctrl+C or SIGTERM."""
    ckpt, _ = imported
    port, = free_ports(1)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, "-m", "teratron", "serve", "--load", ckpt, "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                               preexec_fn=default_ctrl_c)
    try:
        line = process.stdout.readline()
        assert f"at http://127.0.0.1:{port}/v1" in line and "'tiny-llama'" in line, process.stderr.read()
        status, body = _post(f"http://127.0.0.1:{port}", "/v1/completions", {"prompt": "t3", "max_tokens": 3})
        assert status == 200 and body["model"] == "tiny-llama"
    finally:
        process.send_signal(stop)
        out, err = process.communicate(timeout=60)
    assert process.returncode == returncode and last_words in out + err, (out, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_served_on_gpu(imported):
    """The server over an engine on the GPU (the engine thread drives CUDA): fp32 greedy texts of
    concurrent requests equal transformers' on the CPU; bf16 answers too."""
    ckpt, src = imported
    prompts = {"t1 t2 t3": [1, 2, 3], "t9 t8 t7 t6 t5 t4 t3 t2 t1": [9, 8, 7, 6, 5, 4, 3, 2, 1], "t42 t42": [42, 42]}
    for dtype in (torch.float32, torch.bfloat16):
        model, tokenizer = load_for_inference(ckpt, dtype=dtype, device="cuda")
        assert {(p.device.type, p.dtype) for p in model.parameters()} == {("cuda", dtype)}
        engine = DynamicInferenceEngine(model, tokenizer, ENGINE)
        served_model = ServedModel(model_id(ckpt), tokenizer, engine.max_seq_length)
        with running_server(OpenAIServer(AsyncInferenceEngine(engine), served_model).build_app()) as url:
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(pool.map(lambda p: _post(url, "/v1/completions", {"prompt": p, "max_tokens": 10,
                                                                                 "temperature": 0}), prompts))
        for (prompt, prompt_ids), (status, body) in zip(prompts.items(), answers):
            assert status == 200 and body["usage"]["completion_tokens"] >= 1, prompt
            if dtype == torch.float32:
                assert body["choices"][0]["text"] == expected_text(src, prompt_ids, hf_greedy(src, prompt_ids, 10))


def test_only_loopback_hosts_are_private():
    from teratron.inference.cli import _is_loopback

    assert all(_is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(_is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.2", "example.org"))


def test_readme_python_api_block_runs(imported):
    """The README's "From Python" inference block, run as written on the imported checkpoint: its
    logits are the full vocabulary's and its greedy texts are the engine's."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    block = readme.split("<!-- python-api")[1].split("```python\n")[1].split("```")[0]
    ckpt, _ = imported
    scope = {}
    exec(block.replace('"ckpt/tiny-llama"', repr(ckpt)), scope)  # noqa: S102 - our own README's code
    model, tokenizer, outputs = scope["model"], scope["tokenizer"], scope["outputs"]
    assert scope["logits"].shape == (1, len(tokenizer.tokenize("The cat")), model.vocab_size)
    engine = DynamicInferenceEngine(model, tokenizer, ENGINE)
    again = engine.generate(["The cat", "A dog"], SamplingParams(temperature=0, num_tokens_to_generate=8))
    assert [o.text for o in outputs] == [o.text for o in again] and all(o.token_ids for o in outputs)
