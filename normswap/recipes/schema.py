"""The recipe schema: what a `normswap run` YAML file may say, with types, defaults and choices.

A recipe is validated as a whole before anything runs, so a typo in the last section does not
surface after a twenty-minute fine-tune. Every error is one line naming the file and the dotted
key (``recipes/x.yaml: variants.approx.finetune.stpes: unknown key (did you mean steps?)``).

The schema is data (``Field`` tables below), so that ``normswap run --schema``, validation and
defaults come from one place; the convert, finetune and eval tables are generated from the
dataclasses that also generate ``normswap convert``'s, ``normswap finetune``'s and ``normswap eval``'s
options (normswap/declared.py).
"""

from __future__ import annotations

import difflib
import re
import reprlib
from dataclasses import dataclass
from typing import Any

from normswap import declared
from normswap.convert.config import recipe_fields as convert_recipe_fields
from normswap.errors import NormswapError
from normswap.evaluate.config import option_errors as eval_option_errors
from normswap.evaluate.config import recipe_fields as eval_recipe_fields
from normswap.export.int8 import SCHEMES
from normswap.finetune.config import option_errors, recipe_fields
from normswap.slice.config import SliceOptions
from normswap.slice.config import option_errors as slice_option_errors
from normswap.study.config import option_errors as study_option_errors
from normswap.study.config import recipe_fields as study_recipe_fields

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
SOURCE_NAME = "original"  # the unconverted source's label in the report (and the baseline)
HEALED_SUFFIX = "-healed"  # report/directory label of a variant after its fine-tune
TASKS = ("causal-lm", "masked-lm", "encoder")


@dataclass(frozen=True)
class Field:
    kind: str  # str, int, float, bool, list[str], choice
    default: Any = None
    choices: tuple = ()
    required: bool = False
    nullable: bool = False
    minimum: float | None = None
    help: str = ""


# ---------------------------------------------------------------------------------- sections
TOP = {
    "name": Field("str", required=True, help="short identifier of the recipe"),
    "description": Field("str", default="", help="one paragraph shown in the run summary"),
    "source": Field("str", required=True, help="model to migrate: a local directory, a hub id or normswap:NAME"),
    "task": Field(
        "choice",
        default="causal-lm",
        choices=TASKS,
        help="causal-lm (perplexity), masked-lm or encoder (BERT, sentence encoders: fidelity to the source)",
    ),
    "data": Field(
        "str", default="embedded", help="corpus for fine-tuning and evaluation (see normswap finetune --data)"
    ),
    "device": Field("str", default="auto", help="cpu, cuda, cuda:N or auto"),
    "seed": Field("int", default=0),
    "needs_network": Field("bool", default=False, help="true when the source or data come from the Hugging Face Hub"),
    "trust_remote_code": Field(
        "bool",
        default=False,
        help="the source runs the Python files it ships: the run is refused unless the command line also has "
        "--trust-remote-code (a recipe cannot grant trust)",
    ),
    "variants": Field(
        "variants", required=True, help="name -> {convert: or slice:, finetune:}; each becomes a model in the report"
    ),
    "eval": Field("section", default=None),
    "report": Field("section", default=None),
    "study": Field(
        "section",
        default=None,
        help="optional: `normswap study` of the source (its arms trained side by side) into DIR/study",
    ),
}

# generated from ConvertOptions, the one declaration of convert's options (also `normswap convert`'s)
CONVERT = {name: Field(**spec) for name, spec in convert_recipe_fields().items()}

# generated from SliceOptions, the one declaration of slice's options (also `normswap slice`'s); the
# calibration text and the seed are the recipe's own data and seed, so they are not repeated here
SLICE_FROM_RECIPE = ("data", "seed")
SLICE = {
    name: Field(**spec) for name, spec in declared.recipe_fields(SliceOptions).items() if name not in SLICE_FROM_RECIPE
}

# generated from FinetuneConfig, the one declaration of the fine-tune's options
FINETUNE = {name: Field(**spec) for name, spec in recipe_fields().items()}

# generated from EvalConfig, the one declaration of the evaluation's options (also `normswap eval`'s),
# plus what only a recipe decides: which of its models the report shows
EVAL = {name: Field(**spec) for name, spec in eval_recipe_fields().items()} | {
    "before_finetune": Field(
        "bool", default=True, help="also report each fine-tuned variant as it was before the fine-tune"
    ),
}

REPORT = {
    "title": Field("str", default=None, nullable=True),
}

# generated from StudyConfig, the one declaration of `normswap study`'s options (the model, data and
# device are the recipe's source, data and device)
STUDY = {name: Field(**spec) for name, spec in study_recipe_fields().items()}

# the export a variant is served as (`normswap export`'s options; the choices are its own): the exported
# directory becomes the variant's model in the report. Only the ONNX format, the one eval measures
# (perplexity and forward speed in onnxruntime: evaluate/onnx_model.py); a stock export is the same
# PyTorch model again.
EXPORT = {
    "format": Field("choice", default="onnx", choices=("onnx",), help="onnx: an onnxruntime generation graph"),
    "quantize": Field(
        "choice", default=None, choices=SCHEMES, nullable=True, help="int8: onnxruntime's dynamic quantizer"
    ),
    "rotate": Field("bool", default=True, help="the incoherence rotation before int8 (where the stream takes it)"),
}
EXPORTED_FROM = "+pytorch"  # DIR/models/<variant>+pytorch: the model an export variant exports (never a variant name)

VARIANT_KEYS = ("convert", "slice", "finetune", "export", "description")


# ---------------------------------------------------------------------------------- validation
class RecipeError(NormswapError):
    pass


_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 80
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict = 3, 6, 6


def show(value) -> str:
    """A value as an error message quotes it: repr, cut to a few dozen characters however big it is."""
    return _SHOW.repr(value)


def _fail(where: str, key: str, msg: str):
    key = key if len(key) <= 120 else key[:117] + "..."  # a key is data from the file too
    raise RecipeError(f"{where}: {key}: {msg}" if key else f"{where}: {msg}")


def _unknown(where: str, prefix: str, key, known) -> None:
    close = difflib.get_close_matches(str(key)[:200], list(known), n=1)
    hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(known)})"
    _fail(where, prefix + str(key), "unknown key" + hint)


def _coerce(where: str, key: str, f: Field, value):
    if value is None:
        if f.nullable or not f.required and f.default is None:
            return None
        _fail(where, key, "must not be empty")
    kind = f.kind
    if kind == "bool":
        if isinstance(value, bool):
            return value
        _fail(where, key, f"expected true or false, got {show(value)}")
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                _fail(where, key, f"expected an integer, got {show(value)}")
    elif kind == "float":
        if isinstance(value, bool):
            _fail(where, key, f"expected a number, got {show(value)}")
        if isinstance(value, str):
            # YAML 1.1 (PyYAML) reads `1e-3` as a string: accept what a reader means by it
            try:
                value = float(value)
            except ValueError:
                _fail(where, key, f"expected a number, got {show(value)}")
        elif not isinstance(value, (int, float)):
            _fail(where, key, f"expected a number, got {show(value)}")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            _fail(where, key, f"expected a finite number, got {show(value)}")
    elif kind in ("str", "choice"):
        if not isinstance(value, str):
            if kind == "choice" and isinstance(value, bool):
                _fail(where, key, f"expected one of {', '.join(f.choices)}, got {show(value)}")
            if kind == "str" and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)
            else:
                _fail(
                    where,
                    key,
                    f"expected {'one of ' + ', '.join(f.choices) if kind == 'choice' else 'a string'}, "
                    f"got {show(value)}",
                )
        if kind == "str":
            value = " ".join(value.split()) if "\n" in value else value.strip()
        if kind == "choice" and value not in f.choices:
            _fail(where, key, f"expected one of {', '.join(f.choices)}, got {show(value)}")
    elif kind == "list[str]":
        if isinstance(value, str):  # `tasks: a,b` as well as a YAML list
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            _fail(where, key, f"expected a list of strings, got {show(value)}")
        return list(value)
    if f.minimum is not None and isinstance(value, (int, float)) and value < f.minimum:
        _fail(where, key, f"must be >= {f.minimum:g}, got {show(value)}")
    return value


def _section(where: str, prefix: str, data, table: dict) -> dict:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        _fail(where, prefix.rstrip("."), f"expected a mapping of keys, got {type(data).__name__} {show(data)}")
    for k in data:
        if k not in table:
            _unknown(where, prefix, k, table)
    out = {}
    for k, f in table.items():
        if k in data:
            out[k] = _coerce(where, prefix + k, f, data[k])
        elif f.required:
            _fail(where, prefix + k, "missing (required)")
        else:
            out[k] = list(f.default) if isinstance(f.default, list) else f.default
    return out


def validate(raw, where: str) -> dict:
    """Check ``raw`` (the parsed YAML) and return the resolved recipe with every default filled."""
    if not isinstance(raw, dict):
        _fail(where, "", f"a recipe is a YAML mapping (name:, source:, variants:, ...), got {type(raw).__name__}")
    raw = dict(raw)
    if "models" in raw and "variants" not in raw:  # the spelling; one name in the output
        raw["variants"] = raw.pop("models")
    for k in raw:
        if k not in TOP:
            _unknown(where, "", k, TOP)
    scalars = {k: f for k, f in TOP.items() if f.kind not in ("variants", "section")}
    recipe = _section(where, "", {k: v for k, v in raw.items() if k in scalars}, scalars)
    if not _NAME.match(recipe["name"]):
        _fail(where, "name", f"use letters, digits, '-', '_' or '.', got {show(recipe['name'])}")
    if not recipe["source"].strip():
        _fail(where, "source", "must not be empty")

    if "variants" not in raw:
        _fail(where, "variants", "missing (required): at least one model to build from the source")
    variants = raw["variants"]
    if not isinstance(variants, dict) or not variants:
        _fail(where, "variants", "expected a non-empty mapping of name -> {convert: ..., finetune: ...}")
    resolved_variants = {str(name): _variant(where, str(name), spec) for name, spec in variants.items()}
    names = set(resolved_variants)
    for n, v in resolved_variants.items():
        if built(v) and v["finetune"] is not None and n + HEALED_SUFFIX in names:
            _fail(where, f"variants.{n}{HEALED_SUFFIX}", "clashes with the healed model of variant " + n)
    recipe["variants"] = resolved_variants

    recipe["eval"] = _section(where, "eval.", raw.get("eval"), EVAL)
    recipe["report"] = _section(where, "report.", raw.get("report"), REPORT)
    recipe["study"] = _section(where, "study.", raw["study"], STUDY) if raw.get("study") is not None else None
    for option, why in study_option_errors(recipe["study"]) if recipe["study"] is not None else ():
        _fail(where, f"study.{option}", why)
    ev = _eval_section(where, recipe)
    for option, why in eval_option_errors(ev):
        _fail(where, f"eval.{option}", why)
    if recipe["report"]["title"] is None:
        recipe["report"]["title"] = recipe["name"]
    return recipe


def _variant(where: str, name_s: str, spec) -> dict:
    """One entry of ``variants:``, checked, with its sections' defaults filled."""
    key = f"variants.{name_s}"
    if not _NAME.match(name_s):
        _fail(where, key, "a variant name uses letters, digits, '-', '_' or '.'")
    if name_s == SOURCE_NAME or name_s.endswith(HEALED_SUFFIX):
        _fail(
            where,
            key,
            f"the names {SOURCE_NAME!r} and '*{HEALED_SUFFIX}' are used for the source and healed models",
        )
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        _fail(where, key, f"expected a mapping with convert: and/or finetune:, got {show(spec)}")
    for k in spec:
        if k not in VARIANT_KEYS:
            _unknown(where, key + ".", k, VARIANT_KEYS)
    if (
        spec.get("convert") is None
        and spec.get("slice") is None
        and spec.get("finetune") is None
        and not spec.get("export")
    ):
        _fail(
            where,
            key,
            "needs convert: (e.g. {mode: exact}) or slice: (e.g. {fraction: 0.25}), and/or finetune: "
            "(e.g. {steps: 200})",
        )
    if spec.get("convert") is not None and spec.get("slice") is not None:
        _fail(
            where,
            key + ".slice",
            "slice converts the source exactly itself (verified); give a variant convert: or slice:, not both",
        )
    desc = spec.get("description")
    v = {"description": "" if desc is None else _coerce(where, key + ".description", Field("str"), desc)}
    v["convert"] = (
        _section(where, key + ".convert.", spec["convert"], CONVERT) if spec.get("convert") is not None else None
    )
    v["finetune"] = (
        _section(where, key + ".finetune.", spec["finetune"], FINETUNE) if spec.get("finetune") is not None else None
    )
    v["slice"] = _section(where, key + ".slice.", spec["slice"], SLICE) if spec.get("slice") is not None else None
    for option, why in slice_option_errors(v["slice"]) if v["slice"] is not None else ():
        _fail(where, f"{key}.slice.{option}", why)
    if v["slice"] is not None and not 0 < v["slice"]["fraction"] < 1:
        _fail(where, f"{key}.slice.fraction", f"must be in (0, 1), got {show(v['slice']['fraction'])}")
    ft = v["finetune"]
    for option, why in option_errors(ft) if ft is not None else ():
        _fail(where, f"{key}.finetune.{option}", why)
    v["export"] = _section(where, key + ".export.", spec["export"], EXPORT) if spec.get("export") is not None else None
    if v["export"] is not None and (ft is not None or not built(v)):
        # one model a variant: what it builds (convert: or slice:) is what it serves; a fine-tuned model's
        # export would need the healed and the exported rows both, which a variant does not name
        _fail(where, key + ".export", "exports what convert: or slice: built; give one of them and no finetune:")
    return v


def _eval_section(where: str, recipe: dict) -> dict:
    """``eval:`` with the defaults that depend on the task: perplexity for a causal LM, fidelity for an encoder."""
    ev = recipe["eval"]
    masked = recipe["task"] in ("masked-lm", "encoder")
    if ev["perplexity"] is None:
        ev["perplexity"] = not masked
    if ev["fidelity"] is None:
        ev["fidelity"] = masked
    if masked:
        if ev["perplexity"]:
            _fail(
                where,
                "eval.perplexity",
                f"perplexity is not defined for a {recipe['task']}; use eval.fidelity "
                "(cosine and masked-token loss vs the source)",
            )
        if ev["tasks"]:
            _fail(where, "eval.tasks", "lm-eval tasks need a causal-lm recipe")
    return ev


def built(variant: dict) -> bool:
    """Whether a variant builds a model of its own before any fine-tune (convert: or slice:), so that
    a fine-tune's output is its ``-healed`` model."""
    return variant["convert"] is not None or variant.get("slice") is not None


def report_names(recipe: dict) -> list[str]:
    """Names of the models in the report, in order: the source, then each variant (its pre-fine-tune
    checkpoint first when shown)."""
    names = [SOURCE_NAME]
    for n, v in recipe["variants"].items():
        if built(v) and v["finetune"] is not None:
            if recipe["eval"]["before_finetune"]:
                names.append(n)
            names.append(n + HEALED_SUFFIX)
        else:
            names.append(n)
    return names


def describe_fields() -> str:
    """Plain-text reference of every key (for docs and `normswap run --schema`)."""
    lines = []
    for title, table in (
        ("top level", TOP),
        ("variants.<name>.convert", CONVERT),
        ("variants.<name>.slice", SLICE),
        ("variants.<name>.finetune", FINETUNE),
        ("variants.<name>.export", EXPORT),
        ("eval", EVAL),
        ("report", REPORT),
        ("study", STUDY),
    ):
        lines.append(f"{title}:")
        for k, f in table.items():
            if f.kind in ("variants", "section"):
                lines.append(f"  {k}: {f.help or 'section, see below'}")
                continue
            kind = "|".join(f.choices) if f.kind == "choice" else f.kind
            dflt = "required" if f.required else f"default {f.default!r}"
            lines.append(f"  {k} ({kind}, {dflt})" + (f": {f.help}" if f.help else ""))
    return "\n".join(lines)
