"""Trace transformers' own model code to ONNX with QEfficient's IO contract (the ``traced`` route).

The model is loaded as transformers builds it; four replacements make it a Cloud AI program: the
KV cache (:mod:`.kv`: CtxScatter/CtxGather on the ``past_*`` inputs), the attention (:mod:`.attention`:
the model's own eager attention under a mask made from the real positions), the LM head
(:mod:`.program`: logits only at ``argmax(position_ids)``) and the RMSNorm modules (:mod:`.norm`:
QEfficient's ``CustomRMSNorm``). Mixture-of-experts blocks use transformers' batched experts
implementation, which has no data-dependent loop.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch

from qaic_aot.export import contract
from qaic_aot.export.norm_op import CUSTOM_OPS_VERSION, custom_ops_imports, rms_norm_function
from qaic_aot.export.ops import DOMAIN, DOMAIN_VERSION, ONNX_OPSET, kv_functions
from qaic_aot.export.traced import attention, norm
from qaic_aot.export.traced.families import TracedFamily
from qaic_aot.export.traced.program import CausalLMProgram
from qaic_core.custom_ops import CUSTOM_OPS_DOMAIN
from qaic_core.settings import CompileSettings

logger = logging.getLogger("qaic.aot.export")

TRACED_REVISION = 2
"""Raised when the traced graph changes for the same model (2: RMSNorm as ``CustomRMSNorm``), so a
cached export is not reused."""


@dataclass(frozen=True)
class KvGeometry:
    """What the model's attention writes to its cache, as measured by running it once."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


def load_model(model_dir: Path, family: TracedFamily) -> Any:
    """The checkpoint as transformers builds it: fp32, eval mode, eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    )
    if family.experts is not None:
        model.config._experts_implementation = family.experts
    return model.eval()


def measure(model: Any) -> KvGeometry:
    """Run two tokens through the model with a plain cache and read the KV shapes it stored.

    Layer count, KV heads and head size come from the model's own code (Falcon's multi-query layout
    keeps one KV head whatever its config says), not from config field names.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[1, 2]]), past_key_values=cache, use_cache=True)
    keys = [getattr(layer, "keys", None) for layer in cache.layers]
    shapes = {tuple(k.shape) for k in keys if isinstance(k, torch.Tensor)}
    if len(shapes) != 1:
        raise ValueError(f"{type(model).__name__}: layers store KV of different shapes {sorted(shapes)}")
    _, heads, _, head_dim = shapes.pop()
    return KvGeometry(len(cache.layers), int(heads), int(head_dim), int(out.logits.shape[-1]))


def example_inputs(
    geometry: KvGeometry, settings: CompileSettings, ccl: bool = False
) -> tuple[torch.Tensor, ...]:
    """Inputs for tracing: two rows of three tokens (one padded) against the whole cache."""
    s = settings
    slots = s.full_batch_size if s.full_batch_size is not None else 2
    ids = torch.tensor([[3, 4, 5], [6, 7, 0]], dtype=torch.int64)
    pos = torch.tensor([[0, 1, 2], [5, 6, -1]], dtype=torch.int64)
    kv_shape = (slots, geometry.num_kv_heads, s.ctx_len, geometry.head_dim)
    past = [torch.zeros(kv_shape, dtype=torch.float32) for _ in range(2 * geometry.num_layers)]
    args: list[torch.Tensor] = [ids, pos, *past]
    if ccl:
        args.append(torch.zeros(max(8, s.ctx_len // 2), dtype=torch.int64))
    if s.full_batch_size is not None:
        args.append(torch.tensor([[0], [min(1, slots - 1)]], dtype=torch.int64))
    if s.num_speculative_tokens is not None:
        args.append(torch.zeros((s.num_speculative_tokens + 1, 1), dtype=torch.int64))
    return tuple(args)


def dynamic_axes(num_layers: int, settings: CompileSettings, ccl: bool = False) -> dict[str, dict[int, str]]:
    """The contract's symbolic dims, by input and output name."""
    kv_rows = contract.kv_batch_dim(settings)
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: contract.BATCH_SIZE, 1: contract.SEQ_LEN},
        "position_ids": {0: contract.BATCH_SIZE, 1: contract.SEQ_LEN},
        "logits": {0: contract.BATCH_SIZE},
    }
    for name in contract.kv_names(num_layers):
        axes[name] = {0: kv_rows, 2: contract.CTX_LEN}
        axes[f"{name}_RetainedState"] = {0: kv_rows, 2: contract.CTX_LEN}
    if ccl:
        axes[contract.COMP_CTX_LENGTHS] = {0: contract.COMP_CTX_LENGTHS}
    if settings.full_batch_size is not None:
        axes["batch_index"] = {0: contract.BATCH_SIZE}
    if settings.num_speculative_tokens is not None:
        axes["num_logits_to_keep"] = {0: contract.NUM_LOGITS_TO_KEEP}
        axes["logits"][1] = contract.NUM_LOGITS_TO_KEEP
    return axes


def trace(model: Any, geometry: KvGeometry, settings: CompileSettings, ccl: bool = False) -> onnx.ModelProto:
    """Export ``model`` through the contract and return the finished ONNX (weights in memory).

    ``ccl`` adds QEfficient's ``comp_ctx_lengths`` input: attention reads only as many cache positions
    as it is long (a compute-context length, one specialization each).
    """
    n = geometry.num_layers
    model.config._attn_implementation = attention.register()
    norm.replace_rms_norms(model)
    program = CausalLMProgram(
        model, n, settings.full_batch_size is not None, settings.num_speculative_tokens is not None, ccl
    ).eval()
    with tempfile.TemporaryDirectory(prefix="qaic-trace-") as tmp, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "traced.onnx"
        torch.onnx.export(
            program,
            example_inputs(geometry, settings, ccl),
            str(path),
            dynamo=False,
            input_names=contract.input_names(n, settings, ccl=ccl),
            output_names=contract.output_names(n),
            dynamic_axes=dynamic_axes(n, settings, ccl),
            opset_version=ONNX_OPSET,
            custom_opsets={DOMAIN: DOMAIN_VERSION, CUSTOM_OPS_DOMAIN: CUSTOM_OPS_VERSION},
            do_constant_folding=True,
        )
        traced = onnx.load(str(path))
    return finish(traced, geometry, settings)


def finish(model: onnx.ModelProto, geometry: KvGeometry, settings: CompileSettings) -> onnx.ModelProto:
    """The contract's dims on every input and output, the KV functions attached, no stale inner shapes."""
    kv_shape: list[str | int] = [
        contract.kv_batch_dim(settings),
        geometry.num_kv_heads,
        contract.CTX_LEN,
        geometry.head_dim,
    ]
    n_logits: str | int = contract.NUM_LOGITS_TO_KEEP if settings.num_speculative_tokens is not None else 1
    shapes: dict[str, list[str | int]] = {
        "input_ids": [contract.BATCH_SIZE, contract.SEQ_LEN],
        "position_ids": [contract.BATCH_SIZE, contract.SEQ_LEN],
        "batch_index": [contract.BATCH_SIZE, 1],
        "num_logits_to_keep": [contract.NUM_LOGITS_TO_KEEP, 1],
        contract.COMP_CTX_LENGTHS: [contract.COMP_CTX_LENGTHS],
        "logits": [contract.BATCH_SIZE, n_logits, geometry.vocab_size],
    }
    for name in contract.kv_names(geometry.num_layers):
        shapes[name] = kv_shape
        shapes[f"{name}_RetainedState"] = kv_shape
    for value in [*model.graph.input, *model.graph.output]:
        if value.name in shapes:
            _set_shape(value, shapes[value.name])
    del model.graph.value_info[:]
    model.functions.extend(kv_functions(settings.full_batch_size is not None))
    model.functions.extend(rms_norm_function(model.graph.node))
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    if not any(o.domain == CUSTOM_OPS_DOMAIN for o in model.opset_import):
        model.opset_import.extend(custom_ops_imports(model.graph.node))
    model.producer_name = "qaic-aot"
    return model


def _set_shape(value: onnx.ValueInfoProto, dims: list[str | int]) -> None:
    shape = value.type.tensor_type.shape
    shape.ClearField("dim")
    for d in dims:
        dim = shape.dim.add()
        if isinstance(d, int):
            dim.dim_value = d
        else:
            dim.dim_param = d
