"""``ExecObj``: binds host buffers to a program's bindings and runs one inference."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from qaic_core import runtime
from qaic_core.types import Binding, Direction
from qaic_sim import fpenv, trace
from qaic_sim.buffers import QBuffer
from qaic_sim.clock import sleep_until
from qaic_sim.costing import TimingModelError
from qaic_sim.program import Program, SlicingSpecHandle
from qaic_sim.status import Failure, QStatus

if TYPE_CHECKING:
    from qaic_sim.qaicrt import Context

log = logging.getLogger("qaic.sim.runtime")
_ids = itertools.count()


class ExecObj:
    """One set of buffers for a program; enqueue it on a Queue and wait for it."""

    def __init__(self, ctx: Context, program: Program) -> None:
        self.ctx = ctx
        self.program = program
        self.id = next(_ids)
        n = len(program.image.bindings)
        self._arrays: list[np.ndarray | None] = [None] * n
        self._slices: list[tuple[Direction, Binding, np.ndarray, tuple[int, ...]]] = []
        self._qbuffer_mode = False
        self._inputs_qb: list[QBuffer] = []
        self._results: list[np.ndarray | None] = [None] * n
        self._future: Future[QStatus] | None = None
        self._status = QStatus.SUCCESS
        self._set_error: Failure | None = None
        self.lastError = ""
        self.lastDeviceTimeS = 0.0
        self.lastSpecialization = ""
        self._ready_at = 0.0
        self._lock = threading.Lock()
        self._held: tuple[int, Callable[[], None]] | None = None
        self._held_lock = threading.Lock()

    # -- binding buffers -----------------------------------------------------------------
    def setData(
        self, buffers: Sequence[Any], dims: runtime.BufferDimensionsVecRef | Sequence[Any] | None = None
    ) -> QStatus:
        """``setData(qbuffers, dims)`` or the zero-copy ``setData([(binding_index, ndarray), ...])``.

        A held run of this exec object executes first, on the buffers it was enqueued with."""
        self.run_held()
        try:
            if dims is None:
                self._set_pairs(buffers)
            else:
                self._set_qbuffers(buffers, dims)
            self._slices = []
            self._set_error = None
        except Failure as exc:
            self._set_error = exc
            return self._fail(exc)
        return QStatus.SUCCESS

    def _set_qbuffers(self, buffers: Sequence[Any], dims: Any) -> None:
        bindings = self.program.image.bindings
        if len(buffers) != len(bindings) or len(dims) != len(bindings):
            raise Failure(
                QStatus.INVAL,
                f"setData got {len(buffers)} buffers and {len(dims)} dims for {len(bindings)} bindings",
            )
        arrays: list[np.ndarray | None] = []
        dtypes = self.program.image.dtypes
        for b, qb, (itemsize, shape) in zip(bindings, buffers, dims, strict=True):
            dt = dtypes[b.index]
            count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
            if count == 0 or qb.size == 0:
                arrays.append(None)
                continue
            self._check_itemsize(b, dt, int(itemsize))
            if qb.size != count * dt.itemsize:
                raise Failure(
                    QStatus.INVAL,
                    f"buffer {b.name!r} holds {qb.size} bytes but dims {list(shape)} need {count * dt.itemsize}",
                )
            if b.dir == Direction.IN:
                arrays.append(qb.array(dt, tuple(shape)))
            else:
                # Outputs land in the caller's buffer when it is writable (an ndarray or bytearray).
                target = qb.writable_array(dt, tuple(shape))
                arrays.append(target if target is not None else np.empty(tuple(shape), dtype=dt))
        self._arrays = arrays
        self._inputs_qb = list(buffers)
        self._qbuffer_mode = True

    def _set_pairs(self, pairs: Sequence[Any]) -> None:
        bindings = self.program.image.bindings
        dtypes = self.program.image.dtypes
        arrays: list[np.ndarray | None] = [None] * len(bindings)
        for item in pairs:
            try:
                index, arr = item
            except (TypeError, ValueError):
                raise Failure(
                    QStatus.INVAL, f"setData expects (binding_index, ndarray) pairs, got {item!r}"
                ) from None
            if not 0 <= int(index) < len(bindings):
                raise Failure(QStatus.INVAL, f"binding index {index} out of range 0..{len(bindings) - 1}")
            if type(arr) is not np.ndarray:
                arr = np.asarray(arr)
            if arr.size == 0:  # a skipped buffer: retained state stays on the device, no read-back
                continue
            b = bindings[int(index)]
            dt = dtypes[b.index]
            if arr.dtype is dt and arr.flags.c_contiguous:  # the common case: nothing to convert
                arrays[int(index)] = arr
                continue
            self._check_itemsize(b, dt, arr.itemsize)
            if not arr.flags.c_contiguous:
                if b.dir == Direction.OUT:
                    raise Failure(
                        QStatus.INVAL, f"output buffer {b.name!r} must be C-contiguous to be filled in place"
                    )
                arr = np.ascontiguousarray(arr)
            if arr.dtype != dt:
                arr = arr.view(dt)
            arrays[int(index)] = arr
        self._arrays = arrays
        self._qbuffer_mode = False

    @staticmethod
    def _check_itemsize(b: Binding, dt: np.dtype, itemsize: int) -> None:
        if itemsize != dt.itemsize:
            raise Failure(
                QStatus.INVAL,
                f"buffer {b.name!r} has element size {itemsize} but the binding holds {dt} ({dt.itemsize} bytes)",
            )

    def setDataWithSlices(
        self, pairs: Sequence[Any], handle: SlicingSpecHandle | None, params: Sequence[tuple[str, int]]
    ) -> tuple[QStatus, Any]:
        """Bind buffers; those matching the slicing spec are one slice of the retained state.

        An input slice is written into the device-held state at the spec's start offsets before
        the run; an output slice receives that region of the new state after the run. A held run of
        this exec object executes first, on the buffers it was enqueued with.
        """
        self.run_held()
        plain: list[Any] = []
        slices: list[tuple[Direction, Binding, np.ndarray, tuple[int, ...]]] = []
        values = dict(params)
        try:
            if handle is None:
                raise Failure(
                    QStatus.INVAL, "setDataWithSlices needs a handle from Program.createSlicingSpecHandle"
                )
            image = self.program.image
            for index, arr in pairs:
                b = image.bindings[int(index)]
                spec = handle.find(b.name)
                if spec is None:
                    plain.append((index, arr))
                    continue
                base = image.retained_out.get(b.name, b.name)
                if base not in image.retained:
                    raise Failure(QStatus.INVAL, f"slices apply to retained state only, not to {b.name!r}")
                arr = np.asarray(arr)
                if arr.ndim != len(spec.starts):
                    raise Failure(
                        QStatus.INVAL,
                        f"slice for {b.name!r} has {arr.ndim} dims but its DimSpecs give {len(spec.starts)}",
                    )
                starts = []
                for s in spec.starts:
                    if isinstance(s, str):
                        if s not in values:
                            raise Failure(
                                QStatus.INVAL, f"slicing parameter {s!r} was not given (got {sorted(values)})"
                            )
                        starts.append(int(values[s]))
                    else:
                        starts.append(int(s))
                slices.append((b.dir, image.by_name[base], arr, tuple(starts)))
            self._set_pairs(plain)
        except Failure as exc:
            self._set_error = exc
            return self._fail(exc), None
        self._slices = slices
        self._set_error = None
        return QStatus.SUCCESS, handle

    # -- results -------------------------------------------------------------------------
    def getData(self) -> tuple[QStatus, list[QBuffer]]:
        """Output buffers of the last completed run (inputs as given); empty where not copied back."""
        self.run_held()
        out: list[QBuffer] = []
        for b, res in zip(self.program.image.bindings, self._results, strict=True):
            if b.dir == Direction.IN and self._qbuffer_mode and self._inputs_qb:
                out.append(self._inputs_qb[b.index])
            elif res is not None:
                out.append(QBuffer(res))
            else:
                out.append(QBuffer(b""))
        return self._status, out

    def waitForCompletion(self) -> QStatus:
        """Block until the enqueued run finishes; its status (non-SUCCESS for any failure).

        A paced run finishes at its modelled end: the queue thread computes it and publishes that
        time, and the waiting thread itself sleeps until it (``sleep_until``), so it returns within
        microseconds of the device's end, as a card's completion would, rather than after a wake-up
        from the queue thread (about 0.1 ms on a small virtual machine).
        """
        self.run_held()
        future = self._future
        if future is not None:
            self._status = future.result()
        sleep_until(self._ready_at)
        return self._status

    def submit(self, future: Future[QStatus]) -> None:
        self._future = future

    def hold(self, queue_id: int, claim: Callable[[], bool], done: Callable[[], None]) -> bool:
        """Keep an unpaced run to execute in the caller's thread when it is needed (``run_held``),
        if ``claim()`` gives it the devices; ``done`` gives them back after the run. The claim is
        made under this object's lock, so a thread that finds the run held waits until it is."""
        with self._held_lock:
            if not claim():
                return False
            self._future = None
            self._held = (queue_id, done)
            return True

    def run_held(self) -> None:
        """Execute the held run now, in this thread; nothing if there is none or it already ran."""
        with self._held_lock:
            held, self._held = self._held, None
            if held is None:
                return
            queue_id, done = held
            try:
                self.execute(queue_id)
            finally:
                done()

    def _fail(self, exc: Failure) -> QStatus:
        self.lastError = exc.message
        log.error("%s", exc.message)
        return exc.status

    # -- execution -----------------------------------------------------------------------
    @property
    def ready_at(self) -> float:
        """``perf_counter`` time the last run finished (a paced run: its modelled end, maybe ahead)."""
        return self._ready_at

    def execute(
        self, queue_id: int = 0, enqueued: float | None = None, not_before: float = 0.0, wait: bool = True
    ) -> QStatus:
        """Run once with the bound buffers (called on a queue thread, ``enqueued`` the host's enqueue time).

        ``not_before``: when the queue's previous run ends (a queue runs its exec objects in order).
        ``wait``: return at the run's end (a paced run's modelled end); a queue thread passes False and
        the run's waiter sleeps until that end instead (``waitForCompletion``).
        """
        start = time.perf_counter() if enqueued is None else enqueued
        program = self.program
        self.lastError = ""
        device_start = start
        try:
            if self._set_error is not None:
                raise self._set_error
            program.check_runnable()
            with program.run_lock:
                # The device runs one program execution at a time: the modelled time of this run
                # starts when it was enqueued, or once the one before it has finished if that is
                # later. The queue thread picking the run up late (it waits for the host's
                # interpreter) is the simulator's own delay, which a card's enqueue does not have.
                device_start = max(start, program.device_free_at, not_before)
                status, spec, device_time = self._run(device_start)
        except Failure as exc:
            status, spec, device_time = self._fail(exc), -1, 0.0
        except Exception as exc:
            status, spec, device_time = (
                self._fail(Failure(QStatus.ERROR, f"execution failed: {exc}")),
                -1,
                0.0,
            )
        end = self._ready_at if status == QStatus.SUCCESS else time.perf_counter()
        self._ready_at = end
        self._account(status, spec, device_time, start, end - start, queue_id, device_start)
        self._status = status
        if wait:
            sleep_until(end)
        return status

    def _run(self, start: float) -> tuple[QStatus, int, float]:
        program = self.program
        image = program.image
        shapes = [None if a is None else tuple(a.shape) for a in self._arrays]
        k = image.match(shapes)
        if k is None:
            raise Failure(QStatus.INVAL, image.allowed_text(shapes))
        spec = image.manifest.specs[k]
        self.lastSpecialization = spec.name
        machine = program.machine
        for dev in program.devices:
            with dev.lock:
                dev.runs += 1
                count = dev.runs
            forced = machine.faults.on_run(dev.qid, count)
            if forced is not None:
                raise Failure(QStatus(int(forced)), f"injected fault on QID {dev.qid}: {forced.name}")
        try:
            device_time = machine.device_time_s(image, k, program.devices)
        except TimingModelError as exc:  # before the run, so a failed run leaves the state untouched
            raise Failure(QStatus.ERROR, str(exc)) from exc
        if self._slices:
            nbytes = sum(int(arr.nbytes) for _, _, arr, _ in self._slices)
            positions = max(int(arr.shape[2]) if arr.ndim > 2 else 1 for _, _, arr, _ in self._slices)
            device_time += machine.slice_transfer_s(program.devices, nbytes, positions)
        config = machine.config
        session = image.session(config.threads)
        for direction, b, arr, starts in self._slices:
            if direction == Direction.IN:
                state = program.state_array(b, spec.dims[b.index]).copy()
                region = tuple(slice(s, s + n) for s, n in zip(starts, arr.shape, strict=True))
                state[region] = program.state_values(arr)
                program.store_state(b, state)
        feeds: dict[str, np.ndarray] = {}
        in_place: dict[str, np.ndarray] = {}
        for b in image.inputs:
            given = self._arrays[b.index]
            if given is not None:
                arr = program.state_values(given) if b.name in image.retained else given
            else:
                if b.name not in image.retained:
                    raise Failure(
                        QStatus.INVAL,
                        f"input {b.name!r} has no data (zero-size buffer) and is not retained state: supply it",
                    )
                arr = program.state_array(b, spec.dims[b.index])
            gdt = image.graph_dtypes[b.name]
            feed = arr if arr.dtype == gdt else arr.astype(gdt)
            if b.name in image.in_place:
                # The run updates its cache where it lies (the fused attention kernel appends to the
                # cache it reads): the held state itself, or a private copy of a cache the caller
                # supplied (left as it was), or of held state that cannot be written in place.
                callers = given is not None and np.may_share_memory(feed, given)
                stuck = program.state.get(b.name) is feed and not program.holds(b, feed)
                if callers or stuck or not (feed.flags.c_contiguous and feed.flags.writeable):
                    feed = np.array(feed, order="C", copy=True)
                in_place[image.retained[b.name]] = feed
            feeds[b.name] = feed
        # An fp16 program holds no float32 subnormals: the float32 kernels may flush theirs (fpenv).
        with fpenv.flushing() if image.manifest.convert_to_fp16 else nullcontext():
            results = run_session(session, image.output_names, feeds, in_place)
        out_results: list[np.ndarray | None] = [None] * len(image.bindings)
        for b, value in zip(image.outputs, results, strict=True):
            base = image.retained_out.get(b.name)
            if base is not None:
                program.store_state(image.by_name[base], value)
            target = self._arrays[b.index]
            if target is None:
                continue
            if value.shape != target.shape:
                raise Failure(
                    QStatus.ERROR,
                    f"output {b.name!r} came out as {list(value.shape)} but specialization {spec.name!r} "
                    f"declares {list(target.shape)}: fix the output's dims in the ONNX and recompile",
                )
            np.copyto(target, value, casting="unsafe")
            out_results[b.index] = target
        for direction, b, arr, starts in self._slices:
            if direction == Direction.OUT:
                state = program.state_array(b, spec.dims[b.index])
                region = tuple(slice(s, s + n) for s, n in zip(starts, arr.shape, strict=True))
                np.copyto(arr, state[region], casting="unsafe")
        self._results = out_results
        timeout_ms = program.props.dataPathTimeoutMs
        if timeout_ms and device_time * 1000 > timeout_ms:
            raise Failure(
                QStatus.TIMEDOUT,
                f"modelled device time {device_time * 1000:.0f} ms exceeds dataPathTimeoutMs={timeout_ms}",
            )
        # A paced run ends at its modelled time (the waiter sleeps until then, the queue thread
        # does not): the next run on this program starts from that end, so a run queued behind it
        # is computed while this one is still modelled as running.
        now = time.perf_counter()
        end = max(start + device_time, now) if config.pace or config.pace_as else now
        program.device_free_at = end
        self._ready_at = end
        return QStatus.SUCCESS, k, device_time

    def _account(
        self,
        status: QStatus,
        spec: int,
        device_time: float,
        start: float,
        wall: float,
        queue: int,
        device_start: float,
    ) -> None:
        self.lastDeviceTimeS = device_time
        for dev in self.program.devices:
            with dev.lock:
                dev.device_time_s += device_time
                dev.wall_time_s += wall
        recorder = self.program.machine.trace.recorder()
        if recorder is not None:
            image = self.program.image
            recorder.record(
                trace.RunRecord(
                    program=str(image.path),
                    specialization=image.manifest.specs[spec].name if spec >= 0 else "",
                    spec_index=spec,
                    qids=[d.qid for d in self.program.devices],
                    status=int(status),
                    start_s=start,
                    wall_s=wall,
                    device_time_s=device_time,
                    queue=queue,
                    exec_obj=self.id,
                    message=self.lastError if status != QStatus.SUCCESS else "",
                    device_start_s=device_start,
                )
            )


def run_session(
    session: Any, names: list[str], feeds: dict[str, np.ndarray], in_place: dict[str, np.ndarray]
) -> list[np.ndarray]:
    """Run the onnxruntime session; outputs named in ``in_place`` are written into the given arrays.

    Those are retained-state outputs whose inputs are the held state itself (``ProgramImage.in_place``):
    the device kernels' scatter then updates the state where it lies, as the card's retained state
    does, instead of writing a copy of the whole cache each run.
    """
    if not in_place:
        return list(session.run(names, feeds))
    binding = session.io_binding()
    for name, arr in feeds.items():
        binding.bind_cpu_input(name, arr)
    for name in names:
        target = in_place.get(name)
        if target is None:
            binding.bind_output(name, "cpu")
        else:
            binding.bind_output(name, "cpu", 0, target.dtype, list(target.shape), target.ctypes.data)
    session.run_with_iobinding(binding)
    values = binding.get_outputs()
    return [
        in_place[name] if name in in_place else value.numpy()
        for name, value in zip(names, values, strict=True)
    ]
