"""Decode CUDA graphs (GPU): an engine replaying them gives the tokens of the same engine without
them, for batches that fill a graph exactly, that pad one, and that mix prefill (eager) steps
with decode (graph) steps."""

import pytest
import torch

from inference.test_engine import PROMPTS, VOCAB, save_hf_model
from teratron.convert.hf import from_hf
from teratron.inference.config import InferenceConfig
from teratron.inference.engines import DynamicInferenceEngine
from teratron.inference.sampling_params import SamplingParams
from teratron.tokenizers.null_tokenizer import NullTokenizer


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(model, num_cuda_graphs):
    config = InferenceConfig(buffer_size_gb=0.01, block_size=4, max_requests=6, max_tokens_per_step=8,
                             num_cuda_graphs=num_cuda_graphs)
    return DynamicInferenceEngine(model, NullTokenizer(VOCAB), config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphs_give_the_tokens_of_eager_decode(tmp_path, dtype):
    save_hf_model("llama", tmp_path)
    model, _ = from_hf(str(tmp_path))
    model = model.to(device="cuda", dtype=dtype)
    params = SamplingParams(temperature=0, num_tokens_to_generate=12, ignore_eod=True)
    prompts = PROMPTS + [[3, 1, 4, 1, 5], [2, 7, 1, 8]]  # 6 requests: the graph of 6 rows, then fewer
    eager = _engine(model, 0)
    assert eager.cuda_graphs is None
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    graphed = _engine(model, -1)
    assert graphed.cuda_graphs.batch_sizes == [1, 2, 3, 4, 5, 6]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == expected
    assert graphed.cuda_graphs.num_replays > 0
    if dtype == torch.bfloat16:
        return  # below, padded rows change the GEMMs' shapes: equal only up to rounding
    some = _engine(model, 2)  # graphs of 1 and 6 rows: 3 requests replay 6 rows, 3 of them padding
    assert some.cuda_graphs.batch_sizes == [1, 6]
    assert [o.token_ids for o in some.generate(prompts[:3], params)] == expected[:3]
    assert some.cuda_graphs.num_replays > 0
