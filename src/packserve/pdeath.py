"""One helper for every child packserve starts (its worker, each runner): die with the parent."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when the thread that started it ends (its parent's,
    for a process started from its main thread): nobody can reach it then, and the memory it
    holds is wanted by the next process. Safe between fork and exec (a `preexec_fn`). False
    where the kernel has no such request (not Linux): the parent's stop is then the only end."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False
