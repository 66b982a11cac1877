"""`normswap bench kernels`: the CLI runs, reports every implementation, and refuses bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers import VirtualClock

from normswap.benchmarks import norm_kernels as _bench
from normswap.cli.bench_command import bench

Case, format_markdown, run_benchmark = _bench.Case, _bench.format_markdown, _bench.run_benchmark


def test_bench_kernels_json_and_files(tmp_path):
    out = tmp_path / "res" / "k.json"
    md = tmp_path / "res" / "k.md"
    r = CliRunner().invoke(
        bench,
        [
            "kernels",
            "--quick",
            "--shapes",
            "64x32,3x7",
            "--repeats",
            "2",
            "--json",
            "--out",
            str(out),
            "--markdown",
            str(md),
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data == json.loads(out.read_text())
    # 2 shapes × 1 dtype × 2 variants × 2 modes, each with its four implementations
    assert len(data["rows"]) == 8
    for row in data["rows"]:
        names = set(row["impls"])
        assert names in (
            {"layer_norm", "torch_rms_norm", "normswap", "normswap_weight"},
            {"add_layer_norm", "add_torch_rms_norm", "add_normswap", "normswap_fused"},
        )
        for m in row["impls"].values():
            assert m["median_ms"] > 0 and m["min_ms"] <= m["median_ms"] and m["gbps"] > 0
        ln = row["impls"]["layer_norm" if row["variant"] == "plain" else "add_layer_norm"]
        assert ln["vs_layer_norm"] == 1.0
    assert data["normswap_backend"] in ("cpu", "composite")
    text = md.read_text()
    assert "| 64×32 | float32 | fwd+bwd |" in text and "normswap_fused" in text
    assert not list(tmp_path.glob("res/.*tmp*")), "temporary files left behind"


def test_nominal_bytes():
    import torch

    assert Case(8, 16, torch.bfloat16, "plain", "fwd").nominal_bytes() == 2 * 8 * 16 * 2
    assert Case(8, 16, torch.bfloat16, "plain", "fwd+bwd").nominal_bytes() == 5 * 8 * 16 * 2
    assert Case(8, 16, torch.float32, "residual", "fwd").nominal_bytes() == 4 * 8 * 16 * 4
    assert Case(8, 16, torch.float32, "residual", "fwd+bwd").nominal_bytes() == 8 * 8 * 16 * 4


def test_run_benchmark_forward_only_markdown():
    res = run_benchmark("cpu", dtypes=["bfloat16"], shapes=[(32, 48)], repeats=1, modes=("fwd",), residual=False)
    assert [(r["mode"], r["variant"], r["dtype"]) for r in res["rows"]] == [("fwd", "plain", "bfloat16")]
    assert res["backward"] == [] and "goals" not in res
    assert "| 32×48 | bfloat16 | fwd |" in format_markdown(res)


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--shapes", "64by32"], "ROWSxHIDDEN"),
        (["--shapes", "0x32"], "positive"),
        (["--dtypes", "float8"], "float8"),
        (["--repeats", "0"], "at least 1"),
    ],
)
def test_bench_kernels_rejects_bad_options(args, msg, capsys):
    from normswap.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "kernels", "--quick", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_measured_times_follow_a_known_slowdown(monkeypatch):
    """The timings measure the implementation they name: each call costs a known virtual 0.1 ms,
    torch_rms_norm's a known 4 ms more; it comes out exactly 4 ms slower per call and its ratio to
    LayerNorm says so, while the others (the null control) measure exactly alike (a benchmark that
    timed the wrong thing, or mixed the names up, fails this)."""
    cost, delay = 1e-4, 4e-3
    clock = VirtualClock()
    monkeypatch.setattr(_bench, "time", clock)
    real = _bench._impl_fns

    def costed(fn, seconds):
        return lambda x, r: (clock.advance(seconds), fn(x, r))[1]

    def with_slow_torch_rms_norm(case, w, b):
        fns = real(case, w, b)
        return {name: costed(fn, cost + (delay if name == "torch_rms_norm" else 0.0)) for name, fn in fns.items()}

    monkeypatch.setattr(_bench, "_impl_fns", with_slow_torch_rms_norm)
    res = run_benchmark(
        "cpu", dtypes=["float32"], shapes=[(16, 64)], repeats=12, modes=("fwd",), residual=False, tiny=False,
        budget=1e9,  # virtual seconds: the pairs stop at 12, not at the budget
    )  # fmt: skip
    (row,) = res["rows"]
    impls = row["impls"]
    assert impls["torch_rms_norm"]["min_ms"] == pytest.approx((cost + delay) * 1e3, rel=1e-6)
    assert impls["torch_rms_norm"]["median_ms"] == pytest.approx((cost + delay) * 1e3, rel=1e-6)
    assert impls["torch_rms_norm"]["vs_layer_norm"] == pytest.approx((cost + delay) / cost, rel=1e-6)
    # null control: the untouched implementations measure exactly their known cost, alike
    for name in ("layer_norm", "normswap", "normswap_weight"):
        assert impls[name]["median_ms"] == pytest.approx(cost * 1e3, rel=1e-6), (name, impls[name])
        assert impls[name]["vs_layer_norm"] == pytest.approx(1.0, rel=1e-6), (name, impls[name])
    # the decision: the paired speed ratio calls the slowed one slower, the null control no difference
    assert impls["torch_rms_norm"]["speed"]["verdict"] == "slower"
    assert impls["torch_rms_norm"]["speed"]["ratio"] == pytest.approx(cost / (cost + delay), rel=1e-6)
    assert impls["normswap"]["speed"]["verdict"] == "no measurable difference"
    assert row["null"]["verdict"] == "no measurable difference" and row["null"]["pairs"] == 12
    assert row["null"]["stop_reason"] in ("converged", "max_pairs") and impls["layer_norm"]["speed"] is None


def test_bench_kernels_on_its_defaults_reports_every_row_with_its_null_control(tmp_path):
    """The default dtypes, modes, residual rows and tiny rows, at a budget of 0 s (one round of pairs
    per row) and one small shape in place of the default large ones (test-sized)."""
    out = tmp_path / "k.json"
    r = CliRunner().invoke(bench, ["kernels", "--budget", "0", "--shapes", "64x256", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert len(data["rows"]) == len(_bench.CPU_DTYPES) * 2 * 2
    assert len(data["tiny"]) == 2 * len(_bench.TINY_ROWS) * len(_bench.TINY_HIDDEN)
    for row in data["rows"]:
        assert row["null"]["stop_reason"] == "budget" and row["null"]["pairs"] == 1
        # one pair decides nothing
        assert all(
            m["speed"] is None or m["speed"]["verdict"] == "no measurable difference" for m in row["impls"].values()
        )
    assert set(data["tiny"][0]["null"]) == {"LayerNorm_module", "layer_norm"}
    # the CUDA path's host work, kernel stubbed: every tiny shape, the modules bound as on CUDA
    assert len(data["host_path"]) == len(_bench.TINY_ROWS) * len(_bench.TINY_HIDDEN)
    for t in data["host_path"]:
        assert set(t["impls"]) == set(_bench.HOST_IMPLS) and t["null"]["pairs"] == 1
        assert t["impls"]["RMSNorm_module"]["ran"] == ["native"]
    assert "host path of a CUDA call" in r.stdout
    assert "null control" in r.output and "| null control |" in r.stdout


def test_deadline_skips_the_rows_that_would_end_past_it_and_still_writes_the_tables(monkeypatch):
    """--deadline (a GPU run's step limit): on a virtual clock every big row costs 10 s and every tiny row
    2 s; with 25 s, two big rows run (the third would end at 30 s), then the tiny rows that still fit
    (judged by their own kind's length); the rest are listed, and the tables and `auto`'s choices are
    written as usual. Negative control: without a deadline every row runs."""
    clock = VirtualClock()
    monkeypatch.setattr(_bench, "time", clock)
    real_case, real_fns = _bench.time_case, _bench._impl_fns

    def big_row(*args, **kwargs):  # measured for real, on the virtual clock: 0.1 ms a call
        clock.advance(10.0)
        return real_case(*args, **kwargs)

    def tiny_row(*args, **kwargs):  # a stand-in: what a tiny row holds is test_bench_kernels_on_its_defaults'
        clock.advance(2.0)
        return {
            n: {"median_us": 1.0, "min_us": 1.0, "vs_layer_norm": 1.0, "speed": None} for n in _bench.TINY_IMPLS
        }, {}

    def costed(case, w, b):
        return {n: (lambda x, r, fn=fn: (clock.advance(1e-4), fn(x, r))[1]) for n, fn in real_fns(case, w, b).items()}

    monkeypatch.setattr(_bench, "time_case", big_row)
    monkeypatch.setattr(_bench, "time_tiny", tiny_row)
    monkeypatch.setattr(_bench, "_impl_fns", costed)
    kw = dict(dtypes=["float32"], shapes=[(16, 32), (16, 64)], repeats=1, modes=("fwd",), budget=0, quick=True)
    res = run_benchmark("cpu", deadline=25.0, **kw)
    assert [(r["hidden"], r["variant"]) for r in res["rows"]] == [(32, "plain"), (32, "residual")]
    assert res["skipped"] == ["16x64 float32 plain fwd", "16x64 float32 residual fwd"]
    assert len(res["tiny"]) == 2 and "auto_choices" in res  # 20 s + 2 x 2 s; the tiny rows had room
    assert "not measured (they would have ended past the 25 s deadline): 16x64 float32 plain fwd" in format_markdown(
        res
    )
    whole = run_benchmark("cpu", **kw)
    assert len(whole["rows"]) == 4 and whole["skipped"] == [] and "not measured" not in format_markdown(whole)
