"""Datasets and data loaders of a run (Megatron's `build_train_valid_test_datasets` and loaders)."""

from teratron.datasets.blended_dataset import BlendedDataset
from teratron.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from teratron.datasets.data_samplers import build_pretraining_data_loader
from teratron.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from teratron.datasets.sequence_packing import DocumentSamples, PackedBatches
from teratron.datasets.utils import get_blend_from_list, get_train_valid_test_num_samples


def _blend(paths, flag):
    return get_blend_from_list(None if paths is None else list(paths), flag)


def build_datasets(run, tokenizer):
    """[train, valid, test] datasets sized for the whole run (None for a split without data)."""
    data, training = run.data, run.training
    per_split = [_blend(data.train_data_path, "--train-data-path"),
                 _blend(data.valid_data_path, "--valid-data-path"),
                 _blend(data.test_data_path, "--test-data-path")]
    blend = _blend(data.data_path, "--data-path")
    config = GPTDatasetConfig(
        random_seed=training.seed,
        sequence_length=training.seq_length,
        blend=blend,
        blend_per_split=per_split if any(per_split) else None,
        split=data.split if blend is not None or data.mock_data else None,
        path_to_cache=data.data_cache_path,
        mid_level_dataset_surplus=data.mid_level_dataset_surplus,
        mmap_bin_files=data.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,  # documents go to the model as PackedSeqParams, not an s x s mask
    )
    sizes = get_train_valid_test_num_samples(training.train_iters, training.global_batch_size,
                                             training.eval_interval, training.eval_iters)
    if training.train_samples is not None:
        sizes[0] = training.train_samples  # Megatron sizes the training split by --train-samples
    cls = MockGPTDataset if config.mock else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def build_data_loader(run, dataset, consumed_samples, dp_rank: int, dp_size: int):
    """Micro-batches of this data-parallel rank, resuming after `consumed_samples`."""
    return build_pretraining_data_loader(dataset, consumed_samples, run.training.micro_batch_size,
                                         dp_rank, dp_size, num_workers=run.data.num_workers)


def build_packed_batches(run, dataset, consumed_samples, dp_rank: int, dp_size: int, tokenizer) -> PackedBatches:
    """--sequence-packing: this data-parallel rank's packed micro-batches of `dataset`'s documents,
    each padded to a multiple of 2 x CP (the per-document split of context parallelism)."""
    if isinstance(dataset, BlendedDataset):
        raise ValueError("--sequence-packing reads the documents of one dataset; give one --data-path prefix "
                         "(or per-split paths), not a blend")
    cp = run.transformer.context_parallel_size
    eod = tokenizer.eod if run.data.eod_mask_loss else None
    samples = DocumentSamples(dataset, run.training.seq_length, eod)
    return PackedBatches(samples, run.training.global_batch_size, consumed_samples, run.training.seq_length,
                         2 * cp if cp > 1 else 1, dp_rank, dp_size)
