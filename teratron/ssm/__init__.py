"""State-space and linear-recurrence layers of hybrid models (Megatron Core: `megatron.core.ssm`):
Mamba-2's chunked state-space scan (module `ssd`: its function `ssd` runs Triton kernels on GPUs,
`ssd_triton`, and plain PyTorch, `ssd_chunked`, elsewhere), its causal depthwise convolution
(`causal_conv1d`) and Gated DeltaNet's chunked gated delta rule (module `gated_delta_rule`: its
function `gated_delta_rule` runs Triton kernels on GPUs, `gated_delta_rule_triton`, and plain
PyTorch, `gated_delta_rule_chunked`, elsewhere); all but the two Triton paths in plain PyTorch
(the path the CPU tests run and the reference the GPU kernels are checked against); Gated
DeltaNet's mixer (`GatedDeltaNet`, tensor and sequence parallel); Gated Delta Product's
(`gated_delta_product`: M rank-one updates a token on the gated delta rule)."""

from teratron.ssm.causal_conv1d import causal_conv1d
from teratron.ssm.gated_delta_net import GatedDeltaNet
from teratron.ssm.gated_delta_rule import gated_delta_rule_chunked, gated_delta_rule_sequential
from teratron.ssm.ssd import ssd_chunked, ssd_sequential

__all__ = ["GatedDeltaNet", "causal_conv1d", "gated_delta_rule_chunked", "gated_delta_rule_sequential", "ssd_chunked",
           "ssd_sequential"]
