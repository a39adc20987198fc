"""A small ONNX graph builder: unique names, numpy initializers, one call per node."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper


class GraphBuilder:
    """Collects nodes and initializers; ``op`` returns the name of the node's (first) output."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()
        self._consts: dict[tuple[str, bytes, tuple[int, ...]], str] = {}
        self._count = 0

    def fresh(self, hint: str) -> str:
        """A new tensor name based on ``hint``."""
        self._count += 1
        return f"{hint}_{self._count}"

    def weight(self, name: str, array: np.ndarray) -> str:
        """Add a named initializer (a model weight or table)."""
        if name in self._names:
            raise ValueError(f"duplicate initializer {name}")
        self._names.add(name)
        # np.ascontiguousarray makes a scalar 1-D; a scalar stays a scalar (Range takes only scalars).
        data = np.ascontiguousarray(array) if np.ndim(array) else np.asarray(array)
        self.initializers.append(numpy_helper.from_array(data, name))
        return name

    def const(self, value: Any, dtype: type | np.dtype = np.int64) -> str:
        """A small constant, shared by value."""
        array = np.asarray(value, dtype=dtype)
        key = (str(array.dtype), array.tobytes(), array.shape)
        if key not in self._consts:
            self._consts[key] = self.weight(self.fresh("const"), array)
        return self._consts[key]

    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        *,
        outputs: Sequence[str] | None = None,
        domain: str = "",
        hint: str | None = None,
        **attrs: Any,
    ) -> str:
        """Append one node; returns its first output name."""
        outs = list(outputs) if outputs else [self.fresh(hint or op_type.lower())]
        self.nodes.append(
            helper.make_node(
                op_type, list(inputs), outs, name=self.fresh(f"n_{op_type}"), domain=domain, **attrs
            )
        )
        return outs[0]
