"""Child processes that end with their parent, whatever ends the parent.

`serve` with no backend runs the built-in simulator as a child. Its own `finally` stops
the child on a clean exit, but a SIGKILL (the OOM killer, `kill -9`, a container
runtime's timeout) runs no Python at all: the simulator lived on, holding its port and
a core's worth of a busy engine, with nobody left to stop it. On Linux the kernel can
do it instead: `prctl(PR_SET_PDEATHSIG)` asks for a signal to the child when its parent
dies, by any means. Elsewhere there is no such call, and the child is left as before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

#: <linux/prctl.h>: the signal the calling process gets when its parent dies.
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when this process dies.

    SIGTERM, not SIGKILL, so the child stops as it does on any other SIGTERM (its
    streams ended, its port closed). The kernel ties the signal to the *thread* that
    forks: call Popen from a thread that lives as long as the process (`serve` does,
    from the main thread), or the child is signalled when that thread ends.

    libc is looked up here, in the parent, so the child runs no dynamic loading between
    fork and exec. None where there is no `prctl` (not Linux, no loadable libc): Popen
    then starts the child as it would without, which is the best that can be done there.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()
    signal_number = int(sig)

    def set_parent_death_signal() -> None:
        """In the child, before exec (the setting survives exec).

        If the parent died between fork and the prctl call, no signal will ever come:
        the child was already handed to another parent. It then exits at once instead
        of running on unwatched.
        """
        if prctl(PR_SET_PDEATHSIG, signal_number, 0, 0, 0) != 0:
            return  # refused (an odd kernel): the child runs as it would without
        if os.getppid() != parent:
            os._exit(1)

    return set_parent_death_signal
