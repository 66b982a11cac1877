"""A tokenizer is built first in a child process, under a CPU budget, before any library builds it here.

Building a tokenizer runs its data: a ``tokenizer.json`` whose normalizer is a backtracking ``Replace``
pattern, beside a long added token marked ``normalized``, makes the tokenizers library run that pattern over
the token while it *builds* the tokenizer (inside ``from_pretrained``, on the main thread, holding the
interpreter lock): 4.5 s for an 80-character token, 21 s for 300, growing with the square of its length;
no signal handler runs meanwhile, so SIGTERM did nothing. The guard on encodes (tokenizer_guard.py) comes
only after the build.

So ``vet`` builds each tokenizer file transformers may load (``tokenizer.json`` and the versioned files
``tokenizer_config.json`` names), with the added tokens ``tokenizer_config.json`` and ``added_tokens.json``
declare, in a child (``tokenizer_vet_child.py``: a fresh interpreter that imports only ``tokenizers``), then
tokenizes the guard's probe there and decodes it and every added token. The child's CPU time is capped by
the kernel (``RLIMIT_CPU``), so a build that runs away is ended, not waited for; the command waits on it in
Python, so SIGTERM and Ctrl-C end the command (and the child, with every process it started) at once. A
build past ``BUILD_CPU_SECONDS + BUILD_CPU_SECONDS_PER_MIB`` per MiB of the file, a probe past the guard's
``PROBE_SECONDS``, or a panic refuses the tokenizer in one line (:class:`TokenizerRefused`). What passes is
built again here, at the cost the child measured. The child reads the very bytes normswap read (by the
side-file rule), piped to it; a verdict is kept for the process, keyed by each file's identity and time.
This generalises to every slow-build shape, known or not; the shipped tokenizers take about 0.1 s of CPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from normswap.checkpoint.tokenizer_guard import PROBE, PROBE_SECONDS, TokenizerRefused

# CPU seconds a build may take: the fixed part holds the child's start (about 0.15 s: an interpreter and
# the tokenizers library) ten times over; a 150,000-token BPE tokenizer.json (9.4 MiB) builds in 0.6 s
BUILD_CPU_SECONDS = 2.0
BUILD_CPU_SECONDS_PER_MIB = 0.25
# wall-clock backstop for a child that gets no CPU (a loaded machine) or blocks: the CPU cap ends a busy one
WALL_SECONDS = 120.0
CHILD = Path(__file__).with_name("tokenizer_vet_child.py")
_vetted: set = set()  # the keys of the files that passed, in this process


def build_budget(nbytes: int) -> float:
    """The CPU seconds a tokenizer file of ``nbytes`` bytes may take to build."""
    return BUILD_CPU_SECONDS + BUILD_CPU_SECONDS_PER_MIB * nbytes / (1 << 20)


def vet(directory) -> None:
    """Refuse, in one line, a tokenizer in ``directory`` whose build or probe runs away (module doc);
    nothing to do where it has no tokenizer file. Every file is read by the side-file rule."""
    from normswap.checkpoint.side_files import open_inside

    directory = Path(directory)
    files = []
    for name in _tokenizer_files(directory):
        f = open_inside(directory, name)
        if f is None:
            continue
        with f:
            st = os.fstat(f.fileno())
            files.append((name, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), f.read()))
    if not files:
        return
    added = added_tokens(directory)
    key = (str(directory.resolve()), tuple((n, ident) for n, ident, _ in files), json.dumps(added, sort_keys=True))
    if key in _vetted:
        return
    _judge(directory, files, _run_child(directory, files, added))
    _vetted.add(key)


def _tokenizer_files(directory: Path) -> list[str]:
    """``tokenizer.json`` and the versioned tokenizer files ``tokenizer_config.json`` names."""
    from normswap.checkpoint.side_files import read_json_inside

    config = read_json_inside(directory, "tokenizer_config.json")
    listed = config.get("fast_tokenizer_files") if isinstance(config, dict) else None
    names = [n for n in listed if isinstance(n, str) and n and "/" not in n] if isinstance(listed, list) else []
    return list(dict.fromkeys(["tokenizer.json", *names]))


_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def added_tokens(directory: Path) -> list[dict]:
    """The tokens transformers adds to the built tokenizer from ``tokenizer_config.json`` (its
    ``added_tokens_decoder``, named and extra special tokens) and ``added_tokens.json``, as ``AddedToken``
    arguments. A token whose ``normalized`` flag is not given is vetted normalized (the costlier case)."""
    from normswap.checkpoint.side_files import read_json_inside

    found: list = []
    config = read_json_inside(directory, "tokenizer_config.json")
    if isinstance(config, dict):
        decoder = config.get("added_tokens_decoder")
        found += list(decoder.values()) if isinstance(decoder, dict) else []
        found += [config.get(k) for k in _NAMED]
        for k in ("additional_special_tokens", "extra_special_tokens"):
            extra = config.get(k)
            found += list(extra.values()) if isinstance(extra, dict) else extra if isinstance(extra, list) else []
    legacy = read_json_inside(directory, "added_tokens.json")
    found += list(legacy) if isinstance(legacy, dict) else []
    out = []
    for t in found:
        if isinstance(t, str):
            t = {"content": t}
        if not isinstance(t, dict) or not isinstance(t.get("content"), str) or not t["content"]:
            continue
        token = {"content": t["content"], "normalized": True}
        token.update({k: bool(t[k]) for k in _FLAGS if k in t})
        out.append(token)
    return out


def _run_child(directory: Path, files: list, added: list[dict]) -> tuple[list[dict], int | None]:
    """The child's lines and its exit status (None: ended here at the wall-clock backstop)."""
    import tokenizers

    cpu_limit = math.ceil(sum(build_budget(len(data)) + PROBE_SECONDS for _, _, data in files)) + 1
    job = {
        "cpu_limit": cpu_limit,
        "tokenizers_dir": str(Path(tokenizers.__file__).resolve().parents[1]),
        "files": [[name, len(data), build_budget(len(data))] for name, _, data in files],
        "probe_budget": PROBE_SECONDS,
        "added": added,
        "probe": PROBE,
    }
    stdin = json.dumps(job).encode() + b"\n" + b"".join(data for _, _, data in files)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-I", str(CHILD), str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # a panic's own lines: the one line normswap prints says it
        env=env,
        start_new_session=True,  # a terminal's Ctrl-C reaches the command, which ends it (processes.py)
    )
    try:
        # waiting in Python: a signal's handler runs here at once and ends the child (processes.end_children)
        out, _ = proc.communicate(stdin, timeout=WALL_SECONDS)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        out, code = b"", None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = []
    for line in out.decode(errors="replace").splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines, code


def _judge(directory: Path, files: list, result: tuple[list[dict], int | None]) -> None:
    lines, code = result
    steps = {(d.get("file"), d.get("step")): d for d in lines if isinstance(d, dict)}
    for name, _, data in files:
        where = directory / name
        for step, budget in (("build", build_budget(len(data))), ("probe", PROBE_SECONDS)):
            d = steps.get((name, step))
            if d is None:
                raise TokenizerRefused(_unfinished(where, step, budget, code))
            if "error" in d:
                if not d.get("panic"):
                    return  # the library cannot read it at all: transformers says why, in its own words
                raise TokenizerRefused(
                    f"{where}: the tokenizers library failed on this tokenizer ({d['error'].splitlines()[0]}); its "
                    "normalizer, pre-tokenizer or decoder pattern is likely too costly; normswap does not use "
                    "this tokenizer"
                )
            if d["cpu"] > budget:
                raise TokenizerRefused(_slow(where, step, budget))


def _slow(where, step: str, budget: float) -> str:
    if step == "build":
        return (
            f"{where}: building this tokenizer took more than {budget:.1f} s of CPU (a normal one of its size "
            "takes a small fraction of that): its normalizer runs a pattern that backtracks over its added "
            "tokens, or the like; normswap does not use this tokenizer"
        )
    return (
        f"{where}: tokenizing and decoding a {len(PROBE)}-character probe took more than {budget:.0f} s of CPU "
        "(a normal tokenizer takes milliseconds): its pre-tokenizer, normalizer or decoder pattern backtracks; "
        "normswap does not use this tokenizer"
    )


def _unfinished(where, step: str, budget: float, code: int | None) -> str:
    import signal

    if code is None:
        return (
            f"{where}: building and probing this tokenizer did not finish in {WALL_SECONDS:.0f} s; normswap "
            "does not use this tokenizer"
        )
    if code in (-signal.SIGXCPU, -signal.SIGKILL):  # the kernel's CPU cap ended it
        return _slow(where, step, budget)
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    return (
        f"{where}: the tokenizers library ended abnormally on this tokenizer ({how}) while it was "
        f"{'built' if step == 'build' else 'probed'}; normswap does not use this tokenizer"
    )
