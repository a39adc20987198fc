"""Compile settings of a causal-LM program, validated with messages that name the fix."""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from qaic_core import ccl
from qaic_core.compiler_flags import BOOL_FLAGS, VALUE_FLAGS
from qaic_core.env import parse_bool
from qaic_core.errors import QaicConfigError

MAX_CORES_PER_SOC = 16
MAX_DEVICES = 64


def parse_int(value: Any, what: str) -> int:
    """A whole number from JSON, a variable or a flag; the error names ``what``, the value and the fix."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise QaicConfigError(f"{what}={value!r} is not an integer: give a whole number") from None


def parse_mos(value: Any, what: str) -> int | None:
    """``-mos``: a whole number; -1 (vllm-qaic's default) leaves the choice to the compiler."""
    n = parse_int(value, what)
    return None if n == -1 else n


def _int_list(value: Any, what: str, kind: str, example: str) -> tuple[int, ...]:
    """Whole numbers from ``"a,b"``, ``"[a, b]"``, ``[a, b]`` or one number, in the order given."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    parts = value.strip().strip("[]()").split(",") if isinstance(value, str) else value
    try:
        return tuple(int(str(v).strip()) for v in parts if str(v).strip())
    except (TypeError, ValueError):
        raise QaicConfigError(
            f"{what} {value!r} is not a list of {kind}: write it as '{example}' or [{example.replace(',', ', ')}]"
        ) from None


def parse_device_ids(value: Any, what: str) -> tuple[int, ...]:
    """Device ids from ``"0,1"``, ``"[0, 1]"``, ``[0, 1]`` or one id (vllm-qaic's forms)."""
    return _int_list(value, what, "device ids", "0,1")


def parse_lengths(value: Any, what: str) -> tuple[int, ...]:
    """Token counts from ``"32,64"``, ``"[32, 64]"``, ``[32, 64]`` or one number; sorted, no repeats."""
    return tuple(sorted(set(_int_list(value, what, "lengths", "32,64"))))


def parse_length_list(value: Any, what: str) -> tuple[int, ...]:
    """Lengths from ``"32,64"``, ``"[32, 64]"``, ``[32, 64]`` or one number, in the order given."""
    return _int_list(value, what, "lengths", "4096,8192")


def vendor_flag(piece: str) -> str | None:
    """One ``key=value`` / ``key`` piece of vllm-qaic's ``compiler_args`` as a qaic-compile flag.

    ``aic_pmu_recipe=KernelUtil`` becomes ``-aic-pmu-recipe=KernelUtil`` and ``aic_perf_metrics``
    ``-aic-perf-metrics``, as QEfficient turns compile options into flags. A flag that takes no value
    is given by a yes word (or none) and dropped by a no word (``false``, ``0``); a piece that
    already starts with ``-`` is a flag as it is.
    """
    if piece.startswith("-"):
        return piece
    key, eq, value = piece.partition("=")
    name = key.strip().lower().replace("_", "-")
    word = value.strip()
    boolean = name in BOOL_FLAGS or (name not in VALUE_FLAGS and word.lower() in _WORDS)
    if not eq or (boolean and parse_bool(word or "true", piece)):
        return "-" + name
    if boolean:
        return None
    return f"-{name}={word}"


_WORDS = frozenset({"", "true", "false", "yes", "no", "on", "off"})


def split_arguments(value: str, what: str) -> list[str]:
    """Pieces of a ``compiler_args`` string: split as a shell would, then on vllm-qaic's ``|``."""
    try:
        words = shlex.split(value)
    except ValueError as exc:
        raise QaicConfigError(
            f"{what}={value!r} is not a list of arguments ({exc}): fix its quotes"
        ) from None
    return [p for w in words for p in (w.split("|") if not w.startswith("-") else [w]) if p]


def parse_arguments(value: Any, what: str) -> tuple[str, ...]:
    """Compiler arguments from a list, or from one string of raw flags (``-mos=1 -v``, split as a shell
    would) or vllm-qaic's ``key=value|key`` pieces (``mos=1|aic_perf_metrics``), or both mixed."""
    if isinstance(value, str):
        return tuple(f for f in (vendor_flag(p) for p in split_arguments(value, what)) if f)
    if isinstance(value, list | tuple):
        return tuple(str(a) for a in value)
    raise QaicConfigError(f"{what}={value!r} is not a list of arguments: give a list or one quoted string")


@dataclass(frozen=True)
class SettingSpec:
    """One compile setting described once; the CLI, vLLM's overrides, aliases and docs derive from it."""

    name: str
    default: Any
    help: str
    parse: Callable[[Any, str], Any]
    """``parse(value, what)`` -> the typed value; errors name ``what`` (a key, flag or variable)."""
    flag: str | None = None
    """The ``qaic-aot`` flag; None where the command has none."""
    off_flag: str | None = None
    off_help: str = ""
    aliases: tuple[str, ...] = ()
    """Vendor names (Qualcomm's vllm-qaic plugin, QEfficient) accepted for it."""
    limit: str = ""
    override: bool = True
    """Whether vLLM's ``override_qaic_config`` takes it (else an engine argument decides it)."""
    engine_arg: str | None = None
    """The vLLM engine argument that sets it, or gives its default."""

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    @property
    def boolean(self) -> bool:
        return self.parse is parse_bool

    def value(self, raw: Any, what: str | None = None) -> Any:
        """``raw`` parsed; None stays None for settings that may be unset."""
        if raw is None and self.default is None:
            return None
        return self.parse(raw, what or self.name)


def _setting(default: Any, help: str, parse: Callable[[Any, str], Any], **more: Any) -> Any:
    """A dataclass field that carries its setting's description (``SETTINGS`` collects them)."""
    return field(default=default, metadata={"spec": SettingSpec("", default, help, parse, **more)})


@dataclass(frozen=True)
class CompileSettings:
    """What a program is compiled for; names follow QEfficient's ``compile`` arguments."""

    prefill_seq_len: int = _setting(
        32,
        "tokens per prefill chunk",
        parse_int,
        flag="--prefill-seq-len",
        limit="1 .. `ctx_len`",
        override=False,
        engine_arg="--long-prefill-token-threshold",
    )
    prefill_seq_lens: tuple[int, ...] = _setting(
        (),
        "shorter prefill chunks compiled besides prefill_seq_len; a chunk runs on the shortest that holds it",
        parse_lengths,
        flag="--prefill-seq-lens",
        limit="each 1 .. `prefill_seq_len`",
    )
    prefill_batch_size: int = _setting(
        1,
        "most prompts prefilled together in one batched run of prefill_batch_seq_len tokens per row (continuous "
        "batching); 2, 4, ... rows are compiled too, so fewer prompts compute no padding rows",
        parse_int,
        flag="--prefill-batch-size",
        limit="1 .. `full_batch_size`",
    )
    prefill_batch_seq_len: int | None = _setting(
        None,
        "tokens per row of the batched prefill; unset: the shortest prefill chunk",
        parse_int,
        flag="--prefill-batch-seq-len",
        limit="1 .. `prefill_seq_len`, with `prefill_batch_size` > 1",
    )
    ctx_len: int = _setting(
        128,
        "context length: KV positions per sequence",
        parse_int,
        flag="--ctx-len",
        limit=">= 1",
        override=False,
        engine_arg="--max-model-len",
    )
    batch_size: int = _setting(1, "prefill batch", parse_int, limit="1 .. `full_batch_size`", override=False)
    full_batch_size: int | None = _setting(
        None,
        "KV slots for continuous batching (the decode batch)",
        parse_int,
        flag="--full-batch-size",
        limit=">= 1 or unset",
        override=False,
        engine_arg="--max-num-seqs",
    )
    num_cores: int = _setting(
        16,
        "NSP cores per SoC",
        parse_int,
        flag="--num-cores",
        aliases=("aic_num_cores",),
        limit=f"1 .. {MAX_CORES_PER_SOC}",
    )
    num_devices: int = _setting(
        1,
        "devices (SoCs) to tensor-slice the model over",
        parse_int,
        flag="--num-devices",
        limit=f"1 .. {MAX_DEVICES}; as many as `device_group` lists",
    )
    device_group: tuple[int, ...] | None = _setting(
        None,
        "device ids to run on, comma separated, e.g. 0,1",
        parse_device_ids,
        flag="--device-group",
        aliases=("device_ids", "device_id"),
        limit="`num_devices` ids, no repeats",
    )
    mxfp6: bool = _setting(
        False,
        "compress matmul weights to MX FP6 (-mxfp6-matmul)",
        parse_bool,
        flag="--mxfp6",
        aliases=("mxfp6_matmul", "mxfp6_en"),
        engine_arg="--quantization mxfp6",
    )
    mxint8: bool = _setting(
        False,
        "keep the KV cache in MX INT8 (custom_io.yaml)",
        parse_bool,
        flag="--mxint8",
        aliases=("mxint8_kv_cache", "mxint8_en"),
        engine_arg="--kv-cache-dtype mxint8",
    )
    mos: int | None = _setting(
        None,
        "compiler -mos value (-1: the compiler's choice, vllm-qaic's default)",
        parse_mos,
        flag="--mos",
        limit=">= 1, or -1 / unset",
    )
    aic_enable_depth_first: bool = _setting(
        False,
        "compiler -aic-enable-depth-first",
        parse_bool,
        flag="--aic-enable-depth-first",
        aliases=("dfs",),
    )
    num_speculative_tokens: int | None = _setting(
        None,
        "K: add a decode of K+1 tokens (draft verification)",
        parse_int,
        flag="--num-speculative-tokens",
        limit=">= 1, K+1 <= `ctx_len`",
        override=False,
    )
    ccl_enabled: bool = _setting(
        False,
        "compute-context lengths: also specialize for shorter contexts, each run reading only the "
        "shortest that holds its positions; lists generated from ctx_len unless given",
        parse_bool,
        flag="--ccl-enabled",
    )
    comp_ctx_lengths_prefill: tuple[int, ...] = _setting(
        (),
        "compute-context lengths of the prefill (turns CCL on); ctx_len is added if the last is shorter",
        parse_length_list,
        flag="--comp-ctx-lengths-prefill",
        limit="ascending, each 1 .. `ctx_len`",
    )
    comp_ctx_lengths_decode: tuple[int, ...] = _setting(
        (),
        "compute-context lengths of the decode (turns CCL on); ctx_len is added if the last is shorter",
        parse_length_list,
        flag="--comp-ctx-lengths-decode",
        limit="ascending, each 1 .. `ctx_len`",
    )
    convert_to_fp16: bool = _setting(
        True,
        "compute in fp16 (-convert-to-fp16)",
        parse_bool,
        flag="--fp16",
        off_flag="--fp32",
        off_help="keep fp32 (no -convert-to-fp16)",
        override=False,
        engine_arg="--dtype float16",
    )
    compiler_args: tuple[str, ...] = _setting(
        (),
        "extra qaic-compile flags: a list, or one string of flags (split as a shell would) or of "
        "vllm-qaic's key=value pieces (separated by spaces or pipes)",
        parse_arguments,
        flag="--compiler-args",
    )

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_mapping(
        cls, values: Mapping[str, Any], what: Callable[[str], str] | None = None
    ) -> CompileSettings:
        """Build from a dict (for example ``override_qaic_config``), rejecting unknown keys."""
        return cls(**parse_settings(values, what))

    def replace(self, **changes: Any) -> CompileSettings:
        return dataclasses.replace(self, **changes)

    @property
    def decode_batch_size(self) -> int:
        """Rows of a decode run: ``full_batch_size`` with continuous batching, else batch_size."""
        return self.full_batch_size or self.batch_size

    @property
    def decode_seq_len(self) -> int:
        return (self.num_speculative_tokens or 0) + 1

    @property
    def prefill_lengths(self) -> tuple[int, ...]:
        """Every compiled prefill chunk length, ascending; the last is ``prefill_seq_len``."""
        return tuple(sorted({*self.prefill_seq_lens, self.prefill_seq_len}))

    @property
    def ccl(self) -> bool:
        """Whether the program has compute-context lengths (``ccl_enabled`` or a list given)."""
        return self.ccl_enabled or bool(self.comp_ctx_lengths_prefill or self.comp_ctx_lengths_decode)

    @property
    def compute_context_lengths(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """``(prefill, decode)`` compute-context lengths the program is compiled for, or None without CCL."""
        if not self.ccl:
            return None
        return ccl.resolve(
            self.comp_ctx_lengths_prefill, self.comp_ctx_lengths_decode, self.ctx_len, self.prefill_seq_len
        )

    @property
    def batched_prefill_seq_len(self) -> int | None:
        """Tokens per row of the batched prefill (``prefill_batch_seq_len``, else the shortest chunk),
        or None without one."""
        if self.prefill_batch_size < 2:
            return None
        return self.prefill_batch_seq_len or self.prefill_lengths[0]

    @property
    def batched_prefill_rows(self) -> tuple[int, ...]:
        """Row counts the batched prefill is compiled with: powers of two from 2 below
        ``prefill_batch_size``, and ``prefill_batch_size`` (empty without a batched prefill), so a
        burst of fewer prompts computes no padding rows."""
        if self.prefill_batch_size < 2:
            return ()
        powers = (2**k for k in range(1, self.prefill_batch_size.bit_length()))
        return (*(n for n in powers if n < self.prefill_batch_size), self.prefill_batch_size)

    def validate(self) -> None:
        _positive("prefill_seq_len", self.prefill_seq_len)
        _positive("ctx_len", self.ctx_len)
        _positive("batch_size", self.batch_size)
        if self.full_batch_size is not None:
            _positive("full_batch_size", self.full_batch_size)
        if self.prefill_seq_len > self.ctx_len:
            raise QaicConfigError(
                f"prefill_seq_len ({self.prefill_seq_len}) must not exceed ctx_len ({self.ctx_len}): "
                f"lower {_flag('prefill_seq_len')} or raise {_flag('ctx_len')}"
            )
        for n in self.prefill_seq_lens:
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.prefill_seq_len:
                raise QaicConfigError(
                    f"prefill_seq_lens {list(self.prefill_seq_lens)}: each must be 1 .. prefill_seq_len "
                    f"({self.prefill_seq_len}): fix {_flag('prefill_seq_lens')}"
                )
        _positive("prefill_batch_size", self.prefill_batch_size)
        if self.prefill_batch_size > 1 and self.full_batch_size is None:
            raise QaicConfigError(
                f"prefill_batch_size ({self.prefill_batch_size}) needs continuous batching: set "
                f"{_flag('full_batch_size')} or {_flag('prefill_batch_size')} 1"
            )
        if self.full_batch_size is not None and self.prefill_batch_size > self.full_batch_size:
            raise QaicConfigError(
                f"prefill_batch_size ({self.prefill_batch_size}) must not exceed full_batch_size "
                f"({self.full_batch_size}): lower {_flag('prefill_batch_size')}"
            )
        if self.prefill_batch_seq_len is not None:
            if not 1 <= self.prefill_batch_seq_len <= self.prefill_seq_len:
                raise QaicConfigError(
                    f"prefill_batch_seq_len ({self.prefill_batch_seq_len}) must be 1 .. prefill_seq_len "
                    f"({self.prefill_seq_len}): fix {_flag('prefill_batch_seq_len')} (override_qaic_config "
                    "prefill_batch_seq_len under vLLM)"
                )
            if self.prefill_batch_size < 2:
                raise QaicConfigError(
                    f"prefill_batch_seq_len ({self.prefill_batch_seq_len}) shapes the batched prefill, and "
                    f"prefill_batch_size is {self.prefill_batch_size} (none): set {_flag('prefill_batch_size')} "
                    f"2 or more, or leave out {_flag('prefill_batch_seq_len')} (override_qaic_config "
                    "prefill_batch_size / prefill_batch_seq_len under vLLM)"
                )
        if not 1 <= self.num_cores <= MAX_CORES_PER_SOC:
            raise QaicConfigError(
                f"num_cores ({self.num_cores}) must be between 1 and {MAX_CORES_PER_SOC} "
                f"(NSP cores per SoC): set {_flag('num_cores')} accordingly"
            )
        if not 1 <= self.num_devices <= MAX_DEVICES:
            raise QaicConfigError(
                f"num_devices ({self.num_devices}) must be between 1 and {MAX_DEVICES}: "
                f"list the SoCs with {_flag('device_group')}"
            )
        if self.device_group is not None:
            if len(self.device_group) != self.num_devices:
                raise QaicConfigError(
                    f"device_group {list(self.device_group)} has {len(self.device_group)} devices but "
                    f"num_devices is {self.num_devices}: make them agree ({_flag('device_group')})"
                )
            if len(set(self.device_group)) != len(self.device_group):
                raise QaicConfigError(
                    f"device_group {list(self.device_group)} lists a device twice: fix {_flag('device_group')}"
                )
            if any(d < 0 for d in self.device_group):
                raise QaicConfigError(
                    f"device_group {list(self.device_group)} has a negative device id: "
                    f"fix {_flag('device_group')}"
                )
        if self.mos is not None and self.mos < 1:
            raise QaicConfigError(f"mos ({self.mos}) must be >= 1 or unset: fix {_flag('mos')}")
        if self.num_speculative_tokens is not None:
            if self.num_speculative_tokens < 1:
                raise QaicConfigError(
                    f"num_speculative_tokens ({self.num_speculative_tokens}) must be >= 1 or unset: "
                    f"fix {_flag('num_speculative_tokens')}"
                )
            if self.num_speculative_tokens + 1 > self.ctx_len:
                raise QaicConfigError(
                    f"num_speculative_tokens + 1 ({self.num_speculative_tokens + 1}) exceeds ctx_len "
                    f"({self.ctx_len}): lower {_flag('num_speculative_tokens')} or raise {_flag('ctx_len')}"
                )
        self._validate_ccl()
        if self.full_batch_size is not None and self.batch_size > self.full_batch_size:
            raise QaicConfigError(
                f"batch_size ({self.batch_size}) must not exceed full_batch_size ({self.full_batch_size}): "
                f"lower {_flag('batch_size')} or raise {_flag('full_batch_size')}"
            )

    def _validate_ccl(self) -> None:
        for name in ("comp_ctx_lengths_prefill", "comp_ctx_lengths_decode"):
            lengths = list(getattr(self, name))
            fix = f"fix {_flag(name)} (override_qaic_config {name})"
            for n in lengths:
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise QaicConfigError(f"{name} {lengths}: {n!r} is not a positive length: {fix}")
                if n > self.ctx_len:
                    raise QaicConfigError(
                        f"{name} {lengths}: {n} exceeds ctx_len ({self.ctx_len}, vLLM's --max-model-len): "
                        f"{fix} to lengths of at most {self.ctx_len}, or raise {_flag('ctx_len')}"
                    )
            if any(b <= a for a, b in itertools.pairwise(lengths)):
                raise QaicConfigError(
                    f"{name} {lengths} is not ascending: {fix} to {sorted(set(lengths))} (ascending, "
                    "no repeats)"
                )
        if self.ccl and self.num_speculative_tokens:
            raise QaicConfigError(
                "compute-context lengths and a speculative target (num_speculative_tokens "
                f"{self.num_speculative_tokens}) cannot be combined, as in QEfficient: leave out "
                f"{_flag('ccl_enabled')}, {_flag('comp_ctx_lengths_prefill')} and "
                f"{_flag('comp_ctx_lengths_decode')} (override_qaic_config ccl_enabled / comp_ctx_lengths_*) "
                "or speculative decoding"
            )

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["device_group"] = list(self.device_group) if self.device_group is not None else None
        data["compiler_args"] = list(self.compiler_args)
        data["prefill_seq_lens"] = list(self.prefill_seq_lens)
        data["comp_ctx_lengths_prefill"] = list(self.comp_ctx_lengths_prefill)
        data["comp_ctx_lengths_decode"] = list(self.comp_ctx_lengths_decode)
        return data


SETTINGS: dict[str, SettingSpec] = {
    f.name: dataclasses.replace(f.metadata["spec"], name=f.name) for f in dataclasses.fields(CompileSettings)
}
"""Every compile setting by name, in field order: the one description the CLI, vLLM and docs use."""
SETTING_KEYS: dict[str, SettingSpec] = {key: spec for spec in SETTINGS.values() for key in spec.keys}
"""Names and vendor aliases -> their setting."""


def parse_settings(values: Mapping[str, Any], what: Callable[[str], str] | None = None) -> dict[str, Any]:
    """Known keys (names or aliases) -> parsed values by setting name; a name wins over its alias.

    ``what(key)`` names a key in error messages (a flag, ``override_qaic_config mos``); the key itself
    by default.
    """
    clean: dict[str, Any] = {}
    by_name: dict[str, bool] = {}
    for key, raw in values.items():
        spec = SETTING_KEYS.get(key)
        if spec is None:
            raise QaicConfigError(
                f"unknown compile setting {key!r}; known settings: {', '.join(sorted(SETTING_KEYS))}"
            )
        named = key == spec.name
        if spec.name in by_name and (by_name[spec.name] or not named):
            continue
        clean[spec.name] = spec.value(raw, what(key) if what else key)
        by_name[spec.name] = named
    return clean


def settings_table() -> str:
    """The Markdown table of every setting that docs/configuration.md carries (a test keeps them equal)."""

    def code(text: str | None) -> str:
        return f"`{text}`" if text else ""

    def default(spec: SettingSpec) -> str:
        if spec.default is None:
            return "unset"
        if spec.default == ():
            return "none"
        return code(str(spec.default).lower() if spec.boolean else str(spec.default))

    rows = [
        "| setting | meaning | default | limit | `qaic-aot` flag | aliases | vLLM |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec in SETTINGS.values():
        flags = " / ".join(code(f) for f in (spec.flag, spec.off_flag) if f)
        vllm = [code(spec.engine_arg)] if spec.engine_arg else []
        if spec.override:
            vllm.append("`override_qaic_config`")
        rows.append(
            f"| `{spec.name}` | {spec.help} | {default(spec)} | {spec.limit} | {flags} | "
            f"{', '.join(code(a) for a in spec.aliases)} | {' or '.join(vllm) or 'not settable'} |"
        )
    return "\n".join(rows) + "\n"


def _flag(name: str) -> str:
    """The flag an error message tells the user to change (the setting's name where there is none)."""
    return SETTINGS[name].flag or name


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise QaicConfigError(f"{name} must be a positive integer, got {value!r}: set {_flag(name)}")
