"""Tokenizers are data, and slow data is bounded.

A model directory's ``tokenizer.json`` carries regular expressions (the pre-tokenizer's split pattern,
a normalizer's replacements) that the tokenizers library runs with Oniguruma, in Rust. A backtracking
pattern costs up to Oniguruma's retry limit at every position of the text (about 0.1 s a character):
hours for a test text, in one library call that no Python signal handler can interrupt, because
handlers run only on the main thread, between bytecodes. A pattern past the retry limit makes the
library panic (``pyo3_runtime.PanicException``, a ``BaseException``), and Rust's panic hook prints
its own lines on stderr first.

So every tokenizer normswap loads has its Rust backend wrapped (``guard``):

- Every encode runs ``encode_batch`` (which releases the GIL) on a helper thread while the main thread
  waits on an event: SIGTERM and Ctrl-C run their handlers at once, and the command unwinds (staging
  removed, lock released) while the Rust call is left to die with the process.
- Each call has a time budget, ``BASE_SECONDS`` plus one second per ``MIN_CHARS_PER_SECOND``
  characters (100 times slower than the slowest normal tokenizer measured here); past it the command
  ends with one line naming the file.
- A panic becomes one line naming the file; what Rust printed on stderr during the call is dropped
  (anything else written to the stderr descriptor during the call is passed on after it).
- On load, a short adversarial probe (long runs without digits, spaces or letters) is tokenized and
  decoded under ``PROBE_SECONDS``: a backtracking pattern is refused before any model loads. The probe runs
  first in the vetting build's child (tokenizer_vet.py), which the kernel ends past its budget; here again,
  on the tokenizer transformers built.
- Decodes run the same way (``decode_batch`` releases the GIL too; a decoder's ``Replace`` pattern runs
  on every token), with a budget of ``BASE_SECONDS`` plus a second per ``MIN_CHARS_PER_SECOND`` ids.
- Every refusal is a :class:`TokenizerRefused`, which no command swallows: a refused tokenizer refuses the
  command. A call past its budget leaves its thread in Rust (a thread cannot be stopped), so the backend
  refuses every later call at once, and the command ends, which ends the thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
from pathlib import Path

from normswap.errors import NormswapError, first_line

BASE_SECONDS = 10.0
MIN_CHARS_PER_SECOND = 20_000
PROBE_SECONDS = 2.0
PROBE = (
    "In the beginning God created the heaven and the earth, and the earth was without form and void; "
    "and darkness was upon the face of the deep. "
    + "a" * 64
    + " "
    + "ab" * 32
    + "\n"
    + " " * 64
    + "0123456789" * 4
    + " "
    + ".,;:!?-" * 8
    + " Übergrößenträger naïve café 東京 "
    + "x" * 48
)


class TokenizerRefused(NormswapError):
    """A tokenizer normswap will not use: it ran past a budget or made the library panic. Unlike a model
    that has no tokenizer, this refuses the command (``load.optional_tokenizer`` passes it on)."""


def guard(tokenizer, where: str):
    """``tokenizer`` (a transformers fast tokenizer) with its Rust backend run under the rules above,
    after the probe; a tokenizer without a Rust backend is returned as it is. ``where`` names the file."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or isinstance(backend, GuardedBackend) or not hasattr(backend, "encode_batch"):
        return tokenizer
    guarded = GuardedBackend(backend, where)
    guarded.probe()
    tokenizer._tokenizer = guarded  # transformers keeps its Rust tokenizer in this attribute
    return tokenizer


def _chars(inputs) -> int:
    n = 0
    for item in inputs:
        if isinstance(item, str):
            n += len(item)
        elif isinstance(item, (list, tuple)):
            n += _chars(item)
    return n


class GuardedBackend:
    """A ``tokenizers.Tokenizer`` whose encodes and decodes run under a time budget on a helper thread;
    everything else reaches the Rust tokenizer itself."""

    __slots__ = ("_backend", "_where", "_refused")

    def __init__(self, backend, where: str):
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_where", where)
        object.__setattr__(self, "_refused", None)  # the line of the call that ran past its budget

    def __getattr__(self, name):
        if name in GuardedBackend.__slots__:
            raise AttributeError(name)
        return getattr(self._backend, name)

    def __setattr__(self, name, value):
        setattr(self._backend, name, value)

    def __reduce__(self):
        return (GuardedBackend, (self._backend, self._where))

    def encode_batch(self, inputs, *args, **kwargs):
        return self._run("encode_batch", _chars(inputs), inputs, *args, **kwargs)

    def encode_batch_fast(self, inputs, *args, **kwargs):
        return self._run("encode_batch_fast", _chars(inputs), inputs, *args, **kwargs)

    def encode(self, sequence, pair=None, is_pretokenized=False, add_special_tokens=True):
        # the library's single encode holds the GIL for its whole run; its batch form does not
        item = sequence if pair is None else (sequence, pair)
        return self.encode_batch([item], is_pretokenized=is_pretokenized, add_special_tokens=add_special_tokens)[0]

    def decode_batch(self, sequences, *args, **kwargs):
        return self._run("decode_batch", sum(len(ids) for ids in sequences), sequences, *args, **kwargs)

    def decode(self, ids, skip_special_tokens=True):
        # the library's single decode holds the GIL for its whole run; its batch form does not
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def probe(self) -> None:
        ids = self._run("encode_batch", len(PROBE), [PROBE], budget=PROBE_SECONDS, add_special_tokens=False)[0].ids
        self._run("decode_batch", len(ids), [ids], budget=PROBE_SECONDS, skip_special_tokens=False)

    def _run(self, method: str, chars: int, *args, budget: float | None = None, **kwargs):
        if self._refused is not None:  # an earlier call is still running in Rust: no second one beside it
            raise TokenizerRefused(self._refused)
        limit = budget if budget is not None else BASE_SECONDS + chars / MIN_CHARS_PER_SECOND
        call = getattr(self._backend, method)
        box: dict = {}
        done = threading.Event()

        def work():
            try:
                box["value"] = call(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - a Rust panic is a BaseException; it is judged below
                box["error"] = e
            finally:
                done.set()

        with _native_stderr_held() as held:
            threading.Thread(target=work, name="normswap-tokenize", daemon=True).start()
            finished = done.wait(limit)  # a signal's handler runs here, on the main thread, at once
            error = box.get("error")
            if finished and error is not None and not isinstance(error, Exception):
                held.drop()  # the panic's own lines: the one line below says it
        if not finished:
            what = "decoding" if method.startswith("decode") else "tokenizing"
            unit = "ids" if method.startswith("decode") else "characters"
            object.__setattr__(
                self,
                "_refused",
                f"{self._where}: {what} {chars:,} {unit} took more than {limit:.0f} s (a normal tokenizer takes well "
                f"under a second): its pre-tokenizer, normalizer or decoder pattern backtracks; normswap does not "
                "use this tokenizer",
            )
            raise TokenizerRefused(self._refused)
        if error is None:
            return box["value"]
        if isinstance(error, Exception):
            raise error
        raise TokenizerRefused(
            f"{self._where}: the tokenizers library failed on this tokenizer ({type(error).__name__}: "
            f"{first_line(error)}); its pre-tokenizer, normalizer or decoder pattern is likely too costly; "
            "normswap does not use this tokenizer"
        ) from None


class _Held:
    def __init__(self, file):
        self.file = file
        self.dropped = False

    def drop(self):
        self.dropped = True


_HOLD = {"lock": threading.Lock(), "file": None}


def _hold_file():
    """One file per process that descriptor 2 points to during a call (made once: a call must stay cheap)."""
    if _HOLD["file"] is None:
        try:
            fd = os.memfd_create("normswap-tokenizer-stderr")
            _HOLD["file"] = os.fdopen(fd, "w+b")
        except (AttributeError, OSError):
            _HOLD["file"] = tempfile.TemporaryFile()
    return _HOLD["file"]


@contextlib.contextmanager
def _native_stderr_held():
    """File descriptor 2 goes to a private file for the call (Rust's panic hook writes there, not
    through Python); afterwards what arrived is written to the real stderr, unless dropped."""
    with _HOLD["lock"]:
        try:
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):
            pass
        try:
            file = _hold_file()
            saved = os.dup(2)
            os.dup2(file.fileno(), 2)
        except OSError:  # no descriptor 2 to borrow: nothing is held
            yield _Held(None)
            return
        held = _Held(file)
        try:
            yield held
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError, AttributeError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            size = os.fstat(file.fileno()).st_size
            if size and not held.dropped:
                file.seek(0)
                data = file.read(1 << 20)
                while data:
                    data = data[os.write(2, data) :]
            if size:
                file.seek(0)
                file.truncate()


def where_of(resolved) -> str:
    """The file a tokenizer's patterns come from, for the one line (its directory when not one file)."""
    path = Path(str(resolved)) / "tokenizer.json"
    return str(path) if path.is_file() else str(resolved)
