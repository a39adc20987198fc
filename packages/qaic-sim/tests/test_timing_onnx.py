"""ProgramCost.from_onnx on a QEfficient-shaped decoder graph with CtxScatter/CtxGather local functions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qaic_sim.mx import bytes_per_element
from qaic_sim.timing import ProgramCost

DOMAIN = "com.qualcomm.cloud"
H, HEADS, HD, INTER, VOCAB, LAYERS = 16, 2, 8, 32, 50, 2
CONFIG = {
    "hidden_size": H,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "intermediate_size": INTER,
    "vocab_size": VOCAB,
    "mlp": "plain",
    "tie_word_embeddings": False,
}


def _i64(name: str, values: list[int] | int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def _ctx_scatter() -> onnx.FunctionProto:
    """Write updates [B, H, S, D] at position_ids [B, S]: ScatterND with computed indices."""
    n = helper.make_node
    nodes = [
        n("Constant", [], ["zero"], value=_i64("zero", 0)),
        n("Constant", [], ["one"], value=_i64("one", 1)),
        n("Constant", [], ["ax_123"], value=_i64("ax_123", [1, 2, 3])),
        n("Constant", [], ["ax_023"], value=_i64("ax_023", [0, 2, 3])),
        n("Constant", [], ["ax_13"], value=_i64("ax_13", [1, 3])),
        n("Constant", [], ["c0"], value=_i64("c0", [0])),
        n("Constant", [], ["c1"], value=_i64("c1", [1])),
        n("Shape", ["updates"], ["ushape"]),
        n("Slice", ["ushape", "c0", "c1"], ["b1"]),
        n("Squeeze", ["b1"], ["b"]),
        n("Gather", ["ushape", "one"], ["h"], axis=0),
        n("Range", ["zero", "b", "one"], ["br"]),
        n("Range", ["zero", "h", "one"], ["hr"]),
        n("Unsqueeze", ["br", "ax_123"], ["bi"]),
        n("Unsqueeze", ["hr", "ax_023"], ["hi"]),
        n("Unsqueeze", ["position_ids", "ax_13"], ["pi"]),
        n("Constant", [], ["c3"], value=_i64("c3", [0, 1, 2])),
        n("Gather", ["ushape", "c3"], ["bhs"], axis=0),
        n("Concat", ["bhs", "c1"], ["ishape"], axis=0),
        n("Expand", ["bi", "ishape"], ["be"]),
        n("Expand", ["hi", "ishape"], ["he"]),
        n("Expand", ["pi", "ishape"], ["pe"]),
        n("Concat", ["be", "he", "pe"], ["indices"], axis=3),
        n("ScatterND", ["data", "indices", "updates"], ["out"]),
    ]
    opset = [helper.make_opsetid("", 17)]
    return helper.make_function(
        DOMAIN, "CtxScatter", ["data", "position_ids", "updates"], ["out"], nodes, opset
    )


def _ctx_gather() -> onnx.FunctionProto:
    """Read the cache rows at ctx_indices [C] along the ctx axis."""
    nodes = [helper.make_node("Gather", ["data", "ctx_indices"], ["out"], axis=2)]
    opset = [helper.make_opsetid("", 17)]
    return helper.make_function(DOMAIN, "CtxGather", ["data", "ctx_indices"], ["out"], nodes, opset)


def decoder_model() -> onnx.ModelProto:
    """A pre-norm decoder: embedding, per layer norm/QKV/KV ops/attention/out-proj/MLP, last-position logits."""
    rng = np.random.default_rng(0)
    inits: list[onnx.TensorProto] = []

    def weight(name: str, *shape: int) -> str:
        inits.append(numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), name))
        return name

    n = helper.make_node
    inits += [_i64("heads_shape", [0, 0, HEADS, HD]), _i64("flat_shape", [0, 0, H]), _i64("two", 2)]
    inits += [_i64("zero", 0), _i64("one", 1), _i64("ax2", [2])]
    nodes = [
        n("Gather", [weight("embed", VOCAB, H), "input_ids"], ["x0"]),
        n("Shape", ["past_key.0"], ["kv_shape"]),
        n("Gather", ["kv_shape", "two"], ["ctx"], axis=0),
        n("Range", ["zero", "ctx", "one"], ["ctx_indices"]),
    ]
    x = "x0"
    for i in range(LAYERS):
        p = f"l{i}."
        nodes.append(n("Mul", [x, weight(p + "ln1", H)], [p + "xn"]))
        for proj in ("q", "k", "v"):
            nodes += [
                n("MatMul", [p + "xn", weight(p + proj + "_w", H, HEADS * HD)], [p + proj + "0"]),
                n("Reshape", [p + proj + "0", "heads_shape"], [p + proj + "1"]),
                n("Transpose", [p + proj + "1"], [p + proj], perm=[0, 2, 1, 3]),
            ]
        for kv in ("key", "value"):
            new = f"past_{kv}.{i}_RetainedState"
            nodes.append(n("CtxScatter", [f"past_{kv}.{i}", "position_ids", p + kv[0]], [new], domain=DOMAIN))
            nodes.append(n("CtxGather", [new, "ctx_indices"], [p + kv[0] + "_all"], domain=DOMAIN))
        nodes += [
            n("Transpose", [p + "k_all"], [p + "kt"], perm=[0, 1, 3, 2]),
            n("MatMul", [p + "q", p + "kt"], [p + "scores"]),
            n("Softmax", [p + "scores"], [p + "probs"], axis=-1),
            n("MatMul", [p + "probs", p + "v_all"], [p + "att"]),
            n("Transpose", [p + "att"], [p + "att_t"], perm=[0, 2, 1, 3]),
            n("Reshape", [p + "att_t", "flat_shape"], [p + "att_f"]),
            n("MatMul", [p + "att_f", weight(p + "o_w", HEADS * HD, H)], [p + "o"]),
            n("Add", [x, p + "o"], [p + "x1"]),
            n("Mul", [p + "x1", weight(p + "ln2", H)], [p + "x1n"]),
            n("MatMul", [p + "x1n", weight(p + "up_w", H, INTER)], [p + "up"]),
            n("Relu", [p + "up"], [p + "act"]),
            n("MatMul", [p + "act", weight(p + "down_w", INTER, H)], [p + "down"]),
            n("Add", [p + "x1", p + "down"], [p + "x2"]),
        ]
        x = p + "x2"
    nodes += [
        n("Mul", [x, weight("ln_f", H)], ["xf"]),
        n("ArgMax", ["position_ids"], ["last"], axis=1, keepdims=1),
        n("Unsqueeze", ["last", "ax2"], ["last3"]),
        n("Shape", ["xf"], ["xf_shape"]),
        n("Slice", ["xf_shape", "ax2", "last_dim_end"], ["hdim"]),
        n("Shape", ["last3"], ["l3_shape"]),
        n("Slice", ["l3_shape", "zero1", "ax2"], ["bl"]),
        n("Concat", ["bl", "hdim"], ["gshape"], axis=0),
        n("Expand", ["last3", "gshape"], ["last_idx"]),
        n("GatherElements", ["xf", "last_idx"], ["x_last"], axis=1),
        n("MatMul", ["x_last", weight("lm_head", H, VOCAB)], ["logits"]),
    ]
    inits += [_i64("last_dim_end", [3]), _i64("zero1", [0])]
    kv_type = [("batch_size", HEADS, "ctx_len", HD)]
    ids = [
        helper.make_tensor_value_info(k, TensorProto.INT64, ["batch_size", "seq_len"])
        for k in ("input_ids", "position_ids")
    ]
    kv_in, kv_out = [], []
    for i in range(LAYERS):
        for kv in ("key", "value"):
            kv_in.append(helper.make_tensor_value_info(f"past_{kv}.{i}", TensorProto.FLOAT, list(kv_type[0])))
            kv_out.append(
                helper.make_tensor_value_info(
                    f"past_{kv}.{i}_RetainedState", TensorProto.FLOAT, list(kv_type[0])
                )
            )
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", 1, VOCAB])
    graph = helper.make_graph(nodes, "tiny_decoder", [*ids, *kv_in], [logits, *kv_out], inits)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, functions=[_ctx_scatter(), _ctx_gather()])
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return decoder_model()


def test_graph_runs_in_onnxruntime(model: onnx.ModelProto) -> None:
    """The test graph is a real, runnable program: its KV outputs hold the scattered keys."""
    sess = ort.InferenceSession(model.SerializeToString())
    feeds = {"input_ids": np.array([[3, 4]]), "position_ids": np.array([[0, 1]])}
    feeds |= {
        f"past_{kv}.{i}": np.zeros((1, HEADS, 8, HD), np.float32)
        for i in range(LAYERS)
        for kv in ("key", "value")
    }
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
    assert out["logits"].shape == (1, 1, VOCAB)
    assert np.abs(out["past_key.0_RetainedState"][0, :, :2]).sum() > 0
    assert not out["past_key.0_RetainedState"][0, :, 2:].any()


def test_hand_count_decode(model: onnx.ModelProto) -> None:
    cost = ProgramCost.from_onnx(
        model,
        {"batch_size": 2, "seq_len": 1, "ctx_len": 32},
        weight_bytes_per_param=2.0,
        kv_bytes_per_elem=2.0,
    )
    b, s, c, t = 2, 1, 32, 2
    per_layer = 2 * t * (4 * H * H + 2 * H * INTER) + 2 * 2 * b * HEADS * s * c * HD  # projections + QK^T, PV
    assert cost.flops == LAYERS * per_layer + 2 * b * H * VOCAB  # lm_head on the last position only
    matmul_w = LAYERS * (4 * H * H + 2 * H * INTER) + H * VOCAB
    assert cost.weight_bytes == 2 * matmul_w + 2 * (LAYERS * 2 * H + H) + 2 * t * H  # + norms + gathered rows
    assert cost.weight_storage_bytes == 2 * matmul_w + 2 * (LAYERS * 2 * H + H + VOCAB * H)
    assert cost.kv_read_bytes == LAYERS * 2 * b * HEADS * c * HD * 2
    assert cost.kv_write_bytes == LAYERS * 2 * b * HEADS * s * HD * 2  # CtxScatter updates only
    assert cost.activation_bytes == 2 * b * s * 8 + b * VOCAB * 4
    assert cost.tokens == t
    assert cost.allreduces == 2 * LAYERS and cost.allreduce_bytes == 2 * LAYERS * t * H * 2


@pytest.mark.parametrize(
    ("batch", "seq_len", "ctx_len", "precision"), [(2, 1, 32, "float16"), (1, 8, 64, "mxfp6")]
)
def test_matches_the_analytic_decoder_cost(
    model: onnx.ModelProto, batch: int, seq_len: int, ctx_len: int, precision: str
) -> None:
    """Two independent counts (graph walk and config arithmetic) agree on every field."""
    from_graph = ProgramCost.from_onnx(
        model,
        {"batch_size": batch, "seq_len": seq_len, "ctx_len": ctx_len},
        weight_bytes_per_param=bytes_per_element(precision),
        kv_bytes_per_elem=bytes_per_element("mxint8"),
    )
    from_config = ProgramCost.for_decoder(
        CONFIG,
        batch=batch,
        seq_len=seq_len,
        ctx_len=ctx_len,
        weight_precision=precision,
        kv_precision="mxint8",
    )
    assert dataclasses.asdict(from_graph) == pytest.approx(dataclasses.asdict(from_config))


def test_unbound_symbol_is_named(model: onnx.ModelProto) -> None:
    with pytest.raises(ValueError, match=r"\['ctx_len'\] have no value"):
        ProgramCost.from_onnx(
            model, {"batch_size": 1, "seq_len": 1}, weight_bytes_per_param=2, kv_bytes_per_elem=2
        )


def test_gelu_tanh_addend_is_not_a_residual() -> None:
    """x + 0.044715 x^3 inside GELU is an Add of two activations, but not the residual stream."""
    rng = np.random.default_rng(1)
    w = {
        k: numpy_helper.from_array(rng.normal(size=s).astype(np.float32), k)
        for k, s in [("up", (H, INTER)), ("down", (INTER, H)), ("c", ())]
    }
    n = helper.make_node
    nodes = [
        n("MatMul", ["x", "up"], ["u"]),
        n("Mul", ["u", "u"], ["u2"]),
        n("Mul", ["u2", "u"], ["u3"]),
        n("Mul", ["u3", "c"], ["u3c"]),
        n("Add", ["u", "u3c"], ["inner"]),
        n("Tanh", ["inner"], ["t"]),
        n("MatMul", ["t", "down"], ["d"]),
        n("Add", ["x", "d"], ["y"]),
    ]
    io = [helper.make_tensor_value_info(k, TensorProto.FLOAT, ["tokens", H]) for k in ("x", "y")]
    graph = helper.make_graph(nodes, "mlp", io[:1], io[1:], list(w.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    cost = ProgramCost.from_onnx(model, {"tokens": 3}, weight_bytes_per_param=2.0, kv_bytes_per_elem=2.0)
    assert cost.allreduces == 1 and cost.allreduce_bytes == 3 * H * 2
    assert cost.flops == 2 * 3 * H * INTER * 2 and cost.tokens == 3
    assert cost.activation_bytes == 2 * 3 * H * 4 and cost.kv_read_bytes == 0


def test_weights_need_not_be_loaded(model: onnx.ModelProto, tmp_path: Path) -> None:
    """Only initializer shapes matter: a model saved with external data costs the same unloaded."""
    path = tmp_path / "m.onnx"
    saved = decoder_model()  # saving with external data rewrites the proto in place
    onnx.save_model(
        saved, str(path), save_as_external_data=True, all_tensors_to_one_file=True, size_threshold=512
    )
    light = onnx.load(str(path), load_external_data=False)
    assert any(init.external_data for init in light.graph.initializer)
    symbols = {"batch_size": 1, "seq_len": 4, "ctx_len": 16}
    kwargs = {"weight_bytes_per_param": 2.0, "kv_bytes_per_elem": 2.0}
    assert ProgramCost.from_onnx(light, symbols, **kwargs) == ProgramCost.from_onnx(model, symbols, **kwargs)


def test_einsum_with_ellipsis_counts_the_broadcast_dims() -> None:
    """``...`` stands for batch dims: they multiply the contraction's FLOPs instead of zeroing them."""
    n = helper.make_node
    nodes = [
        n("Einsum", ["a", "b"], ["ab"], equation="...ij,jk->...ik"),
        n("Einsum", ["a", "b2"], ["y"], equation="bhij,hjk->bhik"),
    ]
    graph = helper.make_graph(
        nodes,
        "einsum",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3, 4, 5]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [5, 6]),
            helper.make_tensor_value_info("b2", TensorProto.FLOAT, [3, 5, 6]),
        ],
        [
            helper.make_tensor_value_info("ab", TensorProto.FLOAT, [2, 3, 4, 6]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4, 6]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    cost = ProgramCost.from_onnx(model, {}, weight_bytes_per_param=2.0, kv_bytes_per_elem=2.0)
    assert cost.flops == 2 * (2 * 2 * 3 * 4 * 5 * 6)  # both spell the same contraction
