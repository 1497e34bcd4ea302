"""FP8 training of the transformer layers' linear GEMMs through torch._scaled_mm (docs/performance.md "FP8")."""

from teratron.fp8.linear import Fp8Gemm
from teratron.fp8.recipe import Fp8Recipe, check_fp8_config, layer_uses_fp8

__all__ = ["Fp8Gemm", "Fp8Recipe", "check_fp8_config", "layer_uses_fp8"]
