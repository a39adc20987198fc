"""Building ONNX nodes under one name prefix, for the simulated compiler's graph rewrites."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper


@dataclass
class Names:
    """Value names under one prefix, so that every group and op writes unique SSA names."""

    prefix: str
    nodes: list[onnx.NodeProto] = field(default_factory=list)

    def __call__(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def const(self, name: str, value: Any, dtype: Any) -> str:
        out = self(name)
        self.nodes.append(
            helper.make_node(
                "Constant", [], [out], value=numpy_helper.from_array(np.array(value, dtype), out)
            )
        )
        return out

    def ints(self, name: str, values: list[int]) -> str:
        return self.const(name, values, np.int64)

    def add(self, op: str, inputs: list[str], output: str, **attrs: Any) -> str:
        out = self(output)
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out


def declared_dims(value: onnx.ValueInfoProto) -> tuple[str, ...] | None:
    """A graph input's dims as text (``dim_param`` or value); None when any dim is unnamed."""
    if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
        return None
    dims = []
    for d in value.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(str(d.dim_value))
        elif d.dim_param:
            dims.append(d.dim_param)
        else:
            return None
    return tuple(dims)


def constants(n: Names, up_to: int) -> None:
    """``k0`` .. ``k<up_to>`` and ``kneg1``: one-element int64 constants under ``n``'s prefix."""
    for k in range(up_to + 1):
        n.ints(f"k{k}", [k])
    n.ints("kneg1", [-1])


def arange(n: Names, length: str, out: str) -> str:
    """``out`` = ``0 .. length-1`` for a one-element int64 ``length`` (needs :func:`constants`)."""
    zero = n.add("Squeeze", [n("k0"), n("k0")], f"{out}_start")
    one = n.add("Squeeze", [n("k1"), n("k0")], f"{out}_step")
    end = n.add("Squeeze", [length, n("k0")], f"{out}_len")
    return n.add("Range", [zero, end, one], out)


@contextmanager
def restored(model: onnx.ModelProto) -> Iterator[None]:
    """Within the block the graph's nodes and opset imports may be rewritten; they come back after.

    The compiler serializes the executable program inside the block; the timing model reads the
    exported graph outside it."""
    nodes = [onnx.NodeProto() for _ in model.graph.node]
    for saved, node in zip(nodes, model.graph.node, strict=True):
        saved.CopyFrom(node)
    opsets = [onnx.OperatorSetIdProto() for _ in model.opset_import]
    for saved_opset, opset in zip(opsets, model.opset_import, strict=True):
        saved_opset.CopyFrom(opset)
    try:
        yield
    finally:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        del model.opset_import[:]
        model.opset_import.extend(opsets)
