"""Hugging Face <-> teratron conversion: `hf.from_hf` (a model in memory), `hf.import_hf` /
`hf.export_hf` (checkpoints on disk; the `teratron convert` command in `cli`), the weight table
in `hf_mapping` and the config mapping in `hf_config`."""
