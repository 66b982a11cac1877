"""Family data files: validated on load, looked up strictly, complete against real models."""

import re
from pathlib import Path

import pytest
import torch
import yaml
from helpers import family_variants, tiny_config

from normswap.architectures import all_families, family_for_config, get_family
from normswap.architectures.schema import parse_family
from normswap.convert.config import ConvertOptions
from normswap.convert.plan import build_plan
from normswap.errors import NormswapError
from normswap.model_facts import is_layernorm

REQUIRED = {
    "gpt2",
    "gpt_neo",
    "gpt_neox",
    "opt",
    "bloom",
    "phi",
    "gptj",
    "codegen",
    "falcon",
    "gpt_bigcode",
    "stablelm",
    "xglm",
    "bert",
    "roberta",
}
GOOD = {
    "name": "x",
    "model_types": ["x"],
    "placement": "pre",
    "layers": "h",
    "norms": [{"norm": "h.${i}.ln", "readers": ["h.${i}.fc"]}],
}


def test_required_families_present():
    assert REQUIRED <= {f.name for f in all_families()}


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda d: d.update(colour="red"), "unknown key(s) ['colour']"),
        (lambda d: d.pop("layers"), "missing required key 'layers'"),
        (lambda d: d.update(placement="sideways"), "placement"),
        (lambda d: d["norms"][0].update(readerz=[]), "norms[0]"),
        (lambda d: d["norms"][0].update(norm="h.${j}.ln"), "unknown template variable"),
        (lambda d: d.update(leave_alone=[{"pattern": "(", "reason": "x"}]), "bad regular expression"),
    ],
)
def test_schema_errors_name_file_and_key(mutate, needle):
    raw = yaml.safe_load(yaml.safe_dump(GOOD))
    parse_family(raw, "data/x.yaml")  # the unmutated record is valid
    mutate(raw)
    with pytest.raises(NormswapError) as info:
        parse_family(raw, "data/x.yaml")
    assert "data/x.yaml" in str(info.value) and needle in str(info.value)


def test_unknown_architecture_refused_not_guessed():
    from transformers import LlamaConfig

    with pytest.raises(NormswapError, match="unsupported architecture.*supported families: .*GPT-2"):
        family_for_config(LlamaConfig())


@pytest.mark.parametrize("family,variant", family_variants(), ids=[f"{f}-{v}" for f, v in family_variants()])
def test_every_layernorm_is_listed_or_left_alone(family, variant):
    """On a meta-device model of each test config, the plan accounts for every LayerNorm."""
    from transformers import AutoModel, AutoModelForCausalLM

    config = tiny_config(family, variant)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:
            model = AutoModel.from_config(config)
    fam = get_family(family)
    plan = build_plan(fam, model, config, ConvertOptions(mode="approx"))
    layernorms = {n for n, m in model.named_modules() if is_layernorm(m)}
    left = {x["module"] for x in plan.block["left_alone"]}
    assert layernorms == set(plan.block["norms"]) | left
    for name in plan.block["norms"]:
        assert not any(re.fullmatch(la.pattern, name) for la in fam.leave_alone)


def test_docs_family_table_is_generated_from_data():
    from normswap.architectures.catalog import family_rows, markdown_table

    page = (Path(__file__).parents[1] / "docs" / "convert.md").read_text()
    assert markdown_table(family_rows()) in page, "regenerate with `normswap families --markdown-table`"
