"""Frozen descriptors that plugins return from the hooks in :mod:`qaic_core.hookspecs`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qaic_core.controls import FaultControl, TraceControl
from qaic_core.runtime import AicApiModule, QaicrtModule

if TYPE_CHECKING:
    from qaic_core.eager import EagerDevice, EagerDeviceRequest
    from qaic_core.execution import (
        ExecutionConfig,
        PagedStepModel,
        PoolingModel,
        ShapeChoice,
        ShapeRequest,
        StepModel,
    )
    from qaic_core.session import DeviceSession, SessionRequest


@dataclass(frozen=True)
class DeviceBackend:
    """A source of Cloud AI devices: the real ``qaicrt`` runtime or the simulator.

    ``runtime`` returns a module following :class:`qaic_core.runtime.QaicrtModule` (the real
    ``qaicrt`` names); ``aicapi`` returns one following :class:`qaic_core.runtime.AicApiModule`,
    whose ``IoDesc`` parses ``Qpc.getIoDescriptor()`` bytes; ``compiler`` takes ``qaic-compile`` argv
    (without the program name) and raises on failure. ``trace`` and ``faults`` are the
    typed controls behind the ``traces`` and ``faults`` capabilities (set exactly when claimed).
    ``eager`` opens the device layer the eager path runs on (:mod:`qaic_core.eager`); a backend
    without one leaves the eager path to ``torch_qaic``. ``compiler_revision`` names what changes the
    programs the compiler writes beyond the package's version (its own revision and the settings
    that shape them), so that a cached program is compiled again when it changes.
    """

    name: str
    package: str
    runtime: Callable[[], QaicrtModule]
    aicapi: Callable[[], AicApiModule]
    is_available: Callable[[], bool] = lambda: True
    compiler: Callable[[Sequence[str]], None] | None = None
    priority: int = 0
    capabilities: frozenset[str] = field(default_factory=frozenset)
    description: str = ""
    trace: TraceControl | None = None
    faults: FaultControl | None = None
    eager: Callable[[EagerDeviceRequest], EagerDevice] | None = None
    compiler_revision: Callable[[], str] | None = None


@dataclass(frozen=True)
class AttentionBackend:
    """An attention implementation for the eager path, given as a dotted class path.

    The vLLM platform returns ``class_path`` from its attention-backend selection when the
    execution path in use names this backend (``ExecutionPath.attention_backend``).
    """

    name: str
    package: str
    class_path: str
    description: str = ""


@dataclass(frozen=True)
class ExecutionPath:
    """A way to run a model on Cloud AI: ``aot`` (a compiled program) or ``pyt`` (eager PyTorch).

    ``open(config)`` returns a :class:`qaic_core.execution.StepModel` (or, for a path whose
    ``capabilities`` include ``paged_kv``, a :class:`qaic_core.execution.PagedStepModel`) on the
    device group of ``config.settings``; it may compile, load weights and take minutes, logging
    its progress. ``check(config)`` runs the checks that need no device (a prebuilt program's
    shapes, options the path lacks) so the platform can fail at configuration time.
    ``architectures`` lists the Hugging Face architecture names the path generates with;
    ``pooling_architectures`` those it opens as a :class:`qaic_core.execution.PoolingModel` when
    ``config.task`` is ``embed`` or ``classify`` (empty: the path serves no pooling models).
    """

    name: str
    package: str
    architectures: frozenset[str]
    open: Callable[[ExecutionConfig], StepModel | PagedStepModel | PoolingModel]
    capabilities: frozenset[str] = field(default_factory=frozenset)
    check: Callable[[ExecutionConfig], None] | None = None
    attention_backend: str | None = None
    is_available: Callable[[], bool] = lambda: True
    priority: int = 0
    description: str = ""
    pooling_architectures: frozenset[str] = field(default_factory=frozenset)
    size: Callable[[ShapeRequest], ShapeChoice] | None = None
    """Chooses a batch and context that fit the device group (raises when a given shape cannot fit)."""
    loader_kinds: frozenset[str] = field(default_factory=frozenset)
    """What the path opens a model from: the :data:`LOADER_KINDS` of the model loaders it composes."""


HF_CHECKPOINT = "hf_checkpoint"
"""A Hugging Face checkpoint exported and compiled to a program; ``load`` returns the program's directory."""
QPC = "qpc"
"""A prebuilt program directory; ``load`` returns it (checked against the model)."""
VLLM_CLASSES = "vllm_classes"
"""vLLM's own model classes run eagerly; ``load`` returns the loaded ``torch.nn.Module``."""
LOADER_KINDS: dict[str, str] = {
    HF_CHECKPOINT: "a Hugging Face checkpoint, exported and compiled to a program (aot)",
    QPC: "a prebuilt program directory (aot)",
    VLLM_CLASSES: "vLLM's model classes, loaded eagerly onto the device (pyt)",
}
"""What a model loader may declare it loads, and in words what that is."""
PROGRAM_KINDS = frozenset({HF_CHECKPOINT, QPC})
"""Loader kinds whose ``load`` returns a program directory (what the ``aot`` path runs)."""


@dataclass(frozen=True)
class ModelLoader:
    """A named way to turn a model (``ExecutionConfig.model_dir`` and friends) into what a path runs.

    ``kind`` (one of :data:`LOADER_KINDS`) says what ``load(config)`` returns: a program directory
    for :data:`PROGRAM_KINDS` (the ``aot`` path opens a session on it), a ``torch.nn.Module`` for
    ``vllm_classes`` (the ``pyt`` path steps it). ``applies(config)`` says whether the loader can
    load for this configuration (the ``qpc`` loader needs ``qpc_path``); when no loader is named,
    the path takes the applicable loader of its kinds with the highest ``priority`` (then by name).
    ``reload(config, loaded)`` puts the weights into what ``load`` returned again, in place, after a
    device fault lost them (the ``pyt`` path's recovery); a loader without it cannot recover, and a
    fault then stops the engine.
    """

    name: str
    package: str
    kind: str
    load: Callable[[ExecutionConfig], object]
    applies: Callable[[ExecutionConfig], bool] = lambda config: True
    description: str = ""
    priority: int = 0
    reload: Callable[[ExecutionConfig, object], None] | None = None


@dataclass(frozen=True)
class SessionFactory:
    """A named device-session implementation over a backend's runtime.

    ``open(request)`` loads and activates the program of ``request`` and returns a
    :class:`qaic_core.session.DeviceSession` (``qaic-aot``'s ``QAICInferenceSession`` is ``qaicrt``,
    the default). When no factory is named, the available one with the highest ``priority`` is used.
    """

    name: str
    package: str
    open: Callable[[SessionRequest], DeviceSession]
    is_available: Callable[[], bool] = lambda: True
    description: str = ""
    priority: int = 0


CAPABILITIES = frozenset(
    {
        "compile",  # has a compiler taking qaic-compile flags
        "retained_state",  # keeps KV on device between runs
        "multi_device",  # programs spanning several QIDs (devMapping / mdp partition)
        "mxfp6",  # -mxfp6-matmul weights
        "mxint8",  # mxint8 KV cache through custom_io.yaml
        "fp16",  # -convert-to-fp16
        "slicing",  # createSlicingSpecHandle / setDataWithSlices
        "faults",  # fault injection for tests
        "traces",  # per-run traces
        "timing",  # modelled device time in getPerformanceInfo
    }
)
"""Capability names a backend may claim; the conformance suite skips tests for unclaimed ones."""
