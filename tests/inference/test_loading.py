"""load_for_inference: a `teratron train` checkpoint (saved under TP = 2) and an import-hf
checkpoint load, in any layout, into a model whose logits are the training model's (or
transformers'), with the tokenizer the checkpoint carries and no tokenizer flags."""

import json
import os
import shutil

import pytest
import torch
from torch.testing import assert_close

from convert.hf_testing import VOCAB, finetune, ids_and_positions, save_random_hf_model
from dist import run_distributed
from inference.server_testing import BYTE_VOCAB, CHATML, write_byte_tokenizer
from teratron import cli
from teratron.dist_checkpointing import storage
from teratron.dist_checkpointing.model_state import unwrap
from teratron.inference.loading import generation_stop_token_ids, load_chat_template, load_for_inference
from teratron.tokenizers import HuggingFaceTokenizer, NullTokenizer
from teratron.training.arguments import parse_train_args
from teratron.training.config import build_run_config
from teratron.training.training import pretrain

TRAIN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-layers", "2",
         "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
         "--seq-length", "16", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-2", "--train-iters", "3", "--eval-iters", "0", "--num-workers", "0",
         "--no-progress-bar", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0"]
HF_CONFIG = dict(vocab_size=BYTE_VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                 eos_token_id=[256, 258])


def _logits(model):
    with torch.no_grad():
        return model(*ids_and_positions(), None, runtime_gather_output=True)


def _train_tp2(save):
    """Train 3 iterations under TP = 2 and save; the trained model's logits."""
    logits = []
    run = build_run_config(parse_train_args(TRAIN + ["--tensor-model-parallel-size", "2", "--save", save,
                                                     "--save-interval", "3"]))
    pretrain(run, after_training=lambda trainer: logits.append(_logits(unwrap(trainer.model[0]).eval())))
    return logits[0]


def _load_tp2(save):
    model, tokenizer = load_for_inference(save, tensor_model_parallel_size=2)
    assert model.output_layer.weight.shape[0] == 128  # this rank's half of the padded vocabulary
    return _logits(model), type(tokenizer).__name__


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(save directory of a TP = 2 run, the trained model's logits)."""
    save = str(tmp_path_factory.mktemp("trained") / "ckpt")
    return save, run_distributed(_train_tp2, 2, save)[0]


def test_trained_checkpoint_loads_with_its_tokenizer(trained):
    save, reference = trained
    model, tokenizer = load_for_inference(save)  # TP = 1, from the save directory
    assert not model.training and not any(p.requires_grad and p.grad is not None for p in model.parameters())
    logits = _logits(model)
    assert logits.shape[-1] == 256 and reference.shape == logits.shape
    assert_close(logits[..., :100], reference[..., :100], rtol=0, atol=1e-5)
    assert torch.isneginf(logits[..., 100:]).all()
    assert isinstance(tokenizer, NullTokenizer) and tokenizer.vocab_size == 100 and tokenizer.eod == 99
    assert load_chat_template(save) is None and generation_stop_token_ids(save) == ()

    iteration_folder = storage.iteration_dir(save, 3)  # the same from the iteration folder, in bf16
    model, _ = load_for_inference(iteration_folder, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    fp32, _ = load_for_inference(iteration_folder)
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    for (name, p), q in zip(model.named_parameters(), fp32.parameters()):
        assert torch.equal(p, q.to(torch.bfloat16)), name


def test_batch_invariant_mode_is_set_on_the_loaded_model(trained):
    save, _ = trained
    assert not load_for_inference(save)[0].config.batch_invariant_mode
    assert load_for_inference(save, batch_invariant_mode=True)[0].config.batch_invariant_mode


def test_trained_checkpoint_loads_under_tensor_parallelism(trained):
    save, reference = trained
    for logits, tokenizer in run_distributed(_load_tp2, 2, save):
        assert_close(logits[..., :100], reference[..., :100], rtol=0, atol=1e-5)
        assert tokenizer == "NullTokenizer"


def _import(tmp_path, chat_template=CHATML):
    src, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    reference = save_random_hf_model("LlamaConfig", "LlamaForCausalLM", HF_CONFIG, src, "10MB")
    write_byte_tokenizer(src, chat_template)
    assert cli.main(["convert", "import-hf", "--hf-path", str(src), "--save", str(ckpt),
                     "--tensor-model-parallel-size", "2"]) == 0
    return str(ckpt), reference


def test_imported_checkpoint_loads_with_hf_tokenizer_and_chat_template(tmp_path):
    ckpt, reference = _import(tmp_path)
    model, tokenizer = load_for_inference(ckpt)
    assert_close(_logits(model)[..., :BYTE_VOCAB], reference, rtol=0, atol=1e-4)
    assert isinstance(tokenizer, HuggingFaceTokenizer) and tokenizer.vocab_size == BYTE_VOCAB
    assert tokenizer.tokenize("hi") == [104, 105] and tokenizer.eod == 256
    template = load_chat_template(ckpt)
    text = template.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert template.tokenize(text) == [257, *b"user\nhi", 258, 10, 257, *b"assistant\n"]
    assert generation_stop_token_ids(ckpt) == (256, 258)  # transformers' generation_config.json


def test_template_in_chat_template_jinja(tmp_path):
    """transformers 5 saves the template as chat_template.jinja; import-hf copies it along."""
    ckpt, _ = _import(tmp_path, chat_template=None)
    hf = os.path.join(ckpt, storage.HF_DIRNAME)
    assert load_chat_template(ckpt) is None
    with open(os.path.join(hf, "chat_template.jinja"), "w") as f:
        f.write("{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    with open(os.path.join(hf, "tokenizer_config.json")) as f:
        config = json.load(f)
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({**config, "bos_token": {"content": "<|im_start|>"}}, f)
    assert load_chat_template(ckpt).render([{"role": "user", "content": "a"}]) == "<|im_start|>[a]"


def test_finetuned_import_uses_the_run_tokenizer(tmp_path):
    """A run fine-tuned from an import keeps hf/; when it trained with another vocabulary, the
    run's tokenizer is the model's."""
    src, ckpt, trained = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "trained"
    save_random_hf_model("LlamaConfig", "LlamaForCausalLM", {**HF_CONFIG, "vocab_size": VOCAB, "eos_token_id": None},
                         src, "10MB")
    assert cli.main(["convert", "import-hf", "--hf-path", str(src), "--save", str(ckpt)]) == 0
    finetune(ckpt, trained, "--num-layers", "2", "--ffn-hidden-size", "40", "--disable-bias-linear")
    assert os.path.isdir(trained / storage.HF_DIRNAME)
    _, tokenizer = load_for_inference(str(trained))
    assert isinstance(tokenizer, NullTokenizer) and tokenizer.vocab_size == VOCAB
    _, tokenizer = load_for_inference(str(ckpt))
    assert isinstance(tokenizer, HuggingFaceTokenizer)


def test_finetuned_import_keeps_the_hf_tokenizer(tmp_path):
    """Trained with the imported tokenizer (same vocabulary), the checkpoint serves with hf/'s
    copy, which carries the chat template, even once the run's tokenizer file is gone."""
    ckpt, _ = _import(tmp_path)
    trained, tokenizer_copy = tmp_path / "trained", tmp_path / "tokenizer"
    shutil.copytree(tmp_path / "hf", tokenizer_copy)
    finetune(ckpt, trained, "--num-layers", "2", "--ffn-hidden-size", "40", "--disable-bias-linear",
             "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer_copy))
    shutil.rmtree(tokenizer_copy)
    _, tokenizer = load_for_inference(str(trained))
    assert isinstance(tokenizer, HuggingFaceTokenizer) and tokenizer.vocab_size == BYTE_VOCAB
    assert tokenizer.tokenize("hi") == [104, 105]
    assert load_chat_template(str(trained)) is not None


def test_bad_folders_are_one_line_errors(tmp_path, trained):
    with pytest.raises(FileNotFoundError, match="neither a checkpoint folder"):
        load_for_inference(str(tmp_path / "missing"))
    no_args = tmp_path / "no_args"
    shutil.copytree(trained[0], no_args)
    folder = storage.iteration_dir(str(no_args), 3)
    metadata = storage.read_metadata(folder)
    del metadata["model_args"]
    storage.write_metadata(folder, metadata)
    with pytest.raises(ValueError, match="records no model_args"):
        load_for_inference(str(no_args))

    ckpt, _ = _import(tmp_path / "imported")
    os.remove(os.path.join(ckpt, storage.HF_DIRNAME, "tokenizer.json"))
    with pytest.raises(ValueError, match="the checkpoint has no tokenizer") as error:
        load_for_inference(ckpt)
    assert "\n" not in str(error.value)
