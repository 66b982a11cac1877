"""YAML and JSON from users go through one bounded loader (normswap/bounded_load.py): regular files
only, a size cap, a nesting cap, YAML alias expansion bounded (issue #29, case 11 and the loader
rule). Each refusal is one line; each test has a control that the ordinary file still loads."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import checked_run

from normswap import bounded_load
from normswap.bounded_load import BoundedLoadError

REPO = Path(__file__).resolve().parents[1]
GPT2_FAMILY = REPO / "normswap" / "architectures" / "data" / "gpt2.yaml"


def _nested_aliases(levels: int, fanout: int = 10) -> str:
    """GPT-2's family file with an alias bomb inside a test config (a place the schema passes through
    to the description written into config.json): fanout**levels strings in under 1.2 KB."""
    head = GPT2_FAMILY.read_text().split("test_configs:")[0]
    bomb = ["&b0 [" + ", ".join(["gpt2"] * fanout) + "]"]
    bomb += [f"&b{i} [" + ", ".join([f"*b{i - 1}"] * fanout) + "]" for i in range(1, levels)]
    return (
        head + "test_configs:\n  - {n_layer: 2, n_embd: 64, n_head: 4, vocab_size: 256, n_positions: 64, "
        f"junk: [{', '.join(bomb)}]}}\n"
    )


# -- the loader itself ----------------------------------------------------------------------------


def test_regular_files_load_and_everything_else_is_named(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"a": [1, 2, {"b": "c"}]}))
    assert bounded_load.load_json(good) == {"a": [1, 2, {"b": "c"}]}  # control: a plain file loads
    link = tmp_path / "link.json"
    link.symlink_to(good)
    with pytest.raises(BoundedLoadError, match="is a symbolic link"):
        bounded_load.load_json(link)  # a link found in a directory is never followed ...
    assert bounded_load.load_json(link, follow=True) == {"a": [1, 2, {"b": "c"}]}  # ... one the user named is
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    with pytest.raises(BoundedLoadError, match="is a character device, not a regular file"):
        bounded_load.load_json(zero, follow=True)  # followed, but what it reaches must be a plain file
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(BoundedLoadError, match=r"is a FIFO \(named pipe\)"):
        bounded_load.load_json(fifo)  # named, never opened for a read that would block
    with pytest.raises(BoundedLoadError, match="is a directory"):
        bounded_load.load_yaml(tmp_path)


def test_size_and_nesting_are_capped(tmp_path):
    big = tmp_path / "big.json"
    big.write_text("[" + "1," * 600 + "1]")
    assert len(bounded_load.load_json(big, max_bytes=2000)) == 601  # control: under the cap
    with pytest.raises(BoundedLoadError, match="1,203 bytes; the file is at most 1,000 bytes"):
        bounded_load.load_json(big, max_bytes=1000)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 65 + "]" * 65)
    with pytest.raises(BoundedLoadError, match="nested more than 64 levels"):
        bounded_load.load_json(deep)
    deep.write_text("[" * 5000 + "]" * 5000)  # deeper than Python's own recursion: still one line
    with pytest.raises(BoundedLoadError, match="nested more than 64 levels"):
        bounded_load.load_json(deep)
    deep.write_text("[" * 64 + "]" * 64)
    value, depth = bounded_load.load_json(deep), 1  # control: 64 levels load
    while value:
        value, depth = value[0], depth + 1
    assert depth == 64
    yaml_deep = tmp_path / "deep.yaml"
    yaml_deep.write_text("[" * 3000 + "]" * 3000)
    with pytest.raises(BoundedLoadError, match="nested more than"):
        bounded_load.load_yaml(yaml_deep)


def test_yaml_aliases_are_bounded_cycles_refused_and_modest_sharing_kept(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
    )
    assert len(bomb) < 600  # 10**9 strings in a few hundred bytes
    with pytest.raises(BoundedLoadError, match="aliases expand to more than 100,000 values"):
        bounded_load.parse_yaml(bomb, "bomb.yaml")
    shared = "ft: &ft {steps: 7, lr: 0.1}\na: *ft\nb: *ft\n"
    assert bounded_load.parse_yaml(shared, "s.yaml") == {"ft": {"steps": 7, "lr": 0.1}} | {
        "a": {"steps": 7, "lr": 0.1},
        "b": {"steps": 7, "lr": 0.1},
    }
    with pytest.raises(BoundedLoadError, match="refers to its own anchor"):
        bounded_load.parse_yaml("a: &a [1, *a]\n", "cycle.yaml")
    with pytest.raises(BoundedLoadError, match="invalid YAML at line 2"):
        bounded_load.parse_yaml("a: [unclosed\n", "broken.yaml")
    with pytest.raises(BoundedLoadError, match="could not determine a constructor"):
        bounded_load.parse_yaml("a: !!python/object/apply:os.system [echo hi]\n", "evil.yaml")  # safe tags only


# -- case 11: --family-file, through the real command ----------------------------------------------

CHILD = r"""
import contextlib, io, json, resource, signal, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a hostile input must fit in 2 GiB
from normswap.cli.main import main

def alarm(*_):
    raise TimeoutError("still running after 300 s")

signal.signal(signal.SIGALRM, alarm)
out = {}
for name, family, dest in json.loads(sys.argv[1]):
    err = io.StringIO()
    signal.alarm(300)  # a guard against a hang (the FIFO), not a timing: the first command also imports torch
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main(["convert", "normswap:kjv-gpt2", dest, "--family-file", family, "--no-verify"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:
        code, _ = 99, err.write(f"{type(e).__name__}: {e}\n")
    finally:
        signal.alarm(0)
    out[name] = [code, err.getvalue()]
print(json.dumps(out))
"""


def test_hostile_family_files_are_refused_in_one_line_within_bounds(tmp_path):
    """`--family-file /dev/zero` once read until MemoryError, a FIFO hung, 6 nested aliases wrote a 37 MB
    config.json and 9 ran past ten minutes. Each is now one line and a non-zero exit, under a 2 GiB
    address-space cap; the same family written out plainly still converts (the control)."""
    fifo = tmp_path / "family.fifo"
    os.mkfifo(fifo)
    six, nine = tmp_path / "six.yaml", tmp_path / "nine.yaml"
    six.write_text(_nested_aliases(6))
    nine.write_text(_nested_aliases(9))
    assert six.stat().st_size < 1000 and nine.stat().st_size < 1200
    plain = tmp_path / "gpt2-copy.yaml"
    plain.write_text(GPT2_FAMILY.read_text())
    cases = [
        ("zero", "/dev/zero", "a character device"),
        ("fifo", str(fifo), "a FIFO (named pipe)"),
        ("six", str(six), "aliases expand to more than"),
        ("nine", str(nine), "aliases expand to more than"),
        ("plain", str(plain), None),
    ]
    proc = checked_run(
        [sys.executable, "-c", CHILD, json.dumps([(n, f, str(tmp_path / f"out-{n}")) for n, f, _ in cases])],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "NORMSWAP_CPU_KERNEL": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, family, expected in cases:
        code, err = results[name]
        if expected is None:  # the control: the ordinary family file converts
            assert code == 0 and "using the family file" in err, err[-1000:]
            assert (tmp_path / f"out-{name}" / "config.json").stat().st_size < 100_000
            continue
        lines = [ln for ln in err.strip().splitlines() if ln]
        assert code not in (0, 99), (name, err[-1000:])
        assert len(lines) == 1 and expected in lines[0] and family in lines[0], (name, err[-1000:])
        assert not (tmp_path / f"out-{name}").exists()
