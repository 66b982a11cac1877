"""A recipe's export stage (a variant served as ONNX, int8) and the recipe loader's refusal of a key written
twice: the shipped quickstart had its `sliced:` variant twice, and YAML kept the last without a word."""

from __future__ import annotations

import json

import pytest

from normswap.errors import NormswapError
from normswap.recipes import load_recipe, validate
from normswap.recipes.schema import report_names

HEAD = "name: t\nsource: normswap:kjv-gpt2\nvariants:\n"


@pytest.mark.parametrize(
    "body, key, line",
    [
        ("  a: {convert: {mode: exact}}\n  a: {convert: {mode: approx}}\n", "'a'", 5),
        ("  a:\n    convert: {mode: exact}\n    finetune: {steps: 2, steps: 3}\n", "'steps'", 6),
    ],
)
def test_a_key_written_twice_is_refused_in_one_line_naming_it(tmp_path, body, key, line):
    p = tmp_path / "dup.yaml"
    p.write_text(HEAD + body)
    with pytest.raises(NormswapError) as e:
        load_recipe(str(p))
    msg = str(e.value)
    assert msg.startswith(f"{p}: at line {line}: the key {key} is written twice") and "\n" not in msg
    # control: the same file with the second key renamed loads
    p.write_text(HEAD + body.replace("  a: {convert: {mode: approx}}", "  b: {convert: {mode: approx}}").replace(
        "steps: 2, steps: 3", "steps: 2, lr: 1e-3"
    ))  # fmt: skip
    assert load_recipe(str(p)).recipe["variants"]["a"]["convert"]["mode"] == "exact"


def test_merge_keys_and_aliases_are_not_duplicates(tmp_path):
    p = tmp_path / "alias.yaml"
    p.write_text(HEAD + "  a: &ft {convert: {mode: exact}}\n  b:\n    <<: *ft\n    description: again\n  c: *ft\n")
    assert list(load_recipe(str(p)).recipe["variants"]) == ["a", "b", "c"]


def test_quickstart_serves_the_slice_as_int8_and_has_one_sliced_variant():
    from normswap.recipes.steps import ExportStep, SliceStep, plan_steps

    text = load_recipe("quickstart").original_text
    assert text.count("\n  sliced:\n") == 1
    r = load_recipe("quickstart").recipe
    assert report_names(r)[-3:] == ["sliced", "sliced-healed", "sliced-int8"]
    steps = {s.name: s for s in plan_steps(r)}
    build, export = steps["slice:sliced-int8+pytorch"], steps["export:sliced-int8"]
    assert isinstance(build, SliceStep) and isinstance(export, ExportStep)
    # the same slice as `sliced` (its options; data and seed are the recipe's), exported from it
    assert build.options == steps["slice:sliced"].options and export.source == "sliced-int8+pytorch"
    assert export.options == {"format": "onnx", "quantize": "int8", "rotate": True}


@pytest.mark.parametrize(
    "variant, needle",
    [
        ({"export": {"format": "onnx"}}, "variants.s.export: exports what convert: or slice: built"),
        ({"slice": {}, "finetune": {"steps": 2}, "export": {}}, "no finetune"),
        ({"convert": {}, "export": {"quantize": "int4"}}, "variants.s.export.quantize: expected one of int8"),
        ({"convert": {}, "export": {"format": "stock"}}, "variants.s.export.format: expected one of onnx"),
    ],
)
def test_bad_export_stages_are_one_line_naming_the_key(variant, needle):
    raw = {"name": "t", "source": "normswap:kjv-gpt2", "variants": {"s": variant}}
    with pytest.raises(NormswapError) as e:
        validate(raw, "x")
    assert needle in str(e.value) and "\n" not in str(e.value)
    # control: the variant without the export builds a model of its own
    assert validate({**raw, "variants": {"s": {"convert": {}}}}, "x")["variants"]["s"]["export"] is None


MINI = """\
name: mini-served
source: normswap:kjv-gpt2
device: cpu  # pinned: float32 perplexities compared
variants:
  exact: {convert: {mode: exact}}
  exact-int8:
    convert: {mode: exact}
    export: {format: onnx, quantize: int8}
eval: {seq_len: 64, stride: 32, max_tokens: 1024, batch_size: 4, speed: true, repeats: 2, min_time: 0.01,
       new_tokens: 2, speed_budget: 2, memory: true, diagnostics: true, tasks: [normswap_kjv], lm_eval_limit: 1}
"""


@pytest.mark.slow
def test_a_served_int8_variant_is_measured_beside_pytorch_in_the_report(tmp_path, run_cli):
    recipe = tmp_path / "mini.yaml"
    recipe.write_text(MINI)
    code, _, stderr = run_cli("run", str(recipe), "--out", str(tmp_path / "run"), "--quiet")
    assert code == 0, stderr
    report = tmp_path / "run" / "report"
    rows = {m["name"]: m for m in json.loads((report / "results.json").read_text())["models"]}
    int8, exact = rows["exact-int8"], rows["exact"]
    assert int8["kind"] == "onnx int8 (converted)" and int8["onnx"]["quantize"] == "int8"
    # int8 costs a little perplexity; the same windows and tokens as the PyTorch rows
    assert int8["perplexity_detail"]["tokens"] == exact["perplexity_detail"]["tokens"]
    assert int8["perplexity"] != exact["perplexity"] and int8["perplexity"] == pytest.approx(
        exact["perplexity"], rel=0.05
    )
    assert int8["tokens_per_second"]["forward"] > 0 and "train_step" not in int8["tokens_per_second"]
    # what a graph cannot be measured by: empty, and said so in the report; the PyTorch rows measured it
    assert int8["peak_memory_bytes"] is None and int8["diagnostics"] is None and not int8["tasks"]
    assert exact["peak_memory_bytes"] > 0 and exact["tasks"]["normswap_kjv"]["bits_per_byte"] > 0
    md = (report / "report.md").read_text()
    side = md.split("## Side by side")[1].split("\n## ")[0]
    line = next(ln for ln in side.splitlines() if ln.startswith("| exact-int8"))
    assert "not measured (ONNX)" in line and "onnx int8" in line
    assert "not measured (ONNX)" not in next(ln for ln in side.splitlines() if ln.startswith("| exact "))
    tasks = md.split("## lm-eval tasks")[1].split("\n## ")[0]
    assert "| exact-int8 | not measured (ONNX)" in tasks
    assert "not measured (ONNX)" in (report / "report.html").read_text()
