"""Recipes: schema validation (every shipped recipe, and one-line errors naming file and key),
--set overrides, the offline guard of needs_network recipes, and a small end-to-end run with its
provenance files and --resume."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from helpers import checked_run

from normswap.checkpoint.shards import SINGLE_NAME
from normswap.errors import NormswapError
from normswap.recipes import load_recipe, shipped_recipes, validate
from normswap.recipes.loader import apply_overrides
from normswap.recipes.schema import report_names

REPO = Path(__file__).resolve().parents[1]
SHIPPED = shipped_recipes()

HUB_FAMILIES = {
    "gpt2",
    "pythia-160m",
    "opt-125m",
    "bloom-560m",
    "phi-2",
    "gpt-neo-125m",
    "falcon-rw-1b",
    "bert-base-uncased",
}


def _minimal(**extra):
    raw = {"name": "t", "source": "normswap:kjv-gpt2", "variants": {"exact": {"convert": {"mode": "exact"}}}}
    raw.update(extra)
    return raw


# ------------------------------------------------------------------ shipped recipes
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_recipe_validates(name):
    loaded = load_recipe(name)
    r = loaded.recipe
    assert r["name"] == name  # file name and recipe name agree (`normswap run NAME` finds it)
    assert r["variants"]
    if name != "quickstart":
        assert r["needs_network"] is True, "hub recipes must say they need the network"
    # the resolved form re-validates to itself (what DIR/recipe.yaml holds can be run again)
    assert validate(yaml.safe_load(yaml.safe_dump(r)), "resolved") == r


def test_shipped_set_covers_the_families_and_the_root_recipes_dir_is_the_same():
    assert {"quickstart"} | HUB_FAMILIES <= set(SHIPPED)
    root = REPO / "recipes"
    assert sorted(p.name for p in root.glob("*.yaml")) == sorted(p.name for p in SHIPPED.values())
    for p in root.glob("*.yaml"):
        assert p.read_text() == SHIPPED[p.stem].read_text()


def test_quickstart_is_offline_and_shows_exact_approx_sliced_and_healed():
    r = load_recipe("quickstart").recipe
    assert r["needs_network"] is False and r["source"] == "normswap:kjv-gpt2" and r["data"] == "embedded"
    assert report_names(r) == ["original", "exact", "approx", "approx-healed", "sliced", "sliced-healed", "sliced-int8"]
    assert r["variants"]["sliced"]["slice"]["fraction"] == 0.25 and r["variants"]["sliced"]["convert"] is None
    assert r["variants"]["exact"]["convert"]["mode"] == "exact"
    assert r["variants"]["approx"]["convert"] == dict(r["variants"]["approx"]["convert"], mode="approx", beta="drop")


def test_bert_recipe_measures_fidelity_not_perplexity():
    r = load_recipe("bert-base-uncased").recipe
    assert r["task"] == "masked-lm"
    assert r["eval"]["perplexity"] is False and r["eval"]["fidelity"] is True
    assert all(v["finetune"] is None for v in r["variants"].values())


# ------------------------------------------------------------------ schema errors
def _error(raw, where="recipes/x.yaml") -> str:
    with pytest.raises(NormswapError) as e:
        validate(raw, where)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(where + ": ")
    return msg


def test_unknown_key_is_named_with_its_dotted_path_and_a_suggestion():
    raw = _minimal(variants={"approx": {"convert": {"mode": "approx"}, "finetune": {"stpes": 10}}})
    msg = _error(raw)
    assert "variants.approx.finetune.stpes: unknown key" in msg and "did you mean steps" in msg
    # negative control: the correct spelling passes and is typed
    raw["variants"]["approx"]["finetune"] = {"steps": 10}
    assert validate(raw, "x")["variants"]["approx"]["finetune"]["steps"] == 10
    assert "eval.seqlen" in _error(_minimal(eval={"seqlen": 64}))
    assert "sourse" in _error({"name": "t", "sourse": "x", "source": "y", "variants": {"a": {"convert": {}}}})


@pytest.mark.parametrize(
    "section,key,value,needle",
    [
        ("finetune", "steps", "ten", "expected an integer"),
        ("finetune", "steps", 0, "must be >= 1"),
        ("finetune", "lr", "fast", "expected a number"),
        ("finetune", "schedule", "warm", "expected one of constant, cosine, linear"),
        ("convert", "mode", "fuzzy", "expected one of auto, exact, approx"),
        ("convert", "verify", "yes please", "expected true or false"),
    ],
)
def test_bad_values_name_the_key(section, key, value, needle):
    variant = {"convert": {"mode": "approx"}, "finetune": {"steps": 5}}
    variant[section][key] = value
    msg = _error(_minimal(variants={"v": variant}))
    assert f"variants.v.{section}.{key}" in msg and needle in msg


def test_structure_errors():
    assert "variants: missing" in _error({"name": "t", "source": "s"})
    assert "name: missing" in _error({"source": "s", "variants": {"a": {"convert": {}}}})
    assert "needs convert" in _error(_minimal(variants={"a": {}}))
    assert "names 'original'" in _error(_minimal(variants={"original": {"convert": {}}}))
    assert "eval.perplexity" in _error(_minimal(task="masked-lm", eval={"perplexity": True}))
    validate(
        _minimal(task="masked-lm", variants={"a": {"convert": {}, "finetune": {}}}), "recipes/x.yaml"
    )  # encoders heal too
    assert "a recipe is a YAML mapping" in _error(["not", "a", "mapping"])


def test_yaml_1_1_exponents_are_numbers():
    # PyYAML reads `1e-3` as a string; a recipe author means the number
    raw = _minimal(variants={"a": {"convert": {}, "finetune": {"lr": "1e-3"}}})
    assert validate(raw, "x")["variants"]["a"]["finetune"]["lr"] == pytest.approx(1e-3)


def test_invalid_yaml_is_one_line_with_position(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: t\nvariants: {a: [\n")
    with pytest.raises(NormswapError) as e:
        load_recipe(str(p))
    assert str(e.value).startswith(f"{p}: invalid YAML at line") and "\n" not in str(e.value)


def test_missing_recipe_lists_the_shipped_ones():
    with pytest.raises(NormswapError, match="neither a file nor a shipped recipe.*quickstart"):
        load_recipe("no-such-recipe")


# ------------------------------------------------------------------ --set
def test_overrides_are_dotted_and_typed():
    r = load_recipe(
        "quickstart",
        [
            "finetune.steps=7",
            "models.approx.convert.beta=keep",
            "eval.speed=false",
            "eval.tasks=[normswap_kjv]",
            "variants.approx.finetune.lr=2e-3",
            "eval.max_tokens=0",
            "source=/some/dir",
        ],
    ).recipe
    ft = r["variants"]["approx"]["finetune"]
    assert ft["steps"] == 7 and isinstance(ft["steps"], int)
    assert ft["lr"] == pytest.approx(2e-3)
    assert r["variants"]["approx"]["convert"]["beta"] == "keep"
    assert r["eval"]["speed"] is False and r["eval"]["tasks"] == ["normswap_kjv"] and r["eval"]["max_tokens"] == 0
    assert r["source"] == "/some/dir"
    # the exact variant has no finetune section: `finetune.steps` does not invent one there
    assert r["variants"]["exact"]["finetune"] is None


def test_override_with_empty_value_restores_the_default():
    base = load_recipe("quickstart").recipe
    assert base["variants"]["approx"]["finetune"]["lr"] != 3e-4
    r = load_recipe("quickstart", ["variants.approx.finetune.lr="]).recipe
    assert r["variants"]["approx"]["finetune"]["lr"] == 3e-4  # the schema default


def test_override_errors_name_the_key():
    with pytest.raises(NormswapError, match="variants.approx.finetune.steps: expected an integer"):
        load_recipe("quickstart", ["finetune.steps=many"])
    with pytest.raises(NormswapError, match="expected KEY=VALUE"):
        load_recipe("quickstart", ["finetune.steps"])
    with pytest.raises(NormswapError, match="name is 'quickstart', not a section"):
        load_recipe("quickstart", ["name.x=1"])
    with pytest.raises(NormswapError, match="unknown key"):
        load_recipe("quickstart", ["eval.colour=red"])


def test_overrides_do_not_touch_the_parsed_original():
    raw = _minimal()
    apply_overrides(raw, ["variants.exact.convert.mode=approx"], "x")
    assert raw["variants"]["exact"]["convert"]["mode"] == "exact"


# ------------------------------------------------------------------ needs_network offline
def test_network_recipe_offline_fails_fast_in_one_line(tmp_path, monkeypatch):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "empty-cache"), PYTHONPATH=str(REPO))
    out = tmp_path / "run"
    p = checked_run(
        [sys.executable, "-m", "normswap", "run", "pythia-160m", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "needs the network" in lines[0] and "EleutherAI/pythia-160m" in lines[0], p.stderr
    assert "Traceback" not in p.stderr
    assert not out.exists()  # refused before anything was written
    # negative control: the same recipe pointed at a local source is not refused for the network
    from normswap.recipes.steps import require_network

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    require_network(load_recipe("pythia-160m", [f"source={tmp_path}"]).recipe)
    require_network(load_recipe("quickstart").recipe)  # needs_network: false
    with pytest.raises(NormswapError, match="offline mode is on"):
        require_network(load_recipe("pythia-160m").recipe)


# ------------------------------------------------------------------ a small real run
MINI = """\
# a small recipe for the test-suite
name: mini
source: normswap:kjv-gpt2
device: cpu  # pinned: the test compares float32 perplexities (auto is bf16 on CUDA)
variants:
  exact: {convert: {mode: exact}}
  approx:
    convert: {mode: approx, beta: drop}
    finetune: {steps: 2, warmup_steps: 1, batch_size: 2, seq_len: 64, eval_tokens: 256, lr: 1e-3}
eval: {seq_len: 64, stride: 32, max_tokens: 1024, speed: false, diagnostics: false}
report: {title: mini run}
"""


@pytest.fixture(scope="module")
def mini_run(tmp_path_factory):
    from normswap.cli.main import main

    root = tmp_path_factory.mktemp("mini")
    recipe = root / "mini.yaml"
    recipe.write_text(MINI)
    out = root / "run"
    try:
        main(["run", str(recipe), "--out", str(out), "--set", "eval.batch_size=4"])
    except SystemExit as e:
        assert e.code in (0, None)
    return recipe, out


@pytest.mark.slow
def test_run_writes_models_report_and_provenance(mini_run):
    recipe, out = mini_run
    for name in ("exact", "approx", "approx-healed"):
        assert (out / "models" / name / "config.json").is_file()
    assert (out / "models" / "approx-healed" / "train_log.jsonl").is_file()
    assert (out / "recipe.original.yaml").read_text() == MINI
    resolved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert resolved["eval"]["batch_size"] == 4  # the --set is in the resolved copy...
    assert "batch_size: 4" not in MINI  # ...and not in the original
    assert validate(resolved, "resolved")["variants"]["approx"]["finetune"]["steps"] == 2
    state = json.loads((out / "run.json").read_text())
    assert state["status"] == "finished" and state["overrides"] == ["eval.batch_size=4"]
    assert set(state["steps"]) == {"convert:exact", "convert:approx", "finetune:approx-healed", "eval"}
    results = json.loads((out / "report" / "results.json").read_text())
    assert [m["name"] for m in results["models"]] == ["original", "exact", "approx", "approx-healed"]
    assert results["baseline"] == "original" and results["title"] == "mini run"
    for f in ("report.md", "report.html"):
        assert (out / "report" / f).is_file()
    ppl = {m["name"]: m["perplexity"] for m in results["models"]}
    assert ppl["exact"] == pytest.approx(ppl["original"], rel=1e-4)
    assert abs(ppl["approx"] / ppl["original"] - 1) > 1e-3  # negative control: dropping β is visible
    rows = {r["model"]: r for r in state["summary"]}
    assert rows["exact"]["delta_vs_original"] == pytest.approx(ppl["exact"] / ppl["original"] - 1)
    assert "| approx-healed |" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_run_refuses_to_overwrite_and_resume_redoes_only_what_changed(mini_run, run_cli):
    recipe, out = mini_run
    code, _, err = run_cli("run", recipe, "--out", out)
    assert code == 2 and "holds a previous run" in err and "--resume" in err
    before = json.loads((out / "run.json").read_text())["steps"]
    weights = (out / "models" / "approx-healed" / SINGLE_NAME).read_bytes()

    # only the evaluation changed: no model step runs again
    code, _, err = run_cli("run", recipe, "--out", out, "--resume", "--set", "eval.max_tokens=512")
    assert code == 0, err
    after = json.loads((out / "run.json").read_text())["steps"]
    for step in ("convert:exact", "convert:approx", "finetune:approx-healed"):
        assert after[step]["finished"] == before[step]["finished"], step
    assert after["eval"]["fingerprint"] != before["eval"]["fingerprint"]
    assert "skipped" in err
    assert json.loads((out / "report" / "results.json").read_text())["data"]["max_tokens"] == 512

    # a fine-tune option changed: the fine-tune (and the evaluation) run again, the conversions do not
    code, _, err = run_cli("run", recipe, "--out", out, "--resume", "--set", "finetune.steps=3")
    assert code == 0, err
    again = json.loads((out / "run.json").read_text())["steps"]
    assert again["convert:approx"]["finished"] == before["convert:approx"]["finished"]
    assert again["finetune:approx-healed"]["fingerprint"] != before["finetune:approx-healed"]["fingerprint"]
    assert (out / "models" / "approx-healed" / SINGLE_NAME).read_bytes() != weights


def test_run_never_deletes_a_directory_it_did_not_write(tmp_path, run_cli):
    other = tmp_path / "precious"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    code, _, err = run_cli("run", "quickstart", "--out", other, "--force")
    assert code == 2 and "not a normswap run" in err
    assert (other / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
def test_masked_lm_recipe_reports_fidelity_against_the_source(tmp_path, run_cli):
    """The BERT recipe's path on a tiny real BertForMaskedLM with its own WordPiece vocabulary."""
    from helpers import tiny_model, tiny_wordpiece

    tok = tiny_wordpiece()
    src = tmp_path / "tinybert"
    tiny_model("bert", task="masked-lm").save_pretrained(src)
    tok.save_pretrained(src)
    out = tmp_path / "run"
    code, stdout, err = run_cli(
        "run",
        "bert-base-uncased",
        "--out",
        out,
        "--set",
        f"source={src}",
        "--set",
        "needs_network=false",
        "--set",
        "eval.fidelity_tokens=1024",
        "--set",
        "eval.speed=false",
        "--set",
        "eval.memory=false",
        "--set",
        "device=cpu",
    )  # pinned: float32 tolerances below
    assert code == 0, err
    results = json.loads((out / "report" / "results.json").read_text())
    fid = {m["name"]: m["fidelity"] for m in results["models"]}
    assert list(fid) == ["original", "approx", "approx-no-beta"]
    assert fid["original"]["hidden_cosine"] == pytest.approx(1.0, abs=1e-6) and fid["original"]["top1_agreement"] == 1.0
    for name in ("approx", "approx-no-beta"):  # approximate conversions are measurably not the source
        assert fid[name]["hidden_cosine"] < 0.999 and fid[name]["masked_perplexity"] > 0
    assert all(m["perplexity"] is None for m in results["models"])  # not defined for a masked LM
    assert "hidden cosine" in stdout and "masked ppl" in stdout


# ------------------------------------------------------------------ hostile files
def _alias_bomb(levels=10, fanout=9) -> str:
    """A flow list whose anchors nest: it stands for fanout**levels strings in a few hundred bytes."""
    parts = ["&l0 [" + ", ".join(["lol"] * fanout) + "]"]
    for i in range(1, levels):
        parts.append(f"&l{i} [" + ", ".join([f"*l{i - 1}"] * fanout) + "]")
    return "[" + ", ".join(parts) + "]"


def _run_check(path, tmp_path):
    """`normswap run FILE --check` in a child limited to 1 GiB of address space and 60 s."""
    limit = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
        "from normswap.cli.main import main; main(sys.argv[1:])"
    )
    return checked_run(
        [sys.executable, "-c", limit, "run", str(path), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.parametrize("where", ["description", "finetune.steps"])
def test_alias_bomb_fails_fast_in_one_line_in_bounded_memory(tmp_path, where):
    bomb = _alias_bomb()
    if where == "description":
        text = (
            f"name: t\ndescription: {bomb}\nsource: normswap:kjv-gpt2\n"
            "variants:\n  exact: {convert: {mode: exact}}\n"
        )
    else:
        text = (
            "name: t\nsource: normswap:kjv-gpt2\nvariants:\n  approx:\n    convert: {mode: approx}\n"
            f"    finetune: {{steps: {bomb}}}\n"
        )
    p = tmp_path / "bomb.yaml"
    p.write_text(text)
    assert len(text) < 2000  # a few hundred bytes standing for billions of values
    proc = _run_check(p, tmp_path)
    assert proc.returncode == 2, proc.stderr[-500:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "aliases expand to more than" in lines[0] and "Traceback" not in proc.stderr
    assert len(lines[0]) < 400


def test_modest_aliases_still_work_and_bad_values_are_shown_cut(tmp_path):
    # anchors that share a fine-tune section between variants are ordinary YAML: accepted
    p = tmp_path / "shared.yaml"
    p.write_text(
        "name: t\nsource: normswap:kjv-gpt2\nvariants:\n  a: {convert: {mode: approx}, finetune: &ft {steps: 7}}\n"
        "  b: {convert: {mode: approx, beta: keep}, finetune: *ft}\n"
    )
    r = load_recipe(str(p))
    assert r.recipe["variants"]["a"]["finetune"]["steps"] == r.recipe["variants"]["b"]["finetune"]["steps"] == 7
    # a wrong value thousands of entries long is named, and quoted only in part
    big = tmp_path / "big.yaml"
    big.write_text(
        "name: t\nsource: normswap:kjv-gpt2\nvariants:\n  a:\n    convert: {mode: approx}\n"
        "    finetune:\n      steps: [" + ", ".join(str(i) for i in range(5000)) + "]\n"
    )
    with pytest.raises(NormswapError) as e:
        load_recipe(str(big))
    msg = str(e.value)
    assert "variants.a.finetune.steps: expected an integer, got [0, 1, 2" in msg and "..." in msg and len(msg) < 300


def test_oversized_recipe_is_refused_before_parsing(tmp_path):
    p = tmp_path / "huge.yaml"
    p.write_text("name: t\ndescription: " + "x" * (5 << 20) + "\n")
    with pytest.raises(NormswapError, match="a recipe is at most"):
        load_recipe(str(p))


# ------------------------------------------------------------------ the run as steps
def test_a_recipe_runs_as_an_ordered_list_of_steps():
    from normswap.recipes.steps import ConvertStep, EvalStep, ExportStep, FinetuneStep, SliceStep, plan_steps

    steps = plan_steps(load_recipe("quickstart").recipe)
    assert [s.name for s in steps] == [
        "convert:exact", "convert:approx", "finetune:approx-healed", "slice:sliced", "finetune:sliced-healed",
        "slice:sliced-int8+pytorch", "export:sliced-int8", "eval",
    ]  # fmt: skip
    assert [type(s) for s in steps] == [
        ConvertStep, ConvertStep, FinetuneStep, SliceStep, FinetuneStep, SliceStep, ExportStep, EvalStep
    ]  # fmt: skip
    # each model step reads what the step before it wrote; the evaluation reads every model of the report
    assert (steps[1].source, steps[2].source) == ("original", "approx")
    assert (steps[3].source, steps[4].source) == ("original", "sliced")
    assert steps[-1].names == ["original", "exact", "approx", "approx-healed", "sliced", "sliced-healed", "sliced-int8"]
    # negative control: a variant that only fine-tunes reads the source and keeps its own name
    r = load_recipe("quickstart", ["variants.approx.convert="]).recipe
    assert [(s.name, getattr(s, "source", None)) for s in plan_steps(r)][1:3] == [
        ("finetune:approx", "original"),
        ("slice:sliced", "original"),
    ]


def test_finetune_progress_comes_from_the_trainer_hook_and_its_log(tmp_path):
    """The fine-tune's progress lines come through the trainer's after_step hook and read the loss
    the trainer logged for that step (normswap/progress.py; a fake clock, no sleeps)."""
    from normswap.finetune import FinetuneConfig, run_finetune
    from normswap.finetune.run_dir import RunDir
    from normswap.progress import Heartbeat, StepProgress
    from normswap.testing import FinetuneHooks as Hooks

    now = [0.0]
    lines = []
    beat = Heartbeat(lines.append, every=10.0, enabled=True, clock=lambda: now[0])
    out = tmp_path / "ft"

    def after_step(step):
        StepProgress(RunDir(out), 3, beat.update, clock=lambda: now[0])(step)
        now[0] += 10.0 if step > 1 else 1.0  # step 1 ends before the first interval, steps 2 and 3 at one each
        beat.tick()

    run_finetune(
        FinetuneConfig(
            model="normswap:kjv-gpt2",
            out=str(out),
            steps=3,
            warmup_steps=1,
            seq_len=32,
            batch_size=2,
            eval_tokens=256,
            progress=False,
            device="cpu",
        ),
        hooks=Hooks(after_step=after_step),
        echo=lambda m: None,
    )
    logged = {r["step"]: r["loss"] for r in RunDir(out).rows() if r.get("loss") is not None}
    assert [ln.split("  ")[0] for ln in lines] == ["step 2/3", "step 3/3"]  # step 1 fell inside the first interval
    assert f"loss {logged[2]:.3f}" in lines[0] and f"loss {logged[3]:.3f}" in lines[1]


# ------------------------------------------------------------------ the slice stage
def test_a_slice_stage_is_declared_from_slice_options_and_plans_a_slice_step():
    from normswap.recipes.steps import SliceStep, plan_steps
    from normswap.slice.config import SliceOptions

    raw = _minimal(variants={"s": {"slice": {"fraction": 0.3}, "finetune": {"steps": 5}}})
    r = validate(raw, "x")
    # every default comes from SliceOptions (the declaration `normswap slice` uses), except the
    # calibration text and seed, which are the recipe's own
    assert r["variants"]["s"]["slice"] == {
        "fraction": 0.3,
        "calibration_tokens": SliceOptions.calibration_tokens,
        "round_to": SliceOptions.round_to,
        "basis": "pca",
        "tolerance": SliceOptions.tolerance,
        "eval_tokens": SliceOptions.eval_tokens,
        "memory_budget": SliceOptions.memory_budget,
    }
    assert report_names(r) == ["original", "s", "s-healed"]
    steps = plan_steps(r)
    assert [s.name for s in steps[:2]] == ["slice:s", "finetune:s-healed"]
    assert isinstance(steps[0], SliceStep) and steps[1].source == "s"
    # control: without the slice stage the fine-tune's output is the variant itself, not a healed copy
    plain = validate(_minimal(variants={"s": {"finetune": {"steps": 5}}}), "x")
    assert report_names(plain) == ["original", "s"]


@pytest.mark.parametrize(
    "variant, needle",
    [
        ({"slice": {"fraction": 1.5}}, "variants.s.slice.fraction"),
        ({"slice": {"fraction": 0}}, "variants.s.slice.fraction"),
        ({"slice": {"basis": "per-layer"}}, "variants.s.slice.basis"),
        ({"slice": {"fractoin": 0.2}}, "did you mean fraction"),
        ({"slice": {"seed": 3}}, "variants.s.slice.seed: unknown key"),
        ({"convert": {"mode": "exact"}, "slice": {}}, "not both"),
    ],
)
def test_bad_slice_stages_are_one_line_naming_the_key(variant, needle):
    assert needle in _error(_minimal(variants={"s": variant}))
