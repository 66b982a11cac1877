"""Options shared by several commands, declared once."""

from __future__ import annotations

import click


def device_option(default="auto"):
    return click.option(
        "--device",
        default=default,
        show_default=True,
        help="cpu, cuda, cuda:N or auto (cuda when available).",
    )


json_option = click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON summary.")


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
    if m["kind"] == "bool":
        if default is False:
            return click.option(name, f.name, is_flag=True, default=False, help=m["help"])
        # on by default (``--no-speed`` turns it off) or three states (decided at run time when absent)
        return click.option(
            f"{name}/--no-{name[2:]}", f.name, default=default, show_default="on" if default else False, help=m["help"]
        )
    if m["kind"] == "list[str]":
        default = ",".join(default) or None
    kind = (
        click.Choice(m["choices"])
        if m["choices"]
        else click.Path(dir_okay=False)
        if m.get("path")
        else CLICK_TYPES[m["kind"]]
    )
    return click.option(name, f.name, type=kind, default=default, show_default=default is not None, help=m["help"])


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
