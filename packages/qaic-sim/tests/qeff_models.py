"""A one-layer causal LM written the way QEfficient's exporter writes ONNX, from the facts of its source.

Features, each as QEfficient emits it (quic/efficient-transformers: ``customop/ctx_scatter_gather*.py``,
``customop/rms_norm.py``, ``transformers/cache_utils.py``, ``QEFFAutoModelForCausalLM.export``):

- ``CtxScatterCB(data, batch_index, position_ids, updates)`` in domain ``com.qualcomm.cloud``, fed
  ``INT32_MAX`` where a position is padding (``torch.where(position_ids < 0, INT32_MAX, ...)``);
- ``CtxGatherCB(data, batch_index, ctx_indices, comp_ctx_len)``: a third input, and ``INT32_MAX`` for
  context indices beyond the row's last position;
- ``CustomRMSNorm(hidden_states, weight)`` with attribute ``epsilon`` in domain ``com.qti.aisw.onnx``;
- function bodies whose constants are ``Constant(value_ints=[...])`` (what onnxscript writes for a list
  literal), and ``Range`` over one-element tensors;
- the compute-context length as the length of a ``comp_ctx_lengths`` input;
- ``logits`` with output dims the exporter named itself (``Castlogits_dim_0``, ``Castlogits_dim_1``).

The numpy reference computes the same program with invalid indices skipped (scatter) or masked
(gather), which is what the device does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

QC = "com.qualcomm.cloud"
QTI = "com.qti.aisw.onnx"
INT32_MAX = 2**31 - 1
VOCAB, HIDDEN, HEADS, HEAD_DIM = 32, 16, 2, 8
EPS = 1e-6
MASKED = -10000.0


def _ints(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value_ints=values)


def ctx_scatter_cb() -> onnx.FunctionProto:
    nodes = [
        _ints("c0", [0]),
        _ints("c1", [1]),
        _ints("c2", [2]),
        helper.make_node("Shape", ["batch_index"], ["bi_shape"]),
        helper.make_node("Gather", ["bi_shape", "c0"], ["batch_size"], axis=0),
        helper.make_node("Shape", ["data"], ["data_shape"]),
        helper.make_node("Gather", ["data_shape", "c1"], ["num_heads"], axis=0),
        helper.make_node("Shape", ["position_ids"], ["pos_shape"]),
        helper.make_node("Gather", ["pos_shape", "c1"], ["seq_len"], axis=0),
        helper.make_node("Concat", ["batch_size", "num_heads", "seq_len", "c1"], ["exp_shape"], axis=0),
        _ints("ax23", [2, 3]),
        helper.make_node("Unsqueeze", ["batch_index", "ax23"], ["bi4"]),
        helper.make_node("Expand", ["bi4", "exp_shape"], ["batch_idx"]),
        helper.make_node("Range", ["c0", "num_heads", "c1"], ["heads"]),
        _ints("ax023", [0, 2, 3]),
        helper.make_node("Unsqueeze", ["heads", "ax023"], ["heads4"]),
        helper.make_node("Expand", ["heads4", "exp_shape"], ["head_idx"]),
        _ints("ax13", [1, 3]),
        helper.make_node("Unsqueeze", ["position_ids", "ax13"], ["pos4"]),
        helper.make_node("Expand", ["pos4", "exp_shape"], ["ctx_idx"]),
        helper.make_node("Concat", ["batch_idx", "head_idx", "ctx_idx"], ["indices"], axis=3),
        helper.make_node("ScatterND", ["data", "indices", "updates"], ["out"]),
    ]
    return helper.make_function(
        QC, "CtxScatterCB", ["data", "batch_index", "position_ids", "updates"], ["out"], nodes,
        [helper.make_opsetid("", 17)],
    )  # fmt: skip


def ctx_gather_cb() -> onnx.FunctionProto:
    nodes = [
        _ints("c0", [0]),
        _ints("c1", [1]),
        _ints("c2", [2]),
        helper.make_node("Shape", ["batch_index"], ["bi_shape"]),
        helper.make_node("Gather", ["bi_shape", "c0"], ["batch_size"], axis=0),
        helper.make_node("Shape", ["data"], ["data_shape"]),
        helper.make_node("Gather", ["data_shape", "c1"], ["num_heads"], axis=0),
        helper.make_node("Shape", ["ctx_indices"], ["ci_shape"]),
        helper.make_node("Gather", ["ci_shape", "c2"], ["ctx_len"], axis=0),
        helper.make_node("Concat", ["batch_size", "num_heads", "ctx_len", "c1"], ["exp_shape"], axis=0),
        _ints("ax23", [2, 3]),
        helper.make_node("Unsqueeze", ["batch_index", "ax23"], ["bi4"]),
        helper.make_node("Expand", ["bi4", "exp_shape"], ["batch_idx"]),
        helper.make_node("Range", ["c0", "num_heads", "c1"], ["heads"]),
        _ints("ax023", [0, 2, 3]),
        helper.make_node("Unsqueeze", ["heads", "ax023"], ["heads4"]),
        helper.make_node("Expand", ["heads4", "exp_shape"], ["head_idx"]),
        _ints("ax3", [3]),
        helper.make_node("Unsqueeze", ["ctx_indices", "ax3"], ["ci4"]),
        helper.make_node("Expand", ["ci4", "exp_shape"], ["ctx_idx"]),
        helper.make_node("Concat", ["batch_idx", "head_idx", "ctx_idx"], ["indices"], axis=3),
        helper.make_node("GatherND", ["data", "indices"], ["out"]),
    ]
    return helper.make_function(
        QC, "CtxGatherCB", ["data", "batch_index", "ctx_indices", "comp_ctx_len"], ["out"], nodes,
        [helper.make_opsetid("", 17)],
    )  # fmt: skip


def custom_rms_norm() -> onnx.FunctionProto:
    eps = helper.make_node("Constant", [], ["eps"])
    # onnxscript writes an attribute used as a tensor as Constant(value_float=@epsilon).
    eps.attribute.append(
        onnx.AttributeProto(name="value_float", ref_attr_name="epsilon", type=onnx.AttributeProto.FLOAT)
    )
    nodes = [
        helper.make_node("Cast", ["weight"], ["w"], to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["two"], value_float=2.0),
        helper.make_node("Pow", ["hidden_states", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["variance"], axes=[-1], keepdims=1),
        eps,
        helper.make_node("Shape", ["variance"], ["var_shape"]),
        helper.make_node("Expand", ["eps", "var_shape"], ["eps_x"]),
        helper.make_node("Add", ["variance", "eps_x"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("Reciprocal", ["std"], ["inv"]),
        helper.make_node("Mul", ["hidden_states", "inv"], ["normed"]),
        helper.make_node("Mul", ["w", "normed"], ["out"]),
    ]
    return helper.make_function(
        QTI, "CustomRMSNorm", ["hidden_states", "weight"], ["out"], nodes, [helper.make_opsetid("", 17)],
        attributes=["epsilon"],
    )  # fmt: skip


def gaussian(seed: int) -> Callable[..., np.ndarray]:
    """A maker of float32 weights of any shape, normal with std 0.3, from one seeded stream."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    return w


@dataclass
class QeffWeights:
    embed: np.ndarray
    norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    lm_head: np.ndarray

    @classmethod
    def random(cls, seed: int = 0) -> QeffWeights:
        w = gaussian(seed)
        return cls(w(VOCAB, HIDDEN), 1 + w(HIDDEN), w(HIDDEN, HIDDEN), w(HIDDEN, HIDDEN), w(HIDDEN, HIDDEN),
                   w(HIDDEN, VOCAB))  # fmt: skip


def one_layer_io(
    kv_heads: int, head_dim: int, *, ccl: bool, logits_dims: list[str | int]
) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """A one-layer continuous-batching program's inputs and outputs under QEfficient's IO names;
    with ``ccl`` the ``comp_ctx_lengths`` input too."""
    i64, f32 = TensorProto.INT64, TensorProto.FLOAT
    kv: list[str | int] = ["full_batch_size", kv_heads, "ctx_len", head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["batch_size", "seq_len"]),
        helper.make_tensor_value_info("position_ids", i64, ["batch_size", "seq_len"]),
        helper.make_tensor_value_info("past_key.0", f32, kv),
        helper.make_tensor_value_info("past_value.0", f32, kv),
        helper.make_tensor_value_info("batch_index", i64, ["batch_size", 1]),
    ]
    if ccl:
        inputs.append(helper.make_tensor_value_info("comp_ctx_lengths", i64, ["comp_ctx_lengths"]))
    outputs = [
        helper.make_tensor_value_info("logits", f32, logits_dims),
        helper.make_tensor_value_info("past_key.0_RetainedState", f32, kv),
        helper.make_tensor_value_info("past_value.0_RetainedState", f32, kv),
    ]
    return inputs, outputs


def write_qeff_model(path: Path, weights: QeffWeights, *, ccl: bool = True) -> Path:
    """Write the model; with ``ccl`` the gather reads ``len(comp_ctx_lengths)`` positions, else ``ctx_len``."""
    inputs, outputs = one_layer_io(
        HEADS, HEAD_DIM, ccl=ccl, logits_dims=["Castlogits_dim_0", "Castlogits_dim_1", VOCAB]
    )
    n = helper.make_node
    nodes = [
        n("Gather", ["embed", "input_ids"], ["emb"], axis=0),
        n("CustomRMSNorm", ["emb", "norm"], ["h"], domain=QTI, epsilon=EPS),
        _ints("heads_shape", [0, 0, HEADS, HEAD_DIM]),
    ]
    for name in ("q", "k", "v"):
        nodes += [
            n("MatMul", ["h", f"w{name}"], [f"{name}_flat"]),
            n("Reshape", [f"{name}_flat", "heads_shape"], [f"{name}_bshd"]),
            n("Transpose", [f"{name}_bshd"], [name], perm=[0, 2, 1, 3]),
        ]
    nodes += [
        # Padding positions become INT32_MAX for the scatter, as QEfficient's cache does.
        helper.make_node("Constant", [], ["zero"], value_int=0),
        helper.make_node("Constant", [], ["int32_max"], value_int=INT32_MAX),
        n("Less", ["position_ids", "zero"], ["is_pad"]),
        n("Where", ["is_pad", "int32_max", "position_ids"], ["scatter_pos"]),
        n("CtxScatterCB", ["past_key.0", "batch_index", "scatter_pos", "k"], ["past_key.0_RetainedState"],
          domain=QC),
        n("CtxScatterCB", ["past_value.0", "batch_index", "scatter_pos", "v"], ["past_value.0_RetainedState"],
          domain=QC),
    ]  # fmt: skip
    if ccl:
        nodes.append(n("Shape", ["comp_ctx_lengths"], ["ccl_1d"]))
    else:
        nodes += [n("Shape", ["past_key.0"], ["kv_shape"]), _ints("ax2", [2]),
                  n("Gather", ["kv_shape", "ax2"], ["ccl_1d"], axis=0)]  # fmt: skip
    nodes += [
        _ints("ax0", [0]),
        n("Squeeze", ["ccl_1d", "ax0"], ["ccl"]),
        helper.make_node("Constant", [], ["one"], value_int=1),
        n("Range", ["zero", "ccl", "one"], ["kv_pos"]),
        _ints("ax01", [0, 1]),
        n("Unsqueeze", ["kv_pos", "ax01"], ["ctx_indices"]),  # [1, 1, ccl]
        n("ReduceMax", ["position_ids"], ["limit"], axes=[1], keepdims=1),  # [B, 1]
        _ints("ax1", [1]),
        n("Unsqueeze", ["limit", "ax1"], ["limit3"]),  # [B, 1, 1]
        n("Greater", ["ctx_indices", "limit3"], ["invalid"]),
        n("Where", ["invalid", "int32_max", "ctx_indices"], ["gather_idx"]),
        n("CtxGatherCB", ["past_key.0_RetainedState", "batch_index", "gather_idx", "ccl"], ["keys"], domain=QC),
        n("CtxGatherCB", ["past_value.0_RetainedState", "batch_index", "gather_idx", "ccl"], ["values"],
          domain=QC),
        n("Transpose", ["keys"], ["keys_t"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q", "keys_t"], ["raw"]),
        helper.make_node("Constant", [], ["scale"], value_float=HEAD_DIM**-0.5),
        n("Mul", ["raw", "scale"], ["scores"]),
        _ints("ax13", [1, 3]),
        n("Unsqueeze", ["position_ids", "ax13"], ["qpos"]),  # [B, 1, S, 1]
        n("Greater", ["kv_pos", "qpos"], ["masked"]),  # [B, 1, S, ccl]
        helper.make_node("Constant", [], ["masked_score"], value_float=MASKED),
        n("Where", ["masked", "masked_score", "scores"], ["scores_m"]),
        n("Softmax", ["scores_m"], ["probs"], axis=-1),
        n("MatMul", ["probs", "values"], ["attn"]),
        n("Transpose", ["attn"], ["attn_t"], perm=[0, 2, 1, 3]),
        _ints("flat_shape", [0, 0, HIDDEN]),
        n("Reshape", ["attn_t", "flat_shape"], ["attn_flat"]),
        n("Add", ["h", "attn_flat"], ["hidden"]),
        n("Cast", ["position_ids"], ["pos32"], to=TensorProto.INT32),
        n("ArgMax", ["pos32"], ["last"], axis=1, keepdims=1),
        n("Unsqueeze", ["last", "ax1"], ["last3"]),
        n("GatherND", ["hidden", "last3"], ["h_last"], batch_dims=1),
        n("MatMul", ["h_last", "lm_head"], ["logits_raw"]),
        n("Cast", ["logits_raw"], ["logits"], to=TensorProto.FLOAT),
    ]  # fmt: skip
    inits = [
        numpy_helper.from_array(a, name)
        for name, a in (("embed", weights.embed), ("norm", weights.norm), ("wq", weights.wq),
                        ("wk", weights.wk), ("wv", weights.wv), ("lm_head", weights.lm_head))
    ]  # fmt: skip
    graph = helper.make_graph(nodes, "qeff_style", inputs, outputs, inits)
    return save_model(
        path, graph, [ctx_scatter_cb(), ctx_gather_cb(), custom_rms_norm()], producer_name="pytorch"
    )


def save_model(path: Path, graph: onnx.GraphProto, functions: list[onnx.FunctionProto], **kw: str) -> Path:
    """Check and write a model of ``graph`` with the functions' domains imported (IR version 8)."""
    domains = sorted({f.domain for f in functions})
    opsets = [helper.make_opsetid("", 17), *(helper.make_opsetid(d, 1) for d in domains)]
    model = helper.make_model(graph, opset_imports=opsets, functions=functions, **kw)
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


class CacheReference:
    """A numpy program's KV cache, ``[slots, kv_heads, ctx_len, head_dim]``, kept between runs as the
    device keeps its retained state."""

    def __init__(self, slots: int, kv_heads: int, ctx_len: int, head_dim: int) -> None:
        self.k = np.zeros((slots, kv_heads, ctx_len, head_dim), np.float32)
        self.v = np.zeros_like(self.k)

    def store(self, k: np.ndarray, v: np.ndarray, pos: np.ndarray, rows: np.ndarray) -> None:
        """Write each token's key and value (``[B, kv_heads, S, D]``) at its row and position; a position
        outside the cache (padding) writes nothing, as ``CtxScatter`` does on the device."""
        for i, row in enumerate(rows):
            for j, p in enumerate(pos[i]):
                if 0 <= p < self.k.shape[2]:
                    self.k[row, :, p], self.v[row, :, p] = k[i, :, j], v[i, :, j]


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """``softmax(q keys^T * scale) values`` per head, the keys where ``mask`` is True scored ``MASKED``
    (hidden): ``[B, N, S, D]``."""
    scores = np.where(mask, MASKED, q @ keys.transpose(0, 1, 3, 2) * scale)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out: np.ndarray = probs @ values
    return out


class QeffReference(CacheReference):
    """The same program in numpy, keeping the KV cache between runs as the device does."""

    def __init__(self, weights: QeffWeights, slots: int, ctx_len: int) -> None:
        super().__init__(slots, HEADS, ctx_len, HEAD_DIM)
        self.w = weights

    def run(self, ids: np.ndarray, pos: np.ndarray, rows: np.ndarray, ccl: int) -> np.ndarray:
        w = self.w
        emb = w.embed[ids]
        h = w.norm * emb / np.sqrt((emb**2).mean(-1, keepdims=True) + EPS)

        def heads(m: np.ndarray) -> np.ndarray:
            b, s = ids.shape
            return (h @ m).reshape(b, s, HEADS, HEAD_DIM).transpose(0, 2, 1, 3)

        q, k, v = heads(w.wq), heads(w.wk), heads(w.wv)
        self.store(k, v, pos, rows)
        keys, values = self.k[rows][:, :, :ccl], self.v[rows][:, :, :ccl]
        limit = pos.max(axis=1)[:, None, None, None]
        kv_pos = np.arange(ccl)
        # Keys after the query's position are hidden, and so is what lies beyond the row's last
        # position (not read).
        mask = (kv_pos > pos[:, None, :, None]) | (kv_pos > limit)
        attn = attend(q, keys, values, mask, HEAD_DIM**-0.5)
        hidden = h + attn.transpose(0, 2, 1, 3).reshape(ids.shape[0], ids.shape[1], HIDDEN)
        last = pos.argmax(axis=1)
        return (hidden[np.arange(len(last)), last] @ w.lm_head)[:, None, :]
