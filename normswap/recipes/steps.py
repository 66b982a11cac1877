"""Run a validated recipe: a list of steps (convert or slice each variant, fine-tune where asked, evaluate
all side by side) run in order, each reporting its progress through one callback.

Layout of the run directory DIR:

    DIR/recipe.yaml            the resolved recipe (after --set, every default filled in)
    DIR/recipe.original.yaml   the recipe file exactly as it was given
    DIR/run.json               status, step timings and fingerprints, the final summary table
    DIR/summary.md             that table as markdown
    DIR/models/<variant>/      convert's or slice's output (or finetune's, for a variant with neither)
    DIR/models/<variant>-healed/  finetune's output for a variant that converts or slices and fine-tunes
    DIR/report/                normswap eval report: results.json, report.md, report.html, PNGs
    DIR/study/                 with a `study:` section: normswap study of the source (results.json, report.md, ...)

Each step writes its output atomically (the command it runs publishes it) and is recorded in
run.json with a fingerprint of everything that determines it (its options and its input's
fingerprint). ``resume`` skips a step whose output is complete and whose fingerprint is unchanged,
so an interrupted or edited run redoes only what changed; the evaluation is redone whenever any
model was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from normswap import bounded_load
from normswap.errors import NormswapError
from normswap.overlap import check_disjoint
from normswap.private_dirs import why_not_private, why_replaceable
from normswap.progress import Heartbeat, stderr_lines
from normswap.publish import atomic_write_text
from normswap.recipes.loader import LoadedRecipe, dump_recipe
from normswap.recipes.schema import EXPORTED_FROM, HEALED_SUFFIX, SOURCE_NAME, built, report_names

RUN_FILE = "run.json"
MODELS, REPORT, SUMMARY, STUDY = "models", "report", "summary.md", "study"
OWNED = ("recipe.yaml", "recipe.original.yaml", RUN_FILE, SUMMARY, MODELS, REPORT, STUDY)
MAX_RUN_FILE_BYTES = 16 << 20  # run.json: a few lines per step

Progress = Callable[[str], None]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class Model:
    """A model of the run: where it is and the fingerprint of everything that made it."""

    name: str
    spec: str
    fingerprint: str


@dataclass
class Context:
    recipe: dict
    loaded: LoadedRecipe
    out: Path
    device: str
    say: Progress  # a line now
    update: Callable[[Callable[[], str]], None]  # the status the progress repeats every 10 s (progress.py)
    models: dict[str, Model] = field(default_factory=dict)  # every model built so far, by name
    ran_any: bool = False  # some model step ran (not skipped): the evaluation must run again


# ------------------------------------------------------------------------------------ steps
@dataclass
class ModelStep:
    """A step that writes one model, DIR/models/<produces>, from the model named ``source``."""

    produces: str
    source: str
    options: dict
    kind: ClassVar[str]

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.produces}"

    def target(self, ctx: Context) -> Path:
        return ctx.out / MODELS / self.produces


class ConvertStep(ModelStep):
    kind = "convert"

    def fingerprint(self, ctx: Context) -> str:
        return _fingerprint({"step": "convert", "input": ctx.models[self.source].fingerprint, "options": self.options})

    def complete(self, ctx: Context) -> bool:
        from normswap.checkpoint.manifest import MANIFEST_NAME

        return (self.target(ctx) / MANIFEST_NAME).is_file()  # convert publishes the whole directory at once

    def run(self, ctx: Context) -> dict:
        from normswap import declared
        from normswap.convert.config import ConvertOptions
        from normswap.convert.pipeline import convert_checkpoint

        o, say = self.options, lambda m: ctx.say(f"convert {self.produces}: {m}")
        say(
            f"{o['mode']} mode"
            + "".join(f", {k} {o[k]}" for k in ("gamma", "beta") if o[k])
            + (", untie" if o["untie"] else "")
        )
        t0 = time.perf_counter()
        summary = convert_checkpoint(
            ctx.models[self.source].spec, self.target(ctx), declared.build(ConvertOptions, o), force=True, progress=say
        )
        ver = summary.get("verification") or {}
        line = f"{summary['norms_replaced']} norms replaced in {time.perf_counter() - t0:.1f} s"
        if ver.get("max_abs_diff") is not None:
            line += f"; max |Δ log-prob| vs source {ver['max_abs_diff']:.2g}" + (
                " (exact: passed)" if ver.get("passed") else ""
            )
        say(line)
        return {"mode": summary["mode"], "verification": ver}


class SliceStep(ModelStep):
    """`normswap slice` of the source (converted exactly first, verified) into DIR/models/<variant>,
    calibrated on the recipe's data (its training split) with the recipe's seed."""

    kind = "slice"

    def _options(self, ctx: Context) -> dict:
        return {**self.options, "data": ctx.recipe["data"], "seed": ctx.recipe["seed"]}

    def fingerprint(self, ctx: Context) -> str:
        return _fingerprint(
            {"step": "slice", "input": ctx.models[self.source].fingerprint, "options": self._options(ctx)}
        )

    def complete(self, ctx: Context) -> bool:
        return (self.target(ctx) / "slice.json").is_file()  # slice publishes the whole directory at once

    def run(self, ctx: Context) -> dict:
        from normswap import declared
        from normswap.slice import SliceOptions, slice_checkpoint

        o, say = self._options(ctx), lambda m: ctx.say(f"slice {self.produces}: {m}")
        say(f"deleting {o['fraction']:.0%} of the residual stream's width ({o['basis']} basis)")
        summary = slice_checkpoint(
            ctx.models[self.source].spec,
            self.target(ctx),
            declared.build(SliceOptions, o),
            force=True,
            device=ctx.device,
            progress=say,
        )
        say(
            f"width {summary['hidden_size']} -> {summary['width']}, parameters {summary['parameters_before']:,} -> "
            f"{summary['parameters_after']:,}, stream energy kept {summary['kept_energy_total']:.6f}"
        )
        keep = ("width", "hidden_size", "fraction", "basis", "parameters_before", "parameters_after")
        return {k: summary[k] for k in keep} | {"kept_energy_total": summary["kept_energy_total"]}


class FinetuneStep(ModelStep):
    kind = "finetune"

    def _options(self, ctx: Context) -> dict:
        opts = dict(self.options)
        if opts["distill_from"] == "source":
            opts["distill_from"] = ctx.recipe["source"]
        return opts

    def fingerprint(self, ctx: Context) -> str:
        r = ctx.recipe
        return _fingerprint(
            {
                "step": "finetune",
                "input": ctx.models[self.source].fingerprint,
                "options": self._options(ctx),
                "data": r["data"],
                "seed": r["seed"],
            }
        )

    def complete(self, ctx: Context) -> bool:
        from normswap.finetune.run_dir import RunDir

        try:
            return (RunDir(self.target(ctx)).read_run() or {}).get("status") == "finished"
        except NormswapError:  # a damaged run file: not complete, the step runs again
            return False

    def run(self, ctx: Context) -> dict:
        from normswap.finetune import FinetuneConfig, run_finetune
        from normswap.finetune.objectives import heldout_line
        from normswap.finetune.run_dir import RunDir
        from normswap.finetune.trainer import Hooks
        from normswap.progress import StepProgress

        r, o, say = ctx.recipe, self._options(ctx), lambda m: ctx.say(f"finetune {self.produces}: {m}")
        say(
            f"{o['steps']} steps x {o['batch_size']} sequences, lr {o['lr']:g}, warmup {o['warmup_steps']}"
            + (f", distilling from {o['distill_from']}" if o["distill_from"] else "")
        )
        cfg = FinetuneConfig(
            model=ctx.models[self.source].spec,
            out=str(self.target(ctx)),
            data=r["data"],
            seed=r["seed"],
            device=r["device"],
            force=True,
            progress=False,
            **o,
        )
        steps = StepProgress(
            RunDir(self.target(ctx)), o["steps"], lambda line: ctx.update(lambda: f"finetune {self.produces}: {line()}")
        )
        summary = run_finetune(
            cfg,
            hooks=Hooks(after_step=steps, started=steps.start),
            echo=lambda m: say(m.removeprefix("normswap finetune: ")),
        )
        say(f"{heldout_line(summary)}, in {summary['wall_seconds']:.1f} s")
        return {"perplexity_before": summary["initial_perplexity"], "perplexity_after": summary["final_perplexity"]}


class ExportStep(ModelStep):
    """`normswap export --format onnx [--quantize int8]` of what the variant built, into DIR/models/<variant>:
    the variant's row in the report is the served graph (evaluate/onnx_model.py measures it)."""

    kind = "export"

    def fingerprint(self, ctx: Context) -> str:
        return _fingerprint({"step": "export", "input": ctx.models[self.source].fingerprint, "options": self.options})

    def complete(self, ctx: Context) -> bool:
        from normswap.checkpoint.manifest import MANIFEST_NAME

        return (self.target(ctx) / MANIFEST_NAME).is_file()  # export publishes the whole directory at once

    def run(self, ctx: Context) -> dict:
        from normswap.export import run_export

        o, say = self.options, lambda m: ctx.say(f"export {self.produces}: {m}")
        say(f"{o['format']}" + (f", {o['quantize']}" + (" (rotated)" if o["rotate"] else "") if o["quantize"] else ""))
        record = run_export(
            ctx.models[self.source].spec,
            self.target(ctx),
            o["format"],
            force=True,
            quantize=o["quantize"],
            rotate=o["rotate"],
            progress=lambda m: say(m.removeprefix("normswap export: ")),
        )
        ver = record.get("verification") or {}
        return {"format": o["format"], "quantize": o["quantize"], "verification": ver}


@dataclass
class EvalStep:
    """Every model of the report side by side with the source: results.json and the report."""

    names: list[str]  # the report's models, in order
    name: str = "eval"
    produces: None = None  # a report, not a model

    def target(self, ctx: Context) -> Path:
        return ctx.out / REPORT

    def fingerprint(self, ctx: Context) -> str:
        r = ctx.recipe
        return _fingerprint(
            {
                "step": "eval",
                "models": [(n, ctx.models[n].fingerprint) for n in self.names],
                "eval": r["eval"],
                "data": r["data"],
                "device": ctx.device,
                "report": r["report"],
            }
        )

    def complete(self, ctx: Context) -> bool:
        from normswap.report.report_dir import RESULTS

        return not ctx.ran_any and (self.target(ctx) / RESULTS).is_file()

    def run(self, ctx: Context) -> dict:
        from normswap import declared
        from normswap.devices import resolve_dtype
        from normswap.evaluate.config import EvalConfig
        from normswap.evaluate.preflight import describe, prepare
        from normswap.evaluate.side_by_side import evaluate, load_planned
        from normswap.report import write_report

        r, say = ctx.recipe, lambda m: ctx.say(f"eval: {m}")
        cfg = declared.build(EvalConfig, r["eval"])
        dtype = resolve_dtype(cfg.dtype, ctx.device)
        planned = [(n, ctx.models[n].spec) for n in self.names]
        prepared = prepare(describe(planned), cfg, data=r["data"], baseline_name=SOURCE_NAME, progress=say)
        entries = load_planned(planned, device=ctx.device, dtype=dtype, progress=say)
        results = evaluate(
            entries,
            cfg,
            data=r["data"],
            baseline_name=SOURCE_NAME,
            device=ctx.device,
            dtype=dtype,
            seed=r["seed"],
            progress=say,
            prepared=prepared,
            onnx_rows_unmeasured=True,  # a served variant: measured by what ONNX can be (evaluate/onnx_model.py)
        )
        results["title"] = r["report"]["title"]
        results["recipe"] = {
            "name": r["name"],
            "description": r["description"],
            "file": str(ctx.loaded.path),
            "overrides": ctx.loaded.overrides,
            "run_dir": str(ctx.out),
        }
        say(f"writing {self.target(ctx)}")
        write_report(results, self.target(ctx), force=True)
        return {}

    def results(self, ctx: Context) -> dict:
        from normswap.report.report_dir import RESULTS

        return bounded_load.load_json(self.target(ctx) / RESULTS, what="an evaluation's results.json")


@dataclass
class StudyStep:
    """``normswap study`` of the recipe's source (its ``study:`` section) into DIR/study; finished units
    are kept when the step runs again with the same options (the study's own --resume)."""

    options: dict
    name: str = "study"
    produces: None = None  # a study, not a model

    def target(self, ctx: Context) -> Path:
        return ctx.out / STUDY

    def _config(self, ctx: Context, **extra):
        from normswap.study.config import StudyConfig

        r = ctx.recipe
        return StudyConfig(
            model=ctx.models[SOURCE_NAME].spec,
            out=str(self.target(ctx)),
            data=r["data"],
            device=r["device"],
            progress=False,
            **self.options,
            **extra,
        )

    def fingerprint(self, ctx: Context) -> str:
        return _fingerprint(
            {
                "step": "study",
                "input": ctx.models[SOURCE_NAME].fingerprint,
                "options": self.options,
                "data": ctx.recipe["data"],
            }
        )

    def complete(self, ctx: Context) -> bool:
        from normswap.study.persistence.study_dir import StudyDir

        return (StudyDir(self.target(ctx)).read_run() or {}).get("status") == "finished" and StudyDir(
            self.target(ctx)
        ).results_file.is_file()

    def run(self, ctx: Context) -> dict:
        from normswap.study.persistence.study_dir import StudyDir
        from normswap.study.runner import run_study

        say = lambda m: ctx.say(f"study: {m.removeprefix('normswap study: ').removeprefix('study: ')}")  # noqa: E731
        recorded = StudyDir(self.target(ctx)).read_run() if self.target(ctx).is_dir() else None
        same = recorded is not None and recorded.get("config") == self._config(ctx, force=True).recorded()
        cfg = self._config(ctx, resume=same, force=not same)
        results = run_study(cfg, echo=say)
        for c in results["claims"]:
            say(f"{c['arm']}: {c['claim']}: {c['verdict']} ({c['decided_by']})")
        return {}


def plan_steps(recipe: dict) -> list:
    """The run as a list of steps, in order: each variant's convert and/or fine-tune, the study (when
    the recipe has one), then the evaluation."""
    steps = []
    for name, v in recipe["variants"].items():
        current = SOURCE_NAME
        # an exported variant's row is the export; what it exports is built beside it (schema.EXPORTED_FROM)
        built_as = name + EXPORTED_FROM if v.get("export") is not None else name
        if v["convert"] is not None:
            steps.append(ConvertStep(built_as, current, v["convert"]))
            current = built_as
        if v.get("slice") is not None:
            steps.append(SliceStep(built_as, current, v["slice"]))
            current = built_as
        if v.get("export") is not None:
            steps.append(ExportStep(name, current, v["export"]))
        if v["finetune"] is not None:
            steps.append(FinetuneStep(name + HEALED_SUFFIX if built(v) else name, current, v["finetune"]))
    if recipe.get("study") is not None:
        steps.append(StudyStep(recipe["study"]))
    return steps + [EvalStep(report_names(recipe))]


# ------------------------------------------------------------------------------------ the run
def _teachers(recipe: dict) -> list[str]:
    """The models the recipe's fine-tunes distil from."""
    teachers = [v["finetune"]["distill_from"] for v in recipe["variants"].values() if v["finetune"] is not None]
    return [recipe["source"] if t == "source" else t for t in teachers if t]


def check_overlap(loaded: LoadedRecipe, out) -> None:
    """What the run writes or deletes in DIR (the OWNED names: models/, report/, its own files; never
    the rest of DIR) touches nothing any step reads: the source, the teachers, the data, the recipe
    file. Checked before DIR is touched, so --force never deletes an input."""
    r, out = loaded.recipe, Path(out).expanduser()
    reads = [("the source model", r["source"]), ("the data", r["data"]), ("the recipe", loaded.path)] + [
        ("the teacher", t) for t in _teachers(r)
    ]
    check_disjoint(
        reads,
        [(f"{out / name} (which the run in --out {out} writes)", out / name) for name in OWNED],
        advice="move the input or choose another --out",
    )


def require_network(recipe: dict) -> None:
    """Whatever the recipe downloads must be reachable: checked once, before DIR is touched."""
    from normswap.evaluate.lm_eval_adapter import hub_tasks
    from normswap.network import require_hub

    try:
        require_hub(
            models=[recipe["source"], *_teachers(recipe)],
            data=recipe["data"],
            hub_tasks=hub_tasks(recipe["eval"]["tasks"]),
        )
    except NormswapError as e:
        raise NormswapError(f"recipe {recipe['name']} needs the network: {e}") from None


def check_evaluation(recipe: dict) -> None:
    """The evaluation at the end of the run, checked before its first step: every variant keeps the
    source's config and tokenizer, so the source stands in for them (evaluate/preflight.py: the
    options against the model's kind and context, the data, enough text for each measurement)."""
    from normswap import declared
    from normswap.evaluate.config import EvalConfig
    from normswap.evaluate.preflight import describe, prepare

    prepare(
        describe([(SOURCE_NAME, recipe["source"])]),
        declared.build(EvalConfig, recipe["eval"]),
        data=recipe["data"],
        baseline_name=SOURCE_NAME,
    )


def run_dir_problem(out: Path) -> str | None:
    """Why DIR may not be run into or resumed, or None (a run reads back what it wrote).

    DIR must be ours alone, with no directory above it another user can replace; each name a run
    writes (OWNED), each model under models/ and each file directly in a model or in report/ must
    be no link and ours alone. A step found done is skipped and its output read (a model evaluated,
    results.json summarised), so a link there would make the run report another directory's model
    as its own. Checked by path: nobody else can rename anything inside a DIR that is ours alone."""
    if not (out.exists() or out.is_symlink()):
        return why_replaceable(out)
    why = why_not_private(out) or why_replaceable(out)
    if why or not out.is_dir():
        return why
    inside = [out / name for name in OWNED]
    folders = [out / REPORT, out / MODELS]
    while folders:  # report/, models/ and each model in it: what a done step is read back from
        folder = folders.pop()
        if folder.is_dir() and not folder.is_symlink():
            entries = sorted(folder.iterdir())
            inside += entries
            folders += entries if folder == out / MODELS else []
    for p in inside:
        if p.is_symlink():
            return f"{p} is a symbolic link (to {os.readlink(p)}); a run never follows a link inside its directory"
        if p.exists():
            why = why_not_private(p, kind="directory" if p.is_dir() else "file")
            if why:
                return why
    return None


class Runner:
    def __init__(self, loaded: LoadedRecipe, out, *, resume=False, force=False, progress: Progress | None = None):
        self.loaded = loaded
        self.recipe = loaded.recipe
        self.out = Path(out).expanduser()
        self.resume = resume
        self.force = force
        # every line as it comes, and during a long step the current status every 10 s (progress.py)
        self.heartbeat = Heartbeat(progress or stderr_lines("normswap run: "), enabled=True)
        self.say = self.heartbeat.say
        self.state: dict = {}

    def _prepare_out(self) -> None:
        out = self.out
        if out.exists() and not out.is_dir():
            raise NormswapError(f"--out {out} is a file; give a directory for the run")
        previous = out / RUN_FILE
        why = run_dir_problem(out)
        if why:
            raise NormswapError(
                f"--out {out}: {why}; a run writes only into a directory that is yours alone and reads back "
                "only what is inside it (choose another, or fix its owner and mode, or remove the link)"
            )
        if out.is_dir() and any(out.iterdir()):
            if not previous.is_file():
                raise NormswapError(
                    f"--out {out} exists, is not empty and is not a normswap run; choose another directory"
                )
            if self.force and not self.resume:
                for name in OWNED:  # only what a run writes: never a user's other files
                    p = out / name
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p)  # fd-based where the platform has it: no link inside is followed
                    elif p.exists() or p.is_symlink():
                        p.unlink()  # a link is removed, never followed
            elif not self.resume:
                raise NormswapError(
                    f"--out {out} holds a previous run: pass --resume to continue it (finished steps are kept) "
                    "or --force to start again"
                )
        out.mkdir(parents=True, exist_ok=True)
        (out / MODELS).mkdir(exist_ok=True)
        old = {}
        if self.resume and previous.is_file():
            try:
                old = bounded_load.load_json(previous, what="a run's run.json", max_bytes=MAX_RUN_FILE_BYTES)
            except bounded_load.BoundedLoadError as e:
                if e.syntax is None:  # a link, a FIFO, an oversized file: refused, never read
                    raise
                old = {}  # cut short: the steps run again
            old = old if isinstance(old, dict) else {}
        self.state = {
            "recipe": self.recipe["name"],
            "recipe_file": str(self.loaded.path),
            "overrides": self.loaded.overrides,
            "status": "running",
            "started": _now(),
            "steps": old["steps"] if self.resume and isinstance(old.get("steps"), dict) else {},
        }
        atomic_write_text(out / "recipe.original.yaml", self.loaded.original_text)
        header = (
            f"# normswap run: resolved recipe (from {self.loaded.path}"
            + (f", --set {' --set '.join(self.loaded.overrides)}" if self.loaded.overrides else "")
            + ")\n"
        )
        atomic_write_text(out / "recipe.yaml", header + dump_recipe(self.recipe))
        self._save()

    def _save(self) -> None:
        atomic_write_text(self.out / RUN_FILE, json.dumps(self.state, indent=2, default=str) + "\n")

    def _run_step(self, step, ctx: Context) -> None:
        fp = step.fingerprint(ctx)
        rec = self.state["steps"].get(step.name)
        done = (self.resume and rec and rec.get("status") == "done" and rec.get("fingerprint") == fp) and step.complete(
            ctx
        )
        target = step.target(ctx)
        if done:
            self.say(f"{step.name.replace(':', ' ')}: done already ({target}), skipped")
        else:
            t0 = time.perf_counter()
            extra = step.run(ctx)
            ctx.ran_any = ctx.ran_any or step.produces is not None  # a new model: the evaluation runs again
            self.state["steps"][step.name] = {
                "status": "done",
                "fingerprint": fp,
                "seconds": round(time.perf_counter() - t0, 2),
                "finished": _now(),
                "output": str(target),
                **extra,
            }
            self._save()
        if step.produces is not None:
            ctx.models[step.produces] = Model(step.produces, str(target), fp)

    def run(self) -> dict:
        from normswap.checkpoint.load import resolve
        from normswap.devices import resolve_device

        recipe = self.recipe
        require_network(recipe)
        resolve(recipe["source"])  # a missing source fails before DIR is touched
        check_overlap(self.loaded, self.out)
        check_evaluation(recipe)
        device = resolve_device(recipe["device"])
        self._prepare_out()
        t_run = time.perf_counter()
        self.say(f"recipe {recipe['name']}: {len(recipe['variants'])} variant(s) of {recipe['source']} -> {self.out}")
        ctx = Context(
            recipe=recipe,
            loaded=self.loaded,
            out=self.out,
            device=device,
            say=self.say,
            update=self.heartbeat.update,
            models={SOURCE_NAME: Model(SOURCE_NAME, recipe["source"], _fingerprint({"source": recipe["source"]}))},
        )
        steps = plan_steps(recipe)
        with self.heartbeat:
            for step in steps:
                self._run_step(step, ctx)
        from normswap.report.render import noise_banner
        from normswap.report.report_dir import HTML
        from normswap.report.tables import markdown_table, summary_rows, summary_table

        results = steps[-1].results(ctx)
        rows = summary_rows(results)
        banner = noise_banner(results)  # the machine was too busy to tell speed differences: said once, with the table
        self.state.update(
            status="finished",
            finished=_now(),
            seconds=round(time.perf_counter() - t_run, 1),
            summary=rows,
            speed_noise_banner=banner,
            report=str(self.out / REPORT / HTML),
        )
        self._save()
        table = "\n".join(markdown_table(*summary_table(rows), numbers=True))
        note = f"\n\n> **Too noisy to tell.** {banner}" if banner else ""
        atomic_write_text(
            self.out / SUMMARY, f"# {recipe['report']['title']}\n\n{table}{note}\n\nReport: {REPORT}/{HTML}\n"
        )
        return self.state


def run_recipe(loaded: LoadedRecipe, out, *, resume=False, force=False, progress: Progress | None = None) -> dict:
    """Run ``loaded`` into ``out``; returns run.json's content (with ``summary`` rows). ``progress``
    receives every progress line (default: printed to stderr as ``normswap run: ...``)."""
    if loaded.recipe.get("trust_remote_code"):
        # A recipe is a file someone hands you, like a model directory: it may say that its source
        # needs its own code, but only the person running the command grants that.
        from normswap.checkpoint.load import remote_code_trusted

        if not remote_code_trusted():
            raise NormswapError(
                f"the recipe {loaded.path} says trust_remote_code: true (its source runs the Python "
                "files it ships); a recipe cannot grant that: pass --trust-remote-code on the command line if you "
                "trust the source"
            )
    return Runner(loaded, out, resume=resume, force=force, progress=progress).run()


__all__ = ["Runner", "check_overlap", "plan_steps", "require_network", "run_recipe"]
