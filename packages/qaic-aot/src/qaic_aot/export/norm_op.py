"""``CustomRMSNorm``: RMSNorm as the compiler-known custom op QEfficient exports.

QEfficient replaces every RMSNorm module with ``CustomRMSNorm(hidden_states, weight, epsilon=eps)``
in domain ``com.qti.aisw.onnx``, which the Cloud AI compiler runs as one kernel. The graph carries a
model-local function with the op's meaning in standard ONNX, ``weight * x / sqrt(mean(x^2) + eps)``
over the last axis, so any ONNX runtime can run it; the body has the shape onnxruntime's
``SimplifiedLayerNormalization`` fusion recognises, so the simulator runs it as one kernel too.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import TensorProto, helper

from qaic_aot.export.ops import ONNX_OPSET
from qaic_core.custom_ops import CUSTOM_OPS_DOMAIN, RMS_NORM

CUSTOM_OPS_VERSION = 1


def _uses_rms_norm(nodes: Iterable[onnx.NodeProto]) -> bool:
    return any(n.op_type == RMS_NORM and n.domain == CUSTOM_OPS_DOMAIN for n in nodes)


def custom_ops_imports(nodes: Iterable[onnx.NodeProto]) -> list[onnx.OperatorSetIdProto]:
    """The opset import the graph needs for ``CustomRMSNorm``: one, or none when no node uses it."""
    return [helper.make_opsetid(CUSTOM_OPS_DOMAIN, CUSTOM_OPS_VERSION)] if _uses_rms_norm(nodes) else []


def rms_norm_function(nodes: Iterable[onnx.NodeProto]) -> list[onnx.FunctionProto]:
    """The model-local definition of ``CustomRMSNorm`` (attribute ``epsilon``, a float), when used."""
    return [_rms_norm_function()] if _uses_rms_norm(nodes) else []


def _rms_norm_function() -> onnx.FunctionProto:
    eps = helper.make_node("Constant", [], ["eps"])
    eps.attribute.append(
        onnx.AttributeProto(name="value_float", ref_attr_name="epsilon", type=onnx.AttributeProto.FLOAT)
    )
    two = helper.make_node(
        "Constant", [], ["two"], value=helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    )
    nodes = [
        two,
        eps,
        helper.make_node("Pow", ["hidden_states", "two"], ["squares"]),
        helper.make_node("ReduceMean", ["squares"], ["variance"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["variance", "eps"], ["shifted"]),
        helper.make_node("Sqrt", ["shifted"], ["rms"]),
        helper.make_node("Div", ["hidden_states", "rms"], ["normalized"]),
        helper.make_node("Mul", ["normalized", "weight"], ["output"]),
    ]
    return helper.make_function(
        CUSTOM_OPS_DOMAIN,
        RMS_NORM,
        ["hidden_states", "weight"],
        ["output"],
        nodes,
        [helper.make_opsetid("", ONNX_OPSET)],
        ["epsilon"],
    )
