"""Crash gates: named points where a test can make this process SIGKILL itself.

DEX_ENGINE_CRASH_AT="<gate>:<k>" kills the process on the k-th crossing of <gate> (k defaults to 1).
DEX_ENGINE_GATE_LOG=<path> appends "<pid> <gate>" per crossing, so a test can prove the gate it
targets was reached. With neither set, a gate is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading

CLAIMED = "worker.claimed"  # attempt handed to this worker, handler not yet called
BEFORE_COMMIT = "worker.before_commit"  # handler returned, result not yet sent to the store
INSIDE_COMMIT = "store.inside_commit"  # inside the commit transaction, before COMMIT
AFTER_COMMIT = "worker.after_commit"  # commit acknowledged
INSIDE_DELETE = "store.inside_delete"  # inside delete_flow's transaction, every row deleted, before COMMIT
# A pure Execute run inside another commit (Step.pure_execute) crosses only that commit's gates.
HOUSEKEEPING = "worker.housekeeping"  # inside housekeeping (recovery of earlier crashes)

_crash_at: dict[str, int] = {}
_counts: dict[str, int] = {}
_lock = threading.Lock()
_log_path = os.environ.get("DEX_ENGINE_GATE_LOG")


def _load() -> None:
    spec = os.environ.get("DEX_ENGINE_CRASH_AT", "")
    for item in filter(None, spec.split(",")):
        name, _, k = item.partition(":")
        _crash_at[name] = int(k or "1")


_load()

# False in production: callers test it before calling gate(), so a gate costs one attribute read.
ACTIVE = bool(_crash_at) or _log_path is not None


def gate(name: str) -> None:
    if not ACTIVE:
        return
    # One crossing at a time, the kill included: gates are crossed on the event loop and on store
    # threads, and no other thread's crossing may be counted or logged after the one that kills.
    with _lock:
        count = _counts.get(name, 0) + 1
        _counts[name] = count
        if _log_path is not None:
            # Closed before a kill: the line is then the kernel's, which a SIGKILL cannot lose.
            with open(_log_path, "a") as f:
                f.write(f"{os.getpid()} {name}\n")
        if _crash_at.get(name) == count:
            os.kill(os.getpid(), signal.SIGKILL)
