"""A compiled program read into memory once per machine and shared by every loaded Program."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from qaic_core.types import Binding, Direction, SkuType
from qaic_sim import costing, qpcfile, timing
from qaic_sim.config import QAIC_SIM_PACE_AS, onnx_threads, pace_as_config
from qaic_sim.timing_cost import ProgramCost

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
        self.threads = 0
        """onnxruntime intra-op threads of the session (0 until it is built)."""
        self.graph_dtypes: dict[str, np.dtype] = {}
        self.in_place = frozenset(self.manifest.in_place)
        self._times: dict[tuple[int, SkuType, int, int, str | None], float] = {}
        self._costs: tuple[ProgramCost, ...] | None = None

    def session(self, threads: int) -> Any:
        """The onnxruntime session (CPU), built once; model-local functions are inlined by ORT.

        ``threads`` is the machine's ``threads`` setting (0: every usable core but one, see
        :func:`~qaic_sim.config.onnx_threads`)."""
        with self._lock:
            if self._session is None:
                import onnxruntime as ort

                opts = ort.SessionOptions()
                self.threads = onnx_threads(threads)
                opts.intra_op_num_threads = self.threads
                opts.inter_op_num_threads = 1
                opts.log_severity_level = 3
                model = qpcfile.read_member(self.path, qpcfile.MODEL)
                self._session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
                for v in [*self._session.get_inputs(), *self._session.get_outputs()]:
                    self.graph_dtypes[v.name] = np.dtype(_ORT_DTYPES.get(v.type, np.float32))
                log.info("onnxruntime session ready for %s (%d intra-op threads)", self.path, self.threads)
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

    def cost(self, spec: int) -> ProgramCost:
        """The modelled cost of one run of ``spec``: stored by the compiler, else modelled from the graph now."""
        with self._lock:
            if self._costs is None:
                stored = [s.cost for s in self.manifest.specs if s.cost is not None]
                if len(stored) == len(self.manifest.specs):
                    try:
                        self._costs = tuple(ProgramCost.from_json(c, str(self.path)) for c in stored)
                    except (TypeError, ValueError) as exc:
                        raise costing.TimingModelError(f"{self.path}: stored run cost: {exc}") from exc
                else:  # compiled with timing off (or by an older simulator)
                    import onnx

                    model = onnx.load_from_string(qpcfile.read_member(self.path, qpcfile.MODEL))
                    self._costs = costing.program_costs(model, self.manifest, str(self.path))
            return self._costs[spec]

    def device_time_s(
        self, spec: int, sku: SkuType, num_devices: int, num_cores: int, pace_as: str | None = None
    ) -> float:
        """Modelled device time of one run of ``spec`` on this device group, computed once.

        With ``pace_as`` (a preset or HF config file) the run is timed as that model's program of
        the same specialization (batch, seq_len, ctx_len) instead. A run that cannot be timed raises
        :class:`qaic_sim.costing.TimingModelError`.
        """
        key = (spec, sku, num_devices, num_cores, pace_as)
        if key not in self._times:
            cost = self.cost(spec) if not pace_as else _pace_as_cost(self, spec, pace_as)
            try:
                hw = timing.HardwareModel.for_device_group(sku, num_devices, num_cores)
            except ValueError as exc:
                raise costing.TimingModelError(f"{self.path}: cannot model the device time: {exc}") from exc
            self._times[key] = float(timing.device_time_s(cost, hw))
        return self._times[key]


def _pace_as_cost(image: ProgramImage, spec: int, pace_as: str) -> ProgramCost:
    symbols = image.manifest.specs[spec].symbols
    seq_len = int(symbols.get("seq_len", 1))
    weights, kv = costing.precisions(image.manifest)
    try:
        return ProgramCost.for_decoder(
            pace_as_config(pace_as),
            batch=int(symbols.get("batch_size", 1)),
            seq_len=seq_len,
            ctx_len=int(symbols.get("ctx_len", seq_len)),
            weight_precision=weights,
            kv_precision=kv,
        )
    except ValueError as exc:
        raise costing.TimingModelError(
            f"{image.path}: cannot time specialization {image.manifest.specs[spec].name!r} as {pace_as!r} "
            f"({QAIC_SIM_PACE_AS}): {exc}"
        ) from exc


class ImageCache:
    """The images a machine has read, keyed by path, mtime and size (recompiling gives a new image)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._images: dict[tuple[str, int, int], ProgramImage] = {}

    def open(self, path: str | Path) -> ProgramImage:
        """The shared image of ``programqpc.bin`` under ``path``."""
        program = qpcfile.find_program(path).resolve()
        st = program.stat()
        key = (str(program), st.st_mtime_ns, st.st_size)
        with self._lock:
            image = self._images.get(key)
            if image is None:
                image = ProgramImage(program)
                self._images[key] = image
            return image

    def __len__(self) -> int:
        return len(self._images)
