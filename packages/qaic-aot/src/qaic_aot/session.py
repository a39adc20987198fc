"""QEfficient's ``QAICInferenceSession`` over any device backend, with runs that can overlap."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from qaic_aot.iodesc import check, program_dir, read_program_io, status_name
from qaic_core import get_plugin_manager
from qaic_core.advice import status_advice
from qaic_core.descriptors import DeviceBackend
from qaic_core.errors import QaicConfigError, QaicRuntimeError
from qaic_core.observe import Observer
from qaic_core.runtime import ExecObj, SlicingSpecHandle, Status
from qaic_core.types import Binding, Direction, QStatus

log = logging.getLogger("qaic.aot.session")


class RunHandle:
    """One run in flight on one exec object; ``wait()`` returns its outputs by name."""

    def __init__(self, session: QAICInferenceSession, exec_index: int, arrays: list[np.ndarray]) -> None:
        self._session = session
        self.exec_index = exec_index
        self._arrays = arrays  # bound zero-copy: they must live until the run is waited for
        self._result: dict[str, np.ndarray] | None = None
        self._error: BaseException | None = None

    def wait(self) -> dict[str, np.ndarray]:
        """Block until the run finishes; raises ``QaicRuntimeError`` if the device reports a failure."""
        if self._result is None and self._error is None:
            observer = self._session._observer
            start = time.perf_counter() if observer is not None else 0.0
            try:
                self._result = self._session._complete(self.exec_index, self._arrays)
            except BaseException as exc:
                self._error = exc
            if observer is not None:
                observer.run_waited(self.exec_index, time.perf_counter() - start)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class PreparedRun:
    """A run's buffers made ready (shapes matched, outputs allocated) and not yet handed over.

    ``array(name)`` is the buffer the device will read: a caller may still write into an input
    (the tokens a decode waits for) before ``submit()``, which hands the run to its exec object
    once. A prepared run holds no exec object, so one that is never submitted costs nothing.
    """

    def __init__(
        self,
        session: QAICInferenceSession,
        exec_index: int,
        inputs: Mapping[str, np.ndarray],
        arrays: list[np.ndarray],
    ) -> None:
        self._session = session
        self.exec_index = exec_index
        self._inputs = inputs
        self._arrays = arrays
        self._submitted = False

    def array(self, name: str) -> np.ndarray:
        """The buffer bound for binding ``name``."""
        return self._arrays[self._session.binding_index(name)]

    def submit(self) -> RunHandle:
        """Hand the run to its exec object; ``wait()`` on the handle gives its outputs."""
        if self._submitted:
            raise QaicRuntimeError(
                "this prepared run was already submitted: prepare another", status=QStatus.INVAL
            )
        self._submitted = True
        session = self._session
        observer = session._observer
        if observer is None:
            return session._hand_over(self.exec_index, self._arrays)
        start = time.perf_counter()
        handle = session._hand_over(self.exec_index, self._arrays)
        observer.run_submitted(self._inputs, self.exec_index, time.perf_counter() - start)
        return handle


class QAICInferenceSession:
    """A loaded program: named numpy buffers in, named numpy buffers out (QEfficient's surface)."""

    def __init__(
        self,
        qpc_path: Path | str,
        device_ids: list[int] | None = None,
        activate: bool = True,
        enable_debug_logs: bool = False,
        data_path_timeout_ms: int = 60000,
        *,
        backend: str | DeviceBackend | None = None,
        num_exec_objects: int = 2,
        observer: Observer | None = None,
    ) -> None:
        if num_exec_objects < 1:
            raise QaicConfigError(f"num_exec_objects ({num_exec_objects}) must be at least 1")
        self.device_backend = get_plugin_manager().select_device_backend(backend)
        rt = self._rt = self.device_backend.runtime()
        aicapi = self.device_backend.aicapi()
        self.qpc_path = program_dir(qpc_path)
        self.device_ids = list(device_ids) if device_ids else None
        if self.device_ids:
            self.context = rt.Context(rt.QIDList(self.device_ids))
            queue_device = self.device_ids[0]
        else:
            self.context = rt.Context()
            queue_device = 0
        if enable_debug_logs:
            check(self.context.setLogLevel(rt.QLogLevel.QL_DEBUG), "Context.setLogLevel")
        self._queues = [rt.Queue(self.context, queue_device) for _ in range(num_exec_objects)]
        self.qpc = rt.Qpc(str(self.qpc_path))
        io = read_program_io(rt, aicapi, self.qpc)
        self._bindings = io.bindings
        self._allowed_shapes = io.allowed_shapes
        self._index = {b.name: b.index for b in self._bindings}
        # Prepared once: what every run needs per binding, and the specialization of each shape set seen.
        self._inputs = [b for b in self._bindings if b.dir == Direction.IN]
        self._outputs = [b for b in self._bindings if b.dir == Direction.OUT]
        self._specs: dict[tuple[tuple[int, ...] | None, ...], int] = {}
        props = rt.QAicProgramProperties()
        props.dataPathTimeoutMs = data_path_timeout_ms
        device: int | None = None
        if self.device_ids and len(self.device_ids) == 1:
            device = self.device_ids[0]
        elif self.device_ids:
            props.devMapping = ":".join(str(d) for d in self.device_ids)
        self.program = rt.Program(self.context, device, self.qpc, props)
        self._check_program(self.program.load(), "Program.load")
        self.num_exec_objects = num_exec_objects
        self._exec: list[ExecObj] = []
        self._busy = [threading.Lock() for _ in range(num_exec_objects)]
        self._buffers: dict[str, np.ndarray] = {}
        self._slicing_handles: dict[str, SlicingSpecHandle] = {}
        # Observers see every run handed over and waited for; None (no timing at all) when there are none.
        observer = get_plugin_manager().observers() if observer is None else observer
        self._observer: Observer | None = observer if observer else None
        self.is_active = False
        if activate:
            self.activate()
        log.info(
            "loaded %s on %s (%d bindings)", self.qpc_path, self.device_backend.name, len(self._bindings)
        )

    # -- QEfficient's attributes -----------------------------------------------------------
    @property
    def bindings(self) -> list[Binding]:
        return self._bindings

    @property
    def binding_index_map(self) -> dict[str, int]:
        return dict(self._index)

    def binding_index(self, name: str) -> int:
        """The index of binding ``name`` (``binding_index_map`` without copying the map)."""
        return self._index[name]

    @property
    def allowed_shapes(self) -> list[list[tuple[int, list[int]]]]:
        return self._allowed_shapes

    @property
    def input_names(self) -> list[str]:
        return [b.name for b in self._bindings if b.dir == Direction.IN]

    @property
    def output_names(self) -> list[str]:
        return [b.name for b in self._bindings if b.dir == Direction.OUT]

    @property
    def devices_text(self) -> str:
        """The device group in words, for errors: ``QID 0`` or ``QIDs 0, 1``."""
        ids = self.device_ids or [0]
        return ("QID " if len(ids) == 1 else "QIDs ") + ", ".join(str(d) for d in ids)

    # -- lifecycle ------------------------------------------------------------------------
    def activate(self) -> None:
        """Make the program runnable on its devices and create the exec objects."""
        if self.is_active:
            return
        self._check_program(self.program.activate(), "Program.activate")
        self._exec = [self._rt.ExecObj(self.context, self.program) for _ in range(self.num_exec_objects)]
        self.is_active = True

    def deactivate(self) -> None:
        """Release the devices (the retained state is lost); ``activate()`` loads it again."""
        if not self.is_active:
            return
        self._exec = []
        check(self.program.deactivate(), "Program.deactivate")
        self.is_active = False

    close = deactivate

    def _check_program(self, status: Status, call: str) -> None:
        """``check`` for load and activate: the advice names what this program needs and the devices have free."""
        if int(status) == QStatus.SUCCESS:
            return
        from qaic_aot.memory import program_needs
        from qaic_core.resources import group_ids, query_devices

        devices = []
        needs = None
        try:
            ids = self.device_ids or group_ids(None, 1)
            devices = query_devices(self.device_backend, ids)
            needs = program_needs(self.qpc_path, devices)
        except Exception as exc:  # the advice is best effort; the failure itself must still be raised
            log.debug("could not read the resources for the advice: %s", exc)
        check(
            status,
            call,
            detail=str(getattr(self.program, "lastError", "") or ""),
            advice=status_advice(int(status), call, needs, devices),
        )

    def reload(self) -> None:
        """Load and activate the program again after a device fault (its retained state is lost)."""
        self._exec = []
        self.is_active = False
        for release in (self.program.deactivate, self.program.unload):
            try:
                release()
            except Exception as exc:  # the device may already have dropped the program
                log.debug("releasing the program before a reload: %s", exc)
        self._check_program(self.program.load(), "Program.load")
        self.activate()
        log.warning("reloaded %s after a device fault", self.qpc_path)

    def __enter__(self) -> QAICInferenceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.deactivate()

    # -- buffers --------------------------------------------------------------------------
    def set_buffers(self, buffers: Mapping[str, np.ndarray]) -> None:
        """Keep these buffers for every later run (outputs preallocated with their run's shape)."""
        for name, array in buffers.items():
            if name not in self._index:
                raise QaicConfigError(
                    f"buffer {name!r} is not a binding of this program; bindings: {self._names()}"
                )
            self._buffers[name] = np.asarray(array)

    def skip_buffers(self, names: Iterable[str]) -> None:
        """Send zero-size buffers: KV inputs keep the device's retained state, outputs are not read back."""
        self.set_buffers({name: np.zeros((0,), self._bindings[self._index[name]].dtype) for name in names})

    # -- running --------------------------------------------------------------------------
    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once on exec object 0 and return the outputs that were not skipped."""
        return self.submit(inputs, 0).wait()

    def submit(self, inputs: Mapping[str, np.ndarray], exec_index: int = 0) -> RunHandle:
        """Start a run on exec object ``exec_index``; runs on different exec objects overlap."""
        return self.prepare(inputs, exec_index).submit()

    def prepare(self, inputs: Mapping[str, np.ndarray], exec_index: int = 0) -> PreparedRun:
        """Make a run's buffers ready without starting it (``PreparedRun.submit()`` starts it).

        Everything but the hand-over happens here (the specialization is matched and the output
        buffers allocated), so a caller can prepare the next run while the device is busy.
        """
        self._check_active()
        if not 0 <= exec_index < self.num_exec_objects:
            raise QaicConfigError(
                f"exec_index {exec_index} is out of range: this session has {self.num_exec_objects} exec "
                "objects (num_exec_objects)"
            )
        return PreparedRun(self, exec_index, inputs, self._arrays_for(inputs))

    def _check_active(self) -> None:
        if not self.is_active:
            raise QaicRuntimeError("the session is not active: call activate() first", status=QStatus.INVAL)

    def _hand_over(self, exec_index: int, arrays: list[np.ndarray]) -> RunHandle:
        self._check_active()
        if not self._busy[exec_index].acquire(blocking=False):
            raise QaicRuntimeError(
                f"exec object {exec_index} already has a run in flight: wait() for it first or submit to "
                "another exec_index",
                status=QStatus.BUSY,
            )
        try:
            exe = self._exec[exec_index]
            # Zero-copy binding: inputs are read from these arrays and outputs written into them.
            check(exe.setData(list(enumerate(arrays))), "ExecObj.setData")
            check(self._queues[exec_index].enqueue(exe), "Queue.enqueue")
        except BaseException:
            self._busy[exec_index].release()
            raise
        return RunHandle(self, exec_index, arrays)

    def run_with_slices(
        self,
        inputs: Mapping[str, np.ndarray],
        slices: Mapping[str, np.ndarray],
        spec_json: str,
        params: Sequence[tuple[str, int]],
        exec_index: int = 0,
    ) -> dict[str, np.ndarray]:
        """Run once where ``slices`` are regions of the retained state (the runtime's slice path).

        ``spec_json`` is a ``createSlicingSpecHandle`` spec whose names match the sliced bindings;
        ``params`` give its named start offsets. An input slice is written into the device's state
        before the run; an output slice (a ``_RetainedState`` binding) is filled from the state after
        it, in place. Returns the outputs that were not skipped.
        """
        self._check_active()
        for name in slices:
            if name not in self._index:
                raise QaicConfigError(
                    f"slice {name!r} is not a binding of this program; bindings: {self._names()}"
                )
        handle = self._slicing_handles.get(spec_json)
        if handle is None:
            status, handle = self.program.createSlicingSpecHandle(spec_json)
            check(status, "Program.createSlicingSpecHandle")
            self._slicing_handles[spec_json] = handle
        plain = {k: v for k, v in inputs.items() if k not in slices}
        for name in slices:
            if self._bindings[self._index[name]].dir == Direction.IN:
                plain.setdefault(name, np.zeros((0,), self._bindings[self._index[name]].dtype))
        arrays = self._arrays_for(plain)
        pairs: list[tuple[int, np.ndarray]] = []
        for binding, arr in zip(self._bindings, arrays, strict=True):
            sliced = slices.get(binding.name)
            pairs.append(
                (binding.index, np.ascontiguousarray(sliced, binding.dtype) if sliced is not None else arr)
            )
        if not self._busy[exec_index].acquire(blocking=False):
            raise QaicRuntimeError(
                f"exec object {exec_index} already has a run in flight: wait() for it first",
                status=QStatus.BUSY,
            )
        try:
            exe = self._exec[exec_index]
            status, _ = exe.setDataWithSlices(pairs, handle, list(params))
            check(status, "ExecObj.setDataWithSlices")
            check(self._queues[exec_index].enqueue(exe), "Queue.enqueue")
            status = exe.waitForCompletion()
            if int(status) != QStatus.SUCCESS:
                raise QaicRuntimeError(
                    f"sliced run failed with status {status_name(status)} ({int(status)}) on {self.devices_text}",
                    status=int(status),
                )
        finally:
            self._busy[exec_index].release()
        for index, arr in pairs:
            name = self._bindings[index].name
            if name in slices and self._bindings[index].dir == Direction.OUT:
                np.copyto(slices[name], arr, casting="unsafe")
        return {
            b.name: arr
            for b, (_, arr) in zip(self._bindings, pairs, strict=True)
            if b.dir == Direction.OUT and arr.size and b.name not in slices
        }

    def _complete(self, exec_index: int, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
        try:
            exe = self._exec[exec_index]
            status = exe.waitForCompletion()
            if int(status) != QStatus.SUCCESS:
                raise QaicRuntimeError(
                    f"run failed with status {status_name(status)} ({int(status)}) on {self.devices_text}\n"
                    + self._shapes_report(_dims_of(self._bindings, arrays)),
                    status=int(status),
                )
        finally:
            self._busy[exec_index].release()
        return {b.name: arrays[b.index] for b in self._outputs if arrays[b.index].size}

    def _arrays_for(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """One contiguous array per binding: given, kept (set_buffers) or shaped from the matching specialization.

        Outputs are fresh arrays for the run to fill (a kept output buffer only fixes the shape);
        a zero-size output is not read back.
        """
        for name in inputs:
            if name not in self._index:
                raise QaicConfigError(
                    f"input {name!r} is not a binding of this program; bindings: {self._names()}"
                )
        kept = self._buffers
        arrays: list[np.ndarray | None] = [None] * len(self._bindings)
        missing: list[str] = []
        for b in self._bindings:
            value = inputs.get(b.name)
            if value is None:
                value = kept.get(b.name)
                if value is None:
                    if b.dir == Direction.IN:
                        missing.append(b.name)
                    continue
            arr = value
            if type(arr) is not np.ndarray or arr.dtype != b.dtype or not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr, dtype=b.dtype)
            arrays[b.index] = arr.reshape(1) if arr.ndim == 0 else arr
        if missing:
            raise QaicConfigError(
                f"missing input buffers {missing}: pass them to run() or set_buffers(), or skip_buffers() "
                "for retained-state inputs"
            )
        key = tuple(None if a is None or a.size == 0 else a.shape for a in arrays)
        spec = self._specs.get(key)
        if spec is None:
            spec = self._match(
                {b.name: a for b, a in zip(self._bindings, arrays, strict=True) if a is not None}
            )
            self._specs[key] = spec
        for b in self._outputs:
            given = arrays[b.index]
            if given is not None and given.size == 0:
                continue
            if given is not None:
                dims: Sequence[int] = given.shape
            else:
                dims = self._allowed_shapes[spec][b.index][1] if spec >= 0 else list(b.dims)
            arrays[b.index] = np.empty(dims, b.dtype)
        return arrays  # type: ignore[return-value]  # every binding now has an array

    def _match(self, arrays: Mapping[str, np.ndarray]) -> int:
        """Index of the first specialization all non-empty buffers fit; a clear error if none does."""
        if not self._allowed_shapes:
            return -1
        for i, shape in enumerate(self._allowed_shapes):
            if all(
                arr.size == 0 or list(arr.shape) == shape[self._index[name]][1]
                for name, arr in arrays.items()
            ):
                return i
        dims = [
            (b.dtype.itemsize, list(arrays[b.name].shape) if b.name in arrays else []) for b in self._bindings
        ]
        raise QaicRuntimeError(
            "No matching dimension found for the buffers passed\n" + self._shapes_report(dims),
            status=QStatus.INVAL,
        )

    def _shapes_report(self, dims: list[tuple[int, list[int]]]) -> str:
        lines = ["Allowed shapes:"]
        for i, shape in enumerate(self._allowed_shapes):
            lines.append(f"{i}")
            lines += [f"  {b.name}:\t{size}\t{d}" for b, (size, d) in zip(self._bindings, shape, strict=True)]
        lines.append("Passed shapes:")
        lines += [
            f"  {b.name}:\t{size}\t{d}"
            for b, (size, d) in zip(self._bindings, dims, strict=True)
            if d and d != [0]
        ]
        return "\n".join(lines)

    def _names(self) -> str:
        return ", ".join(b.name for b in self._bindings)


def _dims_of(bindings: Sequence[Binding], arrays: Sequence[np.ndarray]) -> list[tuple[int, list[int]]]:
    return [(b.dtype.itemsize, list(a.shape)) for b, a in zip(bindings, arrays, strict=True)]
