"""A sliced checkpoint where the product takes it: `normswap finetune --distill-from` heals it (the head
adapter trains, the width stays), `normswap export --format onnx` writes a graph onnxruntime runs and
that computes what the sliced model computes, `--format stock` refuses in one line (no stock class has
a residual stream narrower than its attention)."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    from normswap.slice import slice_checkpoint

    root = tmp_path_factory.mktemp("sliced")
    out = root / "sliced"
    summary = slice_checkpoint("normswap:kjv-gpt2", out, fraction=0.25, calibration_tokens=1024)
    return out, summary


def _logprobs(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double().log_softmax(-1)


def test_onnx_export_of_a_sliced_model_runs_in_onnxruntime_and_matches(sliced, tmp_path):
    import normswap
    from normswap.export import run_export
    from normswap.export.onnx import run_session, session

    src, summary = sliced
    record = run_export(src, tmp_path / "onnx", "onnx")
    assert record["verification"]["passed"]
    model = normswap.load_model(str(src)).eval()
    assert model.config.normswap["slice"]["width"] == summary["width"] < summary["hidden_size"]
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    got = run_session(session(Path(record["out"]) / "model.onnx"), ids).double().log_softmax(-1)
    assert float((got - _logprobs(model, ids)).abs().max()) <= 1e-4
    # control: the same comparison tells a sliced model from the conversion it came from
    conversion = normswap.load_model("normswap:kjv-gpt2").eval()
    assert float((got - _logprobs(conversion, ids)).abs().max()) > 1e-3


def test_stock_export_of_a_sliced_model_refuses_in_one_line(sliced, tmp_path, run_cli):
    src, _ = sliced
    code, _, err = run_cli("export", src, tmp_path / "stock", "--format", "stock")
    assert code == 2 and "sliced" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "stock").exists()


def test_finetune_heals_a_sliced_model_training_its_head_adapter(sliced, tmp_path, run_cli):
    import normswap

    src, summary = sliced
    out = tmp_path / "healed"
    code, stdout, err = run_cli(
        "finetune", src, out, "--distill-from", "normswap:kjv-gpt2", "--steps", "3", "--batch-size", "2",
        "--seq-len", "64", "--eval-tokens", "256", "--lr", "1e-3", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    before, after = normswap.load_model(str(src)), normswap.load_model(str(out))
    assert after.config.normswap["slice"]["width"] == summary["width"]
    b, a = dict(before.named_parameters()), dict(after.named_parameters())
    assert set(a) == set(b)  # loaded through normswap's loader as the same sliced structure
    adapters = [k for k in a if k.endswith(".adapter")]
    assert adapters, "kjv-gpt2's tied head keeps its tie through the head adapter"
    for key in adapters + ["transformer.wte.weight"]:
        assert a[key].shape == b[key].shape
        assert not torch.equal(a[key], b[key]), f"{key} did not train"
    # control: loading the sliced checkpoint again gives the same adapter, so the change above is the
    # training's, not a loader that initialises the adapter afresh
    again = dict(normswap.load_model(str(src)).named_parameters())
    assert all(torch.equal(again[key], b[key]) for key in adapters)
