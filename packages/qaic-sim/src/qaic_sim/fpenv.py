"""Float32 subnormals flushed to zero while the simulator computes a program, in the computing thread only.

An fp16 datapath never holds a float32 subnormal (fp16's smallest subnormal, 2**-24, is a normal
float32), but the float32 kernels that emulate it make them: a masked attention score minus the row's
maximum sends ``exp`` below 2**-126, and x86 cores take a slow microcode path for every such value (a
masked 4 x 8 x 32 x 64 softmax runs several times slower than an unmasked one). With the SSE control
register's flush-to-zero and denormals-are-zero bits set for the duration of a run, those values are
zeros, as the fp16 rounding after the node makes them anyway.

onnxruntime's ``session.set_denormal_as_zero`` sets the bits for good in the thread that creates the
session, which here is the caller's (a run executes in the caller's thread when nothing else is
queued): every later float computation of that thread would flush too. :func:`flushing` sets them
around one run and restores the thread's previous environment after it, through the C library's
``fegetenv`` / ``fesetenv``. Only on x86-64 Linux with glibc, whose ``fenv_t`` holds MXCSR at byte
28; elsewhere it changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("qaic.sim.runtime")

FENV_SIZE = 32
"""``sizeof(fenv_t)`` on x86-64 glibc."""
MXCSR_OFFSET = 28
"""Byte offset of ``__mxcsr`` in glibc's x86-64 ``fenv_t``."""
FTZ_DAZ = 0x8040
"""MXCSR flush-to-zero (bit 15) and denormals-are-zero (bit 6)."""


def _libm() -> ctypes.CDLL | None:
    if sys.platform != "linux" or platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc":
        return None
    name = ctypes.util.find_library("m")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        log.debug("no C math library for subnormal flushing: %s", exc)
        return None
    return lib if _works(lib) else None


def _works(lib: ctypes.CDLL) -> bool:
    """Whether setting the bits through ``fesetenv`` reads back, and restoring gives the MXCSR before."""
    saved = ctypes.create_string_buffer(FENV_SIZE)
    if lib.fegetenv(saved) != 0:
        return False
    probe = ctypes.create_string_buffer(FENV_SIZE)
    try:
        if lib.fesetenv(_with_bits(saved)) != 0 or lib.fegetenv(probe) != 0:
            return False
        flushed = _mxcsr(probe) & FTZ_DAZ == FTZ_DAZ
    finally:
        lib.fesetenv(saved)
    return flushed and lib.fegetenv(probe) == 0 and _mxcsr(probe) == _mxcsr(saved)


def _mxcsr(env: ctypes.Array[ctypes.c_char]) -> int:
    value: int = struct.unpack_from("<I", env.raw, MXCSR_OFFSET)[0]
    return value


def _with_bits(env: ctypes.Array[ctypes.c_char]) -> ctypes.Array[ctypes.c_char]:
    out = ctypes.create_string_buffer(env.raw, FENV_SIZE)
    struct.pack_into("<I", out, MXCSR_OFFSET, _mxcsr(env) | FTZ_DAZ)
    return out


_LIBM = _libm()


def available() -> bool:
    """Whether :func:`flushing` flushes on this platform."""
    return _LIBM is not None


@contextmanager
def flushing() -> Iterator[None]:
    """Flush float32 subnormals to zero in this thread for the block; the thread's environment after it
    is the one before (rounding mode, exception masks and flags)."""
    lib = _LIBM
    if lib is None:
        yield
        return
    saved = ctypes.create_string_buffer(FENV_SIZE)
    if lib.fegetenv(saved) != 0:
        yield
        return
    lib.fesetenv(_with_bits(saved))
    try:
        yield
    finally:
        lib.fesetenv(saved)
