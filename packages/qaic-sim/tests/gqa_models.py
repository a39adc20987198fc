"""A one-layer grouped-query causal LM whose attention is written the way our exporter writes it.

Queries ``[B, S, N, D]`` go heads-first and are grouped as ``[B, KV, G, S, D]``; the new keys and
values are scattered into the retained cache (``CtxScatterCB``) and gathered back up to the
compute-context length (``CtxGatherCB`` with ``comp_ctx_len``); scores are scaled, masked with
``Where(mask, -10000, scores)`` where a key lies after the query's position, and a ``Softmax`` over
the keys weighs the values. The numpy reference computes the same program, writes only valid
positions and reads the first ``C`` positions of each row's cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from qeff_models import (
    MASKED,
    QC,
    CacheReference,
    attend,
    ctx_gather_cb,
    ctx_scatter_cb,
    gaussian,
    one_layer_io,
    save_model,
)

VOCAB, KV_HEADS, GROUPS, HEAD_DIM = 40, 2, 2, 8
HEADS = KV_HEADS * GROUPS
HIDDEN = HEADS * HEAD_DIM
SCALE = HEAD_DIM**-0.5


@dataclass
class GqaWeights:
    embed: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    lm_head: np.ndarray

    @classmethod
    def random(cls, seed: int = 0) -> GqaWeights:
        w = gaussian(seed)
        kv = KV_HEADS * HEAD_DIM
        return cls(w(VOCAB, HIDDEN), w(HIDDEN, HIDDEN), w(HIDDEN, kv), w(HIDDEN, kv), w(HIDDEN, HIDDEN),
                   w(HIDDEN, VOCAB))  # fmt: skip


def write_gqa_model(path: Path, weights: GqaWeights) -> Path:
    inputs, outputs = one_layer_io(KV_HEADS, HEAD_DIM, ccl=True, logits_dims=["batch_size", "seq_len", VOCAB])
    n = helper.make_node

    def ints(name: str, values: list[int]) -> onnx.NodeProto:
        return n("Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64), name))

    nodes = [
        n("Gather", ["embed", "input_ids"], ["h"], axis=0),
        ints("q_heads", [0, 0, HEADS, HEAD_DIM]),
        ints("kv_heads", [0, 0, KV_HEADS, HEAD_DIM]),
    ]
    for name, shape in (("q", "q_heads"), ("k", "kv_heads"), ("v", "kv_heads")):
        nodes += [
            n("MatMul", ["h", f"w{name}"], [f"{name}_flat"]),
            n("Reshape", [f"{name}_flat", shape], [f"{name}_bshd"]),
            n("Transpose", [f"{name}_bshd"], [name], perm=[0, 2, 1, 3]),
        ]
    nodes += [
        n("CtxScatterCB", ["past_key.0", "batch_index", "position_ids", "k"], ["past_key.0_RetainedState"],
          domain=QC),
        n("CtxScatterCB", ["past_value.0", "batch_index", "position_ids", "v"], ["past_value.0_RetainedState"],
          domain=QC),
        ints("zero", [0]),
        n("Shape", ["comp_ctx_lengths"], ["ccl_shape"]),
        n("Gather", ["ccl_shape", "zero"], ["ccl_1d"], axis=0),
        n("Squeeze", ["ccl_1d", "zero"], ["ccl"]),
        ints("z", [0]), ints("one", [1]),
        n("Squeeze", ["z", "zero"], ["z0"]), n("Squeeze", ["one", "zero"], ["one0"]),
        n("Range", ["z0", "ccl", "one0"], ["kv_pos"]),
        ints("ax01", [0, 1]),
        n("Unsqueeze", ["kv_pos", "ax01"], ["ctx_indices"]),  # [1, 1, C]
        n("CtxGatherCB", ["past_key.0_RetainedState", "batch_index", "ctx_indices", "ccl"], ["keys"], domain=QC),
        n("CtxGatherCB", ["past_value.0_RetainedState", "batch_index", "ctx_indices", "ccl"], ["values"],
          domain=QC),
        ints("grouped", [0, KV_HEADS, GROUPS, -1, HEAD_DIM]),
        n("Reshape", ["q", "grouped"], ["q5"]),
        ints("ax2", [2]),
        n("Unsqueeze", ["keys", "ax2"], ["k5"]),
        n("Unsqueeze", ["values", "ax2"], ["v5"]),
        n("Transpose", ["k5"], ["k5_t"], perm=[0, 1, 2, 4, 3]),
        n("MatMul", ["q5", "k5_t"], ["raw"]),
        n("Constant", [], ["scale"], value=numpy_helper.from_array(np.array(SCALE, np.float32), "scale")),
        n("Mul", ["raw", "scale"], ["scores"]),
        n("Unsqueeze", ["position_ids", "ax2"], ["qpos"]),  # [B, S, 1]
        n("Greater", ["kv_pos", "qpos"], ["later"]),  # [B, S, C]
        ints("ax12", [1, 2]),
        n("Unsqueeze", ["later", "ax12"], ["mask"]),  # [B, 1, 1, S, C]
        n("Constant", [], ["masked"], value=numpy_helper.from_array(np.array(MASKED, np.float32), "masked")),
        n("Where", ["mask", "masked", "scores"], ["scores_m"]),
        n("Softmax", ["scores_m"], ["probs"], axis=-1),
        n("MatMul", ["probs", "v5"], ["attn5"]),
        ints("heads_first", [0, HEADS, -1, HEAD_DIM]),
        n("Reshape", ["attn5", "heads_first"], ["attn4"]),
        n("Transpose", ["attn4"], ["attn_t"], perm=[0, 2, 1, 3]),
        ints("flat", [0, 0, HIDDEN]),
        n("Reshape", ["attn_t", "flat"], ["attn"]),
        n("MatMul", ["attn", "wo"], ["o"]),
        n("Add", ["h", "o"], ["hidden"]),
        n("MatMul", ["hidden", "lm_head"], ["logits"]),
    ]  # fmt: skip
    inits = [
        numpy_helper.from_array(getattr(weights, name), name)
        for name in ("embed", "wq", "wk", "wv", "wo", "lm_head")
    ]
    return save_model(
        path, helper.make_graph(nodes, "gqa", inputs, outputs, inits), [ctx_scatter_cb(), ctx_gather_cb()]
    )


class GqaReference(CacheReference):
    """The program in numpy (float32), keeping the KV cache between runs as the device does."""

    def __init__(self, weights: GqaWeights, slots: int, ctx_len: int) -> None:
        super().__init__(slots, KV_HEADS, ctx_len, HEAD_DIM)
        self.w = weights

    def run(self, ids: np.ndarray, pos: np.ndarray, rows: np.ndarray, ccl: int) -> np.ndarray:
        w, (b, s) = self.w, ids.shape
        h = w.embed[ids]
        q = (h @ w.wq).reshape(b, s, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
        k = (h @ w.wk).reshape(b, s, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
        v = (h @ w.wv).reshape(b, s, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
        self.store(k, v, pos, rows)
        keys = np.repeat(self.k[rows][:, :, :ccl], GROUPS, axis=1)  # [B, N, C, D]
        values = np.repeat(self.v[rows][:, :, :ccl], GROUPS, axis=1)
        mask = np.arange(ccl) > pos[:, None, :, None]
        attn = attend(q, keys, values, mask, SCALE).transpose(0, 2, 1, 3).reshape(b, s, HIDDEN)
        out: np.ndarray = (h + attn @ w.wo) @ w.lm_head
        return out
