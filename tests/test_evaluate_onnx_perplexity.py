"""Perplexity of an ONNX export (`normswap eval ppl` on `normswap export --format onnx`): the graph's logits
through the very code PyTorch models' go through (evaluate/perplexity.py), so the numbers are comparable."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny GPT-2, its generation graph (float32, with a key/value cache) and a second GPT-2 of another seed."""
    from normswap.export import run_export

    root = tmp_path_factory.mktemp("onnx-ppl")
    model = tiny_model("gpt2", seed=0)
    model.save_pretrained(root / "gpt2")
    run_export(root / "gpt2", root / "onnx", "onnx")
    return model, tiny_model("gpt2", seed=1), root / "onnx"


def _nll(model, ids):
    from normswap.evaluate.perplexity import sequence_nll

    # two window lengths (the last is shorter) and a stride: every path of the window plan
    return sequence_nll(model, ids, seq_len=32, stride=16, batch_size=3)


def test_onnx_export_perplexity_is_the_torch_models(exported):
    from normswap.evaluate.onnx_model import OnnxModel

    torch_model, other, onnx_dir = exported
    graph = OnnxModel(onnx_dir, threads=1)
    assert graph.export["with_past"]  # the generation graph: its forward is the prefill from an empty cache
    ids = torch.randint(0, torch_model.config.vocab_size, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    got, want = _nll(graph, ids), _nll(torch_model, ids)
    assert got[1:] == want[1:]  # the same tokens scored in the same windows
    assert got[0] == pytest.approx(want[0], rel=1e-4)
    # control: the same graph against another model's weights is told apart
    assert abs(_nll(other, ids)[0] - got[0]) > 1e-2 * abs(got[0])
