"""The audit parameter block: isolated coordinates for white-box Dirac canaries (docs/audit.md,
"Full MNIST"). Used by benchmarks/audit_mnist.py and the bug zoo (benchmarks/bug_zoo.py)."""

from __future__ import annotations

import torch


class AuditBlock(torch.nn.Module):
    """The network plus an audit parameter block: a ``side`` x ``side`` linear layer applied to
    zeros, its (zero) output added to the logits. No training example ever has a gradient there
    (the layer's input is 0), so the clipping and the function are the network's; DP-SGD adds its
    noise to the block like to every trainable parameter, and Dirac canaries on the block's
    coordinates are the isolated gradient canaries of the analysis (nothing but the canary and
    the noise lands on them). The block is the last parameter of the model."""

    def __init__(self, net: torch.nn.Module, side: int):
        super().__init__()
        self.net = net
        self.audit = torch.nn.Linear(side, side, bias=False)
        torch.nn.init.zeros_(self.audit.weight)

    def forward(self, x):
        out = self.net(x)
        z = self.audit(x.new_zeros(x.shape[0], self.audit.in_features))
        return out + z[:, :1]
