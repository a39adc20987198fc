"""RMSNorm modules of a traced model exported as QEfficient's ``CustomRMSNorm``.

QEfficient replaces every RMSNorm module with its compiler-known ``CustomRMSNorm`` (domain
``com.qti.aisw.onnx``, see :mod:`qaic_aot.export.norm_op`). The traced route does the same: each
module whose class is an RMSNorm and whose output is ``w * x / sqrt(mean(x^2) + eps)`` over the last
axis (or ``(1 + w) * ...``, Gemma's form, folded into the weight) is swapped for one that traces to
that op. What the module computes is checked on a random input first; a module that computes
something else keeps its own code.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from qaic_core.custom_ops import CUSTOM_OPS_DOMAIN, RMS_NORM

log = logging.getLogger("qaic.aot.export")

_TOLERANCE = 1e-5


class CustomRMSNormOp(torch.autograd.Function):
    """``weight * x / sqrt(mean(x^2, -1) + eps)``; exports as ``CustomRMSNorm(x, weight, epsilon)``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    @staticmethod
    def symbolic(g: Any, x: Any, weight: Any, eps: float) -> Any:
        return g.op(f"{CUSTOM_OPS_DOMAIN}::{RMS_NORM}", x, weight, epsilon_f=float(eps)).setType(x.type())


class CustomRMSNorm(nn.Module):
    """An RMSNorm with its effective weight (Gemma's ``1 + w`` folded in) and epsilon."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = CustomRMSNormOp.apply(x, self.weight, self.eps)
        return out


def _epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, int | float):
            return float(value)
    return None


def _custom(module: nn.Module) -> CustomRMSNorm | None:
    """The replacement for ``module``, or None when it is not an RMSNorm of either form."""
    if not type(module).__name__.endswith("RMSNorm"):
        return None
    weight = getattr(module, "weight", None)
    eps = _epsilon(module)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return None
    x = torch.randn(2, 3, weight.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = module(x)
        normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        for effective in (weight, 1.0 + weight):
            expected = effective * normed
            if got.shape == expected.shape and torch.allclose(
                got, expected, rtol=_TOLERANCE, atol=_TOLERANCE
            ):
                return CustomRMSNorm(effective, eps)
    return None


def replace_rms_norms(model: nn.Module) -> int:
    """Swap every RMSNorm module of ``model`` for :class:`CustomRMSNorm`; returns how many."""
    swaps: list[tuple[nn.Module, str, CustomRMSNorm]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            custom = _custom(child)
            if custom is not None:
                swaps.append((parent, name, custom))
    for parent, name, custom in swaps:
        setattr(parent, name, custom)
    if swaps:
        log.info("export: %d RMSNorm modules as %s", len(swaps), RMS_NORM)
    return len(swaps)
