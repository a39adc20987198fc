"""``export_onnx``: Hugging Face model dir -> ONNX with the QEfficient IO contract."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import onnx
from tqdm.auto import tqdm

from qaic_aot.export import contract
from qaic_aot.export.decoder import DecoderGraph
from qaic_aot.export.families import (
    TRACED,
    architecture_of,
    check_architecture,
    decoder_spec,
    export_route,
    model_facts,
)
from qaic_aot.export.qeff import (
    discard_export,
    export_with_qefficient,
    qefficient_available,
    relocate_onnx,
)
from qaic_aot.export.traced.families import TRACED_FAMILIES, check_traceable
from qaic_aot.export.weights import WeightSource, load_weights, weight_files
from qaic_aot.model_files import config_path
from qaic_core.errors import QaicConfigError
from qaic_core.settings import CompileSettings

logger = logging.getLogger("qaic.aot.export")

# QAIC_AOT_EXPORTER=qaic forces our exporter; =qefficient requires QEfficient; unset picks QEfficient if present.
EXPORTER_ENV = "QAIC_AOT_EXPORTER"
EXPORTERS = ("qefficient", "qaic")
SUPPORTED_DTYPES = ("float32",)
# Above this many weight bytes the tensors go to an external data file (protobuf's 2 GiB limit).
EXTERNAL_DATA_BYTES = 1 << 30


def load_config(model_dir: Path) -> Any:
    """The model's transformers config, with errors that name the missing file."""
    config_path(model_dir)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def choose_exporter() -> str:
    """``qefficient`` when importable (or requested), else our own exporter."""
    wanted = os.environ.get(EXPORTER_ENV, "").strip().lower()
    if wanted and wanted not in EXPORTERS:
        raise QaicConfigError(f"{EXPORTER_ENV}={wanted!r} is not one of {', '.join(EXPORTERS)}")
    if wanted == "qefficient" and not qefficient_available():
        raise QaicConfigError(
            f"{EXPORTER_ENV}=qefficient but QEfficient is not installed: pip install QEfficient"
        )
    if wanted:
        return wanted
    return "qefficient" if qefficient_available() else "qaic"


def export_onnx(
    model_dir: Path | str,
    out_path: Path | str,
    settings: CompileSettings,
    *,
    dtype: str = "float32",
    progress: bool = True,
    ccl: bool = False,
) -> contract.ExportResult:
    """Export ``model_dir`` to ONNX at ``out_path`` for ``settings``; see the IO contract in docs/aot.md.

    ``ccl`` adds the ``comp_ctx_lengths`` input (compute-context lengths).
    """
    model_dir, out_path = Path(model_dir), Path(out_path)
    if dtype not in SUPPORTED_DTYPES:
        raise QaicConfigError(
            f"export dtype {dtype!r} is not supported: the graph is exported in float32 and the compiler "
            "converts it (use convert_to_fp16 / mxfp6 / mxint8 in the compile settings)"
        )
    config = load_config(model_dir)
    exporter = choose_exporter()
    if exporter == "qefficient" and ccl:
        raise QaicConfigError(
            "compute-context lengths are exported by qaic-aot's own exporter, not through QEfficient's "
            "exporter here: set QAIC_AOT_EXPORTER=qaic, or leave out ccl_enabled / comp_ctx_lengths_*"
        )
    if exporter == "qefficient":
        # QEfficient has its own list of supported models and transforms; it decides.
        weight_files(model_dir)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        produced = export_with_qefficient(model_dir, out_path.parent / "qefficient-export", settings)
        onnx_path = relocate_onnx(produced, out_path, _save)
        discard_export(produced, onnx_path)
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        facts = model_facts(config)
        return contract.ExportResult(
            onnx_path=onnx_path,
            **facts,
            input_names=[v.name for v in graph.input],
            output_names=[v.name for v in graph.output],
            exporter=exporter,
        )
    check_architecture(config)
    if export_route(architecture_of(config)) == TRACED:
        weight_files(model_dir)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        return _export_traced(model_dir, out_path, settings, config, progress, ccl)
    spec = decoder_spec(config, settings)
    weight_files(model_dir)  # fail early, naming the missing weight file
    out_path.parent.mkdir(parents=True, exist_ok=True)
    onnx_path = _export_ours(model_dir, out_path, settings, config, progress, ccl)
    return contract.ExportResult(
        onnx_path=onnx_path,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        architecture=spec.architecture,
        input_names=contract.input_names(spec.num_layers, settings, ccl=ccl),
        output_names=contract.output_names(spec.num_layers),
        exporter=exporter,
    )


def _export_ours(
    model_dir: Path, out_path: Path, settings: CompileSettings, config: Any, progress: bool, ccl: bool
) -> Path:
    spec = decoder_spec(config, settings)
    started = time.monotonic()
    stages = tqdm(total=4, desc=f"export {spec.architecture}", disable=not progress, unit="stage")
    stages.set_postfix_str("loading weights")
    weights = WeightSource(load_weights(model_dir, progress), spec.weight_prefix, model_dir)
    stages.update()
    stages.set_postfix_str("building graph")
    logger.info(
        "building %s decoder graph: %d layers, %d heads (%d kv), head_dim %d, ctx_len %d",
        spec.family,
        spec.num_layers,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        settings.ctx_len,
    )
    model = DecoderGraph(spec, config, weights, settings, ccl=ccl).build(progress=progress)
    stages.update()
    stages.set_postfix_str("checking")
    weight_bytes = sum(len(t.raw_data) for t in model.graph.initializer)
    if weight_bytes < EXTERNAL_DATA_BYTES:
        onnx.checker.check_model(model, full_check=True)
    stages.update()
    stages.set_postfix_str("saving")
    _save(model, out_path, weight_bytes)
    stages.update()
    stages.close()
    logger.info("exported %s to %s in %.1fs", model_dir, out_path, time.monotonic() - started)
    return out_path


def _export_traced(
    model_dir: Path, out_path: Path, settings: CompileSettings, config: Any, progress: bool, ccl: bool = False
) -> contract.ExportResult:
    """Trace transformers' own code for the model (``qaic_aot.export.traced``)."""
    from qaic_aot.export.traced import export as traced

    arch = architecture_of(config)
    family = TRACED_FAMILIES[arch]
    check_traceable(family, config, settings)
    started = time.monotonic()
    stages = tqdm(total=4, desc=f"export {arch} (traced)", disable=not progress, unit="stage")
    stages.set_postfix_str("loading model")
    model = traced.load_model(model_dir, family)
    geometry = traced.measure(model)
    stages.update()
    stages.set_postfix_str("tracing")
    logger.info(
        "tracing %s: %d layers, %d kv heads, head_dim %d, ctx_len %d",
        arch,
        geometry.num_layers,
        geometry.num_kv_heads,
        geometry.head_dim,
        settings.ctx_len,
    )
    proto = traced.trace(model, geometry, settings, ccl)
    del model
    stages.update()
    stages.set_postfix_str("checking")
    weight_bytes = sum(len(t.raw_data) for t in proto.graph.initializer)
    if weight_bytes < EXTERNAL_DATA_BYTES:
        onnx.checker.check_model(proto, full_check=True)
    stages.update()
    stages.set_postfix_str("saving")
    _save(proto, out_path, weight_bytes)
    stages.update()
    stages.close()
    logger.info("traced %s to %s in %.1fs", model_dir, out_path, time.monotonic() - started)
    return contract.ExportResult(
        onnx_path=out_path,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        vocab_size=geometry.vocab_size,
        architecture=arch,
        input_names=contract.input_names(geometry.num_layers, settings, ccl=ccl),
        output_names=contract.output_names(geometry.num_layers),
        exporter=exporter_name(TRACED),
    )


def exporter_name(route: str) -> str:
    """``qaic`` for the hand-built graph, ``qaic-traced`` for the traced route."""
    return "qaic" if route == "graph" else "qaic-traced"


def _save(model: onnx.ModelProto, out_path: Path, weight_bytes: int) -> None:
    tmp = out_path.with_name(out_path.name + ".tmp")
    if weight_bytes < EXTERNAL_DATA_BYTES:
        onnx.save_model(model, str(tmp))
    else:
        data_name = out_path.name + ".data"
        onnx.save_model(
            model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True, location=data_name
        )
        onnx.checker.check_model(str(tmp), full_check=False)
    tmp.replace(out_path)
