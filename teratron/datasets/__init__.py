"""The data pipeline, module for module as Megatron Core's `megatron.core.datasets`:

- `indexed_dataset`: the `.bin/.idx` format (`IndexedDataset`, `IndexedDatasetBuilder`, `DType`)
- `vocab_check`: the start-up check of a dataset's token ids against the vocabulary (cached)
- `gpt_dataset`: `GPTDatasetConfig`, `GPTDataset`, `MockGPTDataset` (`--mock-data`)
- `blended_dataset`, `blended_megatron_dataset_builder`: weighted blends and the train/valid/test build
- `helpers`: the sample and blending index builders (numpy)
- `data_samplers`: `MegatronPretrainingSampler`, `build_pretraining_data_loader`
- `preprocess`: `teratron preprocess` (JSONL -> `.bin/.idx`)
- `utils`: `Split`, `--data-path` / `--split` parsing, per-split sample counts
"""
