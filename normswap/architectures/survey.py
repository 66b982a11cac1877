"""Try discovery on every architecture of the installed transformers (`normswap families survey`).

Enumeration: every model_type in transformers' CONFIG_MAPPING; its default config, shrunk to tiny
sizes, builds the class convert would load (causal LM where one exists, else the base model).
Architectures whose tiny model holds no LayerNorm-like module (by class: nn.LayerNorm subclasses
and classes named *LayerNorm*) are counted but not tried. Each of the others is discovered and
checked exactly as `normswap convert` would, and gets one row: exact / approx-only (post-LN) /
refused with the reason. A per-architecture time limit keeps one slow model from stalling the run.
The check converts with the converter the caller passes (``convert``, family_check.Converter).
"""

from __future__ import annotations

import functools
import signal
import time
from contextlib import contextmanager

import torch

from normswap.architectures.family_check import Converter
from normswap.errors import first_line
from normswap.model_facts import is_layernorm

PER_MODEL_SECONDS = 120


class _Timeout(Exception):
    pass


@contextmanager
def _time_limit(seconds):
    def fire(signum, frame):
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def has_layernorm_class(model) -> bool:
    return any(is_layernorm(m) for m in model.modules())


def survey_one(model_type: str, *, convert: Converter) -> dict:
    from transformers import AutoConfig

    from normswap.architectures.family_check import discover_family
    from normswap.architectures.registry import has_family
    from normswap.architectures.tiny import model_class, shrink_config
    from normswap.errors import DiscoveryError

    row = {"model_type": model_type, "curated": False, "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())[:10]}
    t0 = time.perf_counter()
    try:
        # no time limit around imports: interrupting one leaves half-initialised modules behind
        config = AutoConfig.for_model(model_type)
        row["curated"] = has_family(config)
        tiny = shrink_config(config)
        cls = model_class(tiny)
        with torch.device("meta"):
            skeleton = cls.from_config(tiny)
        row["class"] = type(skeleton).__name__
        if not has_layernorm_class(skeleton):
            row.update(status="no-layernorm", reason="no LayerNorm module in the tiny model")
            return row
        cls = type(skeleton)
        with _time_limit(PER_MODEL_SECONDS):
            try:
                family, check = discover_family(config, cls, convert=convert)
            except DiscoveryError as e:
                row.update(status=_status_of(str(e)), reason=str(e))
                return row
            desc = check.pop("description")
            row["placement"] = desc["placement"]
            row["norms"] = len(desc["norms"]) + (1 if desc.get("final_norm") else 0)
            row["centered_inputs"] = bool(desc.get("centered_inputs"))
            row["max_abs_diff"] = check.get("max_abs_diff")
            if check["exact"] is None:
                row.update(
                    status="approx-only",
                    reason=check["reason"] + (f" ({desc['notes'][:120]})" if desc.get("notes") else ""),
                )
            elif check["exact"]:
                row.update(status="exact", reason=check.get("note", ""))
            else:
                row.update(status="refused", reason=check["reason"])
    except _Timeout:
        row.update(status="refused", reason=f"discovery and check took over {PER_MODEL_SECONDS} s")
    except Exception as e:  # a default config that does not build a tiny model is counted, not tried
        if row.get("class") is None:
            row.update(status="not-built", reason=f"{type(e).__name__}: {first_line(e, 160)}")
        else:
            row.update(status="refused", reason=f"{type(e).__name__}: {first_line(e, 160)}")
    finally:
        row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _status_of(reason: str) -> str:
    """Refusals before a plan exists are not the plan's fault: say which kind they are."""
    if reason.startswith(("cannot trace", "cannot build")):
        return "untraceable"  # the probe inputs normswap builds do not run this model
    if "no module computes LayerNorm" in reason:
        return "no-layernorm"  # *LayerNorm-named modules that compute RMSNorm (T5), or none ran on the probe
    return "refused"


def model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def _preload():
    """Import what every architecture needs once per worker, before any time limit applies."""
    import accelerate  # noqa: F401
    import transformers
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModel, AutoModelForCausalLM  # noqa: F401

    import normswap.architectures.family_check  # noqa: F401
    import normswap.architectures.randomize  # noqa: F401

    transformers.logging.set_verbosity_error()


def _worker_init():
    torch.set_num_threads(1)
    _preload()


def run_survey(*, convert: Converter, only=None, progress=None, jobs=1) -> list[dict]:
    """One row per model_type, in order; ``jobs`` worker processes (each architecture is independent).
    ``convert`` must be a module-level function (the workers receive it pickled, its module imported
    before any time limit applies)."""
    one = functools.partial(survey_one, convert=convert)
    names = only or model_types()
    _worker_init() if jobs <= 1 else None
    rows = []

    def report(row):
        rows.append(row)
        if progress:
            progress(
                f"[{len(rows)}/{len(names)}] {row['model_type']}: {row['status']} ({row['seconds']} s) "
                f"{row.get('reason', '')[:100]}"
            )

    if jobs <= 1:
        for mt in names:
            report(one(mt))
    else:
        import multiprocessing

        # spawn, not fork: a forked torch thread pool can deadlock the workers
        with multiprocessing.get_context("spawn").Pool(jobs, initializer=_worker_init) as pool:
            for row in pool.imap_unordered(one, names):
                report(row)
    order = {mt: i for i, mt in enumerate(names)}
    return sorted(rows, key=lambda r: order[r["model_type"]])


def update_rows(rows, *, statuses, convert: Converter, progress=None, jobs=1) -> list[dict]:
    """``rows`` with those of the given statuses surveyed again (a partial run when a full one does
    not fit; each row keeps the date of the run that produced it)."""
    again = [r["model_type"] for r in rows if r["status"] in statuses]
    fresh = {r["model_type"]: r for r in run_survey(convert=convert, only=again, progress=progress, jobs=jobs)}
    return [fresh.get(r["model_type"], r) for r in rows]


def shard_of(names: list[str], spec: str) -> list[str]:
    """The K-th of N interleaved slices of ``names`` (``spec`` "K/N", K from 1)."""
    from normswap.errors import NormswapError

    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise NormswapError(f"--shard {spec!r}: expected K/N, e.g. 1/4") from None
    if not 1 <= k <= n:
        raise NormswapError(f"--shard {spec!r}: K must be between 1 and N")
    return names[k - 1 :: n]


def load_rows(paths) -> list[dict]:
    """Rows saved by ``--save-json`` (one file per shard), in model_type order; a type twice is an error."""
    import json

    from normswap.errors import NormswapError

    rows: dict[str, dict] = {}
    for path in paths:
        try:
            data = json.loads(open(path).read())
        except (OSError, json.JSONDecodeError) as e:
            raise NormswapError(f"{path}: not a survey JSON file ({e})") from None
        if not isinstance(data, list) or not all(
            isinstance(r, dict) and "model_type" in r and "status" in r for r in data
        ):
            raise NormswapError(f"{path}: not a survey JSON file (expected a list of rows with model_type and status)")
        for r in data:
            if r["model_type"] in rows:
                raise NormswapError(f"{path}: model_type {r['model_type']} is also in an earlier file")
            rows[r["model_type"]] = r
    return [rows[k] for k in sorted(rows)]


def shipped_rows() -> list[dict]:
    """The committed survey's rows (``data/survey.json``, written by docs/architectures-survey.sh)."""
    import json
    from importlib import resources

    return json.loads(resources.files("normswap.architectures").joinpath("data", "survey.json").read_text())


RAW_STREAM = "raw residual stream"  # what every refusal of a stream that leaves without a norm says

REFUSAL_CAUSES = (  # (what the reason says, the cause it names), first match wins
    (RAW_STREAM, "the raw residual stream leaves the model or its stack without a norm"),
    (
        "is not produced by any module",
        "a write into the stream that no module owns (a bare parameter, a concatenation)",
    ),
    ("changed by", "the plan's exactness check failed"),
    ("took over", "over the time limit"),
)


def refusal_causes(refused) -> list[tuple[str, int]]:
    """How many refusals each cause accounts for (the rest: 'other'), largest first."""
    counts: dict[str, int] = {}
    for r in refused:
        cause = next((c for key, c in REFUSAL_CAUSES if key in (r.get("reason") or "")), "other")
        counts[cause] = counts.get(cause, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])


def _runs_note(rows) -> list[str]:
    """A line saying which rows come from which run, when they do not all come from one."""
    runs: dict[str, int] = {}
    for r in rows:
        runs[r.get("run") or "an earlier run (undated)"] = runs.get(r.get("run") or "an earlier run (undated)", 0) + 1
    if len(runs) < 2:
        return []
    return [
        "Rows by the run that produced them (`--from-json … --update STATUS` re-runs some rows and keeps the others): "
        + "; ".join(f"{run}: {n}" for run, n in sorted(runs.items()))
        + ".",
        "",
    ]


def survey_markdown(rows) -> str:
    import transformers

    tried = [r for r in rows if r["status"] in ("exact", "approx-only", "refused")]
    exact = [r for r in tried if r["status"] == "exact"]
    approx = [r for r in tried if r["status"] == "approx-only"]
    refused = [r for r in tried if r["status"] == "refused"]
    # a post-LN row refused because even its approximate conversion failed is still post-LN
    pre = [r for r in tried if r["status"] != "approx-only" and r.get("placement") != "post"]
    raw = [r for r in pre if r["status"] == "refused" and RAW_STREAM in (r.get("reason") or "")]
    lines = [
        "# Architectures tried by discovery",
        "",
        f"Generated by `docs/architectures-survey.sh` (`normswap families survey` in four shards, then one table; "
        f"`--update-tried` re-runs the rows tried before) with transformers "
        f"{transformers.__version__} and torch {torch.__version__}.",
        "",
        f"Enumerated: {len(rows)} model_types in transformers' CONFIG_MAPPING; "
        f"{sum(r['status'] == 'not-built' for r in rows)} do not build a tiny model from their default config; "
        f"{sum(r['status'] == 'no-layernorm' for r in rows)} have no module that computes LayerNorm (none by class, "
        "or only RMSNorm under a LayerNorm name); "
        f"{sum(r['status'] == 'untraceable' for r in rows)} do not run on normswap's probe inputs (multimodal models "
        "needing image tokens, boxes, extra inputs). "
        f"**Tried: {len(tried)}** (traced, with LayerNorms) — exact: {len(exact)}, approximate-only (post-LN): "
        f"{len(approx)}, refused: {len(refused)}.",
        "",
        f"Pre-LN or undetermined (tried and not post-LN): {len(pre)}; converted exactly on tiny configs: {len(exact)} "
        f"({100 * len(exact) / max(1, len(pre)):.0f} %). Every refusal is a plan whose check on a tiny randomised "
        "instance was not exact, or an architecture discovery could not describe; none is converted.",
        "",
        "Exact among architectures whose stream ends in a norm (a separate figure; the one above is the "
        f"headline): {len(exact)} of {len(pre) - len(raw)} "
        f"({100 * len(exact) / max(1, len(pre) - len(raw)):.0f} %), leaving out the {len(raw)} pre-LN "
        "architectures whose raw residual stream leaves the model or its stack without a norm (returned "
        "as an output, or read by a convolution, a pooling or a projection). Those are refused on principle: an exact "
        "conversion centres every write, so the stream itself loses its per-token mean, and giving it back costs one "
        "reduction per write (as much as the LayerNorm that was removed).",
        "",
        "Refusals by cause: " + ("; ".join(f"{cause}: {n}" for cause, n in refusal_causes(refused)) or "none") + ".",
        "",
        *_runs_note(rows),
        "| model_type | class | curated file | result | placement | norms | max abs diff | reason |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in tried:
        diff = f"{r['max_abs_diff']:.1e}" if isinstance(r.get("max_abs_diff"), float) else ""
        reason = (r.get("reason") or "").replace("|", "/").replace("\n", " ")[:220]
        lines.append(
            f"| `{r['model_type']}` | {r.get('class', '')} | {'yes' if r['curated'] else ''} | {r['status']} | "
            f"{r.get('placement', '')} | {r.get('norms', '')} | {diff} | {reason} |"
        )
    lines += ["", "## Not tried", "", "| model_type | why |", "|---|---|"]
    for r in rows:
        if r["status"] in ("not-built", "no-layernorm", "untraceable"):
            lines.append(f"| `{r['model_type']}` | {(r.get('reason') or r['status']).replace('|', '/')[:160]} |")
    return "\n".join(lines) + "\n"


def declared_outputs_one(model_type: str, *, convert: Converter) -> dict:
    """For a pre-LN architecture refused because its raw stream is an output: which outputs an exact
    conversion keeps and which move, on a tiny randomised instance (the data for `--exact-outputs
    pooled`). Discovery describes it anyway (``refuse_raw_outputs=False``), the tiny instance is
    converted with that plan, and every output is compared in float64 (family_check.check_family).

    Returns {model_type, class, status, exact_outputs, shifted_outputs, changed_outputs, reason}:
    status ``exact-on-pooled`` when every output that changed is the raw stream moved by its per-token
    mean and at least one output (pooled, projected, logits...) stays exact."""
    from transformers import AutoConfig

    from normswap.architectures.discover import discover
    from normswap.architectures.family_check import check_family
    from normswap.architectures.probes import model_outputs, probe_inputs
    from normswap.architectures.schema import parse_family
    from normswap.architectures.tiny import model_class, shrink_config, tiny_instance
    from normswap.errors import DiscoveryError

    row = {"model_type": model_type}
    t0 = time.perf_counter()
    try:
        config = AutoConfig.for_model(model_type)
        cls = model_class(shrink_config(config))
        with _time_limit(PER_MODEL_SECONDS):
            model = tiny_instance(config, cls, seed=0)
            row["class"] = type(model).__name__
            try:
                raw = discover(model, refuse_raw_outputs=False)
            except DiscoveryError as e:
                row.update(status="refused", reason=str(e))
                return row
            check = check_family(parse_family(raw, f"discovered from {cls.__name__}"), config, cls, convert=convert)
            outputs = list(model_outputs(model, probe_inputs(model, seq_len=8, seed=1)))
    except _Timeout:
        row.update(status="refused", reason=f"took over {PER_MODEL_SECONDS} s")
        return row
    except Exception as e:
        row.update(status="refused", reason=f"{type(e).__name__}: {first_line(e, 160)}")
        return row
    finally:
        row["seconds"] = round(time.perf_counter() - t0, 2)
    changed = check.get("changed_outputs") or []
    row["changed_outputs"] = changed
    row["exact_outputs"] = [k for k in outputs if k not in changed]
    shifted = RAW_STREAM in (check.get("reason") or "")  # every changed output moved by its per-token mean only
    if check["exact"]:
        row.update(status="exact", reason="every output exact on this tiny instance")
    elif shifted and row["exact_outputs"]:
        row.update(status="exact-on-pooled", reason=check["reason"])
    else:
        row.update(status="refused", reason=check.get("reason") or "no output stays exact")
    return row


def raw_stream_refusals() -> list[str]:
    """The model_types the committed survey refuses because their raw stream leaves the model."""
    return [
        r["model_type"]
        for r in shipped_rows()
        if r["status"] == "refused" and r.get("placement") != "post" and RAW_STREAM in (r.get("reason") or "")
    ]


def declared_outputs_markdown(rows, command: str) -> str:
    """The table `docs/raw-stream-outputs.sh` commits: which of the raw-stream refusals keep their
    pooled/projected outputs exact."""
    import transformers

    pooled = [r for r in rows if r["status"] == "exact-on-pooled"]
    lines = [
        "# Raw-stream architectures: which outputs an exact conversion keeps",
        "",
        f"Generated by `{command}` with transformers {transformers.__version__} and torch {torch.__version__} "
        "(tiny randomised instances, every output compared in float64 after converting with the plan discovery "
        "describes when the raw stream is allowed to be an output).",
        "",
        f"**{len(pooled)} of {len(rows)}** architectures the survey refuses because their raw residual stream "
        "is an output keep every other output exact (their pooled / projected outputs pass through a norm); "
        "the outputs that move are the raw stream, shifted by its per-token mean.",
        "",
        "| model_type | class | result | exact outputs | outputs that move | reason |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        reason = (r.get("reason") or "").replace("|", "/").replace("\n", " ")[:160]
        lines.append(
            f"| `{r['model_type']}` | {r.get('class', '')} | {r['status']} | "
            f"{', '.join(r.get('exact_outputs') or [])} | {', '.join(r.get('changed_outputs') or [])} | {reason} |"
        )
    return "\n".join(lines) + "\n"
