"""Sleep until a 32-bit word in shared memory changes, and wake its sleepers: Linux's futex.

A worker waiting for a peer's message sleeps in the kernel and is woken by the peer's
write, with no thread of ours or gloo's in between. Shared (not private) futexes, since
the word lies in a file both processes map. Where the syscall number is unknown (not
Linux on x86-64 or arm64), ``wait`` sleeps briefly instead: the caller re-checks either way.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_INT_MAX = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" and _SYS_FUTEX is not None else None


def available() -> bool:
    return _libc is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``address`` holds ``expected``, at most ``timeout_s`` (or until woken).

    Returns early, spuriously, or at once if the word already differs: the caller re-checks.
    """
    if _libc is None:
        time.sleep(min(timeout_s, 100e-6))
        return
    whole = int(timeout_s)
    ts = _Timespec(whole, int((timeout_s - whole) * 1e9))
    _libc.syscall(
        _SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(expected), ctypes.byref(ts), None, 0
    )


def wake(address: int) -> None:
    """Wake every process sleeping on the int32 at ``address``."""
    if _libc is not None:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _INT_MAX, None, None, 0)
