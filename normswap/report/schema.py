"""The shape of a results.json that ``eval render`` rebuilds a report from, checked before rendering.

Why: ``eval render`` works on a file it received (or one edited by hand); rendered unchecked, a
wrongly typed value ends deep in the renderer as ``AttributeError: 'str' object has no attribute
'get'``, ``KeyError: 'name'`` or matplotlib's ``Axis limits cannot be NaN``. So the keys
the report reads are declared here as data (docs/results-schema.md describes them) and checked
first; a file that does not fit is refused in one line that says which key and what was expected.

Every key may be absent or null (a measurement that did not run) unless it is in ``REQUIRED``;
keys not declared here are let through (others may grow). Kinds: ``str``, ``int``, ``bool``,
``object``, ``list``, ``number`` (finite), ``number or inf`` (a perplexity of text the model
cannot predict is infinite; NaN never is), a dict (an object with those keys), or
``("object of", kind)`` (an object whose every value is of that kind).
"""

from __future__ import annotations

import math

from normswap.errors import NormswapError

_RATIOS = ("object of", ("number or inf", "object"))  # one ratio per metric; tokens_per_second: per kind

MODEL = {
    "name": "str",
    "path": "str",
    "spec": "str",
    "kind": "str",
    "model_kind": "str",
    "architecture": "str",
    "parameters": "int",
    "norm_classes": "list",
    "norm_layers": "int",
    "flops_per_token": ("object of", "number"),
    "normswap": "object",
    "finetune": "object",
    "perplexity": "number or inf",
    "bits_per_byte": "number or inf",
    "word_perplexity": "number or inf",
    "perplexity_detail": "object",
    "diagnostics": {"loss": "number or inf", "grad_norm": "number or inf", "layers": "list"},
    "tasks": ("object of", "object"),
    "task_crosscheck": "object",
    "tokens_per_second": ("object of", "number"),
    "norm_time_share": "number",
    "norm_time": {
        "share_of_forward": "number",
        "norm_ms_per_forward": "number",
        "layers": "int",
        "calls_per_forward": "int",
        "classes": "list",
        "implementations": ("object of", "object"),
    },
    "speed_setup": "object",
    "peak_memory_bytes": "int",
    "memory_detail": "object",
    "fidelity": "object",
    "ratios": _RATIOS,
    "ratio_intervals": ("object of", "object"),
}

RESULTS = {
    "schema_version": "int",
    "device": "str",
    "dtype": "str",
    "data": "object",
    "created": "str",
    "versions": "object",
    "baseline": "str",
    "models": ("list of", MODEL),
    "lm_eval_log": "str",
    "speed_setup": "object",
    "speed_noise": "object",
    "null_control": {"name": "str", "of": "str", "tokens_per_second": ("object of", "number"), "ratios": _RATIOS},
    "ratio_method": "str",
    "title": "str",
    "recipe": "object",
    "figures": ("object of", "str"),
    # perplexity and speed against the fraction sliced (`normswap bench slice --quality`, docs/results-schema.md)
    "slice_curve": {
        "perplexity": ("list of", {"model": "str", "original": "number", "points": "list"}),
        "speed": ("list of", {"fraction": "number", "kind": "str", "baseline": "str", "ratio": "number"}),
    },
}

REQUIRED = {"models", "models[].name"}

_TYPES = {"str": str, "bool": bool, "object": dict, "list": list}


def _fits(value, kind) -> bool:
    """Whether ``value`` is of the scalar or container ``kind`` (the structure below is not looked at)."""
    if isinstance(kind, tuple) and kind[0] not in ("object of", "list of"):
        return any(_fits(value, k) for k in kind)
    if isinstance(kind, dict) or (isinstance(kind, tuple) and kind[0] == "object of"):
        return isinstance(value, dict)
    if isinstance(kind, tuple):
        return isinstance(value, list)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind in ("number", "number or inf"):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and not math.isnan(value) and (kind == "number or inf" or math.isfinite(value))
    return isinstance(value, _TYPES[kind])


def _say(kind) -> str:
    if isinstance(kind, dict):
        return "an object"
    if isinstance(kind, tuple) and kind[0] == "object of":
        return f"an object whose every value is {_say(kind[1])}"
    if isinstance(kind, tuple) and kind[0] == "list of":
        return "a list of objects"
    if isinstance(kind, tuple):
        return " or ".join(_say(k) for k in kind)
    return {"int": "a whole number", "number": "a finite number", "number or inf": "a number (not NaN)"}.get(
        kind, f"{'an' if kind[0] in 'ao' else 'a'} {kind}"
    )


def schema_problem(value, schema=RESULTS, where: str = "", generic: str = "") -> str | None:
    """The first key of ``value`` that does not fit ``schema``, as "KEY is X; expected Y", or None."""
    for key, kind in schema.items():
        path, rule = f"{where}{key}", f"{generic}{key}"
        if key not in value or value[key] is None:
            if rule in REQUIRED:
                return f"{path} is {'null' if key in value else 'missing'}; expected {_say(kind)}"
            continue
        problem = _check(value[key], kind, path, rule)
        if problem:
            return problem
    return None


def _check(v, kind, path: str, rule: str) -> str | None:
    if not _fits(v, kind):
        shown = repr(v) if not isinstance(v, (dict, list)) else ("an object" if isinstance(v, dict) else "a list")
        return f"{path} is {shown[:60]}; expected {_say(kind)}"
    if isinstance(kind, dict):
        return schema_problem(v, kind, f"{path}.", f"{rule}.")
    if isinstance(kind, tuple) and kind[0] == "object of":
        return next((p for k, x in v.items() if x is not None and (p := _check(x, kind[1], f"{path}.{k}", rule))), None)
    if isinstance(kind, tuple) and kind[0] == "list of":
        for i, item in enumerate(v):
            if not isinstance(item, dict):
                return f"{path}[{i}] is {repr(item)[:60]}; expected an object"
            problem = schema_problem(item, kind[1], f"{path}[{i}].", f"{rule}[].")
            if problem:
                return problem
    return None


def check_results(results, source) -> None:
    """Refuse, in one line naming ``source``, a results.json whose keys do not fit the schema."""
    if not isinstance(results, dict):
        raise NormswapError(f"{source} is not a normswap results.json (not a JSON object)")
    problem = schema_problem(results)
    if problem:
        raise NormswapError(
            f"{source} does not fit the results.json schema (docs/results-schema.md): {problem}; nothing was rendered"
        )
