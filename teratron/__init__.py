"""teratron: train large transformer language models with Megatron Core's feature set."""

__version__ = "0.1.0"

# Imported first so it records the launcher's pid as soon as a rank starts (`parent_death`).
from teratron import parent_death  # noqa: E402,F401
