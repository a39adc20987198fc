"""One config-driven decoder graph for every supported family, built node by node from the weights."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper
from tqdm.auto import tqdm

from qaic_aot.export import contract
from qaic_aot.export.families import DecoderSpec
from qaic_aot.export.graph import GraphBuilder
from qaic_aot.export.norm_op import custom_ops_imports, rms_norm_function
from qaic_aot.export.ops import DOMAIN, DOMAIN_VERSION, ONNX_OPSET, kv_functions
from qaic_aot.export.rope import rope_tables
from qaic_aot.export.weights import WeightSource
from qaic_core.custom_ops import CUSTOM_OPS_DOMAIN, RMS_NORM
from qaic_core.settings import CompileSettings

logger = logging.getLogger("qaic.aot.export")

F32 = np.float32

GRAPH_REVISION = 3
"""Raised whenever the graph this module builds changes, so that cached exports are rebuilt (part of
the export's cache key). 2: the last layer computes queries, attention output and MLP only for the
rows whose logits the program returns. 3: RMSNorm is QEfficient's ``CustomRMSNorm``."""


class DecoderGraph:
    """Builds the graph of one decoder: embeddings, layers with KV ops, final norm, logits."""

    def __init__(
        self,
        spec: DecoderSpec,
        config: Any,
        weights: WeightSource,
        settings: CompileSettings,
        *,
        ccl: bool = False,
    ) -> None:
        self.spec = spec
        self.config = config
        self.w = weights
        self.settings = settings
        self.g = GraphBuilder()
        self.cb = settings.full_batch_size is not None
        self.ccl = ccl

    # -- small blocks -------------------------------------------------------------------------
    def linear(self, x: str, name: str, *, conv1d: bool = False) -> str:
        """x @ W^T + b for a Linear (weight [out, in]); x @ W + b for GPT-2's Conv1D (weight [in, out])."""
        weight = self.w.get(f"{name}.weight")
        kernel = weight if conv1d else weight.T
        y = self.g.op("MatMul", [x, self.g.weight(f"{name}.weight", kernel)], hint=name)
        if self.w.has(f"{name}.bias"):
            y = self.g.op("Add", [y, self.g.weight(f"{name}.bias", self.w.get(f"{name}.bias"))])
        return y

    def norm(self, x: str, name: str) -> str:
        g, spec = self.g, self.spec
        if spec.norm == "layer":
            scale = g.weight(f"{name}.weight", self.w.get(f"{name}.weight"))
            bias = g.weight(f"{name}.bias", self.w.get(f"{name}.bias"))
            return g.op("LayerNormalization", [x, scale, bias], axis=-1, epsilon=spec.norm_eps)
        weight = self.w.get(f"{name}.weight").astype(F32) + F32(spec.norm_weight_offset)
        return self.rms(x, g.weight(f"{name}.weight", weight))

    def rms(self, x: str, weight: str) -> str:
        """QEfficient's compiler-known ``CustomRMSNorm`` (see :mod:`qaic_aot.export.norm_op`)."""
        return self.g.op(RMS_NORM, [x, weight], domain=CUSTOM_OPS_DOMAIN, epsilon=float(self.spec.norm_eps))

    def act(self, x: str) -> str:
        g, kind = self.g, self.spec.activation
        if kind == "silu":
            return g.op("Mul", [x, g.op("Sigmoid", [x])])
        if kind == "relu":
            return g.op("Relu", [x])
        half_x = g.op("Mul", [x, g.const(0.5, F32)])
        if kind == "gelu":
            inner = g.op("Erf", [g.op("Div", [x, g.const(np.sqrt(2.0), F32)])])
        else:  # tanh approximation: gelu_new, gelu_pytorch_tanh
            cube = g.op("Mul", [g.op("Mul", [x, x]), x])
            poly = g.op("Add", [x, g.op("Mul", [cube, g.const(0.044715, F32)])])
            inner = g.op("Tanh", [g.op("Mul", [poly, g.const(np.sqrt(2.0 / np.pi), F32)])])
        return g.op("Mul", [half_x, g.op("Add", [inner, g.const(1.0, F32)])])

    def rotate(self, x: str, cos: str, sin: str) -> str:
        """x * cos + rotate_half(x) * sin on the first rotary_dim dims of the head."""
        g, spec = self.g, self.spec
        rot, half = spec.rotary_dim, spec.rotary_dim // 2
        x_rot, x_pass = x, ""
        if rot < spec.head_dim:
            x_rot, x_pass = g.fresh("rot"), g.fresh("pass")
            g.op("Split", [x, g.const([rot, spec.head_dim - rot])], outputs=[x_rot, x_pass], axis=-1)
        x1 = g.op("Slice", [x_rot, g.const([0]), g.const([half]), g.const([-1])])
        x2 = g.op("Slice", [x_rot, g.const([half]), g.const([rot]), g.const([-1])])
        rotated = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
        out = g.op("Add", [g.op("Mul", [x_rot, cos]), g.op("Mul", [rotated, sin])])
        if x_pass:
            out = g.op("Concat", [out, x_pass], axis=-1)
        return out

    def heads(self, x: str, n: int) -> str:
        """[B, S, n*D] -> [B, S, n, D]."""
        return self.g.op("Reshape", [x, self.g.const([0, 0, n, self.spec.head_dim])])

    # -- the graph ---------------------------------------------------------------------------
    def build(self, progress: bool = True) -> onnx.ModelProto:
        g, spec, s = self.g, self.spec, self.settings
        ids, pos = "input_ids", "position_ids"
        pos_c = g.op("Max", [pos, g.const(0)], hint="pos_clamped")
        embed_name = "wte" if spec.family == "gpt2" else "embed_tokens"
        embed = self.w.get(f"{embed_name}.weight")
        h = g.op("Gather", [g.weight(f"{embed_name}.weight", embed), ids], axis=0, hint="embeds")
        if spec.embed_scale is not None:
            h = g.op("Mul", [h, g.const(spec.embed_scale, F32)])
        if spec.positions == "learned":
            wpe = g.weight("wpe.weight", self.w.get("wpe.weight"))
            h = g.op("Add", [h, g.op("Gather", [wpe, pos_c], axis=0)])
        cos = sin = ""
        if spec.positions == "rope":
            cos_t, sin_t = rope_tables(self.config, spec, s.ctx_len)
            cos = g.op(
                "Unsqueeze", [g.op("Gather", [g.weight("rope.cos", cos_t), pos_c], axis=0), g.const([2])]
            )
            sin = g.op(
                "Unsqueeze", [g.op("Gather", [g.weight("rope.sin", sin_t), pos_c], axis=0), g.const([2])]
            )
        kv = self.kv_positions()
        mask = self.attention_mask(pos, kv)
        ctx_indices = g.op("Unsqueeze", [kv, g.const([0, 1])], hint="ctx_indices")
        # Only the rows whose logits leave the program need the last layer's queries, attention
        # output and MLP; every row's keys and values are still written to the cache.
        kept = self.kept_rows(pos)
        kept_pos = g.op("GatherND", [pos, kept], batch_dims=1, hint="kept_pos")
        kept_mask = self.attention_mask(kept_pos, kv)
        last = spec.num_layers - 1
        for i in tqdm(
            range(spec.num_layers), desc="export: decoder layers", disable=not progress, leave=False
        ):
            rows = (kept, kept_mask) if i == last else None
            h = self.layer(i, h, cos, sin, mask, ctx_indices, rows=rows)
        h = self.norm(h, "ln_f" if spec.family == "gpt2" else "norm")
        if spec.tie_word_embeddings or not self.w.has("lm_head.weight"):
            head = embed.T
        else:
            head = self.w.get("lm_head.weight").T
        g.op("MatMul", [h, g.weight("lm_head.weight", head)], outputs=["logits"])
        return self.model()

    def kv_positions(self) -> str:
        """The KV positions ``[C]`` a run reads and attends to: the cache's context, or with
        compute-context lengths the length of ``comp_ctx_lengths`` (QEfficient's CCL)."""
        g = self.g
        source = contract.COMP_CTX_LENGTHS if self.ccl else "past_key.0"
        axis = 0 if self.ccl else 2
        ctx = g.op("Gather", [g.op("Shape", [source]), g.const(axis)], axis=0, hint="ctx_len")
        return g.op("Range", [g.const(0), ctx, g.const(1)], hint="kv_positions")

    def attention_mask(self, pos: str, kv: str) -> str:
        """Masked ``[B, 1, 1, S, C]`` for queries at ``pos`` ``[B, S]``: key j hidden from a query
        at p when j > p (or outside the window)."""
        g = self.g
        query = g.op("Unsqueeze", [pos, g.const([2])])
        masked = g.op("Greater", [kv, query])
        if self.spec.sliding_window is not None and self.spec.sliding_window < self.settings.ctx_len:
            lower = g.op("Sub", [query, g.const(self.spec.sliding_window)])
            masked = g.op("Or", [masked, g.op("LessOrEqual", [kv, lower])])
        return g.op("Unsqueeze", [masked, g.const([1, 2])], hint="attn_mask")

    def layer(
        self,
        i: int,
        x: str,
        cos: str,
        sin: str,
        mask: str,
        ctx_indices: str,
        *,
        rows: tuple[str, str] | None = None,
    ) -> str:
        """One decoder layer. With ``rows`` (index ``[B, n, 1]`` into the sequence, and the mask of
        those queries), the layer returns only those rows: all keys and values, n queries."""
        g, spec = self.g, self.spec
        gpt2 = spec.family == "gpt2"
        p = f"h.{i}" if gpt2 else f"layers.{i}"
        attn = f"{p}.attn" if gpt2 else f"{p}.self_attn"
        n1 = self.norm(x, f"{p}.ln_1" if gpt2 else f"{p}.input_layernorm")
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        if spec.qkv == "separate":
            q, k, v = (self.linear(n1, f"{attn}.{n}_proj") for n in "qkv")
        else:
            fused = (
                self.linear(n1, f"{attn}.c_attn", conv1d=True)
                if gpt2
                else self.linear(n1, f"{attn}.qkv_proj")
            )
            outs = [g.fresh("q"), g.fresh("k"), g.fresh("v")]
            g.op("Split", [fused, g.const([q_size, kv_size, kv_size])], outputs=outs, axis=-1)
            q, k, v = outs
        q, k, v = (
            self.heads(q, spec.num_heads),
            self.heads(k, spec.num_kv_heads),
            self.heads(v, spec.num_kv_heads),
        )
        if spec.qk_norm:
            q = self.norm(q, f"{attn}.q_norm")
            k = self.norm(k, f"{attn}.k_norm")
        if spec.positions == "rope":
            q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if rows is not None:
            index, mask = rows  # the kept queries attend under their own mask
            q = g.op("GatherND", [q, index], batch_dims=1, hint=f"{p}.kept_queries")
            x = g.op("GatherND", [x, index], batch_dims=1, hint=f"{p}.kept_rows")
        q, k, v = (g.op("Transpose", [t], perm=[0, 2, 1, 3]) for t in (q, k, v))
        keys = self.cache(i, "key", k, ctx_indices)
        values = self.cache(i, "value", v, ctx_indices)
        d = spec.head_dim
        q5 = g.op("Reshape", [q, g.const([0, spec.num_kv_heads, spec.num_kv_groups, -1, d])])
        k5 = g.op("Unsqueeze", [keys, g.const([2])])
        v5 = g.op("Unsqueeze", [values, g.const([2])])
        scores = g.op("MatMul", [q5, g.op("Transpose", [k5], perm=[0, 1, 2, 4, 3])])
        scale = spec.attn_scale / (i + 1) if spec.attn_scale_divisor_by_layer else spec.attn_scale
        scores = g.op("Mul", [scores, g.const(scale, F32)])
        scores = g.op("Where", [mask, g.const(contract.MASKED_SCORE, F32), scores])
        probs = g.op("Softmax", [scores], axis=-1)
        out = g.op("MatMul", [probs, v5])  # [B, KV, G, S, D]
        out = g.op("Reshape", [out, g.const([0, spec.num_heads, -1, d])])
        out = g.op("Transpose", [out], perm=[0, 2, 1, 3])
        out = g.op("Reshape", [out, g.const([0, 0, q_size])])
        out = self.linear(out, f"{attn}.c_proj", conv1d=True) if gpt2 else self.linear(out, f"{attn}.o_proj")
        h = g.op("Add", [x, out], hint=f"{p}.attn_residual")
        n2 = self.norm(h, f"{p}.ln_2" if gpt2 else f"{p}.post_attention_layernorm")
        return g.op("Add", [h, self.mlp(p, n2)], hint=f"{p}.residual")

    def mlp(self, p: str, x: str) -> str:
        g, spec = self.g, self.spec
        if spec.mlp == "gpt2":
            up = self.act(self.linear(x, f"{p}.mlp.c_fc", conv1d=True))
            return self.linear(up, f"{p}.mlp.c_proj", conv1d=True)
        if spec.mlp == "gated_fused":
            gate, up = g.fresh("gate"), g.fresh("up")
            both = self.linear(x, f"{p}.mlp.gate_up_proj")
            g.op("Split", [both, g.const([spec.intermediate_size] * 2)], outputs=[gate, up], axis=-1)
        else:
            gate, up = self.linear(x, f"{p}.mlp.gate_proj"), self.linear(x, f"{p}.mlp.up_proj")
        return self.linear(g.op("Mul", [self.act(gate), up]), f"{p}.mlp.down_proj")

    def cache(self, i: int, kind: str, new: str, ctx_indices: str) -> str:
        """Scatter the new K or V into the cache (the retained state) and gather the whole ctx back."""
        g = self.g
        past = f"past_{kind}.{i}"
        rows = ["batch_index"] if self.cb else []
        suffix = "CB" if self.cb else ""
        kept = g.op(
            f"CtxScatter{suffix}",
            [past, *rows, "position_ids", new],
            outputs=[f"{past}_RetainedState"],
            domain=DOMAIN,
        )
        return g.op(f"CtxGather{suffix}", [kept, *rows, ctx_indices], domain=DOMAIN, hint=f"{past}_all")

    def kept_rows(self, pos: str) -> str:
        """Index ``[B, n, 1]`` of the rows whose logits the program returns: argmax(position_ids)
        per row (n = 1), or the last K+1 up to it with speculative decoding."""
        g = self.g
        last = g.op("ArgMax", [g.op("Cast", [pos], to=TensorProto.INT32)], axis=1, keepdims=1)  # [B, 1]
        if self.settings.num_speculative_tokens is not None:
            keep = g.op("Gather", [g.op("Shape", ["num_logits_to_keep"]), g.const(0)], axis=0)
            start = g.op("Sub", [last, g.op("Sub", [keep, g.const(1)])])
            last = g.op("Add", [start, g.op("Range", [g.const(0), keep, g.const(1)])])
            last = g.op("Max", [last, g.const(0)])
        return g.op("Unsqueeze", [last, g.const([2])], hint="kept_rows")

    def model(self) -> onnx.ModelProto:
        spec, s = self.spec, self.settings
        kv_rows = contract.kv_batch_dim(s)
        kv_shape: list[str | int] = [kv_rows, spec.num_kv_heads, contract.CTX_LEN, spec.head_dim]
        bs, sl = contract.BATCH_SIZE, contract.SEQ_LEN
        info = helper.make_tensor_value_info
        inputs = [
            info("input_ids", TensorProto.INT64, [bs, sl]),
            info("position_ids", TensorProto.INT64, [bs, sl]),
        ]
        inputs += [info(n, TensorProto.FLOAT, kv_shape) for n in contract.kv_names(spec.num_layers)]
        if self.ccl:
            inputs.append(info(contract.COMP_CTX_LENGTHS, TensorProto.INT64, [contract.COMP_CTX_LENGTHS]))
        if self.cb:
            inputs.append(info("batch_index", TensorProto.INT64, [bs, 1]))
        n_logits: str | int = 1
        if s.num_speculative_tokens is not None:
            inputs.append(info("num_logits_to_keep", TensorProto.INT64, [contract.NUM_LOGITS_TO_KEEP, 1]))
            n_logits = contract.NUM_LOGITS_TO_KEEP
        logits_shape: list[str | int] = [bs, n_logits, spec.vocab_size]
        outputs = [info("logits", TensorProto.FLOAT, logits_shape)]
        outputs += [
            info(n, TensorProto.FLOAT, kv_shape) for n in contract.kv_names(spec.num_layers, "_RetainedState")
        ]
        graph = helper.make_graph(
            self.g.nodes, f"qaic_{spec.family}_decoder", inputs, outputs, initializer=self.g.initializers
        )
        model = helper.make_model(
            graph,
            opset_imports=[
                helper.make_opsetid("", ONNX_OPSET),
                helper.make_opsetid(DOMAIN, DOMAIN_VERSION),
                *custom_ops_imports(self.g.nodes),
            ],
            functions=[*kv_functions(self.cb), *rms_norm_function(self.g.nodes)],
            producer_name="qaic-aot",
        )
        model.ir_version = 8
        return model
