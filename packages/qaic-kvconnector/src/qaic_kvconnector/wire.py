"""What travels between instances: the handshake fingerprint and one request's KV as header + buffers.

A KV message is a JSON header and one buffer per array, in header order. A float KV travels as
its raw values; an mxint8 KV travels compact (``mxint8`` codes, then ``e8m0`` exponents, per
tensor) unless the sender turned that off or ``head_dim`` is too short for blocks of 32 to pay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qaic_core.execution import SlotKV
from qaic_kvconnector import mxint8

PROTOCOL = 1
"""Bumped when the messages change; instances speaking another version are refused at handshake."""

FINGERPRINT_KEYS = ("protocol", "model", "ctx_len", "kv_dtype", "layout")
"""What two instances must agree on before KV moves between them."""


def fingerprint(model: str, ctx_len: int, probe: SlotKV) -> dict[str, Any]:
    """This instance's fingerprint: model, ctx_len, KV dtype and layout (from a one-position slot read)."""
    layout = []
    for name in sorted(probe.tensors):
        arr = np.asarray(probe.tensors[name])
        heads, head_dim = (int(arr.shape[1]), int(arr.shape[3])) if arr.ndim == 4 else (0, 0)
        layout.append(f"{name}:{heads}x{head_dim}:{arr.dtype}")
    return {
        "protocol": PROTOCOL,
        "model": model,
        "ctx_len": int(ctx_len),
        "kv_dtype": probe.dtype,
        "layout": ",".join(layout),
    }


def differences(mine: Mapping[str, Any], theirs: Mapping[str, Any], me: str, them: str) -> list[str]:
    """Each fingerprint key that differs, with both values: ``ctx_len: decode 512, prefill 256``."""
    out = []
    for key in FINGERPRINT_KEYS:
        if mine.get(key) != theirs.get(key):
            out.append(f"{key}: {me} {mine.get(key)!r}, {them} {theirs.get(key)!r}")
    return out


def prompt_hash(token_ids: Sequence[int]) -> str:
    """A short digest of a prompt, so a decode instance never takes KV computed for another prompt."""
    data = np.asarray(list(token_ids), dtype=np.int64).tobytes()
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def encode_kv(kv: SlotKV, compact: bool = True) -> tuple[dict[str, Any], list[np.ndarray]]:
    """``kv`` as a header and its buffers; mxint8 KV as codes and exponents when ``compact`` and smaller."""
    tensors: list[dict[str, Any]] = []
    buffers: list[np.ndarray] = []
    for name in sorted(kv.tensors):
        arr = np.ascontiguousarray(kv.tensors[name])
        entry: dict[str, Any] = {"name": name, "shape": list(arr.shape), "dtype": str(arr.dtype)}
        if compact and kv.dtype == "mxint8" and mxint8.wire_bytes(arr.shape) < arr.nbytes:
            codes, scales = mxint8.encode(arr)
            entry["wire"] = "mxint8"
            buffers += [codes, scales]
        else:
            entry["wire"] = "raw"
            buffers.append(arr)
        tensors.append(entry)
    header = {"num_tokens": int(kv.num_tokens), "dtype": kv.dtype, "tensors": tensors}
    header["nbytes"] = sum(int(b.nbytes) for b in buffers)
    return header, buffers


def decode_kv(header: Mapping[str, Any], buffers: Sequence[Any]) -> SlotKV:
    """The :class:`SlotKV` a header and its buffers (bytes-like, in order) describe."""
    tensors: dict[str, np.ndarray] = {}
    i = 0
    for entry in header["tensors"]:
        shape = tuple(int(d) for d in entry["shape"])
        dtype = np.dtype(entry["dtype"])
        if entry["wire"] == "mxint8":
            padded = (*shape[:-1], -(-shape[-1] // mxint8.BLOCK) * mxint8.BLOCK)
            codes = np.frombuffer(buffers[i], dtype=np.int8).reshape(padded)
            scales = np.frombuffer(buffers[i + 1], dtype=np.uint8).reshape(
                *shape[:-1], padded[-1] // mxint8.BLOCK
            )
            tensors[entry["name"]] = mxint8.decode(codes, scales, shape[-1], dtype)
            i += 2
        elif entry["wire"] == "raw":
            tensors[entry["name"]] = np.frombuffer(buffers[i], dtype=dtype).reshape(shape)
            i += 1
        else:
            raise ValueError(f"unknown KV wire format {entry['wire']!r} for {entry['name']}")
    if i != len(buffers):
        raise ValueError(f"the KV message has {len(buffers)} buffers but its header describes {i}")
    return SlotKV(num_tokens=int(header["num_tokens"]), tensors=tensors, dtype=str(header["dtype"]))
