"""The pass rule is capped: a checkpoint cannot widen it (docs/security.md S7.3).

The model: GPT-2 from its family test config with every embedding row shifted by one large common
offset (LayerNorm removes it exactly in float64, not in float32) and the final norm's γ scaled up (a
scaled tied head): the source's own float32 rounding moves its log-probs by nats. The rule used to be
max(tolerance, 4 × that floor), so a candidate wrong by 10 nats passed (threshold ~18). Now the
floor's share is capped (pass_rule.FLOOR_CAP) and the conversion is also checked in float64, where a
wrong fold stands out whatever the model's float32 floor.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model

from normswap.convert import ops
from normswap.slice import rotation_check

OFFSET, GAMMA_SCALE, PLANTED = 1e4, 50.0, 10.0


def inflated_model():
    model = tiny_model("gpt2", 0).eval()
    with torch.no_grad():
        model.transformer.wte.weight += OFFSET
        model.transformer.ln_f.weight *= GAMMA_SCALE
    return model


@pytest.fixture
def planted_10_nats(monkeypatch):
    """A wrong exact conversion: the tied head's logits bias W·β off by 10 nats at token 0."""
    original = ops._linear_bias

    def off(op, *args, **kwargs):
        out = original(op, *args, **kwargs)
        if op.get("beta") and not op.get("center") and op.get("src") is None:  # the tied head's W·β
            out[0] += PLANTED
        return out

    monkeypatch.setattr(ops, "_linear_bias", off)


@pytest.fixture(scope="module")
def inflated_src(tmp_path_factory):
    path = tmp_path_factory.mktemp("inflated") / "src"
    inflated_model().save_pretrained(path)
    return path


def test_convert_refuses_a_10_nat_error_on_an_inflated_floor(inflated_src, tmp_path, run_cli, planted_10_nats):
    code, out, err = run_cli("convert", inflated_src, tmp_path / "out")
    assert code == 1 and "verification failed: not exact" in err, err
    assert "PASSED" not in out and not (tmp_path / "out").exists()
    # even a user-widened float32 tolerance does not pass it: the float64 half of the rule does not move
    code, out, err = run_cli("convert", inflated_src, tmp_path / "wide", "--tolerance", "20")
    assert code == 1 and "not exact" in err and not (tmp_path / "wide").exists()


def test_honest_conversion_of_the_inflated_model_is_refused_as_unstable(inflated_src, tmp_path, run_cli):
    """The negative control: the correct conversion is exact in float64 but the source is not stable in
    float32, which the rule says in so many words; the user (not the checkpoint) may accept the drift."""
    code, out, err = run_cli("convert", inflated_src, tmp_path / "out")
    assert code == 1 and "not numerically stable in float32" in err and not (tmp_path / "out").exists(), err
    assert "exact in float64" in err
    code, out, err = run_cli("convert", inflated_src, tmp_path / "accepted", "--tolerance", "20")
    assert code == 0, err
    assert "exact: PASSED (threshold 20; float64 threshold 0.0002)" in out


def _with_planted_logit(model):
    """``model`` with token 0's logit moved by 10 nats (a wrong rotation of one head row, in effect)."""
    bad = copy.deepcopy(model)

    def hook(module, args, output):
        output = output.clone()
        output[..., 0] += PLANTED
        return output

    bad.lm_head.register_forward_hook(hook)
    return bad


def test_slice_check_refuses_a_10_nat_error_on_an_inflated_floor():
    reference = inflated_model()
    candidate = _with_planted_logit(reference)
    check = rotation_check.compare(
        reference, candidate, tolerance=1e-5, candidate_float64=_with_planted_logit(copy.deepcopy(reference).double())
    )
    assert check["noise_floor"] > 1 and check["max_abs_diff"] > 9
    assert check["passed"] is False and check["reason"].startswith("not exact")
    # without the float64 candidate the float32 half alone refuses it: the floor's share is capped
    from normswap.convert import pass_rule

    alone = rotation_check.compare(reference, candidate, tolerance=1e-5)
    assert alone["passed"] is False and alone["threshold"] <= 4 * pass_rule.FLOOR_CAP
    # the control: the reference against itself passes the float64 half and is refused as unstable
    same = rotation_check.compare(reference, copy.deepcopy(reference), tolerance=1e-5)
    assert same["exact_float64"] is None and same["passed"] is False and same.get("unstable") is True


def test_the_rule_on_figures():
    from normswap.convert import pass_rule

    judge = pass_rule.judge
    assert judge(exact_float64=1e-14, drift_float32=5e-5, noise_floor=2e-5, tolerance=1e-5)["passed"] is True
    assert judge(exact_float64=1e-5, drift_float32=1e-6, noise_floor=1e-6, tolerance=1e-5)["passed"] is False
    inflated = judge(exact_float64=1e-10, drift_float32=10.0, noise_floor=4.5, tolerance=1e-5)
    assert inflated["passed"] is False and inflated["threshold"] == 4 * pass_rule.FLOOR_CAP
