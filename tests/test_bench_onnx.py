"""`normswap bench onnx` (#31): exported converted vs exported original in onnxruntime on CPU, outputs
checked before timing, interleaved repeats with a null control. No wall-clock thresholds: only what the
recorded numbers are made of, and that a graph that does not compute the original's function is refused."""

import json
import statistics

import pytest
from helpers import tiny_model

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


def _paired(samples, name):
    return [a / b for a, b in zip(samples[name], samples["original"])]


@pytest.mark.slow  # converts and exports (about 2 min on the loaded 2-core machine)
def test_bench_onnx_converts_exports_matches_and_times(tmp_path, run_cli):
    tiny_model("gpt2", 0).save_pretrained(tmp_path / "src")
    out = tmp_path / "onnx.json"
    code, stdout, _ = run_cli(
        "bench", "onnx", tmp_path / "src", "--repeats", "5", "--min-time", "0", "--seq-len", "16",
        "--onnx-norm-op", "simplified", "--json", out,
    )  # fmt: skip
    assert code == 0 and "null control" in stdout
    doc = json.loads(out.read_text())
    (r,) = doc["onnx"]
    assert doc["onnxruntime"] and r["graph_optimization_level"] == "ORT_ENABLE_ALL"
    assert set(r["graphs"]) == {"original", "converted (simplified)"}
    # outputs match: the converted graph computes the original graph's function
    assert r["graphs"]["original"]["max_abs_logprob_diff_vs_original"] == 0
    assert r["graphs"]["converted (simplified)"]["max_abs_logprob_diff_vs_original"] <= 1e-4
    # what onnxruntime runs is read from its optimised graph: the converted one holds no LayerNorm
    fused = {name: g["optimised_norm_ops"] for name, g in r["graphs"].items()}
    assert any("LayerNormalization" in op for op in fused["original"])
    assert fused["converted (simplified)"] and not {"LayerNormalization", "SkipLayerNormalization"} & set(
        fused["converted (simplified)"]
    )
    s = r["samples"]
    assert set(s) == {"original", "converted (simplified)", "null control"} and all(len(v) == 5 for v in s.values())
    # control: the null control and the converted graph are timed on their own, not copies of the original
    assert s["null control"] != s["original"] and s["converted (simplified)"] != s["original"]
    for name, iv in (*r["over_original"].items(), ("null control", r["null_control_over_original"])):
        paired = _paired(s, name)
        assert (iv["low"], iv["high"], iv["median"]) == (min(paired), max(paired), statistics.median(paired))
    assert len(r["machine"]["load_before"]) == 3 and len(r["machine"]["load_after"]) == 3


@pytest.mark.slow  # one conversion and three exports
def test_bench_onnx_refuses_a_graph_that_does_not_match(tmp_path, run_cli):
    import numpy as np
    import onnx
    from onnx import numpy_helper

    tiny_model("gpt2", 0).save_pretrained(tmp_path / "src")
    assert run_cli("convert", tmp_path / "src", tmp_path / "conv")[0] == 0
    for src, dest in (("src", "orig.onnx"), ("conv", "conv.onnx"), ("conv", "bad.onnx")):
        assert run_cli("export", tmp_path / src, tmp_path / dest, "--format", "onnx")[0] == 0
    # the tampered graph: the token embedding moved after export (what a bad exporter or a swapped file gives)
    path = tmp_path / "bad.onnx" / "model.onnx"
    proto = onnx.load(str(path))
    emb = max(proto.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    emb.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(emb) * 1.5, emb.name))
    onnx.save(proto, str(path))
    code, _, err = run_cli("bench", "onnx", f"{tmp_path}/orig.onnx={tmp_path}/bad.onnx", "--repeats", "5")
    assert code != 0 and "does not match" in err and "bad.onnx" in err and len(err.strip().splitlines()) == 1
    # the safe path: the untampered pair is timed
    code, stdout, _ = run_cli(
        "bench", "onnx", f"{tmp_path}/orig.onnx={tmp_path}/conv.onnx", "--repeats", "5", "--min-time", "0"
    )
    assert code == 0 and "converted:" in stdout
    # an ORIGINAL=CONVERTED pair that is not two ONNX exports is refused in one line
    code, _, err = run_cli("bench", "onnx", f"{tmp_path}/src={tmp_path}/conv", "--repeats", "5")
    assert code != 0 and "--format onnx" in err and len(err.strip().splitlines()) == 1
