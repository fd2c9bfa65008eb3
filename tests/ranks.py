"""Running a multi-process command (``torch.distributed.run`` on gloo) from a test, once more if a rank died in
native code.

Why a second run: in one CI run (2026-12-05, 2 cores) rank 0 of ``docs/scripts/fsdp2.py check`` was killed by
SIGSEGV during its first gradseam row's step under FSDP2 (the other rank, inside an all-gather, then saw "Connection
closed by peer"); the same command passed 25 times in a row on a 2-core machine beside up to three busy processes,
and every earlier CI run passed it. Where it came from is not known: the script now enables ``faulthandler``, so the
next one prints every thread's Python stack. So a run that ends with a rank killed by a signal (SIGSEGV, SIGBUS,
SIGABRT, SIGILL) runs once more, with a warning carrying the first run's tail (that stack included), which the test
summary shows: a crash that comes back is seen, not hidden, and one that comes back twice fails the test. A rank
that fails any other way (an assertion, an exception, a wrong result) is never run again: the first run is the result.
"""

from __future__ import annotations

import re
import subprocess
import warnings
from collections.abc import Callable
from typing import Any

# torch.distributed.run's failure report: "exitcode  : -11 (pid: ...)" and "Signal 11 (SIGSEGV) received by PID ..."
NATIVE_CRASH = re.compile(r"exitcode\s*:\s*-(4|6|7|11)\b|\(SIG(SEGV|BUS|ABRT|ILL)\)")


def native_crash(done: subprocess.CompletedProcess) -> bool:
    """Whether a rank of ``done`` was killed by a signal of a native crash (not a Python failure)."""
    return done.returncode != 0 and bool(NATIVE_CRASH.search(f"{done.stdout or ''}\n{done.stderr or ''}"))


def run_ranks(command: Callable[[], list[str]], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(command(), capture_output=True, text=True, **kwargs)``, once more after a native crash.
    ``command`` is called for each run: a second run takes a fresh rendezvous port (the first one's may linger)."""
    cmd = command()
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if native_crash(done):
        warnings.warn(f"a rank of {' '.join(cmd[-6:])} died in native code (exit {done.returncode}); running it once "
                      f"more. Its output's tail:\n{(done.stdout or '')[-1500:]}\n{(done.stderr or '')[-3000:]}",
                      stacklevel=2)
        done = subprocess.run(command(), capture_output=True, text=True, **kwargs)
    return done
