"""Pooling models to ONNX with QEfficient's embedding IO contract (``QEFFAutoModel``, no KV cache).

Inputs ``input_ids`` and ``attention_mask`` ``[batch_size, seq_len]`` (int64, right padded, mask 0 on
padding); one output:

- ``output`` ``[batch_size, seq_len, hidden]``: every token's last hidden state (host pooling);
- ``output`` ``[batch_size, hidden]``: pooled in the program (``pooling_device: qaic``), then
  L2-normalized when ``normalize`` is set;
- ``logits`` ``[batch_size, num_labels]``: a sequence classifier's head on its first token.

Encoders (BERT, RoBERTa, XLM-RoBERTa) attend both ways over the real tokens; a decoder used as an
embedder (``MistralModel``, ``Qwen2Model``, ``LlamaModel``) attends causally, reusing the decoder
graph's layers without a KV cache.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper
from tqdm.auto import tqdm

from qaic_aot.export import contract
from qaic_aot.export.decoder import DecoderGraph
from qaic_aot.export.families import DecoderSpec, decoder_spec
from qaic_aot.export.graph import GraphBuilder
from qaic_aot.export.norm_op import custom_ops_imports, rms_norm_function
from qaic_aot.export.ops import ONNX_OPSET
from qaic_aot.export.pooling_archs import CLASSIFIER, DECODER, pooling_architecture
from qaic_aot.export.weights import WeightSource
from qaic_core.errors import QaicConfigError
from qaic_core.execution import (
    HIDDEN_OUTPUT,
    LOGITS_OUTPUT,
    POOL_ON_DEVICE,
    POOLED_OUTPUT,
    PoolingSettings,
)
from qaic_core.settings import CompileSettings

F32 = np.float32
OUTPUT = "output"
LOGITS = "logits"


def output_name(config: Any) -> str:
    _, arch = pooling_architecture(config)
    return LOGITS if arch.kind == CLASSIFIER else OUTPUT


@dataclass(frozen=True)
class EncoderSpec:
    """A BERT-style encoder's geometry and switches, read from its config."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    norm_eps: float
    activation: str
    max_positions: int
    padding_idx: int
    weight_prefix: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def encoder_spec(config: Any, family: str, max_seq_len: int) -> EncoderSpec:
    """Read a BERT or RoBERTa config, refusing what the graph cannot express."""
    position_type = getattr(config, "position_embedding_type", "absolute") or "absolute"
    if position_type != "absolute":
        raise QaicConfigError(
            f"{family}: position_embedding_type {position_type!r} is not supported by the exporter (absolute only)"
        )
    act = str(config.hidden_act)
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
        raise QaicConfigError(f"{family}: activation {act!r} is not supported by the exporter")
    padding_idx = int(getattr(config, "pad_token_id", 1) or 0) if family == "roberta" else 0
    max_pos = int(config.max_position_embeddings)
    usable = max_pos - (padding_idx + 1 if family == "roberta" else 0)
    if max_seq_len > usable:
        raise QaicConfigError(
            f"{family}: embed_seq_len {max_seq_len} exceeds the model's {usable} positions: lower "
            f"--max-model-len (and embed_seq_len) to at most {usable}"
        )
    return EncoderSpec(
        family=family,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        num_heads=int(config.num_attention_heads),
        intermediate_size=int(config.intermediate_size),
        norm_eps=float(config.layer_norm_eps),
        activation=act,
        max_positions=max_pos,
        padding_idx=padding_idx,
        weight_prefix=f"{family}.",
    )


def _inputs(g: GraphBuilder) -> tuple[str, str]:
    """``[B, S]`` mask as float (1 real, 0 padding) and as bool."""
    keep = g.op("Cast", ["attention_mask"], to=TensorProto.BOOL, hint="keep")
    keep_f = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT, hint="keep_f")
    return keep, keep_f


def pool(g: GraphBuilder, hidden: str, keep: str, keep_f: str, method: str) -> str:
    """``[B, S, H]`` -> ``[B, H]`` over the real tokens (QEfficient's pooling functions)."""
    if method == "cls":
        return first_token(g, hidden)
    weights = g.op("Unsqueeze", [keep_f, g.const([2])])  # [B, S, 1]
    if method in ("mean", "avg"):
        total = g.op("ReduceSum", [g.op("Mul", [hidden, weights]), g.const([1])], keepdims=0)
        count = g.op("Max", [g.op("ReduceSum", [weights, g.const([1])], keepdims=0), g.const(1e-9, F32)])
        return g.op("Div", [total, count], hint="mean")
    if method == "max":
        kept = g.op("Where", [g.op("Unsqueeze", [keep, g.const([2])]), hidden, g.const(-1e9, F32)])
        return g.op("ReduceMax", [kept], axes=[1], keepdims=0, hint="max")  # opset 17: axes attribute
    if method == "last":
        count = g.op("ReduceSum", ["attention_mask", g.const([1])], keepdims=1)  # [B, 1]
        last = g.op("Max", [g.op("Sub", [count, g.const(1)]), g.const(0)])
        index = g.op("Unsqueeze", [last, g.const([2])])  # [B, 1, 1]
        picked = g.op("GatherND", [hidden, index], batch_dims=1)  # [B, 1, H]
        return g.op("Squeeze", [picked, g.const([1])], hint="last")
    raise QaicConfigError(f"pooling_method {method!r} cannot be compiled into the program")


def first_token(g: GraphBuilder, hidden: str) -> str:
    """``[B, S, H]`` -> ``[B, H]``: the first token (CLS)."""
    return g.op("Squeeze", [g.op("Gather", [hidden, g.const([0])], axis=1), g.const([1])], hint="first_token")


def l2_normalize(g: GraphBuilder, x: str) -> str:
    """``x / max(||x||, 1e-12)`` along the last axis (torch's F.normalize)."""
    norm = g.op("Sqrt", [g.op("ReduceSum", [g.op("Mul", [x, x]), g.const([-1])], keepdims=1)])
    return g.op("Div", [x, g.op("Max", [norm, g.const(1e-12, F32)])], hint="normalized")


class EncoderGraph:
    """A BERT or RoBERTa encoder with its pooling or classification head, built from the weights."""

    def __init__(
        self, spec: EncoderSpec, config: Any, weights: WeightSource, kind: str, pooling: PoolingSettings
    ) -> None:
        self.spec = spec
        self.config = config
        self.w = weights
        self.kind = kind
        self.pooling = pooling
        self.g = GraphBuilder()

    def linear(self, x: str, name: str) -> str:
        g = self.g
        y = g.op("MatMul", [x, g.weight(f"{name}.weight", self.w.get(f"{name}.weight").T)], hint=name)
        if self.w.has(f"{name}.bias"):
            y = g.op("Add", [y, g.weight(f"{name}.bias", self.w.get(f"{name}.bias"))])
        return y

    def layer_norm(self, x: str, name: str) -> str:
        g = self.g
        scale = g.weight(f"{name}.weight", self.w.get(f"{name}.weight"))
        bias = g.weight(f"{name}.bias", self.w.get(f"{name}.bias"))
        return g.op("LayerNormalization", [x, scale, bias], axis=-1, epsilon=self.spec.norm_eps)

    def act(self, x: str) -> str:
        g, kind = self.g, self.spec.activation
        if kind == "relu":
            return g.op("Relu", [x])
        half_x = g.op("Mul", [x, g.const(0.5, F32)])
        if kind == "gelu":
            inner = g.op("Erf", [g.op("Div", [x, g.const(np.sqrt(2.0), F32)])])
        else:
            cube = g.op("Mul", [g.op("Mul", [x, x]), x])
            poly = g.op("Add", [x, g.op("Mul", [cube, g.const(0.044715, F32)])])
            inner = g.op("Tanh", [g.op("Mul", [poly, g.const(np.sqrt(2.0 / np.pi), F32)])])
        return g.op("Mul", [half_x, g.op("Add", [inner, g.const(1.0, F32)])])

    def embeddings(self) -> str:
        g, spec = self.g, self.spec
        words = g.weight("word_embeddings", self.w.get("embeddings.word_embeddings.weight"))
        h = g.op("Gather", [words, "input_ids"], axis=0, hint="words")
        if spec.family == "roberta":
            # RoBERTa numbers real tokens from padding_idx + 1 (transformers' create_position_ids_from_input_ids).
            count = g.op("CumSum", ["attention_mask", g.const(1)])
            positions = g.op("Add", [g.op("Mul", [count, "attention_mask"]), g.const(spec.padding_idx)])
        else:
            seq = g.op("Gather", [g.op("Shape", ["input_ids"]), g.const(1)], axis=0)
            positions = g.op("Unsqueeze", [g.op("Range", [g.const(0), seq, g.const(1)]), g.const([0])])
        table = g.weight("position_embeddings", self.w.get("embeddings.position_embeddings.weight"))
        h = g.op("Add", [h, g.op("Gather", [table, positions], axis=0)])
        if self.w.has("embeddings.token_type_embeddings.weight"):
            types = self.w.get("embeddings.token_type_embeddings.weight")
            h = g.op("Add", [h, g.weight("token_type_0", types[0])])  # every token is of type 0
        return self.layer_norm(h, "embeddings.LayerNorm")

    def heads(self, x: str) -> str:
        """[B, S, H] -> [B, heads, S, D]."""
        g, spec = self.g, self.spec
        split = g.op("Reshape", [x, g.const([0, 0, spec.num_heads, spec.head_dim])])
        return g.op("Transpose", [split], perm=[0, 2, 1, 3])

    def layer(self, i: int, x: str, masked: str) -> str:
        g, spec = self.g, self.spec
        p = f"encoder.layer.{i}"
        q, k, v = (self.heads(self.linear(x, f"{p}.attention.self.{n}")) for n in ("query", "key", "value"))
        scores = g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])])
        scores = g.op("Mul", [scores, g.const(spec.head_dim**-0.5, F32)])
        scores = g.op("Where", [masked, g.const(contract.MASKED_SCORE, F32), scores])
        ctx = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])  # [B, heads, S, D]
        ctx = g.op(
            "Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]), g.const([0, 0, spec.hidden_size])]
        )
        attn = self.linear(ctx, f"{p}.attention.output.dense")
        h = self.layer_norm(g.op("Add", [attn, x]), f"{p}.attention.output.LayerNorm")
        up = self.act(self.linear(h, f"{p}.intermediate.dense"))
        down = self.linear(up, f"{p}.output.dense")
        return self.layer_norm(g.op("Add", [down, h]), f"{p}.output.LayerNorm")

    def build(self, progress: bool = True) -> onnx.ModelProto:
        g = self.g
        keep, keep_f = _inputs(g)
        # Keys on padding are hidden from every query: [B, 1, 1, S].
        masked = g.op("Unsqueeze", [g.op("Not", [keep]), g.const([1, 2])], hint="attn_mask")
        h = self.embeddings()
        for i in tqdm(
            range(self.spec.num_layers), desc="export: encoder layers", disable=not progress, leave=False
        ):
            h = self.layer(i, h, masked)
        if self.kind == CLASSIFIER:
            self.classifier(h)
            output = LOGITS_OUTPUT
        else:
            output = finish(g, h, keep, keep_f, self.pooling)
        return make_model(g, output, self.spec.family, self.spec.hidden_size, num_labels(self.config))

    def classifier(self, h: str) -> None:
        """transformers' sequence-classification heads on the first token."""
        g = self.g
        first = first_token(g, h)
        if self.spec.family == "roberta":  # RobertaClassificationHead: dense, tanh, out_proj
            x = g.op("Tanh", [self.linear(first, "classifier.dense")])
            out = self.linear(x, "classifier.out_proj")
        else:  # BertPooler (dense, tanh) then the classifier
            x = g.op("Tanh", [self.linear(first, "pooler.dense")])
            out = self.linear(x, "classifier")
        g.op("Identity", [out], outputs=[LOGITS])


class DecoderEmbeddingGraph(DecoderGraph):
    """A decoder's layers without a KV cache: causal attention over the real tokens of each row."""

    def __init__(
        self,
        spec: DecoderSpec,
        config: Any,
        weights: WeightSource,
        settings: CompileSettings,
        pooling: PoolingSettings,
    ) -> None:
        super().__init__(spec, config, weights, settings)
        self.pooling = pooling

    def cache(self, i: int, kind: str, new: str, ctx_indices: str) -> str:
        return new  # every key and value of the sequence is computed in this run

    def build(self, progress: bool = True) -> onnx.ModelProto:
        g, spec = self.g, self.spec
        keep, keep_f = _inputs(g)
        seq = g.op("Gather", [g.op("Shape", ["input_ids"]), g.const(1)], axis=0, hint="seq_len")
        positions = g.op("Range", [g.const(0), seq, g.const(1)], hint="positions")  # [S]
        pos = g.op("Unsqueeze", [positions, g.const([0])])  # [1, S]
        embed = self.w.get("embed_tokens.weight")
        h = g.op("Gather", [g.weight("embed_tokens.weight", embed), "input_ids"], axis=0, hint="embeds")
        if spec.embed_scale is not None:
            h = g.op("Mul", [h, g.const(spec.embed_scale, F32)])
        cos = sin = ""
        if spec.positions == "rope":
            from qaic_aot.export.rope import rope_tables

            cos_t, sin_t = rope_tables(self.config, spec, self.pooling.max_seq_len)
            cos = g.op(
                "Unsqueeze", [g.op("Gather", [g.weight("rope.cos", cos_t), pos], axis=0), g.const([2])]
            )
            sin = g.op(
                "Unsqueeze", [g.op("Gather", [g.weight("rope.sin", sin_t), pos], axis=0), g.const([2])]
            )
        # A query at p sees keys at j <= p (within the window) that are real tokens: [B, 1, 1, S, S].
        query = g.op("Unsqueeze", [positions, g.const([1])])  # [S, 1]
        masked = g.op("Greater", [positions, query])  # [S, S]: key after query
        if spec.sliding_window is not None and spec.sliding_window < self.pooling.max_seq_len:
            lower = g.op("Sub", [query, g.const(spec.sliding_window)])
            masked = g.op("Or", [masked, g.op("LessOrEqual", [positions, lower])])
        padding = g.op("Unsqueeze", [g.op("Not", [keep]), g.const([1])])  # [B, 1, S]
        masked = g.op("Or", [masked, padding])  # [B, S, S]
        mask = g.op("Unsqueeze", [masked, g.const([1, 2])], hint="attn_mask")
        for i in tqdm(
            range(spec.num_layers), desc="export: decoder layers", disable=not progress, leave=False
        ):
            h = self.layer(i, h, cos, sin, mask, "")
        h = self.norm(h, "norm")
        output = finish(g, h, keep, keep_f, self.pooling)
        return make_model(g, output, spec.family, spec.hidden_size, 0)


def finish(g: GraphBuilder, hidden: str, keep: str, keep_f: str, pooling: PoolingSettings) -> str:
    """The ``output`` of an embedding program: hidden states, or pooled (and normalized) in the program."""
    out, kind = hidden, HIDDEN_OUTPUT
    if pooling.device == POOL_ON_DEVICE:
        out, kind = pool(g, hidden, keep, keep_f, pooling.method), POOLED_OUTPUT
        if pooling.normalize:
            out = l2_normalize(g, out)
    g.op("Identity", [out], outputs=[OUTPUT])
    return kind


def num_labels(config: Any) -> int:
    return int(getattr(config, "num_labels", 0) or 0)


def make_model(g: GraphBuilder, output: str, family: str, hidden: int, labels: int) -> onnx.ModelProto:
    """The graph with QEfficient's embedding inputs and the one output ``output`` names."""
    bs, sl = contract.BATCH_SIZE, contract.SEQ_LEN
    info = helper.make_tensor_value_info
    inputs = [
        info("input_ids", TensorProto.INT64, [bs, sl]),
        info("attention_mask", TensorProto.INT64, [bs, sl]),
    ]
    if output == LOGITS_OUTPUT:
        outputs = [info(LOGITS, TensorProto.FLOAT, [bs, labels])]
    elif output == POOLED_OUTPUT:
        outputs = [info(OUTPUT, TensorProto.FLOAT, [bs, hidden])]
    else:
        outputs = [info(OUTPUT, TensorProto.FLOAT, [bs, sl, hidden])]
    graph = helper.make_graph(g.nodes, f"qaic_{family}_{output}", inputs, outputs, initializer=g.initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", ONNX_OPSET), *custom_ops_imports(g.nodes)],
        functions=rms_norm_function(g.nodes),
        producer_name="qaic-aot",
    )
    model.ir_version = 8
    return model


def build_pooling_graph(
    config: Any,
    weights: dict[str, np.ndarray],
    model_dir: Any,
    settings: CompileSettings,
    pooling: PoolingSettings,
    *,
    progress: bool = True,
) -> onnx.ModelProto:
    """The ONNX graph of a pooling model for ``pooling`` (its largest length bounds positions)."""
    arch, found = pooling_architecture(config)
    if found.kind == DECODER:
        causal = copy.copy(config)
        causal.architectures = [found.family]
        spec = dataclasses.replace(
            decoder_spec(causal, settings.replace(ctx_len=max(settings.ctx_len, pooling.max_seq_len))),
            architecture=arch,
        )
        source = WeightSource(weights, "model.", model_dir)
        return DecoderEmbeddingGraph(spec, config, source, settings, pooling).build(progress=progress)
    espec = encoder_spec(config, found.family, pooling.max_seq_len)
    source = WeightSource(weights, espec.weight_prefix, model_dir)
    return EncoderGraph(espec, config, source, found.kind, pooling).build(progress=progress)
