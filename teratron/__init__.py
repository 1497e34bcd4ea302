"""teratron: train large transformer language models with Megatron Core's feature set."""

__version__ = "0.1.0"
