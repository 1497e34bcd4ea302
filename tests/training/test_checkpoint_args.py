"""`--use-checkpoint-args` (teratron.training.checkpoint_args): the architecture flags come from
--load's checkpoint (teratron's recorded model args, or a Megatron-LM checkpoint's args), a flag
given with another value is refused in one line naming both, and a checkpoint of another model
is refused naming the flags that differ."""

import json
import os
import shutil

import pytest

from convert.hf_testing import VOCAB, save_random_hf_model
from teratron import cli
from teratron.dist_checkpointing import save_checkpoint, storage
from teratron.dist_checkpointing.model_args import gpt_config_from_model_args, model_args_from_config
from teratron.models.gpt.builder import build_gpt_model
from teratron.process_groups import ProcessGroupCollection
from teratron.training.arguments import flag_values, flags_by_dest, parse_train_args
from teratron.training.checkpoint_args import checkpoint_flag_values
from teratron.training.config import run_config_from_args

# The training flags of a run: no architecture flag among them.
TRAINING = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3"]
MEGATRON_FIXTURE = os.path.join(os.path.dirname(__file__), "..", "dist_checkpointing", "fixtures", "megatron_core",
                                "tp1")

GDP_SPEC = ["megatron.core.models.hybrid.hybrid_layer_specs", "gdp_stack_spec"]
HYBRID = ["--hybrid-layer-pattern", "M*-M", "--hidden-size", "32", "--num-attention-heads", "4", "--mamba-state-dim",
          "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2"]

# Architectures whose flags differ from the defaults in every recorded field they touch.
ARCHITECTURES = {
    "llama": ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
              "--num-query-groups", "2", "--ffn-hidden-size", "96", "--swiglu", "--normalization", "RMSNorm",
              "--norm-epsilon", "1e-6", "--disable-bias-linear", "--position-embedding-type", "rope",
              "--rotary-base", "500000", "--rotary-percent", "0.5", "--untie-embeddings-and-output-weights",
              "--max-position-embeddings", "64", "--qk-layernorm", "--use-rope-scaling", "--rope-scaling-factor", "4",
              "--rope-scaling-original-max-position-embeddings", "32", "--mtp-num-layers", "1"],
    "gpt2": ["--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "4", "--kv-channels", "16",
             "--add-qkv-bias", "--max-position-embeddings", "40", "--rotary-interleaved", "--openai-gelu"],
    "moe": ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--swiglu",
            "--disable-bias-linear", "--position-embedding-type", "rope", "--num-experts", "4",
            "--moe-ffn-hidden-size", "24", "--moe-router-topk", "2", "--moe-layer-freq", "[0,1,1,1]",
            "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate", "--moe-grouped-gemm",
            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-topk-scaling-factor", "2.5", "--moe-router-pre-softmax"],
    "mla": ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--multi-latent-attention",
            "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "8",
            "--v-head-dim", "16", "--rope-type", "yarn", "--rotary-scaling-factor", "4", "--mscale", "0.7",
            "--mscale-all-dim", "0.7", "--yarn-original-max-position-embeddings", "8", "--position-embedding-type",
            "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"],
    "gpt_oss": ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--quick-geglu",
                "--position-embedding-type", "yarn", "--rotary-scaling-factor", "8",
                "--yarn-original-max-position-embeddings", "8", "--no-yarn-correction-range-round-to-int",
                "--window-size", "8,0", "--window-attn-skip-freq", "2", "--softmax-type", "learnable",
                "--activation-func-clamp-value", "7", "--glu-linear-offset", "1", "--no-rope-freq", "[0,1]",
                "--attention-backend", "local"],
    "gdp": HYBRID + ["--spec", *GDP_SPEC, "--gdp-num-householder", "2"],
}


def _run(argv):
    return run_config_from_args(parse_train_args(argv), 1, vocab_size=100, cuda=False)


def _write_checkpoint(root, model_args, layout=None, iteration=3):
    """A save folder whose tracker names an iteration holding only metadata.json: all that
    --use-checkpoint-args reads."""
    folder = storage.iteration_dir(str(root), iteration)
    os.makedirs(folder)
    storage.write_metadata(folder, {"iteration": iteration, "model_args": model_args, "layout": layout or {}})
    (root / storage.TRACKER_FILENAME).write_text(str(iteration))
    return str(root)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_the_checkpoint_gives_the_same_model(name, tmp_path):
    """A run described by the checkpoint's record alone records the same model again."""
    saved = model_args_from_config(_run(TRAINING + ARCHITECTURES[name]).model)
    load = _write_checkpoint(tmp_path / "ckpt", saved)
    run = _run(TRAINING + ["--load", load, "--use-checkpoint-args"])
    assert model_args_from_config(run.model) == saved
    default = model_args_from_config(_run(TRAINING + ["--num-layers", "2", "--hidden-size", "32",
                                                      "--num-attention-heads", "4"]).model)
    assert len({k for k in saved if saved[k] != default.get(k)}) >= 5  # the round trip is not of defaults


def test_flags_equal_to_the_checkpoints_are_fine_and_a_different_one_is_named(tmp_path):
    saved = model_args_from_config(_run(TRAINING + ARCHITECTURES["moe"]).model)
    load = _write_checkpoint(tmp_path / "ckpt", saved)
    base = TRAINING + ["--load", load, "--use-checkpoint-args"]
    same = ["--num-layers", "4", "--disable-bias-linear", "--swiglu", "--moe-layer-freq", "[0,1,1,1]",
            "--max-position-embeddings", "32", "--mtp-num-layers", "1"]
    args = parse_train_args(base + same)
    assert (args.num_layers, args.add_bias_linear, args.num_experts) == (4, False, 4)
    assert args.max_position_embeddings == 32 and args.mtp_num_layers == 1  # resized table, MTP added: allowed
    folder = storage.iteration_dir(load, 3)
    with pytest.raises(ValueError) as error:
        parse_train_args(base + ["--num-layers", "6", "--hidden-size", "32", "--add-qkv-bias",
                                 "--untie-embeddings-and-output-weights"])
    assert str(error.value) == (
        f"--use-checkpoint-args: the command line contradicts --load {folder}: --add-qkv-bias (checkpoint off, "
        "command line on); --num-layers (checkpoint 4, command line 6); --untie-embeddings-and-output-weights "
        "(checkpoint off, command line on); drop the conflicting flags (the checkpoint gives them)")
    with pytest.raises(ValueError, match=r"--num-experts \(checkpoint 4, command line 8\)"):
        parse_train_args(base + ["--num-experts", "8"])
    # --config values are the command line's too.
    config = tmp_path / "run.yaml"
    config.write_text("moe-layer-freq: 2\n")
    with pytest.raises(ValueError, match=r"--moe-layer-freq \(checkpoint \[0, 1, 1, 1\], command line 2\)"):
        parse_train_args(base + ["--config", str(config)])


def test_an_inverted_switch_reads_as_its_flag(tmp_path):
    saved = model_args_from_config(_run(TRAINING + ARCHITECTURES["gpt2"]).model)  # biases on
    load = _write_checkpoint(tmp_path / "ckpt", saved)
    with pytest.raises(ValueError, match=r"contradicts .*: --disable-bias-linear \(checkpoint off, command line "
                                         r"on\); "):
        parse_train_args(TRAINING + ["--load", load, "--use-checkpoint-args", "--disable-bias-linear"])


def test_parallel_sizes_from_the_checkpoint(tmp_path):
    saved = model_args_from_config(_run(TRAINING + ARCHITECTURES["llama"]).model)
    layout = {"world_size": 8, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
              "virtual_pipeline_model_parallel_size": None, "data_parallel_size": 2, "expert_model_parallel_size": 1}
    load = _write_checkpoint(tmp_path / "ckpt", saved, layout)
    base = TRAINING + ["--load", load, "--use-checkpoint-args"]
    assert parse_train_args(base).tensor_model_parallel_size == 1  # the model's flags only
    args = parse_train_args(base + ["--use-mp-args-from-checkpoint-args", "--tensor-model-parallel-size", "2"])
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size,
            args.virtual_pipeline_model_parallel_size) == (2, 2, 1, None)
    with pytest.raises(ValueError, match=r"--pipeline-model-parallel-size \(checkpoint 2, command line 4\)"):
        parse_train_args(base + ["--use-mp-args-from-checkpoint-args", "--pipeline-model-parallel-size", "4"])
    with pytest.raises(ValueError, match="^--use-mp-args-from-checkpoint-args takes the parallel sizes along with "
                                         "the architecture; add --use-checkpoint-args$"):
        parse_train_args(TRAINING + ["--load", load, "--use-mp-args-from-checkpoint-args"])


def test_refusals_without_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="^--use-checkpoint-args takes the architecture flags from --load's "
                                         "checkpoint; add --load DIR$"):
        parse_train_args(TRAINING + ["--use-checkpoint-args"])
    with pytest.raises(FileNotFoundError, match=f"^--use-checkpoint-args: --load {tmp_path} holds no checkpoint"):
        parse_train_args(TRAINING + ["--use-checkpoint-args", "--load", str(tmp_path)])
    load = _write_checkpoint(tmp_path / "ckpt", {})
    with pytest.raises(ValueError, match="records no model_args; pass the architecture flags"):
        parse_train_args(TRAINING + ["--use-checkpoint-args", "--load", load])


def test_megatron_args_in_teratron_terms(tmp_path):
    """A Megatron-LM checkpoint's args: the query groups without --group-query-attention are the
    heads, --norm-epsilon's and --apply-layernorm-1p's destinations of either era,
    disable_bias_linear of the old foundation models; what the args lack is left to the command line."""
    model_args = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=48,
                      kv_channels=8, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
                      add_qkv_bias=False, qk_layernorm=False, position_embedding_type="rope", rotary_base=10000,
                      rotary_percent=1.0, rotary_interleaved=False, untie_embeddings_and_output_weights=True,
                      max_position_embeddings=16, vocab_size=64, padded_vocab_size=64)
    model = build_gpt_model(gpt_config_from_model_args(model_args), pg_collection=ProcessGroupCollection())
    megatron_args = dict(model_args, group_query_attention=False, num_query_groups=1, layernorm_epsilon=1e-6,
                         apply_layernorm_1p=True, disable_bias_linear=True, tensor_model_parallel_size=2)
    del megatron_args["norm_epsilon"], megatron_args["add_bias_linear"], megatron_args["qk_layernorm"]
    save_checkpoint(str(tmp_path), 5, [model], metadata={"model_args": megatron_args}, ckpt_format="torch_dist")
    folder, values = checkpoint_flag_values(str(tmp_path), with_parallel_sizes=True)
    assert folder == storage.iteration_dir(str(tmp_path), 5)
    assert (values["num_query_groups"], values["group_query_attention"]) == (4, False)
    assert (values["norm_epsilon"], values["layernorm_zero_centered_gamma"], values["add_bias_linear"]) == (
        1e-6, True, False)
    assert "qk_layernorm" not in values and "vocab_size" not in values and "padded_vocab_size" not in values
    assert values["tensor_model_parallel_size"] == 2


def test_megatron_hybrid_patterns_of_either_era():
    """A Megatron hybrid model's layers: --hybrid-layer-pattern, or the older --hybrid-override-pattern
    and --mtp-hybrid-override-pattern joined as Megatron joins them; '|' (the saving run's pipeline
    stages) left out."""
    from teratron.training.checkpoint_args import _megatron_model_args

    assert _megatron_model_args({"num_layers": 4, "hybrid_layer_pattern": None})["hybrid_layer_pattern"] is None
    assert _megatron_model_args({"hybrid_layer_pattern": "M*|M-/M-"})["hybrid_layer_pattern"] == "M*M-/M-"
    older = {"hybrid_override_pattern": "M*M-", "mtp_hybrid_override_pattern": "M-", "mtp_num_layers": 2}
    assert _megatron_model_args(older)["hybrid_layer_pattern"] == "M*M-/M-/M-"
    assert _megatron_model_args({"hybrid_override_pattern": "MG*E"})["hybrid_layer_pattern"] == "MG*E"
    without_depths = {"hybrid_override_pattern": "M*", "mtp_hybrid_override_pattern": "M-", "mtp_num_layers": None}
    assert _megatron_model_args(without_depths)["hybrid_layer_pattern"] == "M*"  # Megatron builds no MTP then


def test_megatron_hybrid_specs():
    """Megatron's --spec: its Gated Delta Product stack gives GDP M layers (with --gdp-num-householder);
    its Mamba-2 stack (either module path), GPT layer specs and none give teratron's record without them;
    another stack of the hybrid module is refused in one line."""
    from teratron.training.checkpoint_args import _megatron_model_args

    gdp = _megatron_model_args({"hybrid_layer_pattern": "M*M-", "spec": GDP_SPEC, "gdp_num_householder": 2})
    assert (gdp["spec"], gdp["gdp_num_householder"]) == (GDP_SPEC, 2)
    for spec in (["megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"],
                 ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"],
                 ["megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"], [], None):
        assert _megatron_model_args({"hybrid_layer_pattern": "M*M-", "spec": spec})["spec"] is None, spec
    assert "spec" not in _megatron_model_args({"hybrid_layer_pattern": "M*M-"})
    inference = _megatron_model_args({"hybrid_layer_pattern": "M*M-", "spec": [GDP_SPEC[0], "gdp_inference_stack_spec"]})
    assert inference["spec"] == GDP_SPEC  # Megatron's inference-optimized stack: the same layers
    with pytest.raises(ValueError, match=r"^--spec megatron.core.models.hybrid.hybrid_layer_specs my_stack_spec: "
                                         r"teratron builds its layers without Megatron's specs"):
        _megatron_model_args({"hybrid_layer_pattern": "M*M-", "spec": [GDP_SPEC[0], "my_stack_spec"]})


def test_a_spec_is_compared_by_the_layers_it_builds(tmp_path):
    """--use-checkpoint-args with --spec: Mamba-2's hybrid_stack_spec agrees with a Mamba checkpoint (which
    records none); gdp_stack_spec contradicts it, and a GDP checkpoint gives the spec itself."""
    saved = model_args_from_config(_run(TRAINING + HYBRID).model)
    assert (saved["spec"], saved["gdp_num_householder"]) == (None, 3)
    base = TRAINING + ["--load", _write_checkpoint(tmp_path / "mamba", saved), "--use-checkpoint-args"]
    assert not _run(base + ["--spec", GDP_SPEC[0], "hybrid_stack_spec"]).model.transformer.gdp_layers
    with pytest.raises(ValueError, match=r"--spec \(checkpoint unset, command line \['megatron.core.models.hybrid."
                                         r"hybrid_layer_specs', 'gdp_stack_spec'\]\)"):
        parse_train_args(base + ["--spec", *GDP_SPEC])
    gdp = model_args_from_config(_run(TRAINING + ARCHITECTURES["gdp"]).model)
    run = _run(TRAINING + ["--load", _write_checkpoint(tmp_path / "gdp", gdp), "--use-checkpoint-args"])
    assert (run.model.transformer.gdp_layers, run.model.transformer.gdp_num_householder) == (True, 2)


def test_mismatch_errors_name_the_flags():
    assert set(flags_by_dest()) >= set(model_args_from_config(_run(TRAINING + ARCHITECTURES["llama"]).model))
    assert flag_values("add_bias_linear", ("saved", False), ("now", True)) == \
        "--disable-bias-linear (saved on, now off)"
    assert flag_values("untie_embeddings_and_output_weights", ("saved", True), ("now", False)) == \
        "--untie-embeddings-and-output-weights (saved on, now off)"
    assert flag_values("norm_epsilon", ("saved", 1e-6), ("now", 1e-5)) == "--norm-epsilon (saved 1e-06, now 1e-05)"
    assert flag_values("window_size", ("saved", (8, 0)), ("now", None)) == "--window-size (saved [8, 0], now unset)"


# ----- through `teratron train` ------------------------------------------------------------------------

HF_LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=500000.0,
                attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
TRAIN = ["train", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--seq-length", "16",
         "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0", "--num-workers", "0",
         "--no-progress-bar", "--log-interval", "1"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("imported")
    save_random_hf_model("LlamaConfig", "LlamaForCausalLM", HF_LLAMA, root / "hf", "10MB")
    assert cli.main(["convert", "import-hf", "--hf-path", str(root / "hf"), "--save", str(root / "ckpt")]) == 0
    return str(root / "ckpt")


def _model_args(save):
    return storage.read_metadata(storage.resolve_checkpoint_dir(save))["model_args"]


def test_finetune_an_imported_model_with_no_architecture_flags(imported, tmp_path):
    trained = str(tmp_path / "trained")
    assert cli.main(TRAIN + ["--load", imported, "--finetune", "--use-checkpoint-args", "--save", trained]) == 0
    assert storage.read_tracker(trained) == 2
    built = _model_args(trained)
    expected = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=40,
                    kv_channels=8, normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, add_bias_linear=True,
                    position_embedding_type="rope", rotary_base=500000, untie_embeddings_and_output_weights=True,
                    max_position_embeddings=64, vocab_size=VOCAB)
    assert {k: built[k] for k in expected} == expected
    imported_args = _model_args(imported)  # what the import records; the run's padding is its own
    assert {k: built[k] for k in imported_args if k != "padded_vocab_size"} == \
        {k: v for k, v in imported_args.items() if k != "padded_vocab_size"}
    # The weights are the import's: a fine-tune of 2 steps at lr 1e-3 stays close to them.
    from teratron.dist_checkpointing import load_full
    from teratron.dist_checkpointing.model_state import is_model_key
    before = load_full(storage.resolve_checkpoint_dir(imported), is_model_key)
    after = load_full(storage.resolve_checkpoint_dir(trained), is_model_key)
    key = "decoder.layers.0.mlp.linear_fc1.weight"
    assert 0 < (after[key] - before[key]).abs().max() < 0.01


def test_a_conflicting_flag_stops_before_anything_is_written(imported, tmp_path, capsys):
    out = tmp_path / "out"
    status = cli.main(TRAIN + ["--load", imported, "--finetune", "--use-checkpoint-args", "--save", str(out),
                               "--num-query-groups", "4", "--group-query-attention", "--swiglu"])
    assert status == 2 and not out.exists()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"teratron: error: --use-checkpoint-args: the command line contradicts --load "
                     f"{storage.iteration_dir(imported, 0)}: --num-query-groups (checkpoint 2, command line 4); drop "
                     "the conflicting flags (the checkpoint gives them)"]


def test_another_model_is_named_by_its_flags(imported, tmp_path, capsys):
    flags = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
             "--num-query-groups", "2", "--ffn-hidden-size", "40", "--swiglu", "--normalization", "RMSNorm",
             "--norm-epsilon", "1e-6", "--position-embedding-type", "rope", "--rotary-base", "500000",
             "--untie-embeddings-and-output-weights", "--max-position-embeddings", "64"]
    status = cli.main(TRAIN + ["--load", imported, "--finetune", *flags, "--disable-bias-linear",
                               "--save", str(tmp_path / "out")])
    assert status == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f"teratron: error: --load {storage.iteration_dir(imported, 0)}: the checkpoint holds another "
                     "model: --disable-bias-linear (saved off, now on); pass the architecture flags it was saved "
                     "with, or --use-checkpoint-args to take them from it")
    assert cli.main(TRAIN + ["--load", imported, "--finetune", *flags, "--save", str(tmp_path / "out")]) == 0


def test_openai_gelu_trains_is_recorded_and_a_plain_gelu_resume_is_refused(tmp_path, capsys):
    """`teratron train --openai-gelu` records openai_gelu; resuming without the flag names it,
    --use-checkpoint-args resumes with it."""
    save = str(tmp_path / "ckpt")
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
    assert cli.main(TRAIN + flags + ["--openai-gelu", "--save", save]) == 0
    assert storage.read_tracker(save) == 2 and _model_args(save)["openai_gelu"] is True
    capsys.readouterr()
    resume = ["--load", save, "--save", save, "--train-iters", "3", "--use-checkpoint-opt_param-scheduler"]
    assert cli.main(TRAIN + flags + resume) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f"teratron: error: --load {storage.iteration_dir(save, 2)}: the checkpoint holds another "
                     "model: --openai-gelu (saved on, now off); pass the architecture flags it was saved with, or "
                     "--use-checkpoint-args to take them from it")
    assert cli.main(TRAIN + resume + ["--use-checkpoint-args"]) == 0
    assert storage.read_tracker(save) == 3 and _model_args(save)["openai_gelu"] is True


def test_a_megatron_checkpoint_trains_with_no_architecture_flags(tmp_path):
    load = tmp_path / "megatron"
    shutil.copytree(MEGATRON_FIXTURE, load)
    metrics = tmp_path / "metrics.jsonl"
    argv = ["train", "--load", str(load), "--no-load-optim", "--use-checkpoint-args", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "64", "--make-vocab-size-divisible-by", "64", "--seq-length", "8",
            "--micro-batch-size", "2", "--train-iters", "7", "--lr", "1e-3", "--log-interval", "1", "--eval-iters",
            "0", "--no-progress-bar", "--num-workers", "0", "--metrics-file", str(metrics)]
    run = run_config_from_args(parse_train_args(argv[1:]), 1, vocab_size=64, cuda=False)
    t = run.transformer
    assert (t.num_layers, t.hidden_size, t.num_attention_heads, t.num_query_groups, t.ffn_hidden_size) == (2, 32, 4, 2,
                                                                                                            48)
    assert (t.normalization, t.gated_linear_unit, t.add_bias_linear) == ("RMSNorm", True, False)
    assert (run.model.position_embedding_type, run.model.share_embeddings_and_output_weights) == ("rope", False)
    assert cli.main(argv) == 0
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [6, 7]

