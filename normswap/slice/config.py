"""`normswap slice`'s options, declared once (normswap/declared.py).

``SliceOptions`` generates the `normswap slice` click options (cli/slice_command.py) and is what
``slice_checkpoint`` takes (its fields as keywords, or the object); both validate with
:func:`option_errors`. The defaults below are the only ones.

This module imports neither torch nor click, so that ``--help`` stays fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from normswap import declared
from normswap.declared import option

DEFAULT_FRACTION = 0.25
DEFAULT_CALIBRATION_TOKENS = 32_768  # 128 blocks of 256: Σ of a 768-wide stream settles well before this
MAX_CALIBRATION_TOKENS = 1 << 22  # 4.2M tokens: a forward over them is the whole cost; beyond, no eigenvector moves
SHIPPED_BASES = ("pca", "random")  # per-layer is an in-memory comparison arm (model.py), never written
DEFAULT_EVAL_TOKENS = 2_048  # 8 blocks of 256: a perplexity to 1-2 %, two streamed forwards per block
DEFAULT_TOLERANCE = 1e-4  # max |Δ log-prob| of the rotation-only model against the conversion (convert's own)
AUTO = "auto"  # --fraction auto: the largest fraction within --max-ppl-increase (slice/auto.py)


@dataclass
class SliceOptions:
    fraction: float | str = option(
        DEFAULT_FRACTION,
        "Share of the residual stream's width to delete, in (0, 1): the new width is d·(1 − F) rounded to "
        "--round-to (at most d − 1). auto: the largest fraction on the --round-to grid whose held-out perplexity "
        "rises by at most --max-ppl-increase percent (one calibration, one rotation; each width tried costs "
        "one evaluation).",
        above=0.0,
        below=1.0,
    )
    data: str = option(
        "embedded",
        "Calibration text (its training split): embedded (the shipped KJV corpus; never its test books), a "
        "text/JSONL/parquet file or directory, a saved dataset, or a hub dataset id.",
    )
    calibration_tokens: int = option(
        DEFAULT_CALIBRATION_TOKENS,
        f"Tokens of calibration text the rotation is fitted on (at most {MAX_CALIBRATION_TOKENS:,}).",
        minimum=1,
        maximum=MAX_CALIBRATION_TOKENS,
    )
    round_to: int = option(8, "Round the new width to a multiple of this (matmul-friendly widths).", minimum=1)
    seed: int = option(0, "Seed of the calibration blocks drawn (and of --basis random).")
    basis: str = option(
        "pca",
        "pca: the stream's principal directions (one rotation for the whole stream); random: a seeded random "
        "rotation (the control, for comparisons).",
        choices=SHIPPED_BASES,
    )
    eval_tokens: int = option(
        DEFAULT_EVAL_TOKENS,
        "Held-out tokens (the test split of --data) on which the conversion's and the sliced model's perplexity "
        "are measured at the end, streamed one module at a time (0: skip).",
        minimum=0,
        maximum=MAX_CALIBRATION_TOKENS,
    )
    memory_budget: str = option(
        "",
        "Memory for one module's float32 weights plus the calibration batch's activations, e.g. 4GiB: sets how "
        "many calibration blocks run at once; refused when one layer does not fit (default: 8 blocks at once).",
    )
    max_ppl_increase: float | None = option(
        None,
        "With --fraction auto (and only with it; required there): the most the held-out perplexity may rise, in "
        "percent of the source's (e.g. 5 for 5 %).",
        kind="float",
        minimum=0.0,
        recipe=False,  # a recipe names its fraction; the search is the command line's
    )
    tolerance: float = option(
        DEFAULT_TOLERANCE,
        "The rotation alone (only the all-ones direction deleted) must reproduce the conversion within this "
        "max |Δ log-prob| (or 4x the float32 noise floor, if larger), else nothing is written.",
        minimum=0.0,
    )


def option_errors(values: dict) -> list[tuple[str, str]]:
    """(option name, what is wrong) for each value in ``values`` outside its declared bounds, and
    --fraction auto / --max-ppl-increase given one without the other (or auto without held-out text)."""
    auto = values.get("fraction") == AUTO
    errors = declared.option_errors(SliceOptions, {**values, "fraction": None} if auto else values)
    if auto and values.get("max_ppl_increase") is None:
        errors.append(("fraction", "auto needs --max-ppl-increase P (the most perplexity may rise, in percent)"))
    if auto and values.get("eval_tokens") == 0:
        errors.append(("fraction", "auto measures held-out perplexity: it needs --eval-tokens > 0"))
    if not auto and values.get("max_ppl_increase") is not None:
        errors.append(("max_ppl_increase", "is only read with --fraction auto"))
    return errors


def is_auto(options) -> bool:
    return options.fraction == AUTO


def options_from(options: SliceOptions | None, values: dict) -> SliceOptions:
    """``options``, or one built from keyword ``values``; never both. Unknown names are a TypeError,
    values outside their bounds a NormswapError (one line)."""
    from normswap.errors import NormswapError

    known = {f.name for f in dataclasses.fields(SliceOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"unexpected slice option(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    if options is not None and values:
        raise TypeError(f"pass either options= or {', '.join(sorted(values))}, not both")
    options = options if options is not None else declared.build(SliceOptions, values)
    problems = [f"--{name.replace('_', '-')} {why}" for name, why in option_errors(dataclasses.asdict(options))]
    if problems:
        raise NormswapError("; ".join(problems))
    return options


def check_out(src, out, *, force: bool, data=None):
    """Refuse an OUT that would clobber something or overlap what slice reads (the model, the
    calibration data); cheap (no torch: the CLI answers it before the slicing modules load and
    before OUT's lock is taken), and slice_checkpoint checks again."""
    from pathlib import Path

    from normswap.publish import check_output_path

    reads = [("the model", src)]
    if data is not None and data != "embedded" and Path(str(data)).exists():
        reads.append(("the calibration data", data))
    return check_output_path(out, force=force, reads=reads)
