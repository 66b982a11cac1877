"""Every documented --gamma/--beta combination is exact in exact mode, or refused before any tensor
is computed: walked on a tiny random instance of every curated pre-LN family (and with --untie where
the head is tied). A β kept beside a folded γ is stored as β/γ (the readers scale the RMSNorm's
whole output by γ); where γ_j = 0 and β_j ≠ 0 there is no such form and convert says so in one line."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch
from helpers import family_variants, tiny_model

from normswap.convert.config import BETA_CHOICES, GAMMA_CHOICES
from normswap.errors import NormswapError

_PRE_LN = {}  # curated family -> its first pre-LN test config
for _fam, _variant in family_variants(placement="pre"):
    _PRE_LN.setdefault(_fam, _variant)
TOLERANCE = 1e-4  # convert's own: max |Δ log-prob| of an exact conversion


def _logprobs(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double().log_softmax(-1)


def _ids(model):
    return torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


def _tied(model) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and head.weight is embed.weight


@pytest.mark.parametrize("family", sorted(_PRE_LN))
def test_every_gamma_beta_combination_is_exact_or_refused_up_front(family):
    from normswap.convert.apply import convert_model

    original = tiny_model(family, _PRE_LN[family])
    ids = _ids(original)
    want = _logprobs(original, ids)
    assert set(GAMMA_CHOICES) == {"fold", "keep", "reset"} and set(BETA_CHOICES) == {"fold", "keep", "drop"}
    for gamma, beta, untie in itertools.product(("fold", "keep"), ("fold", "keep"), (False, True)):
        if untie and not _tied(original):
            continue  # --untie changes nothing on an untied head
        model = copy.deepcopy(original)
        plan = convert_model(model, mode="exact", gamma=gamma, beta=beta, untie=untie)
        diff = float((_logprobs(model, ids) - want).abs().max())
        assert diff <= TOLERANCE, (family, gamma, beta, untie, diff)
        # the defaults (no --gamma / --beta) are fold where a reader can take it and keep elsewhere: the
        # same plan as fold, so the walk above covers them
        if gamma == "fold" and beta == "fold":
            default = convert_model(copy.deepcopy(original), mode="exact", untie=untie)
            assert default.block["norms"] == plan.block["norms"] and default.derivations == plan.derivations
    for gamma, beta in (("reset", None), (None, "drop"), ("reset", "drop")):  # lossy: refused, nothing touched
        model = copy.deepcopy(original)
        with pytest.raises(NormswapError, match="not exact: use --mode approx"):
            convert_model(model, mode="exact", gamma=gamma, beta=beta)
        assert float((_logprobs(model, ids) - want).abs().max()) == 0.0


def test_beta_kept_beside_a_folded_gamma_is_beta_over_gamma(tmp_path, run_cli, capsys, monkeypatch):
    """StableLM, γ folded (the default) and --beta keep: convert verifies and writes; the RMSNorm's bias
    is β/γ. Control: β stored as it was (what convert did before) fails convert's own verification."""
    from normswap.convert import ops

    model = tiny_model("stablelm")
    model.save_pretrained(tmp_path / "src")
    capsys.readouterr()
    code, stdout, stderr = run_cli("convert", tmp_path / "src", tmp_path / "out", "--beta", "keep", "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["verification"]["passed"]
    from safetensors.torch import load_file

    from normswap.checkpoint.shards import SINGLE_NAME

    got = load_file(tmp_path / "out" / SINGLE_NAME)["model.layers.0.input_layernorm.bias"]
    ln = model.model.layers[0].input_layernorm
    assert torch.allclose(got.double(), (ln.bias / ln.weight).double(), rtol=1e-6)

    monkeypatch.setattr(ops, "_beta_over_gamma", lambda op, beta, gamma: beta)
    code, _, stderr = run_cli("convert", tmp_path / "src", tmp_path / "wrong", "--beta", "keep")
    assert code == 1 and "verification failed" in stderr and not (tmp_path / "wrong").exists()


def test_beta_kept_beside_a_zero_gamma_is_refused_in_one_line(tmp_path, run_cli, capsys):
    """γ_j = 0 with β_j ≠ 0: no RMSNorm bias reaches W_j·β_j through W·diag(γ), so --beta keep with γ
    folded is refused naming the tensor and the option that avoids it; nothing is written. Controls:
    --gamma keep --beta keep and the default (β folded too) convert the same source exactly."""
    model = tiny_model("gpt_neox")
    with torch.no_grad():
        model.gpt_neox.layers[1].input_layernorm.weight[3] = 0.0
        model.gpt_neox.layers[1].input_layernorm.bias[3] = 0.5
    model.save_pretrained(tmp_path / "src")
    capsys.readouterr()
    code, _, stderr = run_cli("convert", tmp_path / "src", tmp_path / "out", "--beta", "keep")
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "gpt_neox.layers.1.input_layernorm.bias" in stderr and "γ is 0 at index 3" in stderr
    assert "--gamma keep" in stderr and not (tmp_path / "out").exists()
    for options in (("--gamma", "keep", "--beta", "keep"), ()):
        code, _, stderr = run_cli("convert", tmp_path / "src", tmp_path / f"ok{len(options)}", *options)
        assert code == 0, stderr
