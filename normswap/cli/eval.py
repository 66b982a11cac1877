"""`normswap eval`: perplexity, speed/memory, diagnostics, lm-eval tasks and the report.

    normswap eval report MODEL [MODEL ...] --out DIR [--baseline SRC] [--tasks T1,T2] ...
    normswap eval ppl MODEL [MODEL ...]       # perplexity table only
    normswap eval speed MODEL [MODEL ...]     # throughput / memory / norm-time table only
    normswap eval tasks-path                  # directory for `lm_eval --include_path`
    normswap eval render results.json         # rebuild report.md/html/PNGs from results.json

MODEL is anything convert accepts or produced: a local directory, a hub id, normswap:NAME; write
NAME=SPEC to label it. The held-out split defaults to `test` (the numbers you report) of the
embedded corpus or a dataset with splits, and to all of a text file or directory you name with
--data; use `--split validation` while choosing between models so the test split stays unseen.
"""

from __future__ import annotations

import json
import sys

import click

from normswap.cli.options import (
    batch_size_option, data_option, device_option, dtype_option, force_option, json_option, trust_remote_code_option,
)

SPLITS = ("test", "validation", "train", "all")


def _common(f):
    for decorator in reversed([
        click.argument("models", nargs=-1, required=True),
        data_option,
        click.option("--split", type=click.Choice(SPLITS), default=None,
                     help="Held-out split: test for reported numbers, validation for model selection, all for the whole source "
                          "(default: test of the embedded corpus or a dataset with splits; all of a file or directory you name)."),
        device_option(),
        dtype_option(),
        click.option("--seq-len", type=int, default=None, help="Window length in tokens (default: min(shortest model context, 512))."),
        batch_size_option,
        trust_remote_code_option,
    ]):
        f = decorator(f)
    return f


def _progress(quiet):
    if quiet:
        return None
    return lambda msg: click.echo(f"[normswap eval] {msg}", err=True)


def _require_hub(models, baseline=None, data=None, tasks=None):
    """Before anything loads: whatever must come from the Hub has to be reachable."""
    from normswap.network import require_hub

    require_hub(data=data, tasks=tasks)  # first, before importing torch: the data and tasks need nothing loaded
    from normswap.evaluate.runner import plan_entries

    planned, _ = plan_entries(list(models), baseline)  # a mistyped --baseline is refused here, with a hint
    require_hub(models=[spec for _, spec in planned])


def _split(data, split):
    from normswap.data import default_eval_split

    return split or default_eval_split(data)


def _refuse_encoders(entries):
    from normswap.errors import NormswapError
    from normswap.evaluate.kinds import CAUSAL_LM, model_kind

    enc = [e.name for e in entries if model_kind(e.model) != CAUSAL_LM]
    if enc:
        raise NormswapError(f"perplexity is not defined for encoders ({', '.join(enc)}); "
                            "`normswap eval report` measures their fidelity to a --baseline")


def _setup(device, dtype):
    from normswap.cli.options import resolve_device, resolve_dtype

    dev = resolve_device(device)
    return dev, resolve_dtype(dtype, dev)


@click.group("eval")
def eval_group():
    """Measure models side by side: perplexity, speed, memory, diagnostics, lm-eval; write a report."""


@eval_group.command("report")
@_common
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Directory for results.json, report.md, report.html and the PNGs.")
@click.option("--baseline", default=None, help="Model the ratios are against: one of the MODELs (name or spec) or another spec.")
@click.option("--tasks", default=None, help="Comma-separated lm-eval tasks (normswap_kjv works offline; hub tasks need network).")
@click.option("--stride", type=int, default=None, help="Tokens between window starts (default: seq-len / 2).")
@click.option("--max-tokens", type=int, default=65536, show_default=True, help="Cap on evaluated tokens (0: the whole split); stated in results.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Interleaved speed repeats (medians).")
@click.option("--warmup", type=int, default=1, show_default=True, help="Unmeasured warm-up runs per model.")
@click.option("--min-time", type=float, default=0.2, show_default=True, help="Seconds per speed measurement (short calls are repeated).")
@click.option("--new-tokens", type=int, default=32, show_default=True, help="Tokens generated per generation measurement.")
@click.option("--no-speed", is_flag=True, help="Skip throughput and norm-time measurements.")
@click.option("--compile", "compile_", is_flag=True, help="Measure speed with every model under torch.compile (Inductor): compiled original vs compiled converted.")
@click.option("--no-memory", is_flag=True, help="Skip the peak-memory measurement.")
@click.option("--limit", "lm_eval_limit", type=int, default=None, help="lm-eval: documents per task (for quick runs).")
@force_option
@json_option
@click.option("--quiet", is_flag=True, help="No progress lines.")
def report(models, data, split, device, dtype, seq_len, batch_size, out, baseline, tasks, stride, max_tokens, repeats,
           warmup, min_time, new_tokens, no_speed, compile_, no_memory, lm_eval_limit, force, as_json, quiet):
    """Evaluate MODELs side by side and write DIR/results.json, report.md, report.html and plots."""
    _require_hub(models, baseline, data, tasks)
    from pathlib import Path

    from normswap.evaluate.runner import evaluate, load_entries, split_label
    from normswap.publish import output_lock
    from normswap.report import write_report
    from normswap.report.write import check_out

    local_models = [spec for _, spec in map(split_label, list(models) + [baseline or ""]) if spec and Path(spec).expanduser().exists()]
    check_out(out, force=force, reads=local_models)
    dev, dt = _setup(device, dtype)
    say = _progress(quiet)
    with output_lock(out, create_parent=True):
        entries, base = load_entries(list(models), baseline=baseline, device=dev, dtype=dt, progress=say)
        results = evaluate(entries, data=data, split=_split(data, split), baseline_name=base, tasks=tasks, device=dev, dtype=dt,
                           seq_len=seq_len, stride=stride, batch_size=batch_size, max_tokens=max_tokens,
                           speed=not no_speed, memory=not no_memory, lm_eval_limit=lm_eval_limit, progress=say,
                           speed_options={"repeats": repeats, "warmup": warmup, "min_time": min_time, "new_tokens": new_tokens,
                                          "compile": compile_})
        written = write_report(results, out, force=force)
    if as_json:
        click.echo(json.dumps({k: str(v) for k, v in written.items()}))
    else:
        _print_table(results)
        click.echo(f"report: {written['html']}")


@eval_group.command("ppl")
@_common
@click.option("--stride", type=int, default=None, help="Tokens between window starts (default: seq-len / 2).")
@click.option("--max-tokens", type=int, default=65536, show_default=True, help="Cap on evaluated tokens (0: the whole split).")
@click.option("--baseline", default=None, help="Add perplexity ratios against this model.")
@json_option
@click.option("--quiet", is_flag=True, help="No progress lines.")
def ppl(models, data, split, device, dtype, seq_len, batch_size, stride, max_tokens, baseline, as_json, quiet):
    """Perplexity, bits per byte and word perplexity of MODELs on the held-out split."""
    from normswap.evaluate.runner import evaluate, load_entries

    _require_hub(models, baseline, data)
    dev, dt = _setup(device, dtype)
    say = _progress(quiet)
    entries, base = load_entries(list(models), baseline=baseline, device=dev, dtype=dt, progress=say)
    _refuse_encoders(entries)
    results = evaluate(entries, data=data, split=_split(data, split), baseline_name=base, device=dev, dtype=dt, seq_len=seq_len,
                       stride=stride, batch_size=batch_size, max_tokens=max_tokens, speed=False, memory=False,
                       diagnostics=False, progress=say)
    if as_json:
        click.echo(json.dumps({"data": results["data"], "models": [
            {k: m.get(k) for k in ("name", "path", "perplexity", "bits_per_byte", "word_perplexity", "perplexity_detail", "ratios")}
            for m in results["models"]]}, indent=2))
        return
    d = results["data"]
    click.echo(f"{d['spec']} / {d['split']}: {d['characters']:,} chars, seq_len {d['seq_len']}, stride {d['stride']}"
               + (f" (capped at {d['max_tokens']:,} tokens)" if d["truncated"] else ""))
    rows = [("model", "perplexity", "bits/byte", "word ppl", "tokens")]
    for m in results["models"]:
        ratio = (m.get("ratios") or {}).get("perplexity")
        rows.append((m["name"], f"{m['perplexity']:.4f}" + (f" (x{ratio:.4f})" if ratio and m["name"] != base else ""),
                     f"{m['bits_per_byte']:.4f}", f"{m['word_perplexity']:.3f}", f"{m['perplexity_detail']['tokens']:,}"))
    _echo_rows(rows)


@eval_group.command("speed")
@click.argument("models", nargs=-1, required=True)
@device_option()
@dtype_option()
@click.option("--seq-len", type=int, default=None, help="Tokens per sequence (default: min(shortest model context, 512)).")
@batch_size_option
@click.option("--baseline", default=None, help="Model the ratios are against.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Interleaved repeats (medians).")
@click.option("--warmup", type=int, default=1, show_default=True, help="Unmeasured warm-up runs per model.")
@click.option("--min-time", type=float, default=0.2, show_default=True, help="Seconds per measurement (short calls are repeated).")
@click.option("--new-tokens", type=int, default=32, show_default=True, help="Tokens generated per generation measurement.")
@click.option("--no-memory", is_flag=True, help="Skip the peak-memory measurement.")
@trust_remote_code_option
@click.option("--compile", "compile_", is_flag=True, help="Measure speed with every model under torch.compile (Inductor): compiled original vs compiled converted.")
@json_option
@click.option("--quiet", is_flag=True, help="No progress lines.")
def speed(models, device, dtype, seq_len, batch_size, baseline, repeats, warmup, min_time, new_tokens, no_memory, compile_, as_json, quiet):
    """Throughput (forward, train step, generation), peak memory and time in norm layers, interleaved."""
    from normswap.evaluate.runner import evaluate, load_entries

    _require_hub(models, baseline)
    dev, dt = _setup(device, dtype)
    say = _progress(quiet)
    entries, base = load_entries(list(models), baseline=baseline, device=dev, dtype=dt, progress=say)
    results = evaluate(entries, text="", baseline_name=base, device=dev, dtype=dt, seq_len=seq_len, batch_size=batch_size,
                       perplexity=False, diagnostics=False, memory=not no_memory, progress=say,
                       speed_options={"repeats": repeats, "warmup": warmup, "min_time": min_time, "new_tokens": new_tokens,
                                      "compile": compile_})
    if as_json:
        click.echo(json.dumps({"device": results["device"], "dtype": results["dtype"], "speed_setup": results.get("speed_setup"),
                               "models": [{k: m.get(k) for k in ("name", "path", "tokens_per_second", "peak_memory_bytes",
                                                                  "norm_time_share", "norm_time", "ratios", "ratio_intervals")}
                                          for m in results["models"]], "ratio_method": results.get("ratio_method")}, indent=2))
        return
    click.echo(f"{results['device']}, {results['dtype']}")
    _print_speed(results)


@eval_group.command("tasks-path")
def tasks_path_cmd():
    """Print the directory of normswap's lm-eval tasks (for `lm_eval --include_path`)."""
    from normswap.evaluate.lm_eval_adapter import tasks_path

    click.echo(tasks_path())


@eval_group.command("render")
@click.argument("results_json", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", default=None, type=click.Path(file_okay=False), help="Directory (default: next to results.json).")
@force_option
def render(results_json, out, force):
    """Rebuild report.md, report.html and the PNGs from an existing results.json."""
    from normswap.report import rerender

    written = rerender(results_json, out, force=force)
    click.echo(f"report: {written['html']}")


# ------------------------------------------------------------------ tables
def _echo_rows(rows):
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        click.echo("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            click.echo("  ".join("-" * w for w in widths))


def _fmt_tps(m, key, results):
    """``25,023 x1.03 [0.95–1.12] n.d.``: tokens/s, ratio, per-repeat range, and n.d. when that range
    says the ratio is no measurable difference (stats.py); the baseline gets no ratio."""
    from normswap.evaluate.stats import fmt_interval, intervals_of, measurable

    v = (m.get("tokens_per_second") or {}).get(key)
    r = ((m.get("ratios") or {}).get("tokens_per_second") or {}).get(key)
    if v is None:
        return "-"
    if r is None or m["name"] == results.get("baseline"):
        return f"{v:,.0f}"
    iv = ((intervals_of(m, results) or {}).get("tokens_per_second") or {}).get(key)
    return f"{v:,.0f} x{r:.2f} {fmt_interval(iv)}".rstrip() + ("" if measurable(iv) else " n.d.")


def _ratio_legend(results):
    from normswap.evaluate.stats import MIN_REPEATS, NO_DIFFERENCE

    if results.get("baseline") and any(m.get("tokens_per_second") for m in results["models"]):
        click.echo(f"x: ratio to {results['baseline']}; [min-max] of the per-repeat paired ratios; n.d. = {NO_DIFFERENCE} "
                   f"(range contains 1, or fewer than {MIN_REPEATS} repeats)")


def _print_speed(results):
    from normswap.report.render import fmt_bytes

    rows = [("model", "forward tok/s", "train-step tok/s", "generate tok/s", "decode tok/s", "peak memory", "norm share")]
    for m in results["models"]:
        mr = (m.get("ratios") or {}).get("peak_memory_bytes")
        share = m.get("norm_time_share")
        rows.append((m["name"], _fmt_tps(m, "forward", results), _fmt_tps(m, "train_step", results),
                     _fmt_tps(m, "generate", results), _fmt_tps(m, "decode", results),
                     fmt_bytes(m.get("peak_memory_bytes")) + (f" (x{mr:.2f})" if mr is not None else ""),
                     "-" if share is None else f"{share * 100:.1f}%"))
    _echo_rows(rows)
    _ratio_legend(results)


def _print_table(results):
    if any(m.get("fidelity") for m in results["models"]):
        from normswap.report.encoders import fidelity_rows

        header, rows = fidelity_rows(results)
        _echo_rows([tuple(header)] + [tuple(r) + () for r in rows])
        sys.stdout.flush()
        return
    rows = [("model", "kind", "perplexity", "bits/byte", "forward tok/s", "train-step tok/s")]
    for m in results["models"]:
        rows.append((m["name"], m.get("kind", ""), f"{m['perplexity']:.4f}" if m.get("perplexity") is not None else "-",
                     f"{m['bits_per_byte']:.4f}" if m.get("bits_per_byte") is not None else "-",
                     _fmt_tps(m, "forward", results), _fmt_tps(m, "train_step", results)))
    _echo_rows(rows)
    _ratio_legend(results)
    sys.stdout.flush()
