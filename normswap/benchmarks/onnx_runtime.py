"""The benchmark `normswap bench onnx` runs: the ONNX export of a converted model against the exported original, in
onnxruntime on CPU, converted ÷ original forward speed, with a null control.

Each MODEL is a source checkpoint (converted here, exact mode, then both exported with
``normswap export --format onnx``, all in a temporary directory) or ``ORIGINAL=CONVERTED``: two
directories ``normswap export --format onnx`` already wrote, each read under the rule for
directories read back (export/onnx.py ``read_export``: refused in one line when another user could
have written the graph). Without MODEL: a GPT-2-small-shaped model built from its config (random
init, the shipped kjv-gpt2 tokenizer; no hub).

Before anything is timed, every converted graph must give the original graph's outputs on the same
token ids (max |Δ log-prob| <= --tolerance), else the command stops with one line. The graphs run
in onnxruntime CPU sessions timed by normswap's one timing instrument (normswap/timing.py:
interleaved pairs, the median of per-pair ratios with a bootstrap interval, the original's graph
loaded a second time as the null control, a stop rule), so the verdict words are the instrument's.
Each graph runs in ``--sessions`` sessions (the null control in as many of its own), loaded
round-robin and timed in rotation: a session's speed depends on where its buffers landed, a steady
bias of 1-3 % beside a busy process that one session a side turns into a null control outside its
band (per-copy medians in docs/results.md).
The JSON also records the load average before and after, onnxruntime's graph optimisation level
and which norm ops onnxruntime's optimised graph holds (whether the norms were fused; detected,
not assumed).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from normswap.errors import NormswapError
from normswap.export import DEFAULT_ONNX_NORM_OP
from normswap.publish import atomic_write_json, check_output_file


def _exported_pair(spec: str) -> dict:
    """{"original", "converted"}: the two export directories of ORIGINAL=CONVERTED, each checked."""
    from normswap.export.onnx import is_onnx_dir, read_export

    original, converted = spec.split("=", 1)
    for path in (original, converted):
        read_export(path)  # before anything in it is read: one line if another user could have written it
        if not is_onnx_dir(path):
            raise NormswapError(f"bench onnx: {path!r} is not a directory `normswap export --format onnx` wrote")
    return {"original": Path(original), "converted": Path(converted)}


def graphs(spec: str | None, scratch: Path, norm_ops, say) -> tuple[str, dict]:
    """(what was measured, {graph name: ONNX directory}) for one MODEL; "original" first."""
    if spec is not None and "=" in spec:
        return spec, _exported_pair(spec)
    from normswap.convert.pipeline import convert_checkpoint
    from normswap.export import run_export

    if spec is None:  # no MODEL given
        from normswap.assets.models import GPT2_SMALL, write_gpt2_shaped

        say("building a GPT-2-small-shaped model from its config (random init)")
        write_gpt2_shaped(scratch / "source", GPT2_SMALL)
        spec = str(scratch / "source")
    say(f"converting {spec} (exact)")
    convert_checkpoint(spec, scratch / "converted", mode="exact")
    dirs = {"original": scratch / "onnx-original"}
    say("exporting the original to ONNX")
    run_export(spec, dirs["original"], "onnx")
    for op in norm_ops:
        dirs[f"converted ({op})"] = scratch / f"onnx-converted-{op}"
        say(f"exporting the converted model to ONNX ({op})")
        run_export(str(scratch / "converted"), dirs[f"converted ({op})"], "onnx", norm_op=op)
    return spec, dirs


def _match(models: dict, ids, tolerance: float) -> dict:
    """Max |Δ log-prob| of every graph against the original graph on the same ids; one line if any misses."""
    from normswap.export.onnx import run_session

    ref = run_session(models["original"].session, ids).double().log_softmax(-1)
    diffs = {}
    for name, m in models.items():
        got = run_session(m.session, ids).double().log_softmax(-1)
        diffs[name] = float((got - ref).abs().max()) if got.shape == ref.shape else float("inf")
        if not diffs[name] <= tolerance:
            raise NormswapError(
                f"bench onnx: the {name} graph ({m.path}) does not match the original graph: max |Δ log-prob| "
                f"{diffs[name]:.3g} > {tolerance:.3g}; nothing was timed"
            )
    return diffs


# an onnxruntime CPU session of a graph held 1.7x the graph's bytes (GPT-2-small: 15 sessions, 12.7 GB
# peak resident; measured, see docs/results.md)
SESSION_BYTES_PER_GRAPH_BYTE = 1.7


def _graph_bytes(directory) -> int:
    """The bytes of the regular files directly in an export directory (a link is not followed)."""
    import os

    with os.scandir(directory) as entries:
        return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False))


def _sessions_that_fit(sessions: int, dirs: dict, graphs: int, say) -> int:
    """``sessions`` a graph, or fewer when that many would not fit in half the memory available now."""
    from normswap.devices import available_memory

    size = max(_graph_bytes(d) for d in dirs.values())
    fit = int(available_memory() / 2 // max(1.0, SESSION_BYTES_PER_GRAPH_BYTE * size * graphs))
    if fit >= sessions:
        return sessions
    fewer = max(1, fit)
    if say:
        say(f"{sessions} sessions a graph would not fit in half the free memory: timing {fewer}")
    return fewer


def measure_onnx(
    spec, dirs: dict, *, timing: dict, block_s, threads, batch, seq_len, tolerance, scratch, progress=None, say=None,
    sessions: int = 1,
):  # fmt: skip
    """One MODEL's graphs checked against the original, then timed pairwise by timing.compare
    (``timing``: its stop-rule arguments; ``block_s``: seconds per timed block, 0 for one call;
    ``sessions``: onnxruntime sessions a graph, the null control's its own, rotated by the instrument;
    ``progress``, ``say``: callbacks)."""
    import torch

    from normswap import timing as instrument
    from normswap.evaluate.onnx_model import OnnxModel
    from normswap.evaluate.throughput import machine_load
    from normswap.export.onnx import OPTIMIZATION_LEVEL, optimised_norm_ops
    from normswap.model_facts import context_length

    models = {name: OnnxModel(d, threads=threads) for name, d in dirs.items()}
    models["null control"] = OnnxModel(dirs["original"], threads=threads)  # the same graph, a second session
    vocab = int(models["original"].config.vocab_size)
    seq_len = min(seq_len, context_length(models["original"]) or seq_len)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    diffs = _match({k: m for k, m in models.items() if k != "null control"}, ids, tolerance)
    fused = {name: optimised_norm_ops(models[name].graph, scratch, f"graph{i}") for i, name in enumerate(dirs)}
    feed = {"input_ids": ids.numpy().astype("int64")}

    def call(sess):
        return lambda: sess.run(None, feed)  # the session alone: no tensor conversion inside the timed block

    # the checked session and sessions-1 more of each graph, loaded round-robin across the graphs: a
    # session's speed depends on where its buffers landed, so no graph may have all its sessions made
    # first or last
    sessions = _sessions_that_fit(sessions, dirs, len(models), say)
    fns = {name: [call(m.session)] for name, m in models.items()}
    for _ in range(sessions - 1):
        for name, m in models.items():
            fns[name].append(call(OnnxModel(m.path, threads=threads).session))
    calls = instrument.calibrate_calls(fns["original"][0], block_s) if block_s else 1
    before = machine_load()
    cmp = instrument.compare(fns, "original", "null control", calls_per_sample=calls, progress=progress, **timing)
    after = machine_load()
    return {
        "model": spec,
        "graphs": {
            name: {
                "path": str(d),
                "norm_nodes": models[name].export.get("norm_nodes"),
                "optimised_norm_ops": fused[name],
                "max_abs_logprob_diff_vs_original": diffs[name],
            }
            for name, d in dirs.items()
        },
        "batch": batch,
        "seq_len": seq_len,
        "threads": threads,
        "sessions_per_graph": sessions,
        "graph_optimization_level": OPTIMIZATION_LEVEL,
        "machine": {
            "load_before": before["load_average"],
            "load_after": after["load_average"],
            "cpu_count": before["cpu_count"],
            "usable_cpus": before["usable_cpus"],
        },
        "forward_tokens_per_second": {k: batch * seq_len / s for k, s in cmp.seconds_per_call.items()},
        "over_original": {name: r.to_json() for name, r in cmp.candidates.items()},
        "null_control_over_original": cmp.null.to_json(),
        "timing": cmp.to_json(samples=True),
    }


def result_lines(r: dict) -> list[str]:
    tps, t = r["forward_tokens_per_second"], r["timing"]
    out = [
        f"{r['model']}: onnxruntime CPU, {r['threads']} thread(s), {r.get('sessions_per_graph', 1)} session(s) "
        f"a graph, {r['graph_optimization_level']}, "
        f"batch {r['batch']} x {r['seq_len']} tokens; {t['rounds']} interleaved pairs of {t['calls_per_sample']} "
        f"call(s) in {t['elapsed_s']:.0f} s (stopped: {t['stop_reason']}); load "
        f"{r['machine']['load_before']} -> {r['machine']['load_after']}"
    ]
    for name, g in r["graphs"].items():
        ops = ", ".join(f"{k} x{v}" for k, v in g["optimised_norm_ops"].items()) or "no norm op"
        line = f"  {name}: {tps[name]:.1f} tokens/s, runs {ops}"
        if name != "original":
            c = r["over_original"][name]
            line += (
                f"; /original x{c['ratio']:.3f} [{c['low']:.3f}-{c['high']:.3f}] ({c['verdict']}); "
                f"max |Δ log-prob| {g['max_abs_logprob_diff_vs_original']:.2g}"
            )
        out.append(line)
    n = r["null_control_over_original"]
    out.append(f"  null control: x{n['ratio']:.3f} [{n['low']:.3f}-{n['high']:.3f}] ({n['verdict']})")
    return out


def run_onnx(
    models, *, repeats, budget, target, threads, sessions, batch, seq_len, min_time, norm_ops, tolerance,
    json_out=None, echo=print,
) -> list[dict]:  # fmt: skip
    """Every MODEL (a source to convert and export, or ORIGINAL_ONNX=CONVERTED_ONNX; none: a
    GPT-2-small-shaped model built from its config) measured in turn, each result's lines given to
    ``echo`` as it is done; the results written to ``json_out`` when given."""
    import torch  # not at import time: `normswap bench --help` must not load torch

    from normswap.export.onnx import require_packages
    from normswap.progress import Heartbeat, stderr_lines

    if json_out:  # before any work: never one of the models or graphs read, nor inside one
        reads = [("the model", m) for spec in models for m in spec.split("=")]
        check_output_file(json_out, force=True, reads=reads, label="--save")
    require_packages()
    torch.set_num_threads(threads)
    import onnxruntime

    results = []
    with (
        tempfile.TemporaryDirectory(prefix="normswap-bench-onnx-") as tmp,
        Heartbeat(stderr_lines("normswap bench onnx: ")) as beat,
    ):
        for i, spec in enumerate(models or (None,)):
            scratch = Path(tmp) / str(i)
            scratch.mkdir()
            name, dirs = graphs(spec, scratch, norm_ops or (DEFAULT_ONNX_NORM_OP,), beat.say)
            r = measure_onnx(
                name,
                dirs,
                timing={"min_pairs": repeats, "budget_s": budget, "target_halfwidth": target},
                block_s=min_time,
                threads=threads,
                sessions=sessions,
                say=beat.say,
                batch=batch,
                seq_len=seq_len,
                tolerance=tolerance,
                scratch=scratch,
                progress=beat.update,
            )
            results.append(r)
            echo("\n".join(result_lines(r)))
    if json_out:
        atomic_write_json(
            Path(json_out),
            {"onnx": results, "onnxruntime": onnxruntime.__version__, "torch": torch.__version__},
            indent=1,
        )
    return results
