"""`normswap export --format onnx --quantize int8` (export/int8.py): onnxruntime's quantizer after the
incoherence rotation. Bad input is one line, a non-zero exit and nothing written; the quantizer must
reach a matmul; on a model with a planted loud coordinate int8 without the rotation loses far more
than with it (each direction is the other's control)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import tiny_model

from normswap.errors import NormswapError


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("int8-src") / "gpt2"
    tiny_model("gpt2", 0).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "args,message",
    [
        (["--format", "stock", "--quantize", "int8"], "needs --format onnx"),
        (["--format", "onnx", "--quantize", "int4x"], "not a scheme normswap knows"),
    ],
)
def test_quantize_that_cannot_be_carried_is_one_line_and_writes_nothing(source, tmp_path, run_cli, args, message):
    dest = tmp_path / "dest"
    code, out, err = run_cli("export", source, dest, *args)
    assert code != 0 and message in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    assert not dest.exists()
    # the control: the same source and DEST with a scheme the format carries get past the check
    from normswap.export.int8 import check_scheme

    assert check_scheme("int8", "onnx") == "int8"


def _graph(tmp_path, constant_weight: bool):
    """A one-MatMul ONNX graph: X · W with W an initializer (quantizable) or a second input (not)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 3])
    inputs, inits = [x], []
    if constant_weight:
        inits.append(numpy_helper.from_array(np.arange(12, dtype="float32").reshape(4, 3) / 7, "W"))
    else:
        inputs.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 3]))
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "g", inputs, [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / ("const.onnx" if constant_weight else "input.onnx")
    onnx.save_model(model, str(path))
    return path


def test_a_graph_the_quantizer_cannot_reach_is_refused(tmp_path):
    from normswap.export.int8 import quantize_graph

    out = tmp_path / "int8.onnx"
    with pytest.raises(NormswapError, match="reached no MatMul or Gemm") as refused:
        quantize_graph(_graph(tmp_path, constant_weight=False), out)
    assert "\n" not in str(refused.value) and not out.exists()
    # the control: the same product with a constant weight is quantized
    record = quantize_graph(_graph(tmp_path, constant_weight=True), out)
    assert record["matmuls_quantized"] == 1 and out.is_file()


def _mean_error(fp32_logits, int8_logits) -> float:
    return float((fp32_logits.double().log_softmax(-1) - int8_logits.double().log_softmax(-1)).abs().mean())


@pytest.mark.slow
def test_planted_outlier_needs_the_rotation(tmp_path):
    """A conversion turned so that one coordinate carries its stream's loudest direction (exact: checked
    against the original). int8 of it loses far more without the incoherence rotation than with it."""
    from normswap.benchmarks.serve import plant_outlier, write_graph
    from normswap.convert import convert_model
    from normswap.export.onnx import run_session, session
    from normswap.slice.incoherence import coordinate_energy

    original = tiny_model("gpt2", 0).float().eval()
    conversion = copy.deepcopy(original)
    convert_model(conversion)
    batches = [torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(3))]
    planted = plant_outlier(conversion, batches)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = original(input_ids=ids).logits
        assert _mean_error(ref, planted(input_ids=ids, use_cache=False).logits) < 1e-5  # the plant is exact
    assert coordinate_energy(planted, batches)["max_over_mean"] > 10
    errors = {}
    for name, rotate in (("plain", False), ("rotated", True)):
        write_graph(planted, tmp_path / name, quantize=True, rotate=rotate)
        errors[name] = _mean_error(ref, run_session(session(tmp_path / name / "model.onnx"), ids))
    assert errors["rotated"] < 0.5 * errors["plain"], errors


@pytest.mark.slow
def test_export_int8_of_a_conversion_records_the_rotation(tmp_path, run_cli):
    from normswap.convert.pipeline import convert_checkpoint

    src = tmp_path / "src"
    tiny_model("gpt2", 0).save_pretrained(src)
    convert_checkpoint(str(src), tmp_path / "conv", mode="exact")
    code, out, err = run_cli("export", tmp_path / "conv", tmp_path / "int8", "--format", "onnx", "--quantize", "int8",
                             "--json")  # fmt: skip
    assert code == 0, err
    record = json.loads(out)
    assert record["incoherence_rotation"]["applied"] and record["verification"]["passed"]
    assert record["quantization"]["matmuls_quantized"] >= 9  # 8 in the layers, the head
    assert not (tmp_path / "int8" / "model.onnx.float32.onnx").exists()
    # the control: the LayerNorm original is quantized without the rotation, and says why
    code, out, err = run_cli("export", src, tmp_path / "int8-original", "--format", "onnx", "--quantize", "int8",
                             "--json")  # fmt: skip
    assert code == 0, err
    assert not json.loads(out)["incoherence_rotation"]["applied"]
