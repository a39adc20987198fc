"""A compiled program read into memory once per process and shared by every loaded Program."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from qaic_core.types import Binding, Direction, SkuType
from qaic_sim import qpcfile

log = logging.getLogger("qaic.sim.runtime")

_ORT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


class ProgramImage:
    """Manifest, IoDesc and one onnxruntime session (created on first run, then reused)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest, self.iodesc = qpcfile.read_manifest(path)
        self.bindings: tuple[Binding, ...] = self.manifest.bindings
        self.inputs = [b for b in self.bindings if b.dir == Direction.IN]
        self.outputs = [b for b in self.bindings if b.dir == Direction.OUT]
        self.output_names = [b.name for b in self.outputs]
        self.retained = self.manifest.retained
        self.retained_out = {v: k for k, v in self.retained.items()}
        self.by_name = {b.name: b for b in self.bindings}
        self.dtypes = [b.dtype for b in self.bindings]
        self._lock = threading.Lock()
        self._session: Any = None
        self.graph_dtypes: dict[str, np.dtype] = {}
        self._times: dict[tuple[int, SkuType, int, int, str | None], float] = {}

    def session(self, threads: int) -> Any:
        """The onnxruntime session (CPU), built once; model-local functions are inlined by ORT."""
        with self._lock:
            if self._session is None:
                import onnxruntime as ort

                opts = ort.SessionOptions()
                opts.intra_op_num_threads = threads
                opts.inter_op_num_threads = 1
                opts.log_severity_level = 3
                model = qpcfile.read_member(self.path, qpcfile.MODEL)
                self._session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
                for v in [*self._session.get_inputs(), *self._session.get_outputs()]:
                    self.graph_dtypes[v.name] = np.dtype(_ORT_DTYPES.get(v.type, np.float32))
                log.info("onnxruntime session ready for %s", self.path)
            return self._session

    def match(self, shapes: list[tuple[int, ...] | None]) -> int | None:
        """Index of the first specialization whose dims equal every supplied (non-empty) shape."""
        for k, spec in enumerate(self.manifest.specs):
            if all(s is None or s == d for s, d in zip(shapes, spec.dims, strict=True)):
                return k
        return None

    def allowed_text(self, shapes: list[tuple[int, ...] | None]) -> str:
        lines = ["No matching dimension found. Allowed shapes:"]
        for k, spec in enumerate(self.manifest.specs):
            lines.append(f"  {k} ({spec.name}):")
            for b, d in zip(self.bindings, spec.dims, strict=True):
                lines.append(f"    {b.name}:\t{b.dtype.itemsize}\t{list(d)}")
        lines.append("  Passed shapes:")
        for b, s in zip(self.bindings, shapes, strict=True):
            if s is not None:
                lines.append(f"    {b.name}:\t{b.dtype.itemsize}\t{list(s)}")
        return "\n".join(lines)

    def device_time_s(
        self, spec: int, sku: SkuType, num_devices: int, num_cores: int, pace_as: str | None = None
    ) -> float:
        """Modelled device time of one run of ``spec`` on this device group, computed once.

        With ``pace_as`` (a preset or HF config file) the run is timed as that model's program of
        the same specialization (batch, seq_len, ctx_len) instead.
        """
        key = (spec, sku, num_devices, num_cores, pace_as)
        if key not in self._times:
            if pace_as:
                self._times[key] = _pace_as_time(self, spec, sku, num_devices, num_cores, pace_as)
            else:
                self._times[key] = _model_time(self, spec, sku, num_devices, num_cores)
        return self._times[key]


def _model_time(image: ProgramImage, spec: int, sku: SkuType, num_devices: int, num_cores: int) -> float:
    import onnx

    from qaic_sim import mx, timing

    m = image.manifest
    model = onnx.load_from_string(qpcfile.read_member(image.path, qpcfile.MODEL))
    weights, kv = _precisions(image)
    weight_bytes, kv_bytes = mx.bytes_per_element(weights), mx.bytes_per_element(kv)
    try:
        cost = timing.ProgramCost.from_onnx(
            model, m.specs[spec].symbols, weight_bytes_per_param=weight_bytes, kv_bytes_per_elem=kv_bytes
        )
        hw = timing.HardwareModel.for_device_group(sku, num_devices, num_cores)
        return float(timing.device_time_s(cost, hw))
    except Exception as exc:
        log.warning("device-time model failed for %s spec %d: %s", image.path, spec, exc)
        return 0.0


def _precisions(image: ProgramImage) -> tuple[str, str]:
    """Weight and KV precision names of a program, as ``qaic_sim.mx.bytes_per_element`` takes them."""
    m = image.manifest
    weights = "mxfp6" if m.mxfp6_matmul else ("float16" if m.convert_to_fp16 else "float32")
    kv_prec = next((m.precisions[n] for n in m.retained if n in m.precisions), None)
    if kv_prec is None:
        kv = "float16" if m.convert_to_fp16 else "float32"
    else:
        kv = "float32" if kv_prec == "float" else kv_prec
    return weights, kv


def _pace_as_time(
    image: ProgramImage, spec: int, sku: SkuType, num_devices: int, num_cores: int, pace_as: str
) -> float:
    from qaic_sim import timing
    from qaic_sim.config import pace_as_config

    symbols = image.manifest.specs[spec].symbols
    seq_len = int(symbols.get("seq_len", 1))
    weights, kv = _precisions(image)
    cost = timing.ProgramCost.for_decoder(
        pace_as_config(pace_as),
        batch=int(symbols.get("batch_size", 1)),
        seq_len=seq_len,
        ctx_len=int(symbols.get("ctx_len", seq_len)),
        weight_precision=weights,
        kv_precision=kv,
    )
    hw = timing.HardwareModel.for_device_group(sku, num_devices, num_cores)
    return float(timing.device_time_s(cost, hw))


_images: dict[tuple[str, int, int], ProgramImage] = {}
_images_lock = threading.Lock()


def open_image(path: str | Path) -> ProgramImage:
    """The shared image of ``programqpc.bin`` under ``path``; recompiling gives a new image."""
    program = qpcfile.find_program(path).resolve()
    st = program.stat()
    key = (str(program), st.st_mtime_ns, st.st_size)
    with _images_lock:
        image = _images.get(key)
        if image is None:
            image = ProgramImage(program)
            _images[key] = image
        return image
