"""Discovery: the plan derived from the model itself matches every curated family file, converts
new architectures exactly (ViT, CLIP, Whisper, Cohere, OLMo, Nemotron), and is refused when not."""

import copy
import functools
import json

import pytest
import torch
import yaml
from helpers import family_variants, tiny_model

from normswap.architectures import family_check, get_family
from normswap.architectures.discover import discover
from normswap.architectures.norms import layernorm_spec
from normswap.architectures.probes import model_outputs, probe_inputs
from normswap.architectures.randomize import randomize_
from normswap.architectures.schema import parse_family
from normswap.convert.apply import convert_model
from normswap.convert.config import ConvertOptions
from normswap.convert.inplace import convert_tiny
from normswap.convert.plan import build_plan
from normswap.errors import DiscoveryError, NormswapError

# the family check with the converter `normswap convert` gives it
check_family = functools.partial(family_check.check_family, convert=convert_tiny)
discover_family = functools.partial(family_check.discover_family, convert=convert_tiny)
resolve_family = functools.partial(family_check.resolve_family, convert=convert_tiny)


def _decisions(plan):
    """What a conversion does: per norm γ/β and readers, per tensor the op, run-time centring."""
    b = plan.block
    return {
        "placement": plan.placement,
        "norms": {
            n: (r["gamma"], r["beta"], tuple(sorted(r["readers"])) if "fold" in (r["gamma"], r["beta"]) else ())
            for n, r in b["norms"].items()
        },
        "derivations": {
            k: (v["op"], v.get("center"), v.get("gamma"), v.get("beta")) for k, v in plan.derivations.items()
        },
        "centered_outputs": sorted(b["centered_outputs"]),
        "left_alone": sorted(x["module"] for x in b["left_alone"]),
        "added_biases": sorted(b["added_biases"]),
    }


@pytest.mark.parametrize("family,variant", family_variants(), ids=[f"{f}-{v}" for f, v in family_variants()])
def test_discovery_reproduces_curated_family(family, variant):
    model = tiny_model(family, variant)
    try:
        discovered = parse_family(discover(model.double()), "discovered")
    except DiscoveryError:  # XGLM's masking does not run in float64
        discovered = parse_family(discover(model.float()), "discovered")
    curated = build_plan(get_family(family), model, model.config, ConvertOptions())
    found = build_plan(discovered, model, model.config, ConvertOptions())
    assert _decisions(found) == _decisions(curated)


# -- new architectures: tiny configs, exact conversion, negative control ---------------------------

NEW = {
    "vit": (
        "ViTConfig",
        "ViTModel",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            image_size=32,
            patch_size=8,
        ),
    ),
    "clip_text": (
        "CLIPTextConfig",
        "CLIPTextModel",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=128,
            max_position_embeddings=32,
        ),
    ),
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        dict(
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            num_mel_bins=16,
            max_source_positions=16,
            max_target_positions=32,
            vocab_size=128,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        ),
    ),
    "cohere": (
        "CohereConfig",
        "CohereForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=128,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "olmo": (
        "OlmoConfig",
        "OlmoForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=128,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "nemotron": (
        "NemotronConfig",
        "NemotronForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=128,
            head_dim=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}


def _config(key):
    import transformers

    cfg_cls, model_cls, kwargs = NEW[key]
    return getattr(transformers, cfg_cls)(**kwargs), getattr(transformers, model_cls)


@functools.cache
def _discovered(key):
    config, cls = _config(key)
    family, check = discover_family(config, cls)
    return config, cls, family, check


def _max_rel_diff(a, b):
    scale = max(1.0, max(float(v.abs().max()) for v in a.values()))
    return max(float((a[k] - b[k]).abs().max()) for k in a) / scale


def _skip_centring(family):
    """The same plan with every centring removed: RMSNorm then reads an uncentred stream."""
    raw = copy.deepcopy(family.description)
    raw.update(embeddings=[], writers=[], centered_inputs=[])
    for n in raw["norms"] + ([raw["final_norm"]] if raw.get("final_norm") else []):
        n.pop("starts_stream", None)
    return parse_family(raw, "skip-centring")


@pytest.mark.parametrize("key", sorted(NEW))
def test_new_architecture_converts_exactly(key):
    config, cls, family, check = _discovered(key)
    assert family.discovered and check["exact"], check
    torch.manual_seed(3)
    source = randomize_(cls(config).double().eval(), seed=3)
    inputs = probe_inputs(source, seq_len=8, seed=3)
    ref = model_outputs(source, inputs)
    exact = copy.deepcopy(source)
    convert_model(exact, family=family, mode="exact")
    assert _max_rel_diff(ref, model_outputs(exact, inputs)) < 1e-5  # Cohere/OLMo norms compute in float32
    wrong = copy.deepcopy(source)
    convert_model(wrong, family=_skip_centring(family), mode="exact")
    assert _max_rel_diff(ref, model_outputs(wrong, inputs)) > 1e-2


def test_whisper_encoder_and_decoder_both_converted():
    family = _discovered("whisper")[2]
    desc = family.description
    norms = {n["norm"] for n in desc["norms"]} | ({desc["final_norm"]["norm"]} if desc.get("final_norm") else set())
    assert any(n.startswith("encoder.layers.") for n in norms) and any(n.startswith("decoder.layers.") for n in norms)
    assert {"encoder.layer_norm", "decoder.layer_norm"} <= norms
    # the encoder's stream starts inline (gelu(conv) + positions): centred where its first layer reads it
    assert desc["centered_inputs"] == ["encoder.layers.0"]


def test_clip_vision_tower_pooled_output_exact_but_raw_stream_output_refused():
    """CLIP's vision tower returns its un-normalised residual stream as last_hidden_state: an exact
    conversion centres that stream, so discovery refuses; the same plan keeps its pooled output exact."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8
    )
    with pytest.raises(DiscoveryError, match="raw residual stream of encoder.layers is returned as a model output"):
        discover_family(config, CLIPVisionModel)
    with pytest.raises(NormswapError, match="raw residual stream"):
        resolve_family(config, CLIPVisionModel)
    family = parse_family(
        discover(randomize_(CLIPVisionModel(config).double().eval(), seed=0), refuse_raw_outputs=False), "raw"
    )
    check = check_family(family, config, CLIPVisionModel)
    assert (
        check["exact"] is False
        and "raw residual stream" in check["reason"]
        and check["changed_outputs"] == ["last_hidden_state"]
    )
    source = randomize_(CLIPVisionModel(config).double().eval(), seed=2)
    inputs = probe_inputs(source, seed=2)
    ref = model_outputs(source, inputs)
    conv = copy.deepcopy(source)
    convert_model(conv, family=family, mode="exact")
    got = model_outputs(conv, inputs)
    assert float((ref["pooler_output"] - got["pooler_output"]).abs().max()) < 1e-9
    delta = got["last_hidden_state"] - ref["last_hidden_state"]
    assert float(delta.abs().max()) > 1e-2  # the stream itself moved ...
    assert float((delta - delta.mean(-1, keepdim=True)).abs().max()) < 1e-9  # ... by a per-token constant only


# -- LayerNorm detection by behaviour ------------------------------------------------------------


def test_layernorm_variants_detected_by_behaviour():
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    def rand(m):
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.rand(p.shape) + 0.5)
        return m.double()

    spec = layernorm_spec(rand(torch.nn.LayerNorm(16, eps=1e-6)), (4, 16))
    assert spec and spec.eps == 1e-6 and spec.has_weight and spec.has_bias and spec.gamma_offset == 0
    spec = layernorm_spec(rand(torch.nn.LayerNorm(16, bias=False)), (4, 16))
    assert spec and not spec.has_bias
    spec = layernorm_spec(OlmoLayerNorm(16), (4, 16))  # no parameters, no eps attribute: ε fitted
    assert spec and not spec.has_weight and spec.eps == 1e-5
    assert layernorm_spec(rand(CohereLayerNorm(16, eps=1e-5)), (4, 16)).has_weight
    assert layernorm_spec(rand(NemotronLayerNorm1P(16)), (4, 16)).gamma_offset == 1.0
    assert layernorm_spec(rand(LlamaRMSNorm(16)), (4, 16)) is None  # RMSNorm is not shift-invariant
    assert layernorm_spec(torch.nn.Linear(16, 16).double(), (4, 16)) is None


def test_schema_checks_new_keys():
    good = {
        "name": "x",
        "model_types": ["x"],
        "placement": "pre",
        "layers": "h",
        "norms": [{"norm": "h.${i}.ln", "gamma_offset": 1}],
    }
    assert parse_family(copy.deepcopy(good), "x.yaml").norms[0].gamma_offset == 1.0
    bad = copy.deepcopy(good)
    bad["norms"][0]["eps"] = "small"
    with pytest.raises(NormswapError, match=r"x.yaml: norms\[0\].eps"):
        parse_family(bad, "x.yaml")
    bad = dict(good, centered_inputs=["h 0"])
    with pytest.raises(NormswapError, match=r"centered_inputs\[0\]"):
        parse_family(bad, "x.yaml")
    scaled = dict(good, stream_biases=["h.${i}.bias"], stream_scales=[{"scale": "h.${i}.ls", "writer": "h.${i}.out"}])
    family = parse_family(scaled, "x.yaml")
    assert family.stream_biases == ("h.${i}.bias",) and family.stream_scales[0].writer == "h.${i}.out"
    for wrong, where in (
        ({"scale": "h.${i}.ls"}, r"stream_scales\[0\]"),
        ({"scale": "h.${j}.ls", "writer": "o"}, r"stream_scales\[0\].scale"),
    ):
        with pytest.raises(NormswapError, match=where):
            parse_family(dict(good, stream_scales=[wrong]), "x.yaml")


# -- the CLI: convert without a family file, discover, refuse ---------------------------------------


def test_convert_discovers_records_and_reloads(tmp_path, run_cli):
    """convert on a ViT (no family file): one line says so, the description travels in OUT's config,
    stock transformers reloads OUT through its modeling file, and `families discover OUT` saves it."""
    from transformers import AutoModel

    config, cls = _config("vit")
    torch.manual_seed(0)
    src = randomize_(cls(config).eval())
    src.save_pretrained(tmp_path / "vit")
    code, out, err = run_cli("convert", tmp_path / "vit", tmp_path / "out")
    assert code == 0, err
    assert sum("no family file for model_type 'vit'" in line for line in err.splitlines()) == 1
    assert "exact: PASSED" in out
    block = json.loads((tmp_path / "out" / "config.json").read_text())["normswap"]
    assert block["discovered_family"]["placement"] == "pre" and block["mode"] == "exact"
    reloaded = AutoModel.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    inputs = probe_inputs(src, seed=5)
    with torch.no_grad():
        a, b = src(**inputs).last_hidden_state, reloaded(**inputs).last_hidden_state
    assert float((a - b).abs().max()) < 1e-4

    code, _, err = run_cli("families", "discover", tmp_path / "out", "--family-file", tmp_path / "vit.yaml")
    assert code == 0, err
    saved = parse_family(yaml.safe_load((tmp_path / "vit.yaml").read_text()), "vit.yaml")
    assert saved.discovered and saved.model_types == ("vit",)


def test_families_discover_config_file_and_refusal(tmp_path, run_cli):
    from transformers import CLIPVisionConfig, OlmoConfig

    NEW_OLMO = NEW["olmo"][2]
    OlmoConfig(**NEW_OLMO).save_pretrained(tmp_path / "olmo")
    code, out, err = run_cli("families", "discover", tmp_path / "olmo" / "config.json")
    assert code == 0, err
    assert yaml.safe_load(out)["placement"] == "pre" and "olmo: exact" in err

    CLIPVisionConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8
    ).save_pretrained(tmp_path / "clipv")
    code, out, err = run_cli("families", "discover", tmp_path / "clipv", "--family-file", tmp_path / "clipv.yaml")
    assert code != 0 and "raw residual stream" in err and "Traceback" not in err
    assert not (tmp_path / "clipv.yaml").exists()


def test_check_family_catches_a_wrong_description():
    """The safety net itself: a description missing one writer fails the exact check."""
    model = tiny_model("gpt2").double()
    raw = discover(model)
    raw["writers"] = raw["writers"][:1]
    result = check_family(parse_family(raw, "broken"), model.config)
    assert result["exact"] is False and result["max_abs_diff"] > 1e-3


def test_survey_sample():
    from normswap.architectures.survey import run_survey, survey_markdown

    rows = {r["model_type"]: r for r in run_survey(convert=convert_tiny, only=["vit", "llama", "bert"])}
    assert rows["vit"]["status"] == "exact"
    assert rows["llama"]["status"] == "no-layernorm"  # RMSNorm: nothing to try
    assert rows["bert"]["status"] == "approx-only"
    text = survey_markdown(list(rows.values()))
    assert "**Tried: 2** (traced, with LayerNorms) — exact: 1, approximate-only (post-LN): 1, refused: 0" in text
    # the figure without raw-stream refusals is a separate line, never the headline
    rows["clip_vision_model"] = {
        "model_type": "clip_vision_model",
        "curated": False,
        "status": "refused",
        "placement": "pre",
        "reason": (
            "CLIPVisionModel: pre-LN, but the raw residual stream of encoder.layers is returned as a model output"
        ),
    }
    text = survey_markdown(list(rows.values()))
    assert "converted exactly on tiny configs: 1 (50 %)" in text
    assert (
        "Exact among architectures whose stream ends in a norm (a separate figure; the one above is the "
        "headline): 1 of 1 (100 %)" in text
    )


def test_docs_quote_the_committed_survey():
    """docs/convert.md's numbers are the committed survey's (regenerate: `normswap families survey`)."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    survey = (root / "docs" / "architectures-survey.md").read_text()
    readme = (root / "docs" / "convert.md").read_text()
    summary = [
        line
        for line in survey.splitlines()
        if line.startswith(
            ("Enumerated:", "Pre-LN or undetermined", "Exact among architectures whose stream ends in a norm")
        )
    ]
    assert len(summary) == 3 and all(line in readme for line in summary)


# -- mechanisms added for the survey's refusals -----------------------------------------------------


def _tiny(cfg_name, model_name, **kwargs):
    import transformers

    return getattr(transformers, cfg_name)(**kwargs), getattr(transformers, model_name)


VISION = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8
)


def _exact_and_control(config, cls):
    """The discovered plan is exact, and the same plan without centring is caught by the check."""
    family, check = discover_family(config, cls)
    assert check["exact"], check
    control = check_family(_skip_centring(family), config, cls)
    assert control["exact"] is False and control["max_abs_diff"] > 1e-3
    return family


def test_random_masking_drawn_the_same_for_source_and_conversion():
    """ViT-MAE masks random patches at every forward: the check seeds both forwards alike, so the
    comparison is exact; without the seed the two draws differ and nothing would compare."""
    config, cls = _tiny(
        "ViTMAEConfig",
        "ViTMAEModel",
        decoder_hidden_size=32,
        decoder_num_hidden_layers=1,
        decoder_num_attention_heads=4,
        decoder_intermediate_size=64,
        **VISION,
    )
    _exact_and_control(config, cls)
    model = randomize_(cls(config).double().eval(), seed=1)
    inputs = probe_inputs(model, seed=1)
    a, b, c = (model_outputs(model, inputs, seed=s)["last_hidden_state"] for s in (0, 0, 1))
    assert torch.equal(a, b) and float((a - c).abs().max()) > 1e-3


def test_norm_called_twice_centres_its_non_stream_call():
    """BLIP's post_layernorm normalises the stream, then its own output's first token again: the
    second call reads a norm output (not centred), so its input is centred at run time."""
    config, cls = _tiny("BlipVisionConfig", "BlipVisionModel", **VISION)
    family = _exact_and_control(config, cls)
    assert "post_layernorm" in family.centered_inputs
    without = parse_family({**family.description, "centered_inputs": []}, "no run-time centring")
    result = check_family(without, config, cls)
    assert result["exact"] is False and result["changed_outputs"] == ["pooler_output"]


def test_siglip_conv_patch_embedding_centred_through_its_block():
    """SigLIP's stream starts with conv patches moved to channels-last (flatten, transpose) plus positions;
    the conv output itself is not centred along its last axis, so the whole embeddings block is."""
    config, cls = _tiny("SiglipVisionConfig", "SiglipVisionModel", **VISION)
    family = _exact_and_control(config, cls)
    assert "embeddings" in [e.module for e in family.embeddings]
    wrong = parse_family(
        {**family.description, "embeddings": ["embeddings.patch_embedding", "embeddings.position_embedding"]}, "conv"
    )
    assert check_family(wrong, config, cls)["exact"] is False


def test_hierarchical_and_bare_norm_stacks():
    """PVT's stages are separate layer stacks; the raw stream of one is read by the next stage's
    patch embedding (a conv, no norm), which an exact conversion would shift: refused with the
    reason. XLM keeps its norms in bare lists after each residual add: post-LN, approximate only."""
    config, cls = _tiny(
        "PvtConfig",
        "PvtModel",
        image_size=32,
        hidden_sizes=[16, 32],
        num_encoder_blocks=2,
        depths=[1, 1],
        sequence_reduction_ratios=[2, 1],
        num_attention_heads=[1, 2],
        patch_sizes=[4, 2],
        strides=[4, 2],
        mlp_ratios=[2, 2],
    )
    with pytest.raises(
        DiscoveryError, match=r"raw residual stream of encoder\.block\.0 is read by encoder\.patch_embeddings\.1"
    ):
        discover_family(config, cls)
    config, cls = _tiny(
        "XLMConfig", "XLMModel", emb_dim=64, n_layers=2, n_heads=4, vocab_size=128, max_position_embeddings=32
    )
    family, check = discover_family(config, cls)
    assert check["exact"] is None and family.placement == "post"
    assert {n.norm for n in family.norms} >= {"layer_norm1.0", "layer_norm2.1"}


# -- --family-file: a saved description, checked again before it is used ---------------------------


def test_family_file_round_trip_and_refusals(tmp_path, run_cli):
    """`families discover --family-file FILE` then `convert --family-file FILE` converts exactly; a file that
    drops a writer, names another model_type or is not YAML is refused in one line, OUT not written."""
    config, cls = _config("vit")
    src = randomize_(cls(config).eval(), seed=4)
    src.save_pretrained(tmp_path / "vit")
    code, _, err = run_cli("families", "discover", tmp_path / "vit", "--family-file", tmp_path / "vit.yaml")
    assert code == 0, err
    code, out, err = run_cli("convert", tmp_path / "vit", tmp_path / "out", "--family-file", tmp_path / "vit.yaml")
    assert code == 0, err
    assert f"using the family file {tmp_path / 'vit.yaml'}" in err and "exact: PASSED" in out
    block = json.loads((tmp_path / "out" / "config.json").read_text())["normswap"]
    assert block["discovered_family"] == yaml.safe_load((tmp_path / "vit.yaml").read_text())

    raw = yaml.safe_load((tmp_path / "vit.yaml").read_text())
    bad = {
        "dropped": {**raw, "writers": raw["writers"][:1]},
        "other": {**raw, "model_types": ["deit"]},
    }
    for name, content in bad.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(content))
    (tmp_path / "broken.yaml").write_text("norms: [unclosed\n")
    for name, message in (
        ("dropped", "is not exact on a tiny randomised vit instance"),
        ("other", "describes model_types deit, not 'vit'"),
        ("broken", "not valid YAML"),
    ):
        code, _, err = run_cli(
            "convert", tmp_path / "vit", tmp_path / f"out-{name}", "--family-file", tmp_path / f"{name}.yaml"
        )
        assert code != 0 and message in err and "Traceback" not in err, (name, err)
        assert not (tmp_path / f"out-{name}").exists()


def test_families_all_lists_what_the_committed_survey_converted(run_cli):
    """Plain `families` lists the curated files and says how many more convert through discovery;
    `--all` adds those (exact and approximate) from the shipped survey, never a refused one."""
    from normswap.architectures.survey import shipped_rows

    status = {r["model_type"]: r["status"] for r in shipped_rows()}
    curated = {r["model_type"] for r in shipped_rows() if r["curated"]}  # gpt-sw3's config is a GPT-2 one
    code, out, err = run_cli("families")
    assert code == 0 and "vit" not in out.split() and "normswap families --all" in err
    code, out, _ = run_cli("families", "--all", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["gpt2"]["data_file"] and rows["vit"]["discovered"] and rows["vit"]["exact"]
    listed = {r["model_types"][0] for r in rows.values() if r.get("discovered")}
    assert listed == {mt for mt, s in status.items() if s in ("exact", "approx-only")} - curated
    assert status["clip_vision_model"] == "refused" and "clip_vision_model" not in listed


# -- fidelity for models without text input: eval report on probe inputs ---------------------------


@pytest.mark.parametrize("key", ["vit", pytest.param("whisper", marks=pytest.mark.slow)])
def test_eval_report_fidelity_on_probe_inputs(tmp_path, run_cli, key):
    """`normswap eval report` on a ViT (images) or Whisper (audio features + decoder ids) and its
    conversions reports fidelity to the original on probe inputs instead of refusing: the exact
    conversion matches to float32 rounding, the approximate one (no centring) visibly does not."""
    config, cls = _config(key)
    src = randomize_(cls(config).eval(), seed=6)
    src.save_pretrained(tmp_path / "src")
    for mode in ("exact", "approx"):
        code, _, err = run_cli(
            "convert", tmp_path / "src", tmp_path / mode, "--mode", mode, *(["--no-verify"] if mode == "approx" else [])
        )
        assert code == 0, err
    code, out, err = run_cli(
        "eval",
        "report",
        f"orig={tmp_path / 'src'}",
        f"exact={tmp_path / 'exact'}",
        f"approx={tmp_path / 'approx'}",
        "--out",
        tmp_path / "report",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    )  # pinned: "float32 rounding" below
    assert code == 0, err
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    setup = results["fidelity_setup"]
    assert setup["method"] == "probe inputs" and setup["reference"] == "orig"
    assert ("pixel_values" if key == "vit" else "input_features") in setup["inputs"]
    fid = {m["name"]: m["fidelity"] for m in results["models"]}
    assert fid["orig"]["max_abs_diff"] == 0.0
    assert fid["exact"]["max_rel_diff"] < 1e-5 and fid["exact"]["output_cosine"] > 1 - 1e-9
    assert fid["approx"]["max_rel_diff"] > 1e-3 and fid["approx"]["hidden_cosine"] < fid["exact"]["hidden_cosine"]
    assert results["models"][0]["perplexity"] is None and "max |Δ|" in (tmp_path / "report" / "report.md").read_text()


# -- refusals the survey showed were discovery's own misses ----------------------------------------


def test_post_ln_models_with_unowned_writes_are_approx_only_and_convert(tmp_path, run_cli):
    """FNet's Fourier mixing (``.real`` of an FFT) and XLNet's two-stream attention write into the
    stream without a module: that only blocks an exact plan. Both put the norm after the residual
    addition (post-LN), so discovery says so, the approximate plan converts and runs, and convert
    takes it in approx mode (XLNet's max_position_embeddings is -1, which is no probe length)."""
    fnet = _tiny(
        "FNetConfig",
        "FNetModel",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=32,
        pad_token_id=0,
    )
    xlnet = _tiny(
        "XLNetConfig",
        "XLNetLMHeadModel",
        vocab_size=128,
        d_model=64,
        n_layer=2,
        n_head=4,
        d_inner=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    for config, cls in (fnet, xlnet):
        family, check = discover_family(config, cls)
        assert family.placement == "post" and check["exact"] is None and check["mode"] == "approx", check
        assert resolve_family(config, cls).placement == "post"
        # control: the same plan called pre-LN is caught by the exact check (post-LN is no excuse)
        as_pre = parse_family({**family.description, "placement": "pre"}, "forced pre")
        assert check_family(as_pre, config, cls)["exact"] is False
    # control: a post-LN plan whose approximate conversion cannot apply is refused, not listed as approx-only
    broken = {**family.description, "norms": family.description["norms"] + [{"norm": "no.such.norm", "readers": []}]}
    result = check_family(parse_family(broken, "broken"), config, cls)
    assert result["exact"] is False and "post-LN, and the approximate conversion fails" in result["reason"]
    config, cls = xlnet
    torch.manual_seed(0)
    randomize_(cls(config).eval(), seed=0).save_pretrained(tmp_path / "xlnet")
    code, out, err = run_cli("convert", tmp_path / "xlnet", tmp_path / "out")
    assert code == 0 and "approx mode" in out, err
    code, _, err = run_cli("convert", tmp_path / "xlnet", tmp_path / "exact", "--mode", "exact")
    assert code != 0 and "is post-LN" in err and "Traceback" not in err


def test_bias_vector_added_to_the_stream_is_centred():
    """GPT-NeoX-Japanese's last attention returns its dense_bias beside its output, and the layer adds
    ``bias.expand_as(residual)`` to the stream: the vector is centred (the residual only lends its
    shape, it is not read). Without that record the plan is not exact."""
    config, cls = _tiny(
        "GPTNeoXJapaneseConfig",
        "GPTNeoXJapaneseForCausalLM",
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_multiple_size=2,
        max_position_embeddings=64,
    )
    family, check = discover_family(config, cls)
    assert family.placement == "pre" and check["exact"], check
    assert family.stream_biases == ("layers.1.attention.dense_bias",)  # only the last layer has one
    without = parse_family({k: v for k, v in family.description.items() if k != "stream_biases"}, "no stream bias")
    control = check_family(without, config, cls)
    assert control["exact"] is False and control["max_abs_diff"] > 1e-3


def test_layer_scale_folded_into_its_writer():
    """InternVL's vision layers add λ⊙o_proj(x) to the stream (λ a parameter vector): λ folds into the
    writer's rows, which are then centred, and λ becomes ones; without the fold the centred rows are
    rescaled per feature and the write is no longer zero-mean. With mean pooling (no final norm) the
    raw stream is the output, which discovery refuses with that reason."""
    config, cls = _tiny("InternVLVisionConfig", "InternVLVisionModel", use_mean_pooling=False, **VISION)
    family, check = discover_family(config, cls)
    assert check["exact"], check
    assert {(s.scale, s.writer) for s in family.stream_scales} == {
        ("encoder.layer.${i}.lambda_1", "encoder.layer.${i}.attention.projection_layer"),
        ("encoder.layer.${i}.lambda_2", "encoder.layer.${i}.mlp.fc2"),
    }
    model = randomize_(cls(copy.deepcopy(config)).double().eval(), seed=2)
    convert_model(model, family=family, mode="exact")
    assert torch.equal(model.encoder.layer[0].lambda_1, torch.ones_like(model.encoder.layer[0].lambda_1))
    without = parse_family({k: v for k, v in family.description.items() if k != "stream_scales"}, "no fold")
    control = check_family(without, config, cls)
    assert control["exact"] is False and control["max_abs_diff"] > 1e-3, control
    # a layer scale named on a Linear that is not a stream writer is refused when planning
    misplaced = {
        **family.description,
        "stream_scales": [{"scale": "encoder.layer.${i}.lambda_2", "writer": "encoder.layer.${i}.mlp.fc1"}],
    }
    result = check_family(parse_family(misplaced, "misplaced"), config, cls)
    assert result["exact"] is False and "must scale a centred Linear writer" in result["reason"]
    config, cls = _tiny("InternVLVisionConfig", "InternVLVisionModel", use_mean_pooling=True, **VISION)
    with pytest.raises(DiscoveryError, match="raw residual stream of encoder.layer is returned as a model output"):
        discover_family(config, cls)


def test_tied_table_shared_under_several_names_stays_the_heads():
    """SeamlessM4T's text encoder, text decoder and head share one table: the head must keep the
    original matrix, so every name of that table is centred at run time, not in its rows. The plan
    made as if nothing were tied centres the rows and changes the logits."""
    from transformers import SeamlessM4TConfig, SeamlessM4TForTextToText

    config = SeamlessM4TConfig(
        vocab_size=128,
        hidden_size=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        speech_encoder_layers=1,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        decoder_start_token_id=3,
        t2u_vocab_size=64,
        unit_embed_dim=16,
    )
    family, check = discover_family(config, SeamlessM4TForTextToText)
    assert check["exact"], check
    model = randomize_(SeamlessM4TForTextToText(config).double().eval(), seed=1)
    plan = build_plan(family, model, config, ConvertOptions())
    assert not any(v["op"] == "center_rows" for v in plan.derivations.values())
    assert {"text_encoder.embed_tokens", "text_decoder.embed_tokens"} <= set(plan.block["centered_outputs"])
    untied = build_plan(family, model, config, ConvertOptions(), tied=False)
    assert any(v["op"] == "center_rows" for v in untied.derivations.values())  # what the name-only test did


def test_groupvit_token_mixing_and_grouping_exact():
    """GroupViT mixes its group tokens with an MLP over the token axis (a Linear reading a transposed
    norm output: no γ fold, no row centring there) and feeds a norm output both to the stream and to a
    cross-attention query (centred downstream, where the next stage's layers read it)."""
    config, cls = _tiny(
        "GroupViTConfig",
        "GroupViTModel",
        text_config=dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=128,
            max_position_embeddings=32,
        ),
        vision_config=dict(
            hidden_size=64,
            depths=[2, 1, 1],
            num_group_tokens=[8, 4, 0],
            num_output_groups=[8, 4, 4],
            num_attention_heads=4,
            intermediate_size=128,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=32,
        projection_intermediate_dim=64,
    )
    family = _exact_and_control(config, cls)
    desc = family.description
    readers = {r for n in desc["norms"] for r in n["readers"]}
    assert not any("mlp_inter" in r for r in readers)
    assert not any(n.get("starts_stream") and "norm_post_tokens" in n["norm"] for n in desc["norms"])


def test_cast_that_returns_its_input_keeps_the_residual_a_stream_value():
    """Cohere2-MoE's experts run only in float32, so discovery traces it in float32, where the norm's
    ``x.to(float32)`` returns x itself: the trace keeps x's node (the residual kept aside is still the
    stream), so the model is pre-LN and exact, not mistaken for post-LN."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("cohere2_moe")
    family, check = discover_family(config)
    assert family.placement == "pre" and check["exact"], check
    control = check_family(_skip_centring(family), config, dtype=torch.float32)  # float32: what the experts run in
    assert control["exact"] is False and control["max_abs_diff"] > 1e-3


def test_average_pooling_over_frames_keeps_the_stream_centred():
    """Qwen2-Audio's encoder averages pairs of frames (avg_pool1d on a channel-first view) between its
    last layer and its final norm: channels never mix, so the pooled stream is still centred and the
    conversion is exact. Without following the pooling it was refused as a raw stream read by a
    non-norm module; the skip-centring control shows the check still catches a wrong plan."""
    config, cls = _tiny(
        "Qwen2AudioEncoderConfig",
        "Qwen2AudioEncoder",
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        num_mel_bins=16,
        max_source_positions=32,
    )
    family = _exact_and_control(config, cls)
    assert family.final_norm is not None and family.final_norm.norm == "layer_norm"


def test_raw_stream_architectures_keep_their_pooled_outputs_exact():
    """CLIP's vision tower returns its raw stream as last_hidden_state (refused by default), but its
    pooler_output passes through post_layernorm: converted with the plan discovery describes when the
    raw stream may be an output, pooler_output stays exact and only last_hidden_state moves (by its
    per-token mean). Control: VitDet returns nothing but the raw stream, so nothing stays exact."""
    from normswap.architectures.survey import declared_outputs_one, raw_stream_refusals

    assert {"clip_vision_model", "vitdet"} <= set(raw_stream_refusals())
    clip = declared_outputs_one("clip_vision_model", convert=convert_tiny)
    assert clip["status"] == "exact-on-pooled", clip
    assert clip["exact_outputs"] == ["pooler_output"] and clip["changed_outputs"] == ["last_hidden_state"]
    vitdet = declared_outputs_one("vitdet", convert=convert_tiny)
    assert vitdet["status"] == "refused" and vitdet["exact_outputs"] == []
