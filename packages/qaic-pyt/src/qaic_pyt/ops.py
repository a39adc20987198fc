"""Torch implementations of the vLLM layers whose own paths need CUDA-only kernels: all in this one place.

vLLM's layers dispatch to ``forward_oot`` on an out-of-tree platform, which is their pure-torch
``forward_native`` for norms, rotary embeddings, activations and linear layers. The exception is
the mixture-of-experts layer: its routing calls ``topk_softmax`` from vLLM's compiled kernels and
its unquantized method leaves out-of-tree platforms without an expert kernel. :func:`install`
replaces that method (vLLM's out-of-tree op registry) with :class:`TorchExpertsMethod`, which
routes and runs the experts in plain torch.

vLLM also registers some of its own Python ops (the MoE layer's ``vllm::moe_forward``) for the
platform's dispatch key only (``PrivateUse1``, the ``qaic`` device). On the simulator the tensors
are CPU tensors, so :func:`install` with ``cpu=True`` registers the same Python functions for the
CPU key too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

_installed = threading.Event()
_lock = threading.Lock()
MOE_METHOD = "UnquantizedFusedMoEMethod"
"""vLLM's class for unquantized experts; the out-of-tree registry replaces it by this name."""


CPU_MIRRORED_OPS: dict[str, tuple[str, str]] = {
    "moe_forward": ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "_moe_forward"),
    "moe_forward_shared": ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "_moe_forward_shared"),
}
"""vLLM ops registered for the platform's dispatch key only: op name -> (module, Python function)."""
_cpu_library: list[torch.library.Library] = []


def install(*, cpu: bool = False) -> None:
    """Register the torch implementations with vLLM (once per process; idempotent).

    ``cpu``: the eager device keeps CPU tensors (the simulator), so vLLM's platform-keyed ops get
    a CPU registration as well.
    """
    with _lock:
        if not _installed.is_set():
            from vllm.model_executor.custom_op import CustomOp, op_registry_oot

            if MOE_METHOD not in op_registry_oot:
                CustomOp.register_oot(_experts_method(), name=MOE_METHOD)
            _installed.set()
        if cpu and not _cpu_library:
            _cpu_library.append(_mirror_to_cpu())


def _mirror_to_cpu() -> torch.library.Library:
    import importlib

    library = torch.library.Library("vllm", "IMPL")  # kept alive in _cpu_library
    for op, (module, name) in CPU_MIRRORED_OPS.items():
        if not hasattr(torch.ops.vllm, op):
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm::{op}", "CPU"):
            continue
        library.impl(op, getattr(importlib.import_module(module), name), "CPU")
    return library


def _experts_method() -> type:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    class TorchExpertsMethod(UnquantizedFusedMoEMethod):  # type: ignore[misc]
        """Unquantized experts with routing and expert MLPs in plain torch (router logits in, output out)."""

        @property
        def is_monolithic(self) -> bool:
            return True

        def apply_monolithic(
            self, layer: Any, x: torch.Tensor, router_logits: torch.Tensor, input_ids: Any = None, **_: Any
        ) -> torch.Tensor:
            return torch_experts(layer, x, router_logits)

    return TorchExpertsMethod


def route(layer: Any, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token and their weights, as vLLM's default router computes them."""
    unsupported = [
        name
        for name, value in (
            ("grouped top-k routing", getattr(layer, "use_grouped_topk", False)),
            ("a custom routing function", getattr(layer, "custom_routing_function", None)),
            ("expert score correction bias", getattr(layer, "e_score_correction_bias", None)),
            ("router weights applied to the input", getattr(layer, "apply_router_weight_on_input", False)),
        )
        if value is not None and value is not False
    ]
    if unsupported:
        raise NotImplementedError(
            f"the qaic pyt path's torch experts do not implement {', '.join(unsupported)}"
        )
    logits = router_logits.float()
    scoring = getattr(layer, "scoring_func", "softmax")
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise NotImplementedError(f"MoE scoring function {scoring!r} is not implemented on the qaic pyt path")
    weights, ids = torch.topk(scores, int(layer.top_k), dim=-1)
    if getattr(layer, "renormalize", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    scale = getattr(layer, "routed_scaling_factor", None)
    if scale not in (None, 1.0):
        weights = weights * float(scale)
    return weights, ids


def _activate(layer: Any, h: torch.Tensor) -> torch.Tensor:
    name = getattr(getattr(layer, "activation", None), "value", "silu")
    gated = not str(name).endswith("_no_mul")
    base = str(name).removesuffix("_no_mul")
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "relu2": lambda t: torch.square(F.relu(t)),
    }
    if base not in fns:
        raise NotImplementedError(f"MoE activation {name!r} is not implemented on the qaic pyt path")
    if not gated:
        return fns[base](h)
    gate, up = h.chunk(2, dim=-1)
    return fns[base](gate) * up


def torch_experts(layer: Any, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
    """Route each token to its top-k experts and sum their gated MLPs, weighted."""
    if getattr(layer, "expert_map", None) is not None:
        raise NotImplementedError("expert parallelism is not supported on the qaic pyt path")
    weights, ids = route(layer, router_logits)
    w13, w2 = layer.w13_weight, layer.w2_weight  # [E, 2I, H] and [E, H, I]
    b13 = getattr(layer, "w13_bias", None)
    b2 = getattr(layer, "w2_bias", None)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        tokens, slot = (ids == expert).nonzero(as_tuple=True)
        h = F.linear(x[tokens], w13[expert], None if b13 is None else b13[expert])
        y = F.linear(_activate(layer, h), w2[expert], None if b2 is None else b2[expert])
        out.index_add_(0, tokens, y.float() * weights[tokens, slot, None])
    return out.to(x.dtype)
