"""Convert's options, declared once (normswap/declared.py).

``ConvertOptions`` generates the ``normswap convert`` click options (cli/convert_command.py) and the recipe
schema's ``convert:`` table (recipes/schema.py), is what ``convert_checkpoint`` takes, and carries
the plan's choices (mode, γ, β, untie) to ``build_plan``; both entry points validate with
:func:`option_errors`. The defaults below are the only ones.

This module imports neither torch nor click, so that ``--help`` and recipe validation stay fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from normswap import declared
from normswap.declared import option

GAMMA_CHOICES = ("fold", "keep", "reset")
BETA_CHOICES = ("fold", "drop", "keep")
MODES = ("auto", "exact", "approx")
OUTPUT_DTYPES = ("auto", "float32", "float16", "bfloat16")
EXACT_OUTPUTS = ("all", "pooled")
DEFAULT_TOLERANCE = 1e-5  # max |Δ log-prob| an exact float32 conversion may show
# the options that decide the plan: recorded in the converted config's `normswap` block
PLAN_OPTIONS = ("mode", "gamma", "beta", "untie")


@dataclass
class ConvertOptions:
    mode: str = option(
        "auto",
        "exact: centre residual writers so RMSNorm == LayerNorm (pre-LN only). approx: swap without "
        "centring, then heal with `normswap finetune`. auto: exact for pre-LN, approx for post-LN.",
        choices=MODES,
    )
    gamma: str | None = option(
        None,
        "What to do with each LayerNorm's weight: fold into the reading linears (default where "
        "possible), keep on the RMSNorm (default elsewhere), or reset to 1 (lossy).",
        kind="str",
        choices=GAMMA_CHOICES,
    )
    beta: str | None = option(
        None,
        "What to do with each LayerNorm's bias: fold into the reading linears (default where "
        "possible), keep as an RMSNorm bias (default elsewhere; β/γ where γ is folded), or drop (lossy).",
        kind="str",
        choices=BETA_CHOICES,
    )
    untie: bool = option(
        False, "Untie a tied output head so the final norm folds into it (costs vocab x hidden parameters)."
    )
    exact_outputs: str = option(
        "all",
        "Which outputs an exact conversion must keep: all (default), or pooled: also convert a pre-LN "
        "architecture whose raw residual stream is an output (CLIP-style towers) when its other outputs "
        "(pooler_output, image/text embeds, heads reading a final norm) stay exact; last_hidden_state then "
        "moves by its per-token mean, and verification compares the exact outputs only.",
        choices=EXACT_OUTPUTS,
    )
    dtype: str = option("auto", "Output dtype (auto: the source's).", choices=OUTPUT_DTYPES)
    max_shard_size: str = option("5GB", "Shard the safetensors above this size.", recipe=False)
    verify: bool = option(
        True,
        "Run a probe batch through SRC and the staged OUT (one module at a time, bounded memory) "
        "before publishing OUT.",
    )
    tolerance: float = option(
        DEFAULT_TOLERANCE,
        "Exact mode fails above this max |Δ log-prob| (or 4x the measured float32 / rounding floor, if larger), "
        "unless the converted model is within it of the float64 source.",
        minimum=0.0,
    )
    family_file: str | None = option(
        None,
        "Use this family file (YAML, e.g. saved by `normswap families discover --family-file`) "
        "instead of the curated or discovered plan; it must pass the same exactness check on a "
        "tiny instance.",
        kind="str",
        recipe=False,
        path=True,
    )

    def as_dict(self) -> dict:
        """The plan's options (what the converted config records)."""
        return {name: getattr(self, name) for name in PLAN_OPTIONS}


def option_errors(values: dict) -> list[tuple[str, str]]:
    """(option name, what is wrong) for each value in ``values`` outside its declared bounds."""
    return declared.option_errors(ConvertOptions, values)


def recipe_fields() -> dict[str, dict]:
    """The recipe schema's convert table (see declared.recipe_fields)."""
    return declared.recipe_fields(ConvertOptions)


def options_from(options: ConvertOptions | None, values: dict) -> ConvertOptions:
    """``options``, or one built from keyword ``values`` (``mode=``, ``gamma=``, ...: the Python API's
    spelling); never both. Unknown names are a TypeError, values outside their bounds a NormswapError."""
    from normswap.errors import NormswapError

    known = {f.name for f in dataclasses.fields(ConvertOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"unexpected convert option(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    if options is not None and values:
        raise TypeError(f"pass either options= or {', '.join(sorted(values))}, not both")
    if "dtype" in values and not isinstance(values["dtype"], str):  # None or a torch.dtype
        values = dict(values, dtype="auto" if values["dtype"] is None else str(values["dtype"]).removeprefix("torch."))
    options = options if options is not None else declared.build(ConvertOptions, values)
    problems = [f"--{name.replace('_', '-')} {why}" for name, why in option_errors(dataclasses.asdict(options))]
    if problems:
        raise NormswapError("; ".join(problems))
    return options


def check_out(src, out, *, force: bool, family_file=None):
    """Refuse an OUT that would clobber something or overlap what convert reads (the model and
    the family file); cheap (no torch: the CLI answers it in a fraction of a second, before the
    conversion's modules load and before OUT's lock is taken), and convert_checkpoint checks again."""
    from normswap.publish import check_output_path

    return check_output_path(out, force=force, reads=[("the model", src), ("the family file", family_file)])
