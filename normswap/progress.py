"""Progress lines for long commands, at a steady interval where nobody watches a terminal.

In a terminal a command shows what it does as it goes (and the fine-tune a progress bar). In a log,
CI or under ``nohup`` a bar is noise and a silent stretch of minutes looks like a hang, so every long
command (convert, finetune, eval report/speed/ppl, run, demo) passes its messages through one
:class:`Heartbeat`: each message is printed as it comes, and while none comes the latest one is
repeated every ``EVERY`` seconds with the time elapsed — "still: perplexity: healed (40 s)". The
fine-tune's steps update it silently (:func:`step_status`), so a log gets one line per interval with
the step, the loss and the time left, not one per step.

The clock and the interval are parameters, so tests drive :meth:`Heartbeat.tick` with a fake clock
instead of sleeping.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import threading
import time
from collections.abc import Callable

EVERY = 10.0  # seconds between progress lines when nothing else was said (readable in logs and CI)

# What a terminal acts on instead of showing: C0 controls but newline and tab (ESC starts sequences
# that set the window title or erase a line, CR returns over what was printed, BEL rings), DEL, C1
# controls (U+009B is a one-character CSI on some terminals) and the bidirectional overrides that
# reorder what follows them.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """``text`` with every control character written out as ``\\uXXXX``: a model directory named
    ``m\\x1b]0;owned\\x07`` prints as ``m\\u001b]0;owned\\u0007``, never as a title change. The form is
    a JSON escape too, so ``--json`` output stays valid JSON (it decodes to the name)."""
    return _CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


class TerminalSafe(io.TextIOBase):
    """A text stream that writes what it is given through :func:`terminal_safe`: the one place every
    line normswap prints passes (``escape_standard_streams`` puts it in front of stdout and stderr for
    the life of a command). It has no ``buffer``, so nothing (click included) writes past it."""

    def __init__(self, inner):
        self.inner = inner

    def write(self, text) -> int:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        self.inner.write(terminal_safe(text))
        return len(text)

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self.inner.flush()

    def isatty(self) -> bool:
        return _is_terminal(self.inner)

    def fileno(self) -> int:
        return self.inner.fileno()

    @property
    def encoding(self):
        return getattr(self.inner, "encoding", "utf-8")

    @property
    def errors(self):
        return getattr(self.inner, "errors", "strict")


def escape_standard_streams() -> Callable[[], None]:
    """Put :class:`TerminalSafe` in front of ``sys.stdout`` and ``sys.stderr``; returns the undo."""
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, TerminalSafe) and sys.stdout is not None:
        sys.stdout = TerminalSafe(sys.stdout)
    if not isinstance(sys.stderr, TerminalSafe) and sys.stderr is not None:
        sys.stderr = TerminalSafe(sys.stderr)

    def restore() -> None:
        sys.stdout, sys.stderr = saved

    return restore


def unescaped(stream):
    """The stream behind a :class:`TerminalSafe`: only for a progress bar that draws with its own
    carriage returns and shows no name (tqdm)."""
    return stream.inner if isinstance(stream, TerminalSafe) else stream


def stderr_lines(prefix: str) -> Callable[[str], None]:
    """Print ``prefix + line`` to this process's stderr as it is now, even while a library later
    sends file descriptor 2 to a log of its own (lm-eval's output goes to lm_eval.log, our progress
    must not go with it): a duplicate of the descriptor is written to."""
    try:
        stream = os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
    except (
        AttributeError,
        OSError,
        ValueError,
        io.UnsupportedOperation,
    ):  # a stream without a descriptor (tests, IDEs)
        stream = sys.stderr

    def emit(line: str) -> None:
        stream.write(terminal_safe(f"{prefix}{line}") + "\n")
        stream.flush()

    return emit


def command_lines(command: str) -> Callable[[str], None]:
    """Progress lines of ``normswap COMMAND`` on stderr, as every command prefixes them:
    ``normswap eval report: loading ...`` (one prefix rule, CONVENTIONS.md)."""
    return stderr_lines(f"normswap {command}: ")


_ACTIVE: list[Heartbeat] = []  # the heartbeats of the commands running in this process, innermost last


@contextlib.contextmanager
def announced(msg: str):
    """A long step that starts deep inside a command's own step (the first build of the C++ kernel
    inside "verifying"): said now, through the running command's heartbeat so that its repeated
    lines name it ("still: building ..." rather than "still: verifying ..."), or on stderr where no
    command runs; the command's own status is repeated again once it ends."""
    beat = _ACTIVE[-1] if _ACTIVE else None
    if beat is None:
        print(f"normswap: {msg}", file=sys.stderr, flush=True)
        yield
        return
    with beat._lock:
        before = beat.status
    beat.say(msg)
    try:
        yield
    finally:
        with beat._lock:
            if beat.status == msg:  # nothing newer was said meanwhile
                beat.status = before


def step_status(step: int, total: int, elapsed: float, loss: float | None = None, *, start: int = 0) -> str:
    """``step 40/100  loss 3.201  (12 s, ~18 s left)``: one training step's progress line.

    ``elapsed``: seconds since step ``start`` (a resumed run's first step is start + 1), so the time
    left is extrapolated from the steps this process ran, not from ones a killed run did."""
    done = step - start
    left = f", ~{elapsed / done * (total - step):.0f} s left" if done > 0 else ""
    return (
        f"step {step}/{total}"
        + (f"  loss {loss:.3f}" if isinstance(loss, (int, float)) else "")
        + f"  ({elapsed:.0f} s{left})"
    )


class StepProgress:
    """A fine-tune's ``after_step`` hook: each step becomes the status of a :class:`Heartbeat`
    (``update``), with the loss the trainer logged for it, read from ``run_dir``'s log only when the
    line is due. ``start`` is its ``started`` hook: the trainer says there which step it starts
    after and which is the last, since only it knows a resumed run's recorded target (``total``
    is what the command line said, a guess until then)."""

    def __init__(self, run_dir, total: int, update: Callable, *, clock: Callable[[], float] = time.monotonic):
        self.run_dir, self.total, self.update, self.clock = run_dir, total, update, clock
        self.first = 0
        self.t0 = clock()

    def start(self, first: int, total: int) -> None:
        self.first, self.total, self.t0 = first, total, self.clock()

    def __call__(self, step: int) -> None:
        elapsed = self.clock() - self.t0

        def line() -> str:
            row = next((r for r in reversed(self.run_dir.rows()) if r.get("step") == step), {})
            return step_status(step, self.total, elapsed, row.get("loss"), start=self.first)

        self.update(line)


class Heartbeat:
    """Says each message at once; repeats the latest status every ``every`` seconds of silence.

    ``emit``: where lines go (a command's own prefix included); ``enabled``: repeat at all (default:
    only when stderr is not a terminal). Use as a context manager: a daemon thread calls
    :meth:`tick` about once a second while the command runs.
    """

    def __init__(
        self,
        emit: Callable[[str], None],
        *,
        every: float | None = None,
        enabled: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.emit, self.every, self.clock = emit, EVERY if every is None else every, clock
        self.enabled = (not _is_terminal(sys.stderr)) if enabled is None else enabled
        self.t0 = self.last = clock()
        self.status: str | Callable[[], str] | None = None
        self._fresh = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def say(self, msg: str) -> None:
        """Print ``msg`` now; it is also the status repeated while nothing else is said."""
        with self._lock:
            self.status, self.last, self._fresh = msg, self.clock(), False
        self.emit(msg)

    def update(self, status: str | Callable[[], str]) -> None:
        """A new status, printed as it is once the interval since the last line is over (not at
        every call: for per-step updates). A callable is called only when its line is due (e.g. one
        that reads a log)."""
        with self._lock:
            self.status, self._fresh = status, True
        self.tick()  # due already: a step-driven status needs no thread to be printed on time

    def tick(self) -> str | None:
        """The line due now (also emitted), or None: ``every`` seconds since the last line. A status
        from :meth:`update` is printed as it is; a message already said is repeated as ``still: …``
        with the time since the command started."""
        with self._lock:
            now = self.clock()
            if not self.enabled or self.status is None or now - self.last < self.every:
                return None
            self.last = now
            status = self.status() if callable(self.status) else self.status
            line = status if self._fresh else f"still: {status} ({now - self.t0:.0f} s)"
            self._fresh = False
        self.emit(line)
        return line

    def __enter__(self) -> Heartbeat:
        _ACTIVE.append(self)
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="normswap-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(ValueError):
            _ACTIVE.remove(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(max(0.05, min(1.0, self.every))):
            self.tick()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        return False
