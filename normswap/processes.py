"""Every process normswap starts ends with the command that started it.

One mechanism for every spawner (the study's unit workers, the survey's pool, the compatibility
matrix's row children, anything a bench runs):

- ``child_started()`` runs first in each child normswap starts: the child leaves the terminal's
  process group (a Ctrl-C reaches the command, which ends its children, instead of printing a
  KeyboardInterrupt traceback from every worker), takes SIGTERM's default action (it ends at once;
  a forked child would otherwise inherit the command's handler and print its line too), and is
  killed by the kernel if the command dies first, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``).
- ``end_children()`` ends every process below this one, found by walking the process tree (so a
  child's own children, a compile worker or a subprocess a library started, go too): SIGTERM, a
  short grace, then SIGKILL. The command's signal handlers call it before unwinding, so no worker
  trains on after the command says it stopped.
- ``stop_on_signals()`` installs those handlers (the CLI's entry point): the first SIGTERM or
  SIGINT ends the children and unwinds with one line (staging removed, lock released); a second
  one ends the children and leaves at once, with no traceback.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

GRACE_SECONDS = 3.0  # what a child gets after SIGTERM before SIGKILL
_PR_SET_PDEATHSIG = 1
_stopping = {"signal": None}


def child_started() -> None:
    """Call first in every process normswap starts (an initializer, a process target)."""
    try:
        os.setpgid(0, 0)
    except OSError:  # already a group leader, or not permitted: the tree walk still finds it
        pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command decides what a Ctrl-C means
    import multiprocessing

    started_by = multiprocessing.parent_process()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if started_by is not None and os.getppid() != started_by.pid:  # it died before the death signal was armed
        os._exit(1)


def end_children(grace: float = GRACE_SECONDS) -> int:
    """End every process below this one (SIGTERM, then SIGKILL after ``grace`` s); returns how many."""
    import psutil

    try:
        procs = [p for p in psutil.Process().children(recursive=True) if not _is_resource_tracker(p)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    alive = _wait_ended(procs, grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    _wait_ended(alive, grace)
    _reap()
    return len(procs)


def _wait_ended(procs, timeout: float) -> list:
    """The processes still running after up to ``timeout`` s. A child that ended is left a zombie for
    whoever started it to collect (psutil's wait would reap it, and multiprocessing, which then finds no
    exit status, would take it for alive and wait on it forever)."""
    import time

    import psutil

    def running(p):
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    end = time.monotonic() + timeout
    alive = [p for p in procs if running(p)]
    while alive and time.monotonic() < end:
        time.sleep(0.05)
        alive = [p for p in alive if running(p)]
    return alive


def _is_resource_tracker(p) -> bool:
    """multiprocessing's resource tracker ignores SIGTERM and ends by itself when this process does, after
    freeing what the workers left; killed, it leaves that behind and prints tracebacks."""
    import psutil

    try:
        return "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _reap() -> None:
    """Collect what multiprocessing started (so its exit handler does not wait on the dead)."""
    import multiprocessing

    multiprocessing.active_children()


def _handle(signum, frame):
    if _stopping["signal"] is not None:  # a second signal: now, with nothing more to say
        end_children(grace=0.5)
        os._exit(128 + signum)
    _stopping["signal"] = signum
    if signum == signal.SIGINT:  # the CLI says "interrupted" once it has unwound
        end_children()
        raise KeyboardInterrupt
    # to the terminal's stderr even while a library's output is redirected away (the CPU kernel's build)
    print(f"normswap: stopped by {signal.Signals(signum).name}", file=sys.__stderr__ or sys.stderr, flush=True)
    end_children()
    raise SystemExit(128 + signum)


def stop_on_signals():
    """SIGTERM and SIGINT end this command and every process it started (see the module's doc);
    returns the function that puts the handlers found back (a program that runs several commands in
    one process gets its own handlers back after each).

    Installed only from the main thread and only over the default handlers, so a program that
    embeds the CLI keeps its own."""
    found = {}
    if threading.current_thread() is threading.main_thread():
        for sig, default in ((signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.default_int_handler)):
            if signal.getsignal(sig) is default:
                found[sig] = signal.signal(sig, _handle)

    def restore():
        for sig, old in found.items():
            signal.signal(sig, old)
        _stopping["signal"] = None

    return restore
