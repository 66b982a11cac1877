"""`normswap bench onnx` (#31, #37, #39): exported converted vs exported original in onnxruntime on CPU,
outputs checked before timing, timed by normswap/timing.py with a null control, graphs another user could
have written refused. No wall-clock thresholds: only what the recorded numbers are made of, the decision
path, and that a graph that does not compute the original's function (or is not the user's) is refused."""

import json
import os
import shutil

import pytest
from helpers import tiny_model

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


def _fused(ops: dict) -> int:
    return sum(n for op, n in ops.items() if op.startswith("Skip"))


@pytest.mark.slow  # builds, converts and exports three graphs of a tiny GPT-2 (about a minute)
def test_bench_onnx_on_its_own_defaults(tmp_path, run_cli, monkeypatch):
    """No MODEL: the GPT-2-small-shaped default (here at GPT-2-tiny shape and short), both norm ops,
    every verdict the instrument's own, the converted norms fused at least as often as the original's."""
    from normswap import timing
    from normswap.assets import models
    from normswap.stats import verdicts

    monkeypatch.setattr(models, "GPT2_SMALL", models.GPT2_TINY)  # test-sized: the same path, a smaller config
    out = tmp_path / "onnx.json"
    code, stdout, stderr = run_cli(
        "bench", "onnx", "--budget", "2", "--repeats", "5", "--seq-len", "16", "--min-time", "0", "--save", out,
        "--onnx-norm-op", "simplified", "--onnx-norm-op", "rmsnormalization",
    )  # fmt: skip
    assert code == 0, stderr
    assert "building a GPT-2-small-shaped model" in stderr and "null control" in stdout
    doc = json.loads(out.read_text())
    (r,) = doc["onnx"]
    assert doc["onnxruntime"] and r["graph_optimization_level"] == "ORT_ENABLE_ALL" and r["threads"] == 1
    assert list(r["graphs"]) == ["original", "converted (simplified)", "converted (rmsnormalization)"]
    for name, g in r["graphs"].items():  # outputs match: each converted graph computes the original's function
        assert g["max_abs_logprob_diff_vs_original"] <= (0 if name == "original" else 1e-4)
    # what onnxruntime runs, read from its optimised graph: the default export fused, the portable one not
    fused = {name: g["optimised_norm_ops"] for name, g in r["graphs"].items()}
    assert _fused(fused["converted (simplified)"]) >= _fused(fused["original"]) >= 1
    assert _fused(fused["converted (rmsnormalization)"]) == 0
    assert not {"LayerNormalization", "SkipLayerNormalization"} & set(fused["converted (simplified)"])
    # the decision path: the one instrument's verdicts, from its own intervals and null control
    t, null = r["timing"], r["null_control_over_original"]
    assert t["stop_reason"] in (timing.CONVERGED, timing.BUDGET, timing.MAX_PAIRS) and t["rounds"] >= 5
    assert t["baseline"] == "original" and t["null_name"] == "null control" and t["calls_per_sample"] == 1
    for c in r["over_original"].values():
        assert c["pairs"] == t["rounds"] and c["low"] <= c["ratio"] <= c["high"]
        assert c["verdict"] == verdicts.speed_ratio_verdict(c["low"], c["high"], null["low"], null["high"])
    assert null["verdict"] in (verdicts.NO_DIFFERENCE, verdicts.TOO_NOISY)
    # control: the null control and each converted graph are timed on their own, not copies of the original
    pairs = t["pair_seconds"]
    assert set(pairs) == {"null control", "converted (simplified)", "converted (rmsnormalization)"}
    assert all(any(a != b for a, b in p) for p in pairs.values())
    assert len(r["machine"]["load_before"]) == 3 and len(r["machine"]["load_after"]) == 3
    # every graph (the null control's too) timed in its own sessions, rotated
    assert r["sessions_per_graph"] == 5 and set(t["replicas"].values()) == {5} and len(t["replicas"]) == 4


def test_sessions_are_fewer_when_they_would_not_fit_in_half_the_free_memory(tmp_path, monkeypatch):
    from normswap import devices
    from normswap.benchmarks.onnx_runtime import _sessions_that_fit

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_bytes(b"x" * 1000)
    dirs = {"original": tmp_path / "a", "converted": tmp_path / "b"}
    said = []
    monkeypatch.setattr(devices, "available_memory", lambda device="cpu": 2 * 1.7 * 1000 * 3 * 5)
    assert _sessions_that_fit(5, dirs, 3, said.append) == 5 and not said  # 5 a graph fit exactly
    monkeypatch.setattr(devices, "available_memory", lambda device="cpu": 2 * 1.7 * 1000 * 3 * 2)
    assert _sessions_that_fit(5, dirs, 3, said.append) == 2 and "timing 2" in said[0]
    monkeypatch.setattr(devices, "available_memory", lambda device="cpu": 10)
    assert _sessions_that_fit(5, dirs, 3, said.append) == 1  # never none


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny GPT-2, its conversion, and the two exported (ONNX) plus a copy of the converted export."""
    from normswap.cli.main import main

    root = tmp_path_factory.mktemp("bench-onnx")
    tiny_model("gpt2", 0).save_pretrained(root / "src")

    for args in (
        ("convert", root / "src", root / "conv"),
        ("export", root / "src", root / "orig.onnx", "--format", "onnx"),
        ("export", root / "conv", root / "conv.onnx", "--format", "onnx"),
    ):
        try:
            main([str(a) for a in args])
        except SystemExit as e:
            assert e.code in (0, None), args
    return root


@pytest.mark.slow  # one conversion and two exports (module fixture)
def test_bench_onnx_refuses_a_graph_that_does_not_match(exports, tmp_path, run_cli):
    import numpy as np
    import onnx
    from onnx import numpy_helper

    shutil.copytree(exports / "conv.onnx", tmp_path / "bad.onnx")
    # the tampered graph: the token embedding moved after export (what a bad exporter or a swapped file gives)
    path = tmp_path / "bad.onnx" / "model.onnx"
    proto = onnx.load(str(path))
    emb = max(proto.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    emb.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(emb) * 1.5, emb.name))
    onnx.save(proto, str(path))
    code, _, err = run_cli("bench", "onnx", f"{exports}/orig.onnx={tmp_path}/bad.onnx", "--budget", "1")
    assert code != 0 and "does not match" in err and "bad.onnx" in err and len(err.strip().splitlines()) == 1
    # the safe path: the untampered pair is timed
    code, stdout, _ = run_cli(
        "bench", "onnx", f"{exports}/orig.onnx={exports}/conv.onnx", "--budget", "1", "--min-time", "0"
    )
    assert code == 0 and "converted:" in stdout
    # an ORIGINAL=CONVERTED pair that is not two ONNX exports is refused in one line
    code, _, err = run_cli("bench", "onnx", f"{exports}/src={exports}/conv", "--budget", "1")
    assert code != 0 and "--format onnx" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # shares the module fixture's exports
def test_bench_onnx_refuses_a_graph_another_user_can_write(exports, tmp_path, run_cli):
    """#39 item 3: CONVERTED/model.onnx linked into a world-writable directory, or writable by others itself,
    is refused in one line naming the path and why; control: an untouched export directory is benchmarked."""
    original = exports / "orig.onnx"
    # 1. a planted link: the graph lies in a directory anyone can write (they could swap it at any time)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    shutil.copy(exports / "conv.onnx" / "model.onnx", shared / "model.onnx")
    linked = tmp_path / "linked.onnx"
    shutil.copytree(exports / "conv.onnx", linked)
    (linked / "model.onnx").unlink()
    (linked / "model.onnx").symlink_to(shared / "model.onnx")
    # 2. another user's write bit on the graph itself
    loose = tmp_path / "loose.onnx"
    shutil.copytree(exports / "conv.onnx", loose)
    os.chmod(loose / "model.onnx", 0o646)
    # 3. the export directory itself writable by others
    open_dir = tmp_path / "open.onnx"
    shutil.copytree(exports / "conv.onnx", open_dir)
    os.chmod(open_dir, 0o777)
    for planted, why in (
        (linked, "symbolic link"),
        (loose, "writable by other users"),
        (open_dir, "writable by other users"),
    ):
        code, stdout, err = run_cli("bench", "onnx", f"{original}={planted}", "--budget", "1", "--min-time", "0")
        assert code == 2 and not stdout, (planted, err)
        assert len(err.strip().splitlines()) == 1 and str(planted) in err and why in err, (planted, err)
    # and as ORIGINAL too: the check is for both sides
    code, _, err = run_cli("bench", "onnx", f"{loose}={exports / 'conv.onnx'}", "--budget", "1")
    assert code == 2 and str(loose) in err and len(err.strip().splitlines()) == 1
    # control: the same files, as export wrote them, are benchmarked
    code, stdout, err = run_cli(
        "bench", "onnx", f"{original}={exports / 'conv.onnx'}", "--budget", "1", "--min-time", "0"
    )
    assert code == 0 and "converted:" in stdout, err
