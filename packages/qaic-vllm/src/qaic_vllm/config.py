"""Engine arguments -> compile settings, with vllm-qaic's meanings and errors that name the flag."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qaic_core.descriptors import DeviceBackend
from qaic_core.errors import QaicConfigError
from qaic_core.execution import GENERATE, ExecutionConfig, OpenOptions, PoolingSettings
from qaic_core.settings import MAX_CORES_PER_SOC, SETTINGS, CompileSettings
from qaic_vllm import envs
from qaic_vllm.data_parallel import replica_values
from qaic_vllm.overrides import PARTIAL_PREFILLS, partial_prefills, read_overrides
from qaic_vllm.prefill import prefill_shapes
from qaic_vllm.sizing import device_cores, fit_shape, group_devices

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("qaic.vllm")

DEFAULT_PREFILL_SEQ_LEN = 128
DEFAULT_EXECUTION_PATH = "aot"
EXECUTION_MODE_KEY = "execution_mode"
"""``--additional-config`` key choosing the execution mode (``aot`` or ``pyt``)."""
EXECUTION_MODES = {"aot": "aot", "pyt": "pyt", "eager": "pyt"}
OVERRIDE_KEY = "override_qaic_config"
VLLM_ONLY_KEYS: dict[str, str] = {
    "qpc_path": "a prebuilt QPC directory to serve instead of compiling (checked against the model)",
    "max_num_partial_prefills": "prompts the scheduler lets be in prefill at once (default 1)",
}
"""``override_qaic_config`` keys that are not compile settings."""
OVERRIDE_KEYS = frozenset(
    {key for spec in SETTINGS.values() if spec.override for key in spec.keys} | set(VLLM_ONLY_KEYS)
)
"""Keys ``override_qaic_config`` takes: the overridable settings, their vendor aliases, qpc_path."""
MXINT8_CACHE_DTYPES = frozenset({"mxint8", "fp8", "fp8_e4m3", "fp8_e5m2"})
"""KV cache dtypes that select an mxint8 KV cache (vllm-qaic maps fp8 to mxint8)."""
DTYPES = {"float32": False, "float16": True}
"""Model dtype -> whether the program is compiled with -convert-to-fp16."""


@dataclass(frozen=True)
class EngineSettings:
    """What the worker compiles and runs: the compile settings and a prebuilt QPC, if any."""

    compile: CompileSettings
    qpc_path: Path | None
    dtype: str
    execution_path: str = "aot"
    """The qaic-core execution path that opens the model (``aot``: a compiled program)."""
    max_num_partial_prefills: int = 1
    """Requests the scheduler lets be in prefill at once (``override_qaic_config``)."""
    model_loader: str | None = None
    """The model loader chosen by name (``--additional-config`` ``model_loader``); None: the path's own."""
    session_factory: str | None = None
    """The device-session factory chosen by name (``--additional-config`` ``session_factory``)."""

    def execution_config(
        self,
        model: str,
        device: DeviceBackend,
        options: OpenOptions | None = None,
        task: str = GENERATE,
        pooling: PoolingSettings | None = None,
    ) -> ExecutionConfig:
        """What an execution path opens (or checks) for this engine: its shapes on ``device``."""
        return ExecutionConfig(
            model_dir=model_dir_of(model),
            settings=self.compile,
            device=device,
            qpc_path=self.qpc_path,
            dtype=self.dtype,
            options=options or OpenOptions(),
            task=task,
            pooling=pooling,
            loader=self.model_loader,
            session=self.session_factory,
        )


def execution_path_of(vllm_config: VllmConfig | None) -> str:
    """The qaic-core execution path that serves this engine: the one place the mode is chosen.

    ``--additional-config '{"execution_mode": "pyt"}'`` first, then ``VLLM_QAIC_EXECUTION_MODE``,
    then the vendor's rule: ``pyt`` (eager) when ``torch_qaic`` can be imported, else ``aot``.
    ``eager`` is accepted for ``pyt``.
    """
    additional = getattr(vllm_config, "additional_config", None)  # no config outside an engine
    raw = additional.get(EXECUTION_MODE_KEY) if isinstance(additional, dict) else None
    if raw is not None:
        return _mode(raw, f"--additional-config {EXECUTION_MODE_KEY}")
    raw = os.environ.get(envs.VLLM_QAIC_EXECUTION_MODE, "").strip()
    if raw:
        return _mode(raw, envs.VLLM_QAIC_EXECUTION_MODE)
    return "pyt" if torch_qaic_installed() else DEFAULT_EXECUTION_PATH


def _mode(raw: object, source: str) -> str:
    key = str(raw).strip().lower()
    if key not in EXECUTION_MODES:
        raise QaicConfigError(
            f"{source}={raw!r} is not an execution mode: use aot (compiled programs) or pyt (eager; also 'eager')"
        )
    return EXECUTION_MODES[key]


@functools.cache
def torch_qaic_installed() -> bool:
    """Whether the card's PyTorch device (``torch_qaic``, from the Apps SDK) can be imported."""
    return importlib.util.find_spec("torch_qaic") is not None


def prefill_seq_len_of(long_prefill_token_threshold: int | None, max_model_len: int) -> int:
    """``--long-prefill-token-threshold`` is the prefill chunk; 128 when unset, never above ctx_len."""
    value = long_prefill_token_threshold or DEFAULT_PREFILL_SEQ_LEN
    return min(value, max_model_len)


def _overrides(vllm_config: VllmConfig) -> dict[str, Any]:
    """Top-level ``device_group``, ``override_qaic_config``, then ``VLLM_QAIC_*`` (vllm-qaic's order);
    under data parallelism the device group is this replica's (see qaic_vllm.data_parallel)."""
    return replica_values(vllm_config, read_overrides(vllm_config))


def engine_settings(vllm_config: VllmConfig, *, choose_shape: bool = False) -> EngineSettings:
    """Build (and so validate) the compile settings the engine arguments describe.

    ``num_cores`` defaults to the device's and depth-first scheduling to on (vllm-qaic's defaults).
    With ``choose_shape`` (the platform, at configuration time) an unset ``--max-num-seqs`` /
    ``--max-model-len`` is chosen to fit the device group and a given shape that cannot fit is refused.
    """
    model_config = vllm_config.model_config
    sched = vllm_config.scheduler_config
    source = f"--additional-config {OVERRIDE_KEY} (or VLLM_QAIC_* variables)"
    values = _overrides(vllm_config)

    ctx_len = int(model_config.max_model_len)
    full_batch_size = int(sched.max_num_seqs)
    if full_batch_size < 1:
        raise QaicConfigError(f"--max-num-seqs ({full_batch_size}) must be >= 1 (it is full_batch_size)")
    threshold = int(sched.long_prefill_token_threshold or 0)
    if threshold < 0:
        raise QaicConfigError(f"--long-prefill-token-threshold ({threshold}) must be >= 0")
    prefill_seq_len = prefill_seq_len_of(values.pop("prefill_seq_len", None) or threshold, ctx_len)

    num_cores = values.get("num_cores")
    if num_cores is not None and not 1 <= num_cores <= MAX_CORES_PER_SOC:
        raise QaicConfigError(
            f"num_cores={num_cores} is out of range: set {source} num_cores to 1..{MAX_CORES_PER_SOC} "
            "(NSP cores per SoC)"
        )
    mos = values.get("mos")
    if mos is not None and mos < 1:
        raise QaicConfigError(f"mos={mos} must be >= 1: fix {source} mos")

    dtype = str(model_config.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise QaicConfigError(f"--dtype {dtype} is not supported on Cloud AI: use --dtype float16 or float32")

    quantization = model_config.quantization
    if quantization not in (None, "mxfp6"):
        raise QaicConfigError(
            f"--quantization {quantization} is not supported on Cloud AI: use --quantization mxfp6 or none"
        )
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in MXINT8_CACHE_DTYPES | {"auto", "float16", "float32"}:
        raise QaicConfigError(
            f"--kv-cache-dtype {cache_dtype} is not supported on Cloud AI: use auto or mxint8 (fp8 maps to mxint8)"
        )

    kwargs: dict[str, Any] = {
        "prefill_seq_len": prefill_seq_len,
        "ctx_len": ctx_len,
        "batch_size": 1,
        "full_batch_size": full_batch_size,
        "mxfp6": quantization == "mxfp6",
        "mxint8": cache_dtype in MXINT8_CACHE_DTYPES,
        "convert_to_fp16": DTYPES[dtype],
    }
    kwargs.update((key, value) for key, value in values.items() if key not in VLLM_ONLY_KEYS)
    if "device_group" in values and "num_devices" not in values:
        kwargs["num_devices"] = len(values["device_group"])
    kwargs.setdefault("aic_enable_depth_first", True)  # vllm-qaic compiles with depth-first on
    shapes = prefill_shapes(values, prefill_seq_len, full_batch_size, bool(values.get("qpc_path")))
    kwargs["prefill_seq_lens"] = shapes.seq_lens
    kwargs["prefill_batch_size"] = shapes.batch_size
    kwargs["prefill_batch_seq_len"] = shapes.given_batch_seq_len
    devices = None
    if "num_cores" not in values:
        devices = group_devices(kwargs.get("device_group"), int(kwargs.get("num_devices", 1)))
        kwargs["num_cores"] = device_cores(devices)
    try:
        settings = CompileSettings(**kwargs)
    except QaicConfigError as exc:
        raise QaicConfigError(f"invalid Cloud AI settings from the engine arguments: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise QaicConfigError(f"invalid {source}: {exc}") from exc
    qpc_raw = values.get("qpc_path")
    qpc_path = Path(str(qpc_raw)).expanduser() if qpc_raw else None
    if qpc_path is not None and not qpc_path.exists():
        raise QaicConfigError(
            f"qpc_path {qpc_path} does not exist: fix {source} qpc_path / VLLM_QAIC_QPC_PATH or unset it to compile"
        )
    if choose_shape and qpc_path is None:
        if devices is None:
            devices = group_devices(settings.device_group, settings.num_devices)
        plain = settings.replace(prefill_seq_lens=(), prefill_batch_size=1, prefill_batch_seq_len=None)
        settings = fit_shape(vllm_config, plain, devices, model_dir_of(str(model_config.model)))
        shapes = prefill_shapes(values, settings.prefill_seq_len, settings.decode_batch_size, False)
        settings = settings.replace(
            prefill_seq_lens=shapes.seq_lens,
            prefill_batch_size=shapes.batch_size,
            prefill_batch_seq_len=shapes.given_batch_seq_len,
        )
    partial = partial_prefills(values)
    if partial > settings.decode_batch_size:
        raise QaicConfigError(
            f"{source} {PARTIAL_PREFILLS} ({partial}) exceeds --max-num-seqs ({settings.decode_batch_size}): "
            f"at most one prompt per KV slot is in prefill; lower {PARTIAL_PREFILLS} or raise --max-num-seqs"
        )
    return EngineSettings(
        compile=settings,
        qpc_path=qpc_path,
        dtype=dtype,
        execution_path=execution_path_of(vllm_config),
        max_num_partial_prefills=partial,
        model_loader=plugin_choice(vllm_config, MODEL_LOADER_KEY),
        session_factory=plugin_choice(vllm_config, SESSION_FACTORY_KEY),
    )


MODEL_LOADER_KEY = "model_loader"
"""``--additional-config`` key naming the model loader (``qaic_model_loaders``); else ``QAIC_MODEL_LOADER``."""
SESSION_FACTORY_KEY = "session_factory"
"""``--additional-config`` key naming the session factory (``qaic_session_factories``); else ``QAIC_SESSION_FACTORY``."""


def plugin_choice(vllm_config: VllmConfig, key: str) -> str | None:
    """A plugin named by ``--additional-config`` ``key``; None leaves the choice to the environment and the path."""
    raw = vllm_config.additional_config.get(key) if isinstance(vllm_config.additional_config, dict) else None
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw.strip():
        raise QaicConfigError(
            f"--additional-config {key} must name a registered plugin as a string, got {raw!r}"
        )
    from qaic_core import get_plugin_manager

    pm = get_plugin_manager()
    installed = pm.model_loaders() if key == MODEL_LOADER_KEY else pm.session_factories()
    name = raw.strip()
    if name not in installed:
        raise QaicConfigError(
            f"--additional-config {key} {name!r} is not installed; installed: {', '.join(sorted(installed)) or 'none'} "
            "(drop the key to use the execution path's own)"
        )
    return name


def model_dir_of(model: str) -> Path:
    """A local model directory; hub names resolve only from the local cache (the card host is offline)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))
