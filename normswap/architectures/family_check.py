"""Which family converts a model, and the check that makes a family trustworthy.

A curated family file (architectures/data/*.yaml) is used as it is. A family discovered from the
model (architectures/discover.py) or given with ``--family-file`` is used only after converting a
fresh randomised tiny instance of the architecture with it left every output unchanged in float64;
post-LN families, approximate by nature, must at least convert that instance and run.

The check needs a converter, and convert/ sits above architectures/ (it reads family files): every
function that converts takes it as ``convert``, a :data:`Converter` (``normswap.convert.inplace.convert_tiny``
is the one convert and the CLI pass), so the family knowledge lives here and imports nothing above it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from normswap.architectures.discover import discover
from normswap.architectures.probes import model_outputs, probe_inputs
from normswap.architectures.schema import Family, parse_family
from normswap.architectures.tiny import tiny_instance
from normswap.errors import DiscoveryError, NormswapError, first_line

# convert(model, family, mode): ``model`` converted in place with ``family`` in ``mode`` ("exact" or
# "approx"); a NormswapError when the model has nothing to convert
Converter = Callable[[torch.nn.Module, Family, str], None]

EXACT_RTOL = 1e-5  # relative to the output scale; float32-internal norms (Cohere, OLMo) stay ~1e-7


def check_family(family: Family, config, cls=None, *, convert: Converter, seed=1, dtype=torch.float64) -> dict:
    """Convert a fresh randomised tiny instance with ``family``; compare every output in float64.

    Returns {"exact": bool|None, "max_abs_diff", "threshold", "mode", "reason"}; ``exact`` is None
    for post-LN families (approximate only by construction).
    """
    source = tiny_instance(config, cls, seed=seed, dtype=dtype)
    placement = family.placement_for(source.config)
    if placement == "post":
        # approximate by nature; still, the approximate plan must convert the tiny instance and run
        failure = _approx_failure(family, source, seed, convert)
        if failure:
            return {
                "exact": False,
                "mode": "approx",
                "max_abs_diff": None,
                "threshold": None,
                "reason": f"post-LN, and the approximate conversion {failure}",
            }
        return {
            "exact": None,
            "mode": "approx",
            "max_abs_diff": None,
            "threshold": None,
            "reason": (
                "not pre-LN (a norm's output is the residual skip path, or the stream is read by more than norms)"
            ),
        }
    converted = copy.deepcopy(source)
    try:
        convert(converted, family, "exact")
    except NormswapError as e:
        return {"exact": False, "mode": "exact", "max_abs_diff": None, "threshold": None, "reason": str(e)}
    except Exception as e:  # a fold whose shapes do not fit (a reader that reads another axis): not this plan
        return {
            "exact": False,
            "mode": "exact",
            "max_abs_diff": None,
            "threshold": None,
            "reason": f"the plan does not apply to the tiny model: {first_line(e, 200)}",
        }
    inputs = probe_inputs(source, seq_len=8, seed=seed)
    try:
        ref = model_outputs(source, inputs)
        got = model_outputs(converted, inputs)
    except Exception as e:
        return {
            "exact": False,
            "mode": "exact",
            "max_abs_diff": None,
            "threshold": None,
            "reason": f"the converted tiny model does not run: {first_line(e, 200)}",
        }
    scale = max([1.0] + [float(r.double().abs().max()) for r in ref.values()])
    threshold = EXACT_RTOL * scale
    worst, changed, shifted = 0.0, [], []
    for key, r in ref.items():
        if key not in got or got[key].shape != r.shape:
            return {
                "exact": False,
                "mode": "exact",
                "max_abs_diff": None,
                "threshold": None,
                "reason": f"converted model's output {key} differs in shape",
            }
        delta = got[key].double() - r.double()
        diff = float(delta.abs().max())
        worst = max(worst, diff)
        if diff > threshold:
            changed.append(key)
            if any(
                float((delta - delta.mean(ax, keepdim=True)).abs().max()) <= threshold
                for ax in range(1, delta.dim())
                if delta.shape[ax] > 1
            ):
                shifted.append(key)
    exact = not changed
    reason = ""
    if changed and shifted == changed:
        reason = (
            f"output {', '.join(changed)} is the raw residual stream (no norm before it leaves the model); "
            "an exact conversion centres the stream, which shifts it per token"
        )
    elif changed:
        reason = (
            f"output {', '.join(changed[:3])} changed by {worst:.3g} (> {threshold:.3g}) on a tiny randomised instance"
        )
    return {
        "exact": exact,
        "mode": "exact",
        "max_abs_diff": worst,
        "threshold": threshold,
        "reason": reason,
        "changed_outputs": changed,
        "outputs": list(ref),
    }


def _approx_failure(family, source, seed, convert: Converter) -> str:
    """Why an approximate conversion of ``source`` with ``family`` fails ('' when it converts, runs and
    returns every output, finite wherever the source's is). Shapes may differ: lengths some models
    predict from their hidden states (VITS's, FastSpeech2's durations) move with an approximation."""
    converted = copy.deepcopy(source)
    try:
        convert(converted, family, "approx")
        inputs = probe_inputs(source, seq_len=8, seed=seed)
        ref, got = model_outputs(source, inputs), model_outputs(converted, inputs)
    except Exception as e:
        return f"fails: {first_line(e, 200)}"
    missing = [k for k in ref if k not in got]
    if missing:
        return f"does not return output {', '.join(missing[:3])}"
    broken = [
        k
        for k, r in ref.items()
        if got[k].shape == r.shape and bool((torch.isfinite(r) & ~torch.isfinite(got[k])).any())
    ]
    return f"makes output {', '.join(broken[:3])} non-finite" if broken else ""


def discover_family(config, cls=None, *, convert: Converter, name=None, refuse_raw_outputs=True) -> tuple[Family, dict]:
    """Discover on a tiny instance of ``config``, check, and return (family, check result).
    ``refuse_raw_outputs=False``: describe a model whose raw stream is an output anyway (``--exact-outputs
    pooled``); the check then says which outputs moved."""
    dtype = torch.float64
    model = tiny_instance(config, cls, seed=0)
    try:
        raw = discover(model, name=name, refuse_raw_outputs=refuse_raw_outputs)
    except DiscoveryError as e:
        if "cannot trace" not in str(e):
            raise
        # some modeling code does not run in float64 (XGLM's masking): float32 is enough to see the flow
        dtype = torch.float32
        model = tiny_instance(config, cls, seed=0, dtype=dtype)
        raw = discover(model, name=name, refuse_raw_outputs=refuse_raw_outputs)
    family = parse_family(raw, f"discovered from {type(model).__name__}")
    check = check_family(family, config, cls, convert=convert, dtype=dtype)
    if check["exact"] is False and any(
        n.get("readers") for n in raw["norms"] + ([raw["final_norm"]] if raw.get("final_norm") else [])
    ):
        # folding γ/β is an optimisation; keeping them on the RMSNorm is exact whenever centring is
        unfolded = copy.deepcopy(raw)
        for n in unfolded["norms"] + ([unfolded["final_norm"]] if unfolded.get("final_norm") else []):
            n["readers"] = []
        fam2 = parse_family(unfolded, family.source)
        check2 = check_family(fam2, config, cls, convert=convert, dtype=dtype)
        if check2["exact"]:
            check2["note"] = "γ/β folding was not exact, so they stay on the RMSNorm: " + check["reason"]
            raw, family, check = unfolded, fam2, check2
    return family, {**check, "description": raw}


_RESOLVED: dict = {}
# discovery's refusal of a stream that is itself an output (discover.py); --exact-outputs pooled lifts it
RETURNED_RAW_STREAM = "is returned as a model output without a norm"
POOLED_HINT = (
    "if you use only its pooled/projected outputs (pooler_output, image_embeds, text_embeds), "
    "rerun with --exact-outputs pooled"
)


def resolve_pooled_family(config, cls=None, *, convert: Converter) -> tuple[Family, dict | None]:
    """``--exact-outputs pooled``: the family for ``config`` and which of its outputs stay exact.

    Curated families keep every output (None). Otherwise discovery describes the model even where
    its raw stream is an output, a tiny randomised instance is converted, and the plan is used when
    every output that moved is the raw stream shifted by its per-token mean and at least one output
    stays exact: returns (family, {"exact_outputs": [...], "shifted_outputs": [...]}), or (family,
    None) when every output stays exact. Anything else is refused with the reason.
    """
    from normswap.architectures.registry import family_for_config, has_family

    if has_family(config):
        return family_for_config(config), None
    key = ("pooled", config.to_json_string(use_diff=False), getattr(cls, "__name__", None))
    if key not in _RESOLVED:
        what = f"--exact-outputs pooled: model_type={config.model_type!r}"
        try:
            family, check = discover_family(config, cls, convert=convert, refuse_raw_outputs=False)
        except DiscoveryError as e:
            raise NormswapError(f"{what}: discovery failed: {e}") from None
        declared = None
        if check["exact"] is False:
            changed = check.get("changed_outputs") or []
            kept = [k for k in check.get("outputs") or [] if k not in changed]
            if "raw residual stream" not in (check.get("reason") or "") or not kept:
                raise NormswapError(
                    f"{what} keeps no output exact on a tiny randomised instance "
                    f"({check.get('reason') or 'every output moved'}), so it is refused"
                )
            declared = {"exact_outputs": kept, "shifted_outputs": changed}
        _RESOLVED[key] = (family, declared)
    return _RESOLVED[key]


def resolve_family(config, cls=None, family_file=None, *, convert: Converter) -> Family:
    """The family for ``config``: ``family_file`` when given, else its curated data file, else one
    discovered from the model.

    A family file or a discovered description is used only when converting a fresh randomised tiny
    instance with it left every output unchanged (post-LN ones, approximate by nature, are used in
    approx mode); otherwise refuse with the reason.
    """
    from normswap.architectures.registry import family_for_config, has_family, load_family_file, supported_summary

    if family_file is None and has_family(config):
        return family_for_config(config)
    key = (config.to_json_string(use_diff=False), getattr(cls, "__name__", None), str(family_file))
    if key not in _RESOLVED:
        if family_file is not None:
            _RESOLVED[key] = _checked_file_family(load_family_file(family_file), config, cls, convert)
            return _RESOLVED[key]
        known = f"; supported families: {supported_summary()}"
        try:
            family, check = discover_family(config, cls, convert=convert)
        except DiscoveryError as e:
            hint = f"; {POOLED_HINT}" if RETURNED_RAW_STREAM in str(e) else ""
            raise NormswapError(
                f"unsupported architecture: model_type={config.model_type!r} has no family file, "
                f"and discovery failed: {e}{hint}{known}"
            ) from None
        if check["exact"] is False:  # None: post-LN, whose approximate plan converted and ran
            raise NormswapError(
                f"unsupported architecture: model_type={config.model_type!r} has no family file, "
                f"and the discovered plan is not exact on a tiny randomised instance ({check['reason']}){known}"
            )
        _RESOLVED[key] = family
    return _RESOLVED[key]


def _checked_file_family(family: Family, config, cls, convert: Converter) -> Family:
    """``family`` (from --family-file) if it describes ``config``'s model_type and passes the exactness check."""
    model_type = getattr(config, "model_type", None)
    if model_type not in family.model_types:
        raise NormswapError(
            f"family file {family.source} describes model_types {', '.join(family.model_types)}, not {model_type!r}"
        )
    try:
        check = check_family(family, config, cls, convert=convert)
    except DiscoveryError as e:
        raise NormswapError(f"family file {family.source}: {e}") from None
    except NormswapError:
        raise
    except Exception as e:  # a path the model does not have, a module of the wrong kind
        raise NormswapError(f"family file {family.source} does not fit {model_type}: {first_line(e, 200)}") from None
    if check["exact"] is False:
        raise NormswapError(
            f"family file {family.source} is not exact on a tiny randomised {model_type} instance ({check['reason']})"
        )
    return family
