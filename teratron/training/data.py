"""Datasets and data loaders of a run (Megatron's `build_train_valid_test_datasets` and loaders)."""

from teratron import parallel_state


def _blend(paths, flag):
    from teratron.datasets.utils import get_blend_from_list
    return get_blend_from_list(paths, flag)


def build_datasets(args, tokenizer):
    """[train, valid, test] datasets sized for the whole run (None for a split without data)."""
    from teratron.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from teratron.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from teratron.datasets.utils import get_train_valid_test_num_samples

    per_split = [_blend(args.train_data_path, "--train-data-path"),
                 _blend(args.valid_data_path, "--valid-data-path"),
                 _blend(args.test_data_path, "--test-data-path")]
    blend = _blend(args.data_path, "--data-path")
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=per_split if any(per_split) else None,
        split=args.split if blend is not None or args.mock_data else None,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.reset_attention_mask,
    )
    sizes = get_train_valid_test_num_samples(args.train_iters, args.global_batch_size,
                                             args.eval_interval, args.eval_iters)
    cls = MockGPTDataset if config.mock else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def build_data_loader(args, dataset, consumed_samples):
    from teratron.datasets.data_samplers import build_pretraining_data_loader

    return build_pretraining_data_loader(
        dataset, consumed_samples, args.micro_batch_size,
        parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
        num_workers=args.num_workers,
    )

