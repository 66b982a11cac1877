"""Options shared by several commands, declared once; the CLI grammar every command follows.

The grammar (docs/cli.md; tests/test_cli_grammar.py walks every command and checks it):

* ``--json`` is a flag: one JSON object on stdout, nothing else there (errors too: cli/main.py).
* ``--save FILE`` writes a benchmark's JSON result to a file; ``--out DIR`` is always a directory.
* ``--device`` defaults to ``auto``; dtypes are spelled float32|bfloat16|float16 (fp32/bf16/fp16 accepted).
* ``--quiet`` silences the progress lines, which go to stderr as ``normswap <command>: ...``.
* a time budget is named for what it bounds (``--row-seconds``, ``--training-seconds``, ...);
  learning-rate warmup is ``--warmup-steps``, its decay ``--lr-schedule``.
* an option renamed keeps its old spelling as a hidden alias (:func:`option` ``aliases=``).
"""

from __future__ import annotations

import click


class AliasedOption(click.Option):
    """An option whose old spellings (``hidden_aliases``) are still accepted but not shown in --help:
    scripts written against the old name keep working while the help teaches one name."""

    def __init__(self, *args, hidden_aliases=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.hidden_aliases = tuple(hidden_aliases)

    def get_help_record(self, ctx):
        shown, self.opts = self.opts, [o for o in self.opts if o not in self.hidden_aliases]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = shown


def option(*decls, aliases=(), **kwargs):
    """``click.option`` with ``aliases``: old spellings accepted, hidden from --help."""
    names = [d for d in decls if d.startswith("-")]
    rest = [d for d in decls if not d.startswith("-")]
    return click.option(*names, *aliases, *rest, cls=AliasedOption, hidden_aliases=aliases, **kwargs)


# One spelling per dtype in help and results; the short ones are accepted (and normalised) everywhere.
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}


def canonical_dtype(name: str) -> str:
    n = name.strip().lower()
    return DTYPE_ALIASES.get(n, n)


class DtypeChoice(click.Choice):
    """A dtype choice spelled float32|bfloat16|float16 that also accepts fp32/bf16/fp16.

    ``internal``: where a configuration keeps its own spelling (the study's precision is recorded as
    fp32/bf16/fp16 in its results), the value handed to the command in that spelling."""

    name = "dtype"

    def __init__(self, choices, internal: dict | None = None):
        self.internal = dict(internal or {})  # canonical -> the configuration's spelling
        super().__init__([canonical_dtype(c) for c in choices])

    def convert(self, value, param, ctx):
        if value in self.internal.values():
            return value  # a default (or a recipe value) already in the configuration's spelling
        got = super().convert(canonical_dtype(str(value)), param, ctx)
        return self.internal.get(got, got)


def device_option(default="auto"):
    return click.option(
        "--device",
        default=default,
        show_default=True,
        help="cpu, cuda, cuda:N or auto (cuda when available).",
    )


json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object on stdout (errors too), nothing else there."
)
quiet_option = click.option("--quiet", is_flag=True, help="No progress lines on stderr.")


class OutputFile(click.Path):
    """A FILE the command writes: shown as FILE (never a directory), and checked by the command itself
    before any work (``publish.check_output_file``: a directory there, a planted link, an overlap with
    what it reads), so that a refusal is the house's one line rather than click's usage block."""

    def __init__(self):
        super().__init__(dir_okay=False)

    def convert(self, value, param, ctx):
        return value


def save_option(what: str = "the JSON result", old: tuple = ()):
    """``--save FILE``: a benchmark's result written to a file (``old``: the spellings it had)."""
    return option(
        "--save",
        "save",
        aliases=old,
        type=OutputFile(),
        default=None,
        help=f"Also write {what} to this file.",
    )


def target_option(default: float, of: str = "every speed ratio"):
    """``--target``: the timing instrument's stop rule (normswap/timing.py ``target_halfwidth``)."""
    return click.option(
        "--target",
        type=click.FloatRange(0, min_open=True),
        default=default,
        show_default=True,
        help=f"Stop adding pairs once {of}'s 95% interval is within this of its median (normswap/timing.py).",
    )


def force_replaces(what: str):
    """``--force``, saying what it replaces for this command (a user must not fear for their input)."""
    return click.option("--force", is_flag=True, help=f"Replace {what} if it exists.")


force_option = force_replaces("OUT")  # commands whose output is the positional OUT (convert, finetune)
seed_option = click.option("--seed", type=int, default=0, show_default=True, help="Random seed.")
data_option = click.option(
    "--data",
    default="embedded",
    show_default=True,
    help=(
        "embedded (the shipped KJV corpus), a text/JSONL/parquet file or directory, a saved dataset, "
        "or a hub dataset id."
    ),
)


def _set_trust_remote_code(ctx, param, value):
    from normswap.checkpoint.load import set_trust_remote_code

    set_trust_remote_code(value)  # also when absent: an earlier in-process command's choice never carries over
    return value


trust_remote_code_option = click.option(
    "--trust-remote-code",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_set_trust_remote_code,
    help=(
        "Let source models run the Python files they ship (auto_map). Off by default: only for sources you trust. "
        "normswap's own converted checkpoints never need it."
    ),
)


CLICK_TYPES = {"int": int, "float": float, "str": str, "list[str]": str}  # a list is given as a,b


def config_option(f, shared=None):
    """The click option of one declared config field (normswap/declared.py), from its metadata;
    ``shared``: options declared once here for several commands, by field name."""
    from normswap.declared import cli_flag, default_of

    if shared and f.name in shared:
        return shared[f.name]
    m, name, default = f.metadata, cli_flag(f), default_of(f)
    aliases = tuple(m.get("aliases", ()))  # the flag's old spellings, accepted and hidden
    if m["kind"] == "bool":
        if default is False:
            return option(name, f.name, aliases=aliases, is_flag=True, default=False, help=m["help"])
        # on by default (``--no-speed`` turns it off) or three states (decided at run time when absent)
        return click.option(
            f"{name}/--no-{name[2:]}", f.name, default=default, show_default="on" if default else False, help=m["help"]
        )
    if m["kind"] == "list[str]":
        default = ",".join(default) or None
    kind = (
        _dtype_choice(m["choices"]) or click.Choice(m["choices"])
        if m["choices"]
        else click.Path(dir_okay=False)
        if m.get("path")
        else CLICK_TYPES[m["kind"]]
    )
    if isinstance(kind, DtypeChoice) and default in DTYPE_ALIASES:
        default = DTYPE_ALIASES[default]  # shown in the one spelling help uses; the type hands back the config's
    return option(
        name, f.name, aliases=aliases, type=kind, default=default, show_default=default is not None, help=m["help"]
    )


def _dtype_choice(choices) -> DtypeChoice | None:
    """A DtypeChoice where a declared choice lists dtypes (in either spelling), else None."""
    names = {canonical_dtype(c) for c in choices} - {"auto"}
    if not names or not names <= {"float32", "bfloat16", "float16", "float64"}:
        return None
    internal = {canonical_dtype(c): c for c in choices if c in DTYPE_ALIASES}
    return DtypeChoice(choices, internal)


def config_options(fields, shared=None):
    """Decorator: the click options of ``fields`` (declared config fields), in their order."""

    def decorate(command):
        for f in reversed(list(fields)):
            command = config_option(f, shared)(command)
        return command

    return decorate


ONNX_NORM_OP_HELP = (
    "How each RMSNorm is written in the ONNX graph: simplified: onnxruntime's SimplifiedLayerNormalization, the "
    "residual Add before it folded in (SkipSimplifiedLayerNormalization: what onnxruntime runs fused); "
    "rmsnormalization: ONNX's own RMSNormalization (opset 23; portable, not fused)."
)


def onnx_norm_op_option(*, multiple: bool, default_help: str = ""):
    """``--onnx-norm-op``, for `export` (one choice) and `bench onnx` (repeatable: each one timed)."""
    from normswap.export import DEFAULT_ONNX_NORM_OP, ONNX_NORM_OPS

    extra = {"multiple": True} if multiple else {"default": DEFAULT_ONNX_NORM_OP, "show_default": True}
    return click.option(
        "--onnx-norm-op",
        "norm_ops" if multiple else "norm_op",
        type=click.Choice(tuple(ONNX_NORM_OPS)),
        help=ONNX_NORM_OP_HELP + (f" Repeatable; {default_help}." if multiple else ""),
        **extra,
    )
