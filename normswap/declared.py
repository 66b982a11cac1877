"""Options declared once, as dataclass fields.

A configuration dataclass (``ConvertOptions``, ``FinetuneConfig``, ``EvalConfig``) declares each
option with :func:`option`: its default, help text, kind, choices and bounds. From that one
declaration come the
click options (``normswap.cli.options.config_options``), the recipe schema's tables
(:func:`recipe_fields`), the bounds check shared by both (:func:`option_errors`) and the typed object
built from either (:func:`build`).

A field whose type is itself such a dataclass (``EvalConfig.speed_setup: SpeedConfig``) is a nested
group: its options appear flat, under their own names, on the command line and in the recipe, and
:func:`build` puts them back into the nested object.

This module imports neither torch nor click, so that ``--help`` and recipe validation stay fast.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import field

_UNSET = object()


def option(
    default,
    help,
    *,
    kind=None,
    choices=(),
    minimum=None,
    maximum=None,
    above=None,
    below=None,
    recipe=True,
    cli=True,
    flag=None,
    recipe_default=_UNSET,
    factory=None,
    **extra,
):
    """A config field with its declaration as metadata.

    ``kind``: int, float, str, bool or list[str] (from the default when not given); ``recipe`` /
    ``cli``: whether the option exists there; ``flag``: the command-line spelling when it is not
    ``--field-name``; ``recipe_default``: a recipe's default where it must differ from the command's
    (say why at the field); ``extra``: metadata of one configuration (e.g. the fine-tune's ``resume``).
    """
    if kind is None:
        kind = (
            "bool"
            if isinstance(default, bool)
            else "list[str]"
            if isinstance(default, (list, tuple))
            else type(default).__name__
        )
    meta = dict(
        help=help,
        kind=kind,
        choices=tuple(choices),
        minimum=minimum,
        maximum=maximum,
        above=above,
        below=below,
        recipe=recipe,
        cli=cli,
        flag=flag,
        recipe_default=recipe_default,
        **extra,
    )
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(metadata=meta) if default is dataclasses.MISSING else field(default=default, metadata=meta)


def _is_group(f: dataclasses.Field) -> bool:
    return (
        "help" not in f.metadata
        and f.default_factory is not dataclasses.MISSING
        and dataclasses.is_dataclass(f.default_factory)
    )


def _is_option(f: dataclasses.Field) -> bool:
    return "help" in f.metadata


def options(cls) -> list[dataclasses.Field]:
    """Every declared option of ``cls``, nested groups flattened in place (plain fields, set by the
    program rather than the user, are not options)."""
    out = []
    for f in dataclasses.fields(cls):
        out.extend(options(f.default_factory) if _is_group(f) else [f] if _is_option(f) else [])
    return out


def default_of(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def recipe_default(f: dataclasses.Field):
    d = f.metadata.get("recipe_default", _UNSET)
    return default_of(f) if d is _UNSET else d


def cli_flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def as_list(value) -> list[str]:
    """A list[str] option's value: ``a,b`` (the command line) or a list (a recipe)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = value.split(",")
    return [v.strip() for v in value if v and v.strip()]


def build(cls, values: dict):
    """``cls`` from flat ``values`` (missing names take their defaults; nested groups are filled from
    their own names); list[str] options accept ``a,b``."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if _is_group(f):
            kwargs[f.name] = build(f.default_factory, values)
        elif _is_option(f) and f.name in values:
            v = values[f.name]
            kwargs[f.name] = as_list(v) if f.metadata.get("kind") == "list[str]" else v
    return cls(**kwargs)


def flat(obj) -> dict:
    """The inverse of :func:`build`: every option of ``obj`` by name, nested groups flattened."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out.update(flat(v) if _is_group(f) else {f.name: v} if _is_option(f) else {})
    return out


_KINDS = {  # what a value of each declared kind may be (values from a file, not only from click)
    "int": ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, (str, os.PathLike))),
    "list[str]": (
        "a list of strings",
        lambda v: isinstance(v, str) or (isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)),
    ),
}


def option_errors(cls, values: dict) -> list[tuple[str, str]]:
    """(option name, what is wrong) for each value in ``values`` of the wrong kind or outside its
    declared bounds (values may come from a file: a recipe, a resumed run's record)."""
    errors = []
    for f in options(cls):
        if f.name not in values or values[f.name] is None:
            continue
        v, m = values[f.name], f.metadata
        kind = _KINDS.get(m["kind"])
        if kind is not None and not kind[1](v):
            errors.append((f.name, f"must be {kind[0]}, got {_show(v)}"))
            continue
        if m["choices"] and v not in m["choices"]:
            errors.append((f.name, f"must be one of {', '.join(m['choices'])}, got {v!r}"))
        if m["kind"] not in ("int", "float") or isinstance(v, bool):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            errors.append((f.name, f"must be a finite number, got {v}"))
        elif m["minimum"] is not None and v < m["minimum"]:
            errors.append((f.name, f"must be >= {m['minimum']:g}, got {v}"))
        elif m["maximum"] is not None and v > m["maximum"]:
            errors.append((f.name, f"must be <= {m['maximum']:g}, got {v}"))
        elif m["above"] is not None and not v > m["above"]:
            errors.append((f.name, f"must be > {m['above']:g}, got {v}"))
        elif m["below"] is not None and not v < m["below"]:
            errors.append((f.name, f"must be < {m['below']:g}, got {v}"))
    return errors


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def recipe_fields(cls) -> dict[str, dict]:
    """A recipe schema table: name -> {kind, default, choices, nullable, minimum, help}."""
    table = {}
    for f in options(cls):
        m = f.metadata
        if not m["recipe"]:
            continue
        default = recipe_default(f)
        table[f.name] = dict(
            kind="choice" if m["choices"] else m["kind"],
            default=default,
            choices=m["choices"],
            nullable=default is None,
            minimum=m["minimum"] if m["minimum"] is not None else m["above"],
            help=m["help"],
        )
    return table
