"""What this machine is doing: the CPUs this process may run on and the load average, read the same
way by every measurement that records how busy the machine was (the study's load gate, eval's speed
setup, the kernels' autotune table)."""

from __future__ import annotations

import os


def usable_cpus() -> int | None:
    """The CPUs this process may run on (its affinity mask where the OS has one, else the count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def load_average(ndigits: int | None = 2) -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (rounded to ``ndigits``; None: as read), or None where
    the OS has none."""
    try:
        loads = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return [v if ndigits is None else round(v, ndigits) for v in loads]
