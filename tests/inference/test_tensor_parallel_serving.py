"""`teratron generate` and `teratron serve` at --tensor-model-parallel-size 2 (two gloo ranks on
the CPU) answer exactly as at TP 1, and rank 0's engine calls reach the other rank: every step's
outputs are the same on both ranks, with the same request ids, across refused requests, seeded
and unseeded sampling, and aborts. The served pair answers concurrent requests and survives a
client that disconnects mid-stream; a signal to rank 0 (or Ctrl+C to both, as torchrun passes it
on) stops both processes."""

import concurrent.futures
import contextlib
import http.client
import io
import os
import signal
import subprocess
import sys

import pytest

from dist import free_ports, run_distributed
from inference.server_testing import default_ctrl_c
from inference.test_inference_cli import ENGINE, _post, drafts, imported, served  # noqa: F401 - fixtures
from teratron import cli
from teratron import parallel_state as ps
from teratron.inference.engines.dynamic_engine import DynamicInferenceEngine
from teratron.inference.loading import load_for_inference
from teratron.inference.sampling_params import SamplingParams
from teratron.inference.tensor_parallel_serving import BroadcastingEngine, EngineCallChannel, run_follower

SMALL = ["--inference-dynamic-batching-buffer-size-gb", "0.001", "--inference-dynamic-batching-block-size", "4"]


def _generate(argv_list):
    """On each rank: what `teratron generate` printed for each argv."""
    printed = []
    for argv in argv_list:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(argv) == 0
        printed.append(out.getvalue())
    return printed


def test_generate_under_tensor_parallelism_equals_tp1(imported, drafts, capsys):
    """Rank 0 prints TP 1's text, plain and with a draft model (itself loaded at TP 2); rank 1 prints nothing."""
    ckpt, _ = imported
    argv = ["generate", "--load", ckpt, "--prompt", "t9 t3 t27", "--max-tokens", "10", "--temperature", "0", *SMALL]
    assert cli.main(argv) == 0
    reference = capsys.readouterr().out
    assert len(reference.split()) == 10
    tp2 = [argv + ["--tensor-model-parallel-size", "2"]]
    tp2.append(tp2[0] + ["--draft-load", drafts[0], "--num-speculative-tokens", "2"])
    rank0, rank1 = run_distributed(_generate, 2, tp2)
    assert rank0 == [reference] * 2 and rank1 == [""] * 2


def _replay(ckpt):
    """Rank 0 drives a TP = 2 engine through a BroadcastingEngine (and shuts it down); rank 1
    follows. Every rank returns its engine's outputs, step by step, and its state at the end."""
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model, tokenizer = load_for_inference(ckpt, tensor_model_parallel_size=2)
    engine = DynamicInferenceEngine(model, tokenizer, ENGINE)
    steps, step = [], engine.step

    def recorded_step():
        outputs = step()
        steps.append([(o.request_id, o.token_ids, o.finish_reason) for o in outputs])
        return outputs

    engine.step = recorded_step
    channel = EngineCallChannel([0, 1])
    if ps.get_tensor_model_parallel_rank() == 0:
        _drive(BroadcastingEngine(engine, channel))
    else:
        run_follower(engine, channel)
    all_free = engine.context.allocator.num_free == engine.context.num_blocks
    return steps, engine.next_request_id, engine.has_unfinished_requests(), all_free


def _drive(leader: BroadcastingEngine) -> None:
    greedy = SamplingParams(temperature=0, num_tokens_to_generate=6)
    first = leader.add_request([4, 5, 6], greedy)
    with pytest.raises(ValueError, match="exceeds max_seq_length"):
        leader.add_request([1], SamplingParams(num_tokens_to_generate=1000))  # refused: not replayed
    unseeded = leader.add_request([7, 8], SamplingParams(temperature=1.0, num_tokens_to_generate=6))
    leader.step()
    doomed = leader.add_request([9] * 5, SamplingParams(temperature=0.8, seed=3, num_tokens_to_generate=8))
    leader.step()
    leader.abort(doomed)
    while leader.has_unfinished_requests():
        leader.step()
    assert (first, unseeded, doomed) == (0, 1, 2)
    leader.shutdown()
    assert not leader.has_unfinished_requests() and leader.step() == []


def test_follower_replays_rank0_engine_calls(imported):
    rank0, rank1 = run_distributed(_replay, 2, imported[0])
    steps, next_id, unfinished, all_free = rank0
    assert rank1 == rank0 and next_id == 3 and not unfinished and all_free
    finished = {request_id: reason for step in steps for request_id, _, reason in step if reason}
    assert set(finished) == {0, 1, 2} and finished[2] == "abort"
    assert len(steps) > 3 and all(tokens for step in steps[:2] for _, tokens, _ in step)


def _launch_tp2_server(ckpt, port, master):
    """`teratron serve --tensor-model-parallel-size 2` as two processes with torchrun's environment
    (`master`: the rendezvous port, not the server's)."""
    argv = [sys.executable, "-m", "teratron", "serve", "--load", ckpt, "--port", str(port),
            "--tensor-model-parallel-size", "2", *SMALL]
    return [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_ctrl_c,
                             env=dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master),
                                      WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank)))
            for rank in range(2)]


def _disconnect_mid_stream(url) -> None:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", body='{"prompt": [5, 6], "max_tokens": 60, "stream": true}',
                 headers={"Content-Type": "application/json"})
    assert conn.getresponse().readline().startswith(b"data: ")
    conn.sock.close()
    conn.close()


@pytest.mark.parametrize("stop", ["SIGINT to both", "SIGTERM to rank 0"])
def test_tensor_parallel_server_answers_as_tp1(imported, served, stop):
    ckpt, _ = imported
    tp1_url, _ = served
    port, master = free_ports(2)  # one call: a master port equal to the server's would take it first
    ranks = _launch_tp2_server(ckpt, port, master)
    url = f"http://127.0.0.1:{port}"
    try:
        line = ranks[0].stdout.readline()
        assert f"at {url}/v1" in line, ranks[0].stderr.read()
        requests = [{"prompt": p, "max_tokens": 10, "temperature": 0} for p in ("t1 t2 t3", "t200", "t42 t42")]
        if stop == "SIGINT to both":  # two at once, then again after a client left mid-stream
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                answers = list(pool.map(lambda body: _post(url, "/v1/completions", body), requests[:2]))
            _disconnect_mid_stream(url)
            answers.append(_post(url, "/v1/completions", requests[2]))
        else:
            requests = requests[:1]
            answers = [_post(url, "/v1/completions", requests[0])]
        for body, (status, answer) in zip(requests, answers):
            tp1_status, tp1_answer = _post(tp1_url, "/v1/completions", body)
            assert status == tp1_status == 200 and answer["choices"] == tp1_answer["choices"], body
            assert answer["usage"] == tp1_answer["usage"]
    finally:
        for rank in ranks if stop == "SIGINT to both" else ranks[:1]:
            rank.send_signal(signal.SIGINT if stop == "SIGINT to both" else signal.SIGTERM)
        try:
            results = [rank.communicate(timeout=60) for rank in ranks]
        finally:
            for rank in ranks:
                if rank.poll() is None:  # it hung: fail, leaving nothing behind
                    rank.kill()
                    rank.wait()
    (out0, err0), (out1, err1) = results
    if stop == "SIGINT to both":
        assert ranks[0].returncode == 130 and "teratron: interrupted" in err0, (out0, err0)
    else:
        assert ranks[0].returncode == 0 and "teratron serve: stopped" in out0, (out0, err0)
    assert ranks[1].returncode == 0 and out1 == "" and err1 == "", (out1, err1)
