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
    config_options,
    data_option,
    device_option,
    force_replaces,
    json_option,
    quiet_option,
    trust_remote_code_option,
)
from normswap.declared import options
from normswap.evaluate.config import EvalConfig

# Which of EvalConfig's options each command offers (`report` offers them all); the declaration
# itself (help, default, bounds) is EvalConfig's.
PPL_OPTIONS = ("split", "seq_len", "batch_size", "dtype", "stride", "max_tokens")
SPEED_OPTIONS = (
    "seq_len",
    "batch_size",
    "dtype",
    "repeats",
    "warmup",
    "min_time",
    "speed_budget",
    "target_halfwidth",
    "new_tokens",
    "compile",
    "compile_mode",
    "null_control",
    "memory",
)


def _offered(names=None):
    return config_options([f for f in options(EvalConfig) if names is None or f.name in names])


baseline_option = click.option(
    "--baseline",
    default=None,
    help="Model the ratios and differences are against: one of the MODELs (its NAME or SPEC) or another spec, "
    "added first. Default: none (each model's numbers alone, no ratios, no differences).",
)


def _config(opts: dict, **fixed) -> EvalConfig:
    """The EvalConfig of a command's options (``fixed``: what the command itself decides); a value
    outside its declared bounds is refused in one line naming the option."""
    from normswap import declared
    from normswap.errors import NormswapError
    from normswap.evaluate.config import option_errors

    values = {**opts, **fixed}
    flags = {f.name: declared.cli_flag(f) for f in options(EvalConfig)}
    problems = [f"{flags[name]} {why}" for name, why in option_errors(values)]
    if problems:
        raise NormswapError("; ".join(problems))
    return declared.build(EvalConfig, values)


def _progress(quiet):
    """The command's progress (normswap/progress.py): each step as it starts, and where the output is
    not a terminal the current step again every 10 s while it runs; nothing with --quiet."""
    import contextlib

    from normswap.progress import Heartbeat, command_lines

    if quiet:
        return contextlib.nullcontext(None)
    return Heartbeat(command_lines(click.get_current_context().command_path.removeprefix("normswap ")))


def _say(heartbeat):
    return None if heartbeat is None else heartbeat.say


def _require_hub(models, baseline=None, data=None, tasks=None):
    """Before anything loads: whatever must come from the Hub has to be reachable."""
    from normswap.evaluate.lm_eval_adapter import hub_tasks
    from normswap.network import require_hub

    require_hub(
        data=data, hub_tasks=hub_tasks(tasks) if tasks else ()
    )  # first, before importing torch: the data and tasks need nothing loaded
    from normswap.evaluate.side_by_side import plan_entries

    planned, _ = plan_entries(list(models), baseline)  # a mistyped --baseline is refused here, with a hint
    require_hub(models=[spec for _, spec in planned])


def _load(models, baseline, device, cfg, say, data="embedded"):
    """Check everything the options, configs, tokenizers and data can show (evaluate/preflight.py),
    then load the models: a bad input fails in seconds, before any weights load."""
    from normswap.devices import resolve_device, resolve_dtype
    from normswap.evaluate.preflight import describe, prepare
    from normswap.evaluate.side_by_side import load_planned, plan_entries

    planned, base = plan_entries(list(models), baseline)
    prepared = prepare(describe(planned, say), cfg, data=data, baseline_name=base, progress=say)
    dev = resolve_device(device)
    dt = resolve_dtype(cfg.dtype, dev)
    entries = load_planned(planned, device=dev, dtype=dt, progress=say)
    return entries, base, dict(baseline_name=base, device=dev, dtype=dt, progress=say, prepared=prepared)


@click.group("eval")
def eval_group():
    """Measure models side by side: perplexity, speed, memory, diagnostics, lm-eval; write a report."""


@eval_group.command("report")
@click.argument("models", nargs=-1, required=True)
@data_option
@device_option()
@_offered()
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="Directory for results.json, report.md, report.html and the PNGs.",
)
@baseline_option
@trust_remote_code_option
@force_replaces("--out DIR")
@json_option
@quiet_option
def report(models, data, device, out, baseline, force, as_json, quiet, **opts):
    """Evaluate MODELs side by side and write DIR/results.json, report.md, report.html and plots.

    Each MODEL is a SPEC (a directory, normswap:NAME, a hub id) or NAME=SPEC, which labels it NAME in
    the report and for --baseline (e.g. original=my-model/ healed=my-model-healed).

    \b
    Which text is scored (--split not given):
      the embedded corpus or a dataset with splits: its test split;
      a file or directory: all of it, unless a compared model was fine-tuned on it by normswap
      (its manifest says so): then its test split, documents that fine-tune never saw.
    A split that overlaps training (all, train) is scored as asked and marked NOT held-out.
    """
    cfg = _config(opts)
    _require_hub(models, baseline, data, cfg.tasks)
    from normswap.evaluate.side_by_side import evaluate, split_label
    from normswap.publish import output_lock
    from normswap.report import write_report
    from normswap.report.report_dir import check_out

    # before the lock file is made beside OUT and before anything loads: OUT never overlaps a model or the data
    check_out(
        out,
        force=force,
        reads=[("the model", spec) for _, spec in map(split_label, list(models) + [baseline or ""])]
        + [("the data", data)],
    )
    with output_lock(out, create_parent=True), _progress(quiet) as progress:
        entries, _, run = _load(models, baseline, device, cfg, _say(progress), data)
        results = evaluate(entries, cfg, data=data, **run)
        written = write_report(results, out, force=force)
    if as_json:
        click.echo(json.dumps({k: str(v) for k, v in written.items()}))
    else:
        _print_table(results)
        click.echo(f"report: {written['html']}")


@eval_group.command("ppl")
@click.argument("models", nargs=-1, required=True)
@data_option
@device_option()
@_offered(PPL_OPTIONS)
@baseline_option
@trust_remote_code_option
@json_option
@quiet_option
def ppl(models, data, device, baseline, as_json, quiet, **opts):
    """Perplexity, bits per byte and word perplexity of MODELs on the held-out split."""
    from normswap.evaluate.side_by_side import evaluate
    from normswap.report.tables import text_table

    cfg = _config(opts, perplexity=True, diagnostics=False, speed=False, memory=False, fidelity=False)
    _require_hub(models, baseline, data)
    with _progress(quiet) as progress:
        entries, base, run = _load(models, baseline, device, cfg, _say(progress), data)
        results = evaluate(entries, cfg, data=data, **run)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "data": results["data"],
                    "models": [
                        {
                            k: m.get(k)
                            for k in (
                                "name",
                                "path",
                                "perplexity",
                                "bits_per_byte",
                                "word_perplexity",
                                "perplexity_detail",
                                "ratios",
                            )
                        }
                        for m in results["models"]
                    ],
                },
                indent=2,
            )
        )
        return
    d = results["data"]
    click.echo(
        f"{d['spec']} / {d['split']}: {d['characters']:,} chars, seq_len {d['seq_len']}, stride {d['stride']}"
        + (f" (capped at {d['max_tokens']:,} tokens)" if d["truncated"] else "")
    )
    rows = []
    for m in results["models"]:
        ratio = (m.get("ratios") or {}).get("perplexity")
        rows.append(
            (
                m["name"],
                f"{m['perplexity']:.4f}" + (f" (×{ratio:.4f})" if ratio and m["name"] != base else ""),
                f"{m['bits_per_byte']:.4f}",
                f"{m['word_perplexity']:.3f}",
                f"{m['perplexity_detail']['tokens']:,}",
            )
        )
    click.echo(text_table(("model", "perplexity", "bits/byte", "word ppl", "tokens"), rows))


@eval_group.command("speed")
@click.argument("models", nargs=-1, required=True)
@device_option()
@_offered(SPEED_OPTIONS)
@baseline_option
@trust_remote_code_option
@json_option
@quiet_option
def speed(models, device, baseline, as_json, quiet, **opts):
    """Throughput (forward, train step, generation), peak memory and time in norm layers, interleaved."""
    from normswap.evaluate.side_by_side import evaluate

    cfg = _config(opts, perplexity=False, diagnostics=False, fidelity=False, speed=True)
    _require_hub(models, baseline)
    with _progress(quiet) as progress:
        entries, _, run = _load(models, baseline, device, cfg, _say(progress))
        results = evaluate(entries, cfg, **run)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "device": results["device"],
                    "dtype": results["dtype"],
                    "speed_setup": results.get("speed_setup"),
                    "models": [
                        {
                            k: m.get(k)
                            for k in (
                                "name",
                                "path",
                                "tokens_per_second",
                                "peak_memory_bytes",
                                "norm_time_share",
                                "norm_time",
                                "ratios",
                                "ratio_intervals",
                            )
                        }
                        for m in results["models"]
                    ],
                    "ratio_method": results.get("ratio_method"),
                    "null_control": results.get("null_control"),
                    "speed_noise": results.get("speed_noise"),
                },
                indent=2,
            )
        )
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
@click.option(
    "--out", default=None, type=click.Path(file_okay=False), help="Directory (default: next to results.json)."
)
@force_replaces("--out DIR")
def render(results_json, out, force):
    """Rebuild report.md, report.html and the PNGs from an existing results.json."""
    from normswap.report import rerender

    written = rerender(results_json, out, force=force)
    click.echo(f"report: {written['html']}")


# ------------------------------------------------------------------ tables
def _fmt_tps(m, key, results):
    """``25,023 ×1.03 [0.95–1.12] n.d.``: tokens/s, ratio, per-repeat range, and n.d. when that range
    says the ratio is no measurable difference (normswap/stats/verdicts.py; "noisy" when the null control says the
    machine was too noisy to tell); the baseline gets no ratio."""
    from normswap.evaluate.speed_intervals import fmt_interval, intervals_of

    v = (m.get("tokens_per_second") or {}).get(key)
    r = ((m.get("ratios") or {}).get("tokens_per_second") or {}).get(key)
    if v is None:
        return "-"
    if r is None or m["name"] == results.get("baseline"):
        return f"{v:,.0f}"
    iv = ((intervals_of(m, results) or {}).get("tokens_per_second") or {}).get(key)
    return f"{v:,.0f} ×{r:.2f} {fmt_interval(iv)}".rstrip() + _undecided_tag(iv)


def _undecided_tag(iv) -> str:
    """`` n.d.`` for a ratio that is no measurable difference, `` noisy`` when the null control said
    too noisy to tell, nothing for a decided one."""
    from normswap.stats.verdicts import TOO_NOISY, measurable

    return "" if measurable(iv) else " noisy" if iv and iv["verdict"] == TOO_NOISY else " n.d."


def _fmt_norms(m, results):
    """``0.7% ×0.41 [0.40–0.42]``: the share of a forward in norm layers and, against the baseline, the
    norm-time ratio (a time: below 1 is less) with its interval, tagged like :func:`_fmt_tps`."""
    from normswap.evaluate.speed_intervals import fmt_interval, intervals_of

    share = m.get("norm_time_share")
    if share is None:
        return "-"
    iv = (intervals_of(m, results) or {}).get("norm_ms_per_forward")
    if not iv or m["name"] == results.get("baseline"):
        return f"{share * 100:.1f}%"
    return f"{share * 100:.1f}% ×{iv['median']:.2f} {fmt_interval(iv)}" + _undecided_tag(iv)


def _ratio_legend(results):
    from normswap.report.render import noise_banner, null_control_note, speed_compared
    from normswap.stats.verdicts import MIN_PAIRS, NO_DIFFERENCE, TOO_NOISY

    if speed_compared(results):
        click.echo(
            f"x: ratio to {results['baseline']}; [95% interval of the median per-pair ratio, normswap/timing.py]; "
            f"n.d. = {NO_DIFFERENCE} (range contains 1 or the null control's, or fewer than {MIN_PAIRS} pairs); "
            f"noisy = {TOO_NOISY}"
        )
        click.echo(null_control_note(results))
        banner = noise_banner(results)
        if banner:
            click.echo(f"*** {TOO_NOISY.upper()}: {banner}")


def _print_speed(results):
    from normswap.report.render import fmt_bytes
    from normswap.report.tables import text_table

    rows = []
    for m in results["models"]:
        mr = (m.get("ratios") or {}).get("peak_memory_bytes")
        rows.append(
            (
                m["name"],
                _fmt_tps(m, "forward", results),
                _fmt_tps(m, "train_step", results),
                _fmt_tps(m, "generate", results),
                _fmt_tps(m, "decode", results),
                fmt_bytes(m.get("peak_memory_bytes")) + (f" (×{mr:.2f})" if mr is not None else ""),
                _fmt_norms(m, results),
            )
        )
    click.echo(
        text_table(
            (
                "model",
                "forward tok/s",
                "train-step tok/s",
                "generate tok/s",
                "decode tok/s",
                "peak memory",
                "norm share, time ×",
            ),
            rows,
        )
    )
    _ratio_legend(results)


def _print_table(results):
    from normswap.report.encoders import fidelity_rows, has_fidelity
    from normswap.report.tables import text_table

    if has_fidelity(results):
        click.echo(text_table(*fidelity_rows(results)))
        sys.stdout.flush()
        return
    rows = []
    for m in results["models"]:
        rows.append(
            (
                m["name"],
                m.get("kind", ""),
                f"{m['perplexity']:.4f}" if m.get("perplexity") is not None else "-",
                f"{m['bits_per_byte']:.4f}" if m.get("bits_per_byte") is not None else "-",
                _fmt_tps(m, "forward", results),
                _fmt_tps(m, "train_step", results),
            )
        )
    click.echo(text_table(("model", "kind", "perplexity", "bits/byte", "forward tok/s", "train-step tok/s"), rows))
    _ratio_legend(results)
    sys.stdout.flush()
