"""results.json -> report.md and a self-contained report.html (figures embedded as base64)."""

from __future__ import annotations

from pathlib import Path

from normswap.evaluate.speed_intervals import (
    fmt_interval,
    intervals_of,
    noisy_kinds,
    throughput_method,
    throughput_pairs,
)
from normswap.report import encoders
from normswap.report import page as kit
from normswap.report.claims import claims
from normswap.report.glossary import glossary
from normswap.report.intervals import change_interval, difference_resolved
from normswap.report.page import escape
from normswap.report.tables import html_table, markdown_table, signed_percent
from normswap.stats.verdicts import MIN_PAIRS, MIN_REPEATS, NO_DIFFERENCE, NULL_BAND, TOO_NOISY, measurable, undecided

UNDECIDED = (NO_DIFFERENCE, TOO_NOISY)


def fmt_num(x, digits=2):
    """One number format everywhere: thousands separated, ``digits`` decimals whatever the size (so
    979.45 and 1,072.31 sit in one column, never 979.45 beside 1,072); integers without decimals."""
    if x is None:
        return "–"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}"


NOT_MEASURED_ONNX = "not measured (ONNX)"


def onnx_gap(m, text: str) -> str:
    """An ONNX export's empty cell says why (evaluate/onnx_model.py: what a graph cannot be measured by),
    where a PyTorch row's empty cell is a dash."""
    return NOT_MEASURED_ONNX if m.get("onnx") and text in ("–", "", "0") else text


def fmt_bytes(n):
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def fmt_ratio(r):
    """``×1.04``; a ratio that is not 1 but would print as ×1.00 is written as the change it is
    (``-0.40%``, ``-0.04%``), so a real difference never reads as none."""
    if r is None:
        return ""
    return signed_percent((r - 1) * 100) if r != 1.0 and f"{r:.2f}" == "1.00" else f"×{r:.2f}"


def fmt_change(r):
    """A ratio of two numbers where lower or higher is a quality (perplexity, bits/byte) as the signed
    change it is: ``-0.40%``, ``+1.80%`` (two decimals, so -0.4 % never hides in a ×1.00)."""
    return "" if r is None else signed_percent((r - 1) * 100)


def fmt_params(n):
    if n is None:
        return "–"
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.0f}k"


def _ratios(m):
    return m.get("ratios") or {}


# A cell's state: "good"/"bad" (a measured difference, better/worse for the user), "same" (no
# measurable difference: never coloured) or "" (nothing to judge).
def exact_state(ratio, *, lower_better: bool, tol: float) -> str:
    """For numbers that do not vary between runs (perplexity, counted memory)."""
    if ratio is None:
        return ""
    if abs(ratio - 1.0) <= tol:
        return "same"
    return "good" if (ratio < 1.0) == lower_better else "bad"


def timed_state(iv) -> str:
    """For speed ratios: a colour only when the per-repeat interval excludes 1 (normswap/stats/verdicts.py)."""
    if not measurable(iv):
        return "same"
    return "good" if iv["verdict"] == "higher" else "bad"


def timed_ratio_text(ratio, iv) -> str:
    """``×1.12 [1.05–1.20]``; a ratio that is no difference also says so in words (no measurable
    difference, or too noisy to tell)."""
    if ratio is None:
        return ""
    text = f"{fmt_ratio(ratio)} {fmt_interval(iv)}".strip()
    return text if measurable(iv) else f"{text} {undecided(iv)}"


KIND_WORDS = {
    "forward": "forward",
    "train_step": "train step",
    "generate": "generate",
    "prefill": "prefill",
    "decode": "decode",
    "norm_ms_per_forward": "time in norms",
}


def load_averages(noise: dict) -> tuple[float, float] | None:
    """The 1-minute load average before and after the timing, when the run recorded both."""
    if noise.get("load_before") and noise.get("load_after"):
        return noise["load_before"][0], noise["load_after"][0]
    return None


def noise_banner(results) -> str | None:
    """The one prominent line a report shows when its null control says the machine was too busy to
    tell a speed difference from noise (normswap/stats/verdicts.py: the rule), else None."""
    noisy = noisy_kinds(results)
    if not noisy:
        return None
    noise = results.get("speed_noise") or {}
    spread = noise.get("null_spread") or {}
    null = results.get("null_control") or {}
    null_name = f"{null['of']} loaded a second time" if null.get("of") else "the baseline loaded a second time"
    parts = [f"{KIND_WORDS.get(k, k)} {fmt_interval(spread.get(k)) or '(not measured)'}" for k in noisy]
    every = set(noisy) >= set(spread)
    which = "no speed ratio" if every else "no " + ", ".join(KIND_WORDS.get(k, k) for k in noisy) + " ratio"
    loads = load_averages(noise)
    load = (
        f" Load average {loads[0]:.1f} before and {loads[1]:.1f} after the timing, "
        f"on {noise.get('usable_cpus') or noise.get('cpu_count')} CPUs."
        if loads
        else ""
    )
    return (
        f"This machine was too noisy to tell speed differences: the null control ({null_name}, timed like the others) "
        f"ranged {'; '.join(parts)} against the baseline, outside ±{NULL_BAND * 100:.0f} %, "
        f"so {which} is called faster "
        f"or slower and none is coloured.{load} Re-run on a quieter machine to tell."
    )


# (word perplexity, generate and prefill tokens/s stay in results.json: the table must fit a page
# without wrapping its numbers)
SPEED_COLUMNS = (("forward", "forward tok/s"), ("train_step", "train-step tok/s"), ("decode", "decode tok/s"))


def memory_note(results) -> str | None:
    """Why the peak-memory column is empty, when it is."""
    reasons = {
        (m.get("memory_detail") or {}).get("reason") for m in results["models"] if m.get("peak_memory_bytes") is None
    }
    reasons.discard(None)
    if not reasons and all(m.get("peak_memory_bytes") is None for m in results["models"]):
        reasons = {"not measured in this run"}
    return ("Peak memory: " + "; ".join(sorted(reasons))) if reasons else None


def held_out(results) -> bool:
    """False when the evaluated text includes what a compared model was fine-tuned on (evaluate/heldout.py):
    its perplexity then measures memory of the training text, and is never coloured as a gain."""
    return (results.get("data") or {}).get("held_out") is not False


def table_rows(results) -> tuple[list[str], list[list[tuple[str, str, str]]]]:
    """Header and rows of the side-by-side table: each cell is (value, ratio text, state)."""

    def judged(cell):
        return cell if held_out(results) or not cell[2] else (cell[0], cell[1], "same")

    header = (
        ["model", "kind", "perplexity", "bits/byte"]
        + [label for _, label in SPEED_COLUMNS]
        + ["peak memory", "time in norms"]
    )
    rows = []
    for m in results["models"]:
        r = _ratios(m)
        tr = r.get("tokens_per_second") or {}
        tps = m.get("tokens_per_second") or {}
        ivs = (intervals_of(m, results) or {}).get("tokens_per_second") or {}
        is_base = m["name"] == results.get("baseline")

        def exact(key, digits, value=None, lower_better=True, tol=0.001, change=False, m=m, r=r, is_base=is_base):
            v = m.get(key) if value is None else value
            if is_base or r.get(key) is None:
                return (v if isinstance(v, str) else fmt_num(v, digits), "", "")
            state = exact_state(r[key], lower_better=lower_better, tol=tol)
            if change and state in ("good", "bad") and not difference_resolved(m, key):
                state = "same"  # its interval over documents contains 0: not a measured change
            return (
                v if isinstance(v, str) else fmt_num(v, digits),
                fmt_change(r[key]) if change else fmt_ratio(r[key]),
                state,
            )

        row = [
            (m["name"] + (" (baseline)" if is_base else ""), "", ""),
            (m.get("kind", "") + (f", {fmt_params(m['parameters'])}" if m.get("parameters") else ""), "", ""),
            judged(exact("perplexity", 3, change=True)),
            judged(exact("bits_per_byte", 4, change=True)),
        ]
        for key, _ in SPEED_COLUMNS:
            if is_base or tr.get(key) is None:
                row.append((onnx_gap(m, fmt_num(tps.get(key), 0)), "", ""))
            else:
                row.append(
                    (fmt_num(tps.get(key), 0), timed_ratio_text(tr[key], ivs.get(key)), timed_state(ivs.get(key)))
                )
        memory = exact("peak_memory_bytes", 0, value=fmt_bytes(m.get("peak_memory_bytes")), tol=0.005)
        row.append((onnx_gap(m, memory[0]), *memory[1:]))
        norm = _norm_time_cell(m, (intervals_of(m, results) or {}).get("norm_ms_per_forward"), is_base)
        row.append((onnx_gap(m, norm[0]), *norm[1:]))
        rows.append(row)
    # a column no model has a number in does not apply to these models (an encoder's perplexity and
    # decode, speed in a perplexity-only run): left out rather than shown empty
    empty = ("–", "", NOT_MEASURED_ONNX)
    keep = [i for i in range(len(header)) if i < 2 or any(row[i][0] not in empty for row in rows)]
    return [header[i] for i in keep], [[row[i] for i in keep] for row in rows]


def _norm_time_cell(m, iv, is_base) -> tuple[str, str, str]:
    """The share of the forward in norm layers, and against the baseline the norm-time ratio with its
    interval (a time: lower is less time, so ``lower`` is the good colour)."""
    share = m.get("norm_time_share")
    value = "–" if share is None else f"{share * 100:.1f}%"
    if is_base or not iv:
        return (value, "", "")
    state = "same" if not measurable(iv) else ("good" if iv["verdict"] == "lower" else "bad")
    return (value, timed_ratio_text(iv["median"], iv), state)


def fidelity_items(f: dict, reference: str) -> list[tuple[str, str, str, str]]:
    """An encoder's headline: its only quality number, fidelity to the reference (1 = identical)."""
    note = f"cosine to {reference}"
    if f.get("embedding_cosine") is not None:  # text encoders: sentence embeddings, mean and worst sentence
        return [
            ("sentence cosine, mean", f"{f['embedding_cosine']:.4f}", "", note),
            ("sentence cosine, worst", f"{f['embedding_cosine_min']:.4f}", "", note),
        ]
    items = (
        [("output cosine, mean", f"{f['hidden_cosine']:.4f}", "", note)] if f.get("hidden_cosine") is not None else []
    )
    if f.get("output_cosine") is not None:  # probe inputs: the worst of every output
        items.append(("output cosine, worst", f"{f['output_cosine']:.4f}", "", note))
    return items


def headlines(results) -> list[dict]:
    """One card per compared model: the few numbers a user asks first.

    Each item: (label, value, state, note); a timed ratio that is no measured difference shows the
    words ("no measurable difference" / "too noisy to tell") as its value, state "same", and its
    number only in the note: large type is for measured differences.
    """
    base = results.get("baseline")
    reference = (results.get("fidelity_setup") or {}).get("reference") or base
    cards = []
    for m in results["models"]:
        fidelity = m.get("fidelity") if m["name"] != reference else None
        if m["name"] == base or not (m.get("ratios") or fidelity):
            continue
        r = m.get("ratios") or {}
        tr = r.get("tokens_per_second") or {}
        ivs = (intervals_of(m, results) or {}).get("tokens_per_second") or {}
        items = fidelity_items(fidelity, reference) if fidelity else []
        if r.get("perplexity") is not None:
            state = exact_state(r["perplexity"], lower_better=True, tol=0.001) if held_out(results) else "same"
            civ = change_interval(m, "perplexity")
            note = "" if held_out(results) else "not held-out text"
            if civ is not None:
                span = f"[{signed_percent((civ['low'] - 1) * 100)}, {signed_percent((civ['high'] - 1) * 100)}]"
                note = (note + " " + span).strip()
                if not difference_resolved(m, "perplexity"):
                    state = "same"
                    note += f" {NO_DIFFERENCE}"
            items.append(("perplexity", fmt_change(r["perplexity"]), state, note))
        for key, label in (("forward", "forward"), ("train_step", "train step"), ("decode", "decode")):
            if tr.get(key) is not None:
                iv = ivs.get(key)
                number = f"{fmt_ratio(tr[key])} {fmt_interval(iv)}".strip()
                if measurable(iv):
                    items.append((label, fmt_ratio(tr[key]), timed_state(iv), fmt_interval(iv)))
                else:  # noise is not a headline number: the words in its place, the number beneath
                    items.append((label, undecided(iv), "same", number))
        if r.get("peak_memory_bytes") is not None:
            items.append(
                (
                    "peak memory",
                    fmt_ratio(r["peak_memory_bytes"]),
                    exact_state(r["peak_memory_bytes"], lower_better=True, tol=0.005),
                    "",
                )
            )
        cards.append({"name": m["name"], "kind": m.get("kind", ""), "items": items})
    return cards


def speed_compared(results) -> bool:
    """True when the run timed models against a baseline (so its ratios and null control need saying)."""
    return bool(results.get("baseline")) and any(m.get("tokens_per_second") for m in results["models"])


def table_notes(results) -> list[str]:
    """What the side-by-side table needs said beside it: how sure its speed ratios are, and why a
    column is empty."""
    notes = []
    if speed_compared(results):
        rule = (  # the rule each kind of result was judged by (normswap/stats/verdicts.py)
            f"a ratio whose bracket does not lie further from 1 than the null control's reaches, or that rests "
            f"on fewer than {MIN_PAIRS} pairs"
            if throughput_pairs(results)
            else f"a ratio whose range contains 1 or the null control's, or that rests on fewer than "
            f"{MIN_REPEATS} repeats"
        )
        notes.append(f'Speed ratios: {throughput_method(results)}; {rule}, is "{NO_DIFFERENCE}" and is not coloured.')
        notes.append(null_control_note(results))
        note = kernels_note(results)
        if note:
            notes.append(note)
    note = memory_note(results)
    if note:
        notes.append(note)
    return notes


def kernels_note(results) -> str | None:
    """Which implementation each model's norm layers ran, per kind of call (results.json
    ``norm_time.implementations``), or None for results that do not say."""
    parts = []
    for m in results["models"]:
        impls = (m.get("norm_time") or {}).get("implementations")
        if impls:
            said = "; ".join(
                ", ".join(f"{impl} ×{n}" for impl, n in ran.items()) + ("" if kind == "own forward" else f" ({kind})")
                for kind, ran in impls.items()
            )
            parts.append(f"{m['name']}: {said}")
    return ("Norm kernels that ran (layers): " + " · ".join(parts) + ".") if parts else None


def null_control_note(results) -> str:
    """What the run's null control measured and how it decided the colours (or that there was none)."""
    noise = results.get("speed_noise") or {}
    null = results.get("null_control")
    if not null:
        return (
            "No null control in this run (--no-null-control, or results from before it): "
            "the verdicts rest on the paired "
            "intervals alone, which a machine whose load changes during the run can fool."
        )
    spread = noise.get("null_spread") or {}
    shown = "; ".join(f"{KIND_WORDS.get(k, k)} {fmt_interval(iv)}" for k, iv in spread.items())
    loads = load_averages(noise)
    load = f" Load average {loads[0]:.1f} → {loads[1]:.1f} on {noise.get('usable_cpus')} CPUs." if loads else ""
    return (
        f"Null control: {null['name']} against {null['of']}: {shown}. "
        "A ratio is coloured only when this range stays within "
        f'±{NULL_BAND * 100:.0f} % for its kind (else "{TOO_NOISY}") and the ratio\'s own range lies outside it.' + load
    )


def task_notes(results) -> list[str]:
    """How lm-eval's numbers relate to normswap's own, so one quantity never shows two unexplained values."""
    notes = []
    for m in results["models"]:
        for task, check in (m.get("task_crosscheck") or {}).items():
            lm = ((m.get("tasks") or {}).get(task) or {}).get("bits_per_byte")
            if lm is None:
                continue
            agree = abs(check["bits_per_byte"] / lm - 1) < 1e-4
            notes.append(
                f"{m['name']} / {task}: normswap on lm-eval's windows "
                f"({check['documents']} documents, each from a fresh "
                f"context, {check['window']}-token windows without overlap) "
                f"gives bits/byte {check['bits_per_byte']:.4f} "
                f"vs lm-eval's {lm:.4f}: " + ("the same number." if agree else "they DIFFER (please report this).")
            )
    if notes:
        d = results.get("data") or {}
        notes.append(
            "The perplexity and bits/byte in the side-by-side table differ from lm-eval's on purpose: there the "
            f"{d.get('split', 'held-out')} split is read as one stream ({d.get('characters', 0):,} characters"
            + (", capped" if d.get("truncated") else "")
            + f"), in {d.get('seq_len')}-token windows every "
            f"{d.get('stride')} tokens, so tokens get more context and chapter boundaries are not restarts."
        )
    return notes


def task_table(results):
    cols = []
    for m in results["models"]:
        for task, scores in (m.get("tasks") or {}).items():
            for metric in scores:
                if metric.endswith("_stderr") or metric == "sample_len":
                    continue
                if (task, metric) not in cols:
                    cols.append((task, metric))
    rows = [
        [m["name"]] + [onnx_gap(m, fmt_num((m.get("tasks") or {}).get(t, {}).get(k), 4)) for t, k in cols]
        for m in results["models"]
    ]
    return cols, rows


def report_title(results) -> str:
    """A recipe run passes its own title; a bare `eval report` gets the generic one."""
    return results.get("title") or "normswap evaluation report"


def _setup_lines(results) -> list[str]:
    d = results.get("data")
    v = results.get("versions") or {}
    lines = [f"Device: {results['device']}; dtype: {results['dtype']}; created {results['created']}"]
    if d:  # speed-only runs measure no perplexity and read no text
        lines += [
            (f"Evaluated: {d['caption']}; " if d.get("caption") else "") + f"Data: {d['spec']} ({d['split']} split), "
            f"{d['characters']:,} characters / {d['bytes']:,} bytes / {d['words']:,} words"
            + (
                f" (capped at {d['max_tokens']:,} tokens of {d.get('cap_tokenizer_of')}'s tokenizer "
                f"from {d['characters_available']:,} characters)"
                if d.get("truncated")
                else ""
            ),
            f"Perplexity windows: seq_len {d['seq_len']}, stride {d['stride']}, batch {d['batch_size']}",
        ]
    lines.append("Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val and k != "platform"))
    s = results.get("speed_setup")
    if s:
        timed = (
            f"interleaved pairs until every interval is within ±{s['target_halfwidth']:g} or "
            f"{s['speed_budget']:g} s a kind are spent (at most {s['repeats']})"
            if throughput_pairs(results) and s.get("speed_budget") is not None
            else f"{s['repeats']} interleaved repeats (medians)"
        )
        lines.append(
            f"Speed: batch {s['batch_size']} × {s['seq_len']} tokens, {timed}, "
            f"warm-up {s['warmup']}, generation {s['prompt_len']}-token prompt + {s['new_tokens']} new tokens"
        )
    return lines


def eval_terms(results) -> list[tuple[str, str]]:
    """The glossary entries this report's words need (speed terms only when speed was measured)."""
    speed = any(m.get("tokens_per_second") for m in results["models"])
    used = ["paired interval", NO_DIFFERENCE, "null control", TOO_NOISY, "norm share", "Amdahl bound"] if speed else []
    return glossary(used)


# ---------------------------------------------------------------- markdown
def _markdown_safe(value):
    """``value`` with every string's ``&``, ``<`` and ``>`` written as entities, as report.html escapes
    them: a markdown viewer renders raw HTML, and results.json strings (model names, tasks, warnings)
    come from a file that may have been received from anywhere. Entities read the same as text."""
    if isinstance(value, str):
        return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    if isinstance(value, dict):
        return {_markdown_safe(k): _markdown_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_markdown_safe(v) for v in value]
    return value


def markdown(results, figures: dict[str, Path]) -> str:
    results = _markdown_safe(results)  # every string from the file, once, before any line is made of it
    out = [f"# {report_title(results)}", ""] + kit.md_warnings(results.get("warnings"))  # thin evidence first
    out += [f"- {line}" for line in _setup_lines(results)]
    if results.get("baseline"):
        out.append(
            f"- Changes are against **{results['baseline']}**: ×1.10 = 10 % higher; perplexity and bits/byte as "
            "the signed change in per cent."
        )
    out.append("")
    banner = noise_banner(results)
    if banner:
        out += kit.md_alert(TOO_NOISY.capitalize(), banner)
    cards = headlines(results)
    if cards:
        out += ["## Headline", ""]
        for c in cards:
            out.append(
                f"- **{c['name']}** ({c['kind']}): "
                + ", ".join(
                    f"{label}: {val} ({note})" if val in UNDECIDED else f"{label} {val}" + (f" {note}" if note else "")
                    for label, val, _, note in c["items"]
                )
            )
        out.append("")
    header, rows = table_rows(results)
    out += ["## Side by side", ""] + markdown_table(
        header, [[v + (f" ({r})" if r else "") for v, r, _ in row] for row in rows]
    )
    out.append("")
    out += [f"- {line}" for line in table_notes(results)]
    out.append("")
    out += encoders.markdown_section(results)
    out += ["## Claims vs measured", ""]
    for c in claims(results):
        out.append(f"**{c['claim']}** — **{c['verdict']}**. {c['meaning']}")
        out += [f"- {line}" for line in c["measured"]]
        out.append("")
    cols, trows = task_table(results)
    if cols:
        out += ["## lm-eval tasks", ""] + markdown_table(["model"] + [f"{t} {k}" for t, k in cols], trows)
        out.append("")
        out += [f"- {line}" for line in task_notes(results)]
        out.append("")
    drows = []
    for m in results["models"]:
        dg = m.get("diagnostics") or {}
        layers = dg.get("layers") or []
        rms = [lay["rms"] for lay in layers if "rms" in lay]
        tm = [lay["token_mean_abs"] for lay in layers if "token_mean_abs" in lay]
        drows.append(
            [
                m["name"],
                onnx_gap(m, fmt_num(dg.get("loss"), 4)),
                onnx_gap(m, fmt_num(dg.get("grad_norm"), 4)),
                len(layers),
                fmt_num(sum(rms) / len(rms) if rms else None, 4),
                fmt_num(max(tm) if tm else None, 5),
            ]
        )
    out += ["## Training diagnostics (one fixed batch)", ""] + markdown_table(
        ["model", "loss", "grad norm", "norm layers", "mean input RMS", "max abs(per-token mean)"], drows
    )
    out.append("")
    if figures:
        out += ["## Figures", ""]
        for key, path in figures.items():
            out += kit.md_figure(FIGURE_TEXT.get(key, (key, ""))[0], path)
    out += kit.md_terms(eval_terms(results))
    out += ["---", "Method: docs/results-schema.md (perplexity windows, speed interleaving, memory, diagnostics).", ""]
    return "\n".join(out)


# ---------------------------------------------------------------- html
FIGURE_TEXT = {  # key -> (heading, caption) on the HTML page; the markdown page uses the heading only
    "perplexity": (
        "Perplexity",
        "Token perplexity and bits per byte on the held-out text; bits per byte compares across tokenizers.",
    ),
    "fidelity": ("Fidelity to the reference", encoders.CAPTION),
    "throughput": (
        "Throughput",
        "Tokens per second (medians of interleaved repeats) and the share of forward time inside norm layers.",
    ),
    "finetune_loss": (
        "Fine-tune loss",
        "From train_log.jsonl next to each fine-tuned model: training loss per step, held-out loss at its eval steps.",
    ),
    "activations": (
        "Activations entering each norm",
        "Per norm layer, on one fixed batch: RMS of the input, and how far each token's vector is from zero-mean.",
    ),
}


def html_top(results) -> list[str]:
    """Title, the compared models, thin-evidence warnings, the setup box and the too-noisy banner."""
    names = ", ".join(m["name"] for m in results["models"])
    parts = [f"<h1>{escape(report_title(results))}</h1><p class='sub'>{escape(names)}</p>"]
    parts += kit.html_warnings(results.get("warnings"))  # thin evidence is said first, before any number
    parts.append(kit.html_meta(_setup_lines(results)))
    banner = noise_banner(results)
    return parts + ([kit.html_alert(TOO_NOISY.capitalize(), banner)] if banner else [])


def html_headline_cards(results) -> list[str]:
    cards = headlines(results)
    if not cards:
        return []
    against = results.get("baseline") or (results.get("fidelity_setup") or {}).get("reference") or ""
    parts = [
        "<h2>Headline <small style='font-weight:400;color:var(--muted);font-size:14px'>"
        f"against {escape(against)}</small></h2><div class='cards'>"
    ]
    for c in cards:
        items = "".join(
            f"<div><div class='v {state}{' words' if val in UNDECIDED else ''}'>{escape(val)}</div>"
            f"<div class='l'>{escape(label)}</div>"
            + (f"<div class='n'>{escape(note)}</div>" if note else "")
            + "</div>"
            for label, val, state, note in c["items"]
        )
        parts.append(
            f"<div class='card'><h3>{escape(c['name'])}</h3><div class='kind'>{escape(c['kind'])}</div>"
            f"<div class='items'>{items}</div></div>"
        )
    return parts + ["</div>"]


def _html_cell(value: str, ratio: str, state: str) -> str:
    """A side-by-side cell: the value, its ratio beneath, and the undecided words on a line of their own
    (numbers never wrap)."""
    note = ""
    for words in (NO_DIFFERENCE, TOO_NOISY):
        if ratio.endswith(words):
            ratio, note = ratio[: -len(words)].strip(), words
    return (
        f"<td>{escape(value)}"
        + (f"<span class='r {state}'>{escape(ratio)}</span>" if ratio else "")
        + (f"<span class='nd'>{escape(note)}</span>" if note else "")
        + "</td>"
    )


def html_side_by_side(results) -> list[str]:
    header, rows = table_rows(results)
    # the kind goes under the model's name: one column less to fit
    header, rows = [header[0]] + header[2:], [[(row[0][0], row[1][0], "")] + row[2:] for row in rows]
    parts = [
        "<h2>Side by side</h2><div class='tablewrap'><table><thead><tr>"
        + "".join(f"<th>{escape(h)}</th>" for h in header)
        + "</tr></thead><tbody>"
    ]
    parts += ["<tr>" + "".join(_html_cell(*cell) for cell in row) + "</tr>" for row in rows]
    parts.append("</tbody></table></div>")
    notes = table_notes(results)
    return parts + ([kit.html_notes(notes)] if notes else [])


def html_claims(results) -> list[str]:
    parts = ["<h2>Claims vs measured</h2>" + kit.CLAIMS_TABLE + kit.claims_table_header("claim", "this run")]
    for c in claims(results):
        items = "".join(f"<li>{escape(line)}</li>" for line in c["measured"])
        parts.append(
            kit.claims_table_row(
                c["claim"], c["verdict"], f"<ul>{items}</ul><div class='why'>{escape(c['meaning'])}</div>"
            )
        )
    return parts + [kit.CLAIMS_TABLE_END]


def html_tasks(results) -> list[str]:
    cols, trows = task_table(results)
    if not cols:
        return []
    return [
        "<h2>lm-eval tasks</h2><div class='tablewrap'><table><thead><tr><th>model</th>"
        + "".join(f"<th>{escape(t)}<br><small>{escape(k)}</small></th>" for t, k in cols)
        + "</tr></thead><tbody>",
        *("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in r) + "</tr>" for r in trows),
        "</tbody></table></div>",
        kit.html_notes(task_notes(results)),
    ]


def html_diagnostics(results) -> list[str]:
    """The one-batch diagnostics table, then each model's per-layer statistics folded away."""
    parts = [
        "<h2>Training diagnostics</h2><p class='sub'>One fixed batch of the evaluation text, dropout off.</p>"
        + html_table(
            ["model", "kind", "loss", "grad norm", "norm layers", "norm classes"],
            [
                [
                    m["name"],
                    m.get("kind", ""),
                    onnx_gap(m, fmt_num((m.get("diagnostics") or {}).get("loss"), 4)),
                    onnx_gap(m, fmt_num((m.get("diagnostics") or {}).get("grad_norm"), 4)),
                    len((m.get("diagnostics") or {}).get("layers") or []),
                    ", ".join(m.get("norm_classes") or []),
                ]
                for m in results["models"]
            ],
        )
    ]
    for m in results["models"]:
        layers = (m.get("diagnostics") or {}).get("layers") or []
        if not layers:
            continue
        parts.append(
            f"<details><summary>{escape(m['name'])}: per-layer statistics ({len(layers)} norm layers)</summary>"
            + html_table(
                ["layer", "class", "rms", "mean", "|per-token mean|"],
                [
                    [
                        lay["name"],
                        lay.get("class", ""),
                        fmt_num(lay.get("rms"), 4),
                        fmt_num(lay.get("mean"), 5),
                        fmt_num(lay.get("token_mean_abs"), 5),
                    ]
                    for lay in layers
                ],
            )
            + "</details>"
        )
    return parts


def html_report(results, figures: dict[str, Path]) -> str:
    """The self-contained report.html: the page kit's head, then the sections in reading order."""
    figure_parts = [
        kit.html_figure(heading, path, caption)
        for key, path in figures.items()
        for heading, caption in [FIGURE_TEXT.get(key, (key, ""))]
    ]
    parts = (
        kit.html_start(report_title(results))
        + html_top(results)
        + html_headline_cards(results)
        + html_side_by_side(results)
        + [encoders.html_section(results)]
        + html_claims(results)
        + figure_parts
        + html_tasks(results)
        + html_diagnostics(results)
        + [kit.html_terms(eval_terms(results))]
    )
    parts.append(
        kit.html_end(
            f"Generated by normswap {escape((results.get('versions') or {}).get('normswap', ''))} "
            f"on {escape(results['created'])}. Definitions: docs/results-schema.md. Raw numbers: results.json."
        )
    )
    return "\n".join(parts)
