"""Observers hear each program the compile cache gives: compiled (a miss, with its seconds) or reused (a hit)."""

from __future__ import annotations

from pathlib import Path

from qaic_aot import compile_model
from qaic_core import get_plugin_manager, hookimpl
from qaic_core.observe import Observer
from qaic_core.settings import CompileSettings

SETTINGS = CompileSettings(prefill_seq_len=8, ctx_len=64, full_batch_size=2, num_cores=1)


class Compiles(Observer):
    def __init__(self) -> None:
        self.events: list[tuple[bool, float]] = []

    @hookimpl
    def qaic_observers(self) -> list[Observer]:
        return [self]

    def program_compiled(self, cached: bool, seconds: float) -> None:
        self.events.append((cached, seconds))


def test_a_compile_then_a_cache_hit_are_reported_once_each(tiny_llama: Path, tmp_path: Path) -> None:
    pm = get_plugin_manager()
    compiles = Compiles()
    assert pm.register(compiles, name="test-compiles") is not None
    try:
        first = compile_model(tiny_llama, SETTINGS, qeff_home=tmp_path, progress=False)
        again = compile_model(tiny_llama, SETTINGS, qeff_home=tmp_path, progress=False)
    finally:
        pm.unregister(compiles)
    assert first == again
    assert [cached for cached, _ in compiles.events] == [False, True]
    (_, compile_s), (_, hit_s) = compiles.events
    assert compile_s > 0 and hit_s == 0
