"""Run a validated recipe: convert each variant, fine-tune where asked, evaluate all side by side.

Layout of the run directory DIR:

    DIR/recipe.yaml            the resolved recipe (after --set, every default filled in)
    DIR/recipe.original.yaml   the recipe file exactly as it was given
    DIR/run.json               status, step timings and fingerprints, the final summary table
    DIR/summary.md             that table as markdown
    DIR/models/<variant>/      convert's output (or finetune's, for a variant without convert)
    DIR/models/<variant>-healed/  finetune's output for a variant that converts and fine-tunes
    DIR/report/                normswap eval report: results.json, report.md, report.html, PNGs

Each step writes its output atomically (convert: staging dir + rename; finetune: final files moved
in last; report: temp dir + rename) and is recorded in run.json with a fingerprint of everything
that determines it (its options and its input's fingerprint). ``resume`` skips a step whose
output is complete and whose fingerprint is unchanged, so an interrupted or edited run redoes only
what changed; the evaluation is redone whenever any model was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from normswap.errors import NormswapError
from normswap.publish import atomic_write_text
from normswap.recipes.loader import LoadedRecipe, dump_recipe
from normswap.recipes.schema import HEALED_SUFFIX, SOURCE_NAME

RUN_FILE = "run.json"
OWNED = ("recipe.yaml", "recipe.original.yaml", RUN_FILE, "summary.md", "models", "report")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------ network
def network_problem(recipe: dict, *, timeout: float = 3.0) -> str | None:
    """Why a needs_network recipe cannot run now (None: it can). Costs at most ~``timeout`` s."""
    from normswap.network import data_needs_hub, hub_problem, model_needs_hub

    if not recipe["needs_network"]:
        return None
    if not model_needs_hub(recipe["source"]) and not data_needs_hub(recipe["data"]):
        return None  # everything it needs is already on this machine
    return hub_problem(timeout)


# ------------------------------------------------------------------------------------ progress
class _FinetuneWatcher:
    """Prints a progress line from finetune's train_log.jsonl every few seconds (works in logs and
    CI, where a progress bar is a wall of carriage returns)."""

    def __init__(self, log_path: Path, label: str, total: int, say, every: float = 10.0):
        self.log_path, self.label, self.total, self.say, self.every = log_path, label, total, say, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._last_step = 0
        self._t0 = time.perf_counter()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        return False

    def _latest(self) -> dict | None:
        try:
            lines = self.log_path.read_text().splitlines()
        except OSError:
            return None
        for line in reversed(lines):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step"):
                return row
        return None

    def _run(self):
        last_print = time.perf_counter()
        while not self._stop.wait(1.0):
            if time.perf_counter() - last_print < self.every:
                continue
            row = self._latest()
            if row is None or row["step"] == self._last_step:
                continue
            self._last_step = row["step"]
            last_print = time.perf_counter()
            elapsed = last_print - self._t0
            left = elapsed / row["step"] * (self.total - row["step"])
            loss = row.get("loss")
            self.say(f"{self.label}: step {row['step']}/{self.total}"
                     + (f"  loss {loss:.3f}" if isinstance(loss, (int, float)) else "")
                     + f"  ({elapsed:.0f} s, ~{left:.0f} s left)")


# ------------------------------------------------------------------------------------ the run
class Runner:
    def __init__(self, loaded: LoadedRecipe, out, *, resume=False, force=False, say=None):
        self.loaded = loaded
        self.recipe = loaded.recipe
        self.out = Path(out).expanduser()
        self.resume = resume
        self.force = force
        self.say = say or (lambda msg: print(f"normswap run: {msg}", file=sys.stderr, flush=True))
        self.state: dict = {}

    # ---- directory --------------------------------------------------------------------------
    def _prepare_out(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise NormswapError(f"--out {out} is a file; give a directory for the run")
        previous = out / RUN_FILE
        if out.is_dir() and any(out.iterdir()):
            if not previous.is_file():
                raise NormswapError(f"--out {out} exists, is not empty and is not a normswap run; choose another directory")
            if self.force and not self.resume:
                for name in OWNED:  # only what a run writes: never a user's other files
                    p = out / name
                    if p.is_dir():
                        shutil.rmtree(p)
                    elif p.exists():
                        p.unlink()
            elif not self.resume:
                raise NormswapError(f"--out {out} holds a previous run: pass --resume to continue it (finished steps are kept) or --force to start again")
        out.mkdir(parents=True, exist_ok=True)
        (out / "models").mkdir(exist_ok=True)
        old = {}
        if self.resume and previous.is_file():
            try:
                old = json.loads(previous.read_text())
            except json.JSONDecodeError:
                old = {}
        self.state = {
            "recipe": self.recipe["name"],
            "recipe_file": str(self.loaded.path),
            "overrides": self.loaded.overrides,
            "status": "running",
            "started": _now(),
            "steps": old.get("steps", {}) if self.resume else {},
        }
        atomic_write_text(out / "recipe.original.yaml", self.loaded.original_text)
        header = (f"# normswap run: resolved recipe (from {self.loaded.path}"
                  + (f", --set {' --set '.join(self.loaded.overrides)}" if self.loaded.overrides else "") + ")\n")
        atomic_write_text(out / "recipe.yaml", header + dump_recipe(self.recipe))
        self._save()

    def _save(self) -> None:
        atomic_write_text(self.out / RUN_FILE, json.dumps(self.state, indent=2, default=str) + "\n")

    def _done(self, step: str, fingerprint: str, complete: bool) -> bool:
        rec = self.state["steps"].get(step)
        return bool(self.resume and complete and rec and rec.get("status") == "done" and rec.get("fingerprint") == fingerprint)

    def _record(self, step: str, fingerprint: str, seconds: float, **extra) -> None:
        self.state["steps"][step] = {"status": "done", "fingerprint": fingerprint, "seconds": round(seconds, 2), "finished": _now(), **extra}
        self._save()

    # ---- steps ------------------------------------------------------------------------------
    def run(self) -> dict:
        recipe = self.recipe
        problem = network_problem(recipe)
        if problem:
            raise NormswapError(f"recipe {recipe['name']} needs the network (needs_network: true, source {recipe['source']}) but {problem}")
        from normswap.checkpoint.load import resolve
        from normswap.cli.options import resolve_device

        resolve(recipe["source"])  # a missing source fails before DIR is touched
        self.device = resolve_device(recipe["device"])
        self._prepare_out()
        t_run = time.perf_counter()
        self.say(f"recipe {recipe['name']}: {len(recipe['variants'])} variant(s) of {recipe['source']} -> {self.out}")
        models = {SOURCE_NAME: (recipe["source"], _fingerprint({"source": recipe["source"]}))}
        ran_any = False
        for name, v in recipe["variants"].items():
            current, fp = models[SOURCE_NAME]
            if v["convert"] is not None:
                target = self.out / "models" / name
                current, fp, ran = self._convert(name, current, fp, v["convert"], target)
                ran_any |= ran
                models[name] = (current, fp)
            if v["finetune"] is not None:
                label = name + HEALED_SUFFIX if v["convert"] is not None else name
                target = self.out / "models" / label
                current, fp, ran = self._finetune(label, current, fp, v["finetune"], target)
                ran_any |= ran
                models[label] = (current, fp)
        from normswap.recipes.schema import report_names

        shown = [(n, models[n]) for n in report_names(recipe)]
        results = self._evaluate(shown, force_rerun=ran_any)
        rows = summary_rows(results)
        self.state.update(status="finished", finished=_now(), seconds=round(time.perf_counter() - t_run, 1), summary=rows,
                          report=str(self.out / "report" / "report.html"))
        self._save()
        table = format_table(rows, markdown=True)
        atomic_write_text(self.out / "summary.md", f"# {recipe['report']['title']}\n\n{table}\n\nReport: report/report.html\n")
        return self.state

    def _convert(self, name, src, src_fp, opts, target: Path):
        from normswap.convert.pipeline import convert_checkpoint

        step = f"convert:{name}"
        fp = _fingerprint({"step": "convert", "input": src_fp, "options": opts})
        complete = (target / "config.json").is_file() and (target / "normswap_manifest.json").is_file()
        if self._done(step, fp, complete):
            self.say(f"convert {name}: done already ({target}), skipped")
            return str(target), fp, False
        self.say(f"convert {name}: {opts['mode']} mode" + "".join(f", {k} {opts[k]}" for k in ("gamma", "beta") if opts[k]) + (", untie" if opts["untie"] else ""))
        t0 = time.perf_counter()
        summary = convert_checkpoint(src, target, mode=opts["mode"], gamma=opts["gamma"], beta=opts["beta"], untie=opts["untie"],
                                     dtype=opts["dtype"], force=True, verify=opts["verify"], tolerance=opts["tolerance"],
                                     progress=lambda m: self.say(f"convert {name}: {m}"))
        ver = summary.get("verification") or {}
        line = f"convert {name}: {summary['norms_replaced']} norms replaced in {time.perf_counter() - t0:.1f} s"
        if ver.get("max_abs_diff") is not None:
            line += f"; max |Δ log-prob| vs source {ver['max_abs_diff']:.2g}" + (" (exact: passed)" if ver.get("passed") else "")
        self.say(line)
        self._record(step, fp, time.perf_counter() - t0, output=str(target), mode=summary["mode"], verification=ver)
        return str(target), fp, True

    def _finetune(self, label, src, src_fp, opts, target: Path):
        from normswap.finetune import FinetuneConfig, run_finetune

        recipe = self.recipe
        step = f"finetune:{label}"
        opts = dict(opts)
        if opts["distill_from"] == "source":
            opts["distill_from"] = recipe["source"]
        fp = _fingerprint({"step": "finetune", "input": src_fp, "options": opts, "data": recipe["data"], "seed": recipe["seed"]})
        run_file = target / "finetune_run.json"
        complete = False
        if run_file.is_file() and (target / "config.json").is_file():
            try:
                complete = json.loads(run_file.read_text()).get("status") == "finished"
            except json.JSONDecodeError:
                complete = False
        if self._done(step, fp, complete):
            self.say(f"finetune {label}: done already ({target}), skipped")
            return str(target), fp, False
        self.say(f"finetune {label}: {opts['steps']} steps x {opts['batch_size']} sequences, lr {opts['lr']:g}, warmup {opts['warmup_steps']}"
                 + (f", distilling from {opts['distill_from']}" if opts["distill_from"] else ""))
        cfg = FinetuneConfig(model=str(src), out=str(target), data=recipe["data"], seed=recipe["seed"], device=recipe["device"],
                             force=True, progress=False, **opts)
        t0 = time.perf_counter()
        with _FinetuneWatcher(target / "train_log.jsonl", f"finetune {label}", opts["steps"], self.say):
            summary = run_finetune(cfg, echo=lambda m: self.say(f"finetune {label}: {m.removeprefix('normswap finetune: ')}"))
        what, a, b = (("perplexity", summary["initial_perplexity"], summary["final_perplexity"]) if summary["final_perplexity"] is not None
                      else ("loss", summary["initial_eval_loss"], summary["final_eval_loss"]))  # a distillation distance: no perplexity
        spec = ".3f" if what == "perplexity" else ".4g"
        self.say(f"finetune {label}: held-out {what} {a:{spec}} -> {b:{spec}} "
                 f"in {summary['wall_seconds']:.1f} s")
        self._record(step, fp, time.perf_counter() - t0, output=str(target),
                     perplexity_before=summary["initial_perplexity"], perplexity_after=summary["final_perplexity"])
        return str(target), fp, True

    def _evaluate(self, shown, *, force_rerun: bool) -> dict:
        recipe, ev = self.recipe, self.recipe["eval"]
        step = "eval"
        report_dir = self.out / "report"
        fp = _fingerprint({"step": "eval", "models": [(n, f) for n, (_, f) in shown], "eval": ev, "data": recipe["data"],
                           "device": self.device, "report": recipe["report"]})
        if not force_rerun and self._done(step, fp, (report_dir / "results.json").is_file()):
            self.say(f"eval: done already ({report_dir}), skipped")
            return json.loads((report_dir / "results.json").read_text())
        from normswap.cli.options import resolve_dtype
        from normswap.evaluate.runner import ModelEntry, evaluate
        from normswap.report import write_report

        import normswap
        from normswap.checkpoint.load import is_local, resolve

        dtype = resolve_dtype(ev["dtype"], self.device)
        masked = recipe["task"] in ("masked-lm", "encoder")
        t0 = time.perf_counter()
        say = lambda m: self.say(f"eval: {m}")  # noqa: E731
        entries = []
        for name, (spec, _) in shown:
            say(f"loading {name} ({spec})")
            resolved = resolve(spec)
            model = normswap.load_model(spec, dtype=dtype, device=self.device, task="auto" if masked else "causal-lm")
            entries.append(ModelEntry(name=name, spec=str(spec), model=model, tokenizer=normswap.load_tokenizer(spec),
                                      path=str(Path(resolved).resolve()) if is_local(resolved) else resolved))
        speed_options = {"repeats": ev["repeats"], "warmup": ev["warmup"], "min_time": ev["min_time"], "new_tokens": ev["new_tokens"]}
        # encoders: evaluate() measures fidelity to the source instead of perplexity, and no generation
        results = evaluate(
            entries, data=recipe["data"], split=ev["split"], baseline_name=SOURCE_NAME, tasks=",".join(ev["tasks"]) or None,
            device=self.device, dtype=dtype, seq_len=ev["seq_len"], stride=ev["stride"], batch_size=ev["batch_size"],
            max_tokens=ev["max_tokens"], perplexity=ev["perplexity"], diagnostics=ev["diagnostics"],
            speed=ev["speed"], speed_options=speed_options, memory=ev["memory"], lm_eval_limit=ev["lm_eval_limit"],
            fidelity=ev["fidelity"], fidelity_tokens=ev["fidelity_tokens"], seed=recipe["seed"], progress=say,
        )
        results["title"] = recipe["report"]["title"]
        results["recipe"] = {"name": recipe["name"], "description": recipe["description"], "file": str(self.loaded.path),
                             "overrides": self.loaded.overrides, "run_dir": str(self.out)}
        say(f"writing {report_dir}")
        write_report(results, report_dir, force=True)
        self._record(step, fp, time.perf_counter() - t0, output=str(report_dir))
        return results


# ------------------------------------------------------------------------------------ summary
def summary_rows(results: dict) -> list[dict]:
    """The numbers the run prints at the end: one row per model, against the source."""
    base = next((m for m in results["models"] if m["name"] == results.get("baseline")), None)
    rows = []
    for m in results["models"]:
        ppl = m.get("perplexity")
        bppl = base.get("perplexity") if base else None
        fwd = ((m.get("ratios") or {}).get("tokens_per_second") or {}).get("forward")
        fwd_iv = (((m.get("ratio_intervals") or {}).get("tokens_per_second")) or {}).get("forward")
        fid = m.get("fidelity") or {}
        rows.append({
            "model": m["name"],
            "kind": m.get("kind"),
            "perplexity": ppl,
            "delta_vs_original": (ppl / bppl - 1.0) if (ppl is not None and bppl) else None,
            "forward_tokens_per_second": (m.get("tokens_per_second") or {}).get("forward"),
            "forward_ratio": fwd,
            "forward_ratio_range": [fwd_iv["low"], fwd_iv["high"]] if fwd_iv else None,
            "forward_verdict": fwd_iv["verdict"] if fwd_iv else None,
            "hidden_cosine": fid.get("hidden_cosine"),
            "embedding_cosine": fid.get("embedding_cosine"),
            "masked_perplexity": fid.get("masked_perplexity"),
            "top1_agreement": fid.get("top1_agreement"),
        })
    return rows


def _pct(x):
    if x is None:
        return "–"
    return "0.00%" if abs(x) < 5e-5 else f"{x * 100:+.2f}%"


def format_table(rows: list[dict], *, markdown: bool = False) -> str:
    fidelity = any(r.get("hidden_cosine") is not None for r in rows)
    perplexity = any(r.get("perplexity") is not None for r in rows)
    header = ["model"]
    if perplexity:
        header += ["perplexity", "Δ vs original"]
    if fidelity:
        header += ["hidden cosine", "embedding cosine", "masked ppl", "top-1 agree"]
    speed = any(r.get("forward_ratio") is not None for r in rows)
    header += ["forward tok/s"] + (["ratio [per-repeat range]", "forward speed"] if speed else [])
    table = [header]
    for r in rows:
        line = [r["model"]]
        if perplexity:
            p = r.get("perplexity")
            line += ["–" if p is None else f"{p:.4f}", "baseline" if r["model"] == SOURCE_NAME else _pct(r.get("delta_vs_original"))]
        if fidelity:
            c, ec, mp, a = r.get("hidden_cosine"), r.get("embedding_cosine"), r.get("masked_perplexity"), r.get("top1_agreement")
            line += ["–" if c is None else f"{c:.4f}", "–" if ec is None else f"{ec:.4f}", "–" if mp is None else f"{mp:.3f}", "–" if a is None else f"{a * 100:.1f}%"]
        t, q, rng = r.get("forward_tokens_per_second"), r.get("forward_ratio"), r.get("forward_ratio_range")
        line.append("–" if t is None else f"{t:,.0f}")
        if speed:
            if r["model"] == SOURCE_NAME:
                line += ["baseline", ""]
            else:
                line += ["–" if q is None else f"×{q:.2f}" + (f" [{rng[0]:.2f}–{rng[1]:.2f}]" if rng else ""),
                         {"higher": "faster", "lower": "slower"}.get(r.get("forward_verdict"), "no measurable difference")]
        table.append(line)
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in table[1:]]
        return "\n".join(out)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = []
    for j, r in enumerate(table):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_recipe(loaded: LoadedRecipe, out, *, resume=False, force=False, say=None) -> dict:
    """Run ``loaded`` into ``out``; returns run.json's content (with ``summary`` rows)."""
    if loaded.recipe.get("trust_remote_code"):
        from normswap.checkpoint.load import set_trust_remote_code

        set_trust_remote_code(True)
    return Runner(loaded, out, resume=resume, force=force, say=say).run()


__all__ = ["Runner", "format_table", "network_problem", "run_recipe", "summary_rows"]
