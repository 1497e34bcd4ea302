"""teratron's own checkpoints of a hybrid model whose M layers are Gated Delta Product mixers
(`--spec megatron.core.models.hybrid.hybrid_layer_specs gdp_stack_spec`): the model record says so
(Megatron's arg names: `spec`, `gdp_num_householder`), a save by two tensor-parallel ranks resumes in one
process that takes its architecture from the record alone with the uninterrupted run's losses, and a
model rebuilt from the record (as export, generate and merge rebuild one) is a GDP model holding the
saved weights; a record without the keys (older checkpoints, imports) stays Mamba-2."""

import torch

from teratron.dist_checkpointing import load_checkpoint, load_full, storage
from teratron.dist_checkpointing.model_args import GDP_DEFAULTS, gpt_config_from_model_args
from teratron.dist_checkpointing.model_state import is_model_key
from teratron.models.gpt.builder import build_gpt_model
from teratron.ssm.gated_delta_product import GatedDeltaProductMixer
from test_hybrid_training import TINY
from train_runs import assert_same_losses, train, training_records

GDP_SPEC = ["megatron.core.models.hybrid.hybrid_layer_specs", "gdp_stack_spec"]
MODEL = TINY + ["--hybrid-layer-pattern", "MG*-E/M-"]  # every layer kind, and a GDP layer in the MTP depth


def test_a_gdp_checkpoint_at_tp2_resumes_at_tp1_from_its_record_and_rebuilds_a_gdp_model(tmp_path):
    gdp = ["--spec", *GDP_SPEC, "--gdp-num-householder", "2"]
    reference = training_records(train(MODEL + gdp, tmp_path, "single")[0])
    train(MODEL + gdp + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", str(tmp_path / "tp2"),
                         "--save-interval", "2", "--exit-interval", "2"], tmp_path, "tp2", nproc=2)
    folder = storage.iteration_dir(str(tmp_path / "tp2"), 2)
    record = storage.read_metadata(folder)["model_args"]
    assert (record["spec"], record["gdp_num_householder"]) == (GDP_SPEC, 2)

    resumed = training_records(train(MODEL + ["--load", str(tmp_path / "tp2"), "--use-checkpoint-args"],
                                     tmp_path, "tp1-from-tp2")[0])  # no --spec: the record gives it
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert_same_losses(reference, resumed, "tp1-from-tp2")

    model = build_gpt_model(gpt_config_from_model_args(record))
    mixers = [module for module in model.modules() if isinstance(module, GatedDeltaProductMixer)]
    assert len(mixers) == 2 and all(mixer.num_householder == 2 for mixer in mixers)  # the decoder's and MTP's
    load_checkpoint(folder, [model], load_rng=False)
    saved = load_full(folder, is_model_key)
    params = dict(model.named_parameters())
    assert params.keys() <= saved.keys()
    assert all(torch.equal(params[key], saved[key]) for key in params), "the rebuilt model holds the saved weights"

    older = {key: value for key, value in record.items() if key not in GDP_DEFAULTS}
    assert not gpt_config_from_model_args(older).transformer.gdp_layers
