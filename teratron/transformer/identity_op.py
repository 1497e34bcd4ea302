"""Placeholders a spec uses where a submodule is switched off (Megatron: `identity_op`)."""

import torch


class IdentityOp(torch.nn.Module):
    """A module that returns its first input; accepts (and ignores) any constructor arguments."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x

