"""The benchmark `normswap bench decode` runs: per-token decode at batch 1, converted ÷ original, with a null control.

Each MODEL is a source (converted here, exact mode, into a temporary directory) or
``SOURCE=CONVERTED`` (a conversion you already have); without MODEL, the shipped models. For
each, the original, the converted model and the original loaded a second time (the null control)
are timed by normswap/timing.py: one decode step at batch 1 through a short KV cache
(``--cache-tokens``, cut back before every step so every step costs the same), ``--new-tokens``
steps per block, in balanced rounds of interleaved pairs (every pair of the three once a round, so
each runs as often as the original) until every interval is within ``--target`` or ``--budget``
runs out. Every model runs on memory of its own (evaluate/throughput.own_memory), in ``--replicas``
copies a side that the pairs rotate through (timing.compare's replicas). The ratio is converted ÷
original decode speed (> 1: faster) with its 95 % interval and verdict, beside the null control's
own ratio; the line says how the stop rule ended.

Then, the same way (the same models, replicas and balanced rounds, ``--generate-budget`` seconds), whole
calls of the model's own ``generate()``: greedy, batch 1, ``--generate-tokens`` tokens after the
prompt, with the per-step host work transformers adds (a converted checkpoint loaded as remote code
once paid an ``inspect.signature`` a step there, which the bare decode step never sees). Its rows are
the JSON's ``generate`` entry per model.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from normswap.errors import NormswapError
from normswap.publish import atomic_write_json, check_output_file


def shipped() -> list[str]:
    """Every model `normswap models` lists, as a spec."""
    from normswap.assets.models import SPEC_PREFIX, list_models

    return [SPEC_PREFIX + m["name"] for m in list_models()]


def model_pair(spec: str, scratch: Path, say) -> tuple[str, str]:
    if "=" in spec:
        source, converted = spec.split("=", 1)
        return source, converted
    from normswap.convert.pipeline import convert_checkpoint

    out = scratch / f"converted-{len(list(scratch.iterdir()))}"
    say(f"converting {spec} (exact) into a temporary directory")
    convert_checkpoint(spec, out, mode="exact")
    return spec, str(out)


def measure_decode(
    source: str,
    converted: str,
    *,
    steps: int,
    cache_tokens: int,
    budget: float,
    target: float,
    max_pairs: int,
    min_pairs: int = 20,
    replicas: int = 1,
    generate_tokens: int = 32,
    generate_budget: float | None = None,
    progress=None,
) -> dict:
    """One pair's decode benchmark: the instrument's converted ÷ original and null control ÷
    original decode-speed ratios (normswap/timing.py), decode tokens/s of each, the machine's load;
    with a ``generate_budget`` (seconds; None: not timed), the same for whole ``generate()`` calls
    (``generate``)."""
    import dataclasses

    from normswap.checkpoint.load import load_model
    from normswap.evaluate.config import SpeedConfig
    from normswap.evaluate.throughput import ModelBench, compare_kind, machine_load

    specs = {"original": source, "converted": converted, "null control": source}  # the null: the same weights again
    cfg = SpeedConfig(
        repeats=max_pairs,
        warmup=3,
        prompt_len=cache_tokens,
        new_tokens=generate_tokens,
        kinds=("generate", "generate_call"),
        speed_budget=budget,
        target_halfwidth=target,
    )
    # replicas, loaded round-robin so that no model has all its copies made first or last: each copy's
    # memory lands somewhere else, and one copy a side is one draw of that placement (2-4 % here)
    benches = [ModelBench(name, load_model(spec).eval(), cfg) for _ in range(replicas) for name, spec in specs.items()]
    before = machine_load()
    # balanced rounds: every model runs as often as the original (in the default round the baseline
    # runs in every pair, and identical copies in the other slots can read 2-5 % slower)
    cmp = compare_kind(benches, "decode", cfg, "original", "null control", progress, calls=steps, balanced=True)
    generate = None
    if generate_budget is not None:
        # transformers' own generate(): its per-step host work on top of the forward the loop above times
        gen_cfg = dataclasses.replace(cfg, speed_budget=generate_budget)
        gen = compare_kind(benches, "generate_call", gen_cfg, "original", "null control", progress, balanced=True)
        generate = _generate_result(gen, benches[0].new_tokens, benches[0].prompt_len)
    after = machine_load()
    conv, null = cmp["converted"], cmp.null
    return {
        "source": source,
        "converted": converted,
        "batch": 1,
        "cache_tokens": benches[0].prompt_len,
        "decode_steps_per_block": steps,
        "replicas": replicas,
        "pairs": cmp.rounds,
        "stop_reason": cmp.stop_reason,
        "elapsed_s": round(cmp.elapsed_s, 1),
        "machine": {"load_before": before["load_average"], "load_after": after["load_average"]}
        | {k: before[k] for k in ("cpu_count", "usable_cpus")},
        "decode_tokens_per_second": {k: 1.0 / v for k, v in cmp.seconds_per_call.items()},
        "converted_over_original": conv.to_json() | {"median": conv.ratio},
        "null_control_over_original": null.to_json() | {"median": null.ratio},
        "timing": cmp.to_json(samples=True),
        "generate": generate,
    }


def _generate_result(cmp, new_tokens: int, prompt_tokens: int) -> dict:
    """The ``generate`` entry: whole greedy generate() calls at batch 1, one a block, in balanced rounds."""
    conv, null = cmp["converted"], cmp.null
    return {
        "new_tokens": new_tokens,
        "prompt_tokens": prompt_tokens,
        "pairs": cmp.rounds,
        "stop_reason": cmp.stop_reason,
        "elapsed_s": round(cmp.elapsed_s, 1),
        "tokens_per_second": {k: new_tokens / v for k, v in cmp.seconds_per_call.items()},
        "converted_over_original": conv.to_json() | {"median": conv.ratio},
        "null_control_over_original": null.to_json() | {"median": null.ratio},
        "timing": cmp.to_json(samples=True),
    }


def result_line(r: dict) -> str:
    c, n = r["converted_over_original"], r["null_control_over_original"]
    tps = r["decode_tokens_per_second"]
    return (
        f"{r['source']}: decode {tps['original']:.1f} -> {tps['converted']:.1f} tokens/s, converted/original "
        f"x{c['ratio']:.3f} [{c['low']:.3f}-{c['high']:.3f}] ({c['verdict']}); null control x{n['ratio']:.3f} "
        f"[{n['low']:.3f}-{n['high']:.3f}] ({n['verdict']}); {r['pairs']} pairs of {r['decode_steps_per_block']} "
        f"steps, stopped: {r['stop_reason']} after {r['elapsed_s']:.0f} s; "
        f"load {r['machine']['load_before']} -> {r['machine']['load_after']}"
    ) + (_generate_line(r["generate"]) if r.get("generate") else "")


def _generate_line(g: dict) -> str:
    c, n, tps = g["converted_over_original"], g["null_control_over_original"], g["tokens_per_second"]
    return (
        f"\n  generate() of {g['new_tokens']} tokens: {tps['original']:.1f} -> {tps['converted']:.1f} tokens/s, "
        f"converted/original x{c['ratio']:.3f} [{c['low']:.3f}-{c['high']:.3f}] ({c['verdict']}); null control "
        f"x{n['ratio']:.3f} [{n['low']:.3f}-{n['high']:.3f}] ({n['verdict']}); {g['pairs']} pairs, "
        f"stopped: {g['stop_reason']} after {g['elapsed_s']:.0f} s"
    )


def run_decode(
    models,
    *,
    repeats,
    new_tokens,
    cache_tokens,
    budget,
    target,
    threads,
    replicas,
    generate_tokens=32,
    generate_budget=None,
    json_out=None,
    echo=print,
) -> list[dict]:
    """Every MODEL (a source, or SOURCE=CONVERTED; none: the shipped models) measured in turn, each
    result's line given to ``echo`` as it is done; the results written to ``json_out`` when given.
    ``generate_budget``: seconds of whole generate() calls per model after the decode steps (None: none)."""
    import torch  # not at import time: `normswap bench --help` must not load torch

    from normswap.progress import Heartbeat, stderr_lines

    if json_out:  # before any work: never one of the models read, nor inside one (--json CONV/model... was)
        reads = [("the model", m) for spec in models for m in spec.split("=")]
        check_output_file(json_out, force=True, reads=reads, label="--save")
    torch.set_num_threads(threads)
    settings = {"steps": new_tokens, "cache_tokens": cache_tokens, "budget": budget, "target": target}
    settings |= {"replicas": replicas, "generate_tokens": generate_tokens, "generate_budget": generate_budget}
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="normswap-bench-decode-") as tmp,
        Heartbeat(stderr_lines("normswap bench decode: ")) as beat,
    ):
        for spec in models or shipped():
            source, converted = model_pair(spec, Path(tmp), beat.say)
            if not Path(converted).is_dir() and not converted.startswith("normswap:"):
                raise NormswapError(f"bench decode: converted model {converted!r} is not a directory")
            results.append(measure_decode(source, converted, max_pairs=repeats, progress=beat.update, **settings))
            echo(result_line(results[-1]))
    if json_out:
        atomic_write_json(Path(json_out), {"decode": results, "threads": threads} | settings, indent=1)
    return results
