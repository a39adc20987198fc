"""Host buffer types of the runtime: ``QBuffer`` and ``BufferDimensionsVecRef``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np


class QBuffer:
    """A host buffer: wraps bytes, a bytearray, a memoryview or a numpy array without copying."""

    __slots__ = ("_array", "_data")

    def __init__(self, data: Any = b"") -> None:
        self._array: np.ndarray | None = None
        if isinstance(data, np.ndarray):
            self._array = data if data.flags.c_contiguous else np.ascontiguousarray(data)
            self._data: Any = self._array.reshape(-1).view(np.uint8) if self._array.size else b""
        elif isinstance(data, int):
            self._data = bytearray(data)
        else:
            self._data = data

    @property
    def size(self) -> int:
        """Bytes held."""
        if self._array is not None:
            return int(self._array.nbytes)
        return len(memoryview(self._data).cast("B"))

    @property
    def buf(self) -> memoryview:
        return memoryview(self._data).cast("B") if self.size else memoryview(b"")

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return self.buf.tobytes()

    def array(self, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
        """The bytes as an array of ``dtype`` and ``shape``, sharing memory."""
        if self._array is not None and self._array.dtype == dtype:
            return self._array.reshape(shape)
        return np.frombuffer(self.buf, dtype=dtype).reshape(shape)

    def writable_array(self, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray | None:
        """A writable view of the memory as ``dtype``/``shape``, or None for read-only bytes."""
        if self._array is not None:
            if not self._array.flags.writeable:
                return None
            flat = self._array.reshape(-1).view(np.uint8)
            return flat.view(dtype).reshape(shape)
        if isinstance(self._data, (bytearray, memoryview)) and not memoryview(self._data).readonly:
            return np.frombuffer(self._data, dtype=dtype).reshape(shape)
        return None

    def __repr__(self) -> str:
        return f"QBuffer(size={self.size})"


def _dims(value: Any) -> tuple[int, list[int]]:
    itemsize, dims = value
    return int(itemsize), [int(d) for d in dims]


class BufferDimensionsVecRef:
    """A list of ``(itemsize, dims)`` per binding; dims read back as lists, as from the runtime."""

    def __init__(self, items: Iterable[Any] = ()) -> None:
        self._items = [_dims(v) for v in items]

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> tuple[int, list[int]]:
        return self._items[index]

    def __setitem__(self, index: int, value: Any) -> None:
        self._items[index] = _dims(value)

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        return iter(self._items)

    def append(self, value: Any) -> None:
        self._items.append(_dims(value))

    def __repr__(self) -> str:
        return f"BufferDimensionsVecRef({self._items!r})"
