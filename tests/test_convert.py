"""`normswap convert`: exactness for every pre-LN family, approx/post-LN, output format."""

import copy
import json

import pytest
import torch
from helpers import family_variants, tiny_model
from helpers import without_centring as _without_centring
from transformers import AutoModelForCausalLM

from normswap.checkpoint.shards import INDEX_NAME
from normswap.model_facts import is_layernorm

PRE = family_variants("pre")
POST = family_variants("post")
TIED = ["gpt2", "bloom", "opt", "falcon", "xglm"]


def _logprobs(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.double().log_softmax(-1)


def _noise_floor(model, ids):
    """The source's own float32-vs-float64 disagreement (None where float64 does not run)."""
    try:
        hi = copy.deepcopy(model).double()
        return float((_logprobs(hi, ids) - _logprobs(model, ids)).abs().max())
    except RuntimeError:
        return None


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids)[0].double()


def _probe(model):
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)


def _threshold(floor):
    return max(1e-5, 4 * floor) if floor is not None else 1e-5


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each pre-LN variant saved once as a stock LayerNorm checkpoint."""
    root = tmp_path_factory.mktemp("sources")
    cache = {}

    def get(family, variant):
        key = (family, variant)
        if key not in cache:
            model = tiny_model(family, variant)
            path = root / f"{family}_{variant}"
            model.save_pretrained(path)
            cache[key] = (path, model)
        return cache[key]

    return get


@pytest.mark.parametrize("family,variant", PRE, ids=[f"{f}-{v}" for f, v in PRE])
def test_exact_conversion_matches_source(family, variant, sources, tmp_path, run_cli):
    src, model = sources(family, variant)
    out = tmp_path / "out"
    code, stdout, stderr = run_cli("convert", src, out, "--json")
    assert code == 0, stderr
    summary = json.loads(stdout)
    assert summary["mode"] == "exact" and summary["verification"]["passed"] is True

    converted = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    ids = _probe(model)
    diff = float((_logprobs(converted, ids) - _logprobs(model, ids)).abs().max())
    assert diff <= _threshold(_noise_floor(model, ids)), diff

    # no LayerNorm that reads the residual stream remains
    left = {x["module"] for x in summary["left_alone"]}
    assert not [n for n, m in converted.named_modules() if is_layernorm(m) and n not in left]
    assert any(type(m).__name__ == "RMSNorm" for m in converted.modules())

    # negative control: the same swap without centring the residual writers fails the check
    neg = tmp_path / "neg"
    code, _, stderr = run_cli("convert", src, neg, "--mode", "approx", "--gamma", "fold", "--beta", "fold")
    assert code == 0, stderr
    wrong = AutoModelForCausalLM.from_pretrained(neg, trust_remote_code=True, dtype=torch.float32).eval()
    assert float((_logprobs(wrong, ids) - _logprobs(model, ids)).abs().max()) > 100 * _threshold(
        _noise_floor(model, ids)
    )


@pytest.mark.parametrize("family", TIED)
def test_untie_folds_final_norm_into_head(family, sources, tmp_path, run_cli):
    src, model = sources(family, 0)
    code, stdout, stderr = run_cli("convert", src, tmp_path / "out", "--untie", "--json")
    assert code == 0, stderr
    s = json.loads(stdout)
    assert s["untied"] and s["verification"]["passed"]
    hidden = model.get_input_embeddings().weight.shape[1]
    # + a vocab x hidden head (and its bias), - the folded γ/β of the norms
    assert (
        s["parameters_after"] - s["parameters_before"]
        >= model.config.vocab_size * hidden - 2 * hidden * s["norms_replaced"]
    )
    assert s["gamma"] == {
        "fold": s["norms_replaced"] - (1 if family == "bloom" else 0),
        **({"keep": 1} if family == "bloom" else {}),
    }
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    assert converted.get_output_embeddings().weight is not converted.get_input_embeddings().weight
    ids = _probe(model)
    assert float((_logprobs(converted, ids) - _logprobs(model, ids)).abs().max()) <= _threshold(
        _noise_floor(model, ids)
    )


def test_tied_head_stays_tied_and_exact(sources, tmp_path, run_cli):
    src, model = sources("gpt2", 0)
    code, stdout, _ = run_cli("convert", src, tmp_path / "out", "--json")
    s = json.loads(stdout)
    assert code == 0 and not s["untied"] and s["centered_at_runtime"] == ["transformer.wte"]
    assert s["parameters_after"] <= s["parameters_before"]
    converted = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", trust_remote_code=True, dtype=torch.float32
    ).eval()
    assert converted.lm_head.weight is converted.transformer.wte.weight
    # the shared matrix is the original one: centring it in place would have changed the logits
    assert torch.equal(converted.lm_head.weight, model.lm_head.weight)
    block = converted.config.normswap
    assert block["norms"]["transformer.ln_f"]["gamma"] == "keep"
    assert "tied output head" in block["norms"]["transformer.ln_f"]["why"]

    # what a user cares about: the tied model computes the source's next-token distribution
    ids = _probe(model)
    threshold = _threshold(_noise_floor(model, ids))
    assert float((_logprobs(converted, ids) - _logprobs(model, ids)).abs().max()) <= threshold
    # negative control: centring the shared matrix in place (instead of the embedding output at run
    # time) keeps the tie but moves the head, which the logits comparison catches
    wrong = copy.deepcopy(converted)
    with torch.no_grad():
        shared = wrong.transformer.wte.weight
        shared.sub_(shared.mean(-1, keepdim=True))
    assert wrong.lm_head.weight is wrong.transformer.wte.weight
    assert float((_logprobs(wrong, ids) - _logprobs(model, ids)).abs().max()) > 100 * threshold


@pytest.mark.parametrize("family,variant", POST, ids=[f"{f}-{v}" for f, v in POST])
def test_post_ln_refuses_exact_and_converts_approx(family, variant, tmp_path, run_cli):
    from transformers import AutoModel, AutoModelForMaskedLM

    model = tiny_model(family, variant, task="causal-lm" if family == "opt" else "masked-lm")
    src = tmp_path / "src"
    model.save_pretrained(src)
    code, _, err = run_cli("convert", src, tmp_path / "x", "--mode", "exact")
    assert code == 2 and "post-LN" in err and "--mode approx" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()

    code, stdout, err = run_cli("convert", src, tmp_path / "out", "--json")  # auto -> approx
    assert code == 0, err
    s = json.loads(stdout)
    assert s["mode"] == "approx" and "fold" not in s["gamma"]  # post-LN norms feed the skip path: kept
    auto = AutoModelForCausalLM if family == "opt" else AutoModelForMaskedLM
    converted = auto.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    assert not any(is_layernorm(m) for m in converted.modules())
    # approx means: each LayerNorm becomes γ·x/rms(x) + β (no centring, γ and β kept), so the
    # converted model computes exactly the source with the centring removed from its norms
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = _without_centring(copy.deepcopy(model))
    got, want, source = (_logits(m, ids) for m in (converted, reference, model))
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * scale
    # negative controls: the source itself (centring kept) is far from that reference on these
    # randomised weights (why post-LN models need healing), and so is dropping β
    assert float((source - want).abs().max()) > 1e-2 * scale
    code, _, err = run_cli("convert", src, tmp_path / "nobeta", "--mode", "approx", "--beta", "drop")
    assert code == 0, err
    no_beta = auto.from_pretrained(tmp_path / "nobeta", trust_remote_code=True).eval()
    assert float((_logits(no_beta, ids) - want).abs().max()) > 1e-2 * scale
    base = AutoModel.from_pretrained(tmp_path / "out", trust_remote_code=True) if family != "opt" else None
    assert base is None or not any(is_layernorm(m) for m in base.modules())


def test_approx_beta_drop_changes_function_and_records_choices(sources, tmp_path, run_cli):
    src, model = sources("gpt2", 0)
    code, stdout, _ = run_cli(
        "convert", src, tmp_path / "out", "--mode", "approx", "--beta", "drop", "--gamma", "reset", "--json"
    )
    assert code == 0
    s = json.loads(stdout)
    assert s["beta"] == {"drop": 5} and s["gamma"] == {"reset": 5} and s["verification"]["passed"] is None
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    norms = converted.config.normswap["norms"]
    assert all(r["gamma"] == "reset" and r["weight"] and not r["bias"] for r in norms.values())
    assert torch.equal(converted.transformer.h[0].ln_1.weight, torch.ones(64))


def test_exact_mode_refuses_lossy_options(sources, tmp_path, run_cli):
    src, _ = sources("gpt2", 0)
    code, _, err = run_cli("convert", src, tmp_path / "o", "--mode", "exact", "--beta", "drop")
    assert code == 2 and "--mode approx" in err


def test_output_format_sharded_bf16_card_and_manifest(sources, tmp_path, run_cli):
    src, model = sources("gpt_neox", 0)
    out = tmp_path / "out"
    code, stdout, err = run_cli("convert", src, out, "--dtype", "bfloat16", "--max-shard-size", "40KB", "--json")
    assert code == 0, err
    s = json.loads(stdout)
    assert s["verification"]["passed"] and s["verification"]["rounding_floor"] > 0
    index = json.loads((out / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt_neox" and "AutoModelForCausalLM" in config["auto_map"]
    assert config["normswap"]["mode"] == "exact" and config["normswap"]["norms"]
    manifest = json.loads((out / "normswap_manifest.json").read_text())
    assert manifest["conversion"]["family"] == "gpt_neox"
    card = (out / "README.md").read_text()
    assert "Verification" in card and "trust_remote_code=True" in card
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype="auto")
    assert next(loaded.parameters()).dtype == torch.bfloat16

    # The bf16 output is the source up to bf16 rounding: its log-probs (computed in float32) stay
    # within 4x of what rounding the *source* to bf16 alone moves them (the floor, measured here,
    # independently of the product's own verification).
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))

    def logprobs(m):
        with torch.no_grad():
            return torch.log_softmax(m.float()(input_ids=ids).logits.float(), -1)

    ref = logprobs(copy.deepcopy(model))
    floor = float((logprobs(copy.deepcopy(model).to(torch.bfloat16)) - ref).abs().max())
    diff = float((logprobs(copy.deepcopy(loaded)) - ref).abs().max())
    assert 0 < diff <= 4 * floor, (diff, floor)
    # negative control: a conversion that forgets the centring (approx mode), in bf16, is caught
    from normswap.convert import convert_model

    broken = copy.deepcopy(model)
    convert_model(broken, mode="approx")
    bad = float((logprobs(broken.to(torch.bfloat16)) - ref).abs().max())
    assert bad > 4 * floor


def test_normswap_load_model_returns_the_same_model(sources, tmp_path, run_cli):
    import normswap

    src, model = sources("phi", 0)
    assert run_cli("convert", src, tmp_path / "out")[0] == 0
    a = normswap.load_model(tmp_path / "out")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    ids = _probe(model)
    assert torch.equal(_logprobs(a, ids), _logprobs(b, ids))
    assert a.normswap_manifest["conversion"]["family"] == "phi"


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "bloom", "falcon", "phi", "opt"])
def test_exact_in_float64_is_exact_to_rounding(family):
    """In float64 the conversion is an identity up to rounding (~1e-15); without centring it is not."""
    from normswap.convert import convert_model

    model = tiny_model(family).double()
    ids = _probe(model)
    ref = _logprobs(model, ids)
    exact = copy.deepcopy(model)
    convert_model(exact, mode="exact")
    assert float((_logprobs(exact, ids) - ref).abs().max()) < 1e-10
    assert all(p.dtype == torch.float64 for p in exact.parameters())
    wrong = copy.deepcopy(model)
    convert_model(wrong, mode="approx", gamma="fold", beta="fold")
    assert float((_logprobs(wrong, ids) - ref).abs().max()) > 1e-3
