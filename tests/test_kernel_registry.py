"""The kernel choice in one table and one chooser (normswap.kernels.implementations, normswap.kernels.choose).

- a record asked for by name that cannot run a call raises one clear line; one picked by `auto`
  that fails falls back to the next;
- a record that does not take a feature (a residual) is never chosen for calls that need it;
- only the kernels package reads NORMSWAP_KERNEL or compares implementation names.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from normswap.errors import NormswapError
from normswap.kernels import choose, rms_norm
from normswap.kernels import implementations as registry
from normswap.kernels.reference import rms_norm_reference
from normswap.modules import RMSNorm
from normswap.testing import kernel_backend, registered_impl

PACKAGE = Path(__file__).resolve().parents[1] / "normswap"


def _planted(name="planted", *, residual=True, bind_fails=False, runs=None):
    """A record like `composite` (correct), first in `auto`'s ranking (see _ranked_first)."""
    base = registry.TABLE["composite"]

    def bind(x, weight, bias, res):
        if bind_fails:
            raise RuntimeError("planted: cannot bind")
        return base.bind(x, weight, bias, res)

    def run(*a):
        if runs is not None:
            runs.append(name)
        return base.run(*a)

    return dataclasses.replace(base, name=name, residual=residual, bind=bind, run=run)


@pytest.fixture
def ranked_first(monkeypatch):
    """`auto`'s measured ranking with the planted record first (the measurement is not what is tested);
    the compiled CPU kernel loaded from the usual cache first (fresh_autotune's empty cache would
    build it again), the rankings kept in memory only."""
    from normswap.kernels import autotune

    registry.cpu_ready()
    monkeypatch.setenv("NORMSWAP_AUTOTUNE", "0")
    monkeypatch.setattr(
        autotune, "ranking", lambda *a, candidates, **k: sorted(candidates, key=lambda c: c != "planted")
    )
    choose.forget()
    yield
    choose.forget()


def test_every_record_says_what_it_runs():
    """The table holds every implementation once, each with its devices, dtypes and features, and
    NORMSWAP_KERNEL accepts exactly `auto` and the records' names."""
    assert set(registry.TABLE) == {"cpu", "triton", "native", "composite", "torch", "compiled"}
    assert choose.settings() == ("auto", *registry.TABLE)
    for impl in registry.TABLE.values():
        assert impl.devices and impl.dtypes and callable(impl.run) and callable(impl.bind), impl.name
    assert registry.TABLE["cpu"].devices == ("cpu",) and registry.TABLE["triton"].devices == ("cuda",)
    assert torch.float64 in registry.TABLE["torch"].dtypes and torch.float64 not in registry.TABLE["cpu"].dtypes


def test_a_named_record_that_cannot_run_raises(ranked_first):
    """Asked for by name (backend=, or NORMSWAP_KERNEL for its own device type), a record that
    cannot run the call raises one line saying why; the control: `auto` runs the same call."""
    x = torch.randn(3, 32)
    with registered_impl(_planted(bind_fails=True)):
        with pytest.raises(RuntimeError, match="planted: cannot bind"):
            choose.bind(x, None, backend="planted")
        with kernel_backend("planted"), pytest.raises(RuntimeError, match="planted: cannot bind"):
            RMSNorm(32, elementwise_affine=False)(x)
    with registered_impl(_planted(residual=False)):
        with pytest.raises(NormswapError, match="backend='planted' cannot run .*does not take a residual"):
            rms_norm(x, None, residual=torch.randn(3, 32), backend="planted")
        torch.testing.assert_close(rms_norm(x, None, backend="planted"), rms_norm_reference(x))  # control


def test_an_automatic_record_that_fails_falls_back(ranked_first):
    """Picked by `auto` (first in its ranking), a record that fails to bind is skipped and the next one
    runs, correctly. Control: the same record, working, is what runs."""
    x = torch.randn(3, 32)
    with registered_impl(_planted(bind_fails=True)):
        m = RMSNorm(32)
        with torch.no_grad():
            y = m(x)
        assert "planted" not in m.kernels_ran.values() and m.kernels_ran, m.kernels_ran
        torch.testing.assert_close(y, rms_norm_reference(x, m.weight), rtol=1e-5, atol=1e-6)
    with registered_impl(_planted()):  # the control
        m = RMSNorm(32)
        with torch.no_grad():
            m(x)
        assert set(m.kernels_ran.values()) == {"planted"}, m.kernels_ran


def test_a_record_without_a_feature_is_never_chosen_for_calls_that_need_it(ranked_first):
    """A record that takes no residual, first in `auto`'s ranking, runs the plain calls (the control)
    and never a call with a residual, through the functional API or the module."""
    runs = []
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    with registered_impl(_planted(residual=False, runs=runs)):
        m = RMSNorm(32)
        with torch.no_grad():
            y, s = m(x, residual=r)
            y2, _ = rms_norm(x, m.weight, residual=r)
        assert runs == [], runs
        torch.testing.assert_close(y, rms_norm_reference(x + r, m.weight), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(y2, y)
        rms_norm(x, m.weight)  # the control: a plain call runs it
        assert runs == ["planted"]


def test_the_decision_is_taken_once_per_kind(ranked_first, monkeypatch):
    """The functional API asks the chooser once per kind of call; a new kind asks again."""
    asked = []
    real = choose.bind
    monkeypatch.setattr(choose, "bind", lambda *a, **k: asked.append(1) or real(*a, **k))
    with registered_impl(_planted()):
        for _ in range(3):
            rms_norm(torch.randn(2, 32))
        assert len(asked) == 1
        rms_norm(torch.randn(200, 32))  # many rows: another kind
        assert len(asked) == 2


# ------------------------------------------------------------------------------ one place
KERNEL_NAMES = {"auto", "cpu", "triton", "native", "composite", "torch"}


def _outside_kernels(root: Path) -> list[tuple[str, int, str]]:
    """Places in the package outside ``kernels/`` that read NORMSWAP_KERNEL or compare a value with an
    implementation's name (``x == "native"``, ``x in ("cpu", "triton")``, ``match`` on one)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "kernels" or rel.name == "testing.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == "NORMSWAP_KERNEL":
                found.append((str(rel), node.lineno, "reads NORMSWAP_KERNEL"))
            if isinstance(node, ast.Compare) and _names_kernel(node, found, rel):
                continue
    return found


def _names_kernel(node: ast.Compare, found: list, rel: Path) -> bool:
    values = []
    for side in (node.left, *node.comparators):
        if isinstance(side, ast.Constant):
            values.append(side.value)
        elif isinstance(side, (ast.Tuple, ast.List, ast.Set)):
            values += [e.value for e in side.elts if isinstance(e, ast.Constant)]
    names = {v for v in values if isinstance(v, str)}
    if isinstance(node.left, ast.Constant) and all(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
        return False  # a substring of a text ("composite" in a label), not a name compared
    # a comparison against a kernel name counts unless it is plainly about devices or dtypes
    text = ast.unparse(node)
    about_devices = any(w in text for w in (".type", "device", "dtype", "task", "tokens", "mode", "cfg.", "option"))
    if names & (KERNEL_NAMES - {"auto", "torch", "cpu"}) or (names & {"auto", "torch", "cpu"} and not about_devices):
        found.append((str(rel), node.lineno, f"compares with {sorted(names & KERNEL_NAMES)}: {text}"))
        return True
    return False


def test_no_module_outside_kernels_reads_the_setting_or_compares_implementation_names(tmp_path):
    """The done-when line of the kernel choice: the chooser alone reads NORMSWAP_KERNEL and names
    implementations. Control: a planted module that reads the setting and compares a name is found."""
    assert _outside_kernels(PACKAGE) == []
    planted = tmp_path / "normswap"
    (planted / "kernels").mkdir(parents=True)
    (planted / "kernels" / "choose.py").write_text('import os\nNAME = os.environ.get("NORMSWAP_KERNEL")\n')
    (planted / "evaluate").mkdir()
    (planted / "evaluate" / "speed.py").write_text(
        'import os\n\ndef pick(name):\n    if os.environ.get("NORMSWAP_KERNEL") == "auto":\n'
        '        return name == "native"\n    return name in ("cpu", "triton")\n'
    )
    found = _outside_kernels(planted)
    assert sorted((f, line) for f, line, _ in found) == [
        ("evaluate/speed.py", 4),
        ("evaluate/speed.py", 4),
        ("evaluate/speed.py", 5),
        ("evaluate/speed.py", 6),
    ], found
