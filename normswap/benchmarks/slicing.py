"""The benchmark `normswap bench slice` runs: what slicing buys in speed, and what each basis costs in perplexity.

Speed (the default). A GPT-2-shaped model (default GPT-2 small: 12 × 768, 50,257 tokens, random
init from its config: the arithmetic is what is timed, not what the weights know) is converted
exactly in memory and sliced at ``--fraction`` two ways: one PCA rotation for the whole stream
(``sliced``, what `normswap slice` writes) and SliceGPT's design (``per-layer``: a rotation per
layer and a k × k shortcut where the stream enters each layer). The rotations are fitted on seeded
random token ids (a randomly initialised model has no text it knows; the shapes, and so the speed,
do not depend on the basis). Two comparisons per kind, each with its own null control, in balanced
rounds of interleaved pairs (normswap/timing.py), every model on memory of its own
(evaluate/throughput.own_memory):

- against the LayerNorm original: the conversion and sliced; null: the original again;
- against the unsliced conversion: sliced and per-layer; null: the conversion again.

Four models a comparison: a balanced round times every pair of them (six pairs), and a forward of
GPT-2 small at 1 × 128 takes a few tenths of a second on one core, so every model more costs rounds.

Kinds: ``forward`` (batch 1 × ``--seq-len`` tokens, no cache) and ``decode`` (one greedy step at
batch 1 through a ``--cache-tokens`` KV cache cut back before every step, ``--new-tokens`` steps a
block: `bench decode`'s operation). The FLOP bound is the ratio of the matmul FLOPs a token costs
before and after slicing (every matmul that reads or writes the stream shrinks to k/d; attention
scores do not).

Quality (``--quality``). For each shipped model (or ``--model``): the original, its exact
conversion and, at every ``--fractions`` value, the three bases (pca, per-layer, random) fitted on
the embedded corpus's training split, scored on its held-out test books (perplexity, 128-token
windows, stride 64: the figure docs/models.md quotes), with the parameter count of each (per-layer:
its shortcut matrices counted). Parameter counts for the GPT-2-small shape at every fraction too.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

from normswap.publish import atomic_write_json, check_output_file

SPEED_ARMS = ("original", "conversion", "sliced", "per-layer")
NULL_ORIGINAL = "null control"
NULL_CONVERSION = "conversion null control"
SPEED_KINDS = ("forward", "decode")
QUALITY_BASES = ("pca", "per-layer", "random")
DEFAULT_FRACTIONS = (0.1, 0.2, 0.25, 0.3, 0.4, 0.5)
GPT2_SMALL_SHAPE = {"layers": 12, "width": 768, "heads": 12, "vocab": 50257}
EVAL_SEQ_LEN, EVAL_STRIDE = 128, 64  # the held-out perplexity docs/models.md quotes (121.94 for kjv-gpt2)


def gpt2_shaped(layers: int, width: int, heads: int, vocab: int, seed: int = 0):
    """A randomly initialised GPT2LMHeadModel of this shape (tied head, as GPT-2 ships), in eval mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab, n_layer=layers, n_embd=width, n_head=heads, n_positions=1024, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def random_batches(vocab: int, tokens: int, seq_len: int, seed: int) -> list:
    """Seeded random token ids, [≤ 8, seq_len] a batch, about ``tokens`` in all (at least one block)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, vocab, (max(1, tokens // seq_len), seq_len), generator=g)
    return list(blocks.split(8))


def matmul_flops_per_token(model) -> int:
    """2 × the weight entries of every Linear / Conv1D and of the tied head, per token: the matmul
    work a token costs (attention scores excluded: they do not change with the stream's width).
    Shortcut matrices of the per-layer arm are not weights and are added by the caller."""
    import torch
    from transformers.pytorch_utils import Conv1D

    total = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            total += module.weight.numel()
    head = model.get_output_embeddings()
    if head is not None and not any(head is m for m in model.modules() if isinstance(m, torch.nn.Linear)):
        total += head.weight.numel()
    return 2 * total


def build_speed_arms(shape: dict, fraction: float, *, calibration_tokens: int, seed: int, say) -> tuple[dict, dict]:
    """({name: model} for SPEED_ARMS and both null controls, facts): the original, its copy, the
    exact conversion, its copy and the two sliced arms, each its own object."""
    from normswap.convert import convert_model
    from normswap.slice import slice_model
    from normswap.slice.model import parameter_count

    say(f"building a GPT-2 of {shape} (random init) and converting it exactly")
    original = gpt2_shaped(**shape, seed=seed)
    conversion = copy.deepcopy(original)
    convert_model(conversion, mode="exact")
    batches = random_batches(shape["vocab"], calibration_tokens, 128, seed)
    say(f"slicing at {fraction:.0%}: one PCA rotation, and per layer (SliceGPT's design)")
    pca = slice_model(conversion, batches, fraction, basis="pca", seed=seed)
    per_layer = slice_model(conversion, batches, fraction, basis="per-layer", seed=seed)
    models = {
        "original": original,
        NULL_ORIGINAL: copy.deepcopy(original),
        "conversion": conversion,
        NULL_CONVERSION: copy.deepcopy(conversion),
        "sliced": pca.model.eval(),
        "per-layer": per_layer.model.eval(),
    }
    d, k = pca.hidden_size, pca.width
    before = matmul_flops_per_token(conversion)
    after = matmul_flops_per_token(pca.model)
    shortcuts = per_layer.parameters_after - parameter_count(per_layer.model)  # the k × k hooks, counted by slice
    facts = {
        "hidden_size": d,
        "width": k,
        "fraction": fraction,
        "parameters": {
            "original": parameter_count(original),
            "conversion": parameter_count(conversion),
            "sliced": pca.parameters_after,
            "per-layer": per_layer.parameters_after,
        },
        "matmul_flops_per_token": {"conversion": before, "sliced": after, "per-layer": after + 2 * shortcuts},
        "flop_bound": before / after,
        "flop_bound_per_layer": before / (after + 2 * shortcuts),
        "calibration": f"{sum(int(b.numel()) for b in batches):,} seeded random token ids (random-init model)",
    }
    return models, facts


def _ratio(r) -> dict:
    return r.to_json()


def measure_speed(
    models: dict, *, seq_len, cache_tokens, steps, budget, decode_budget, target, max_pairs, progress=None
) -> dict:
    """Both comparisons for every kind: {kind: {"vs_original": ..., "vs_conversion": ...}}."""
    from normswap.evaluate.config import SpeedConfig
    from normswap.evaluate.throughput import ModelBench, compare_kind, machine_load

    cfg = SpeedConfig(
        repeats=max_pairs,
        warmup=2,
        batch_size=1,
        seq_len=seq_len,
        prompt_len=cache_tokens,
        new_tokens=2,
        kinds=("forward", "generate"),
        speed_budget=budget,
        target_halfwidth=target,
    )
    benches = {name: ModelBench(name, model, cfg) for name, model in models.items()}
    plans = {
        "vs_original": ("original", NULL_ORIGINAL, ("conversion", "sliced")),
        "vs_conversion": ("conversion", NULL_CONVERSION, ("sliced", "per-layer")),
    }
    out: dict = {}
    for kind in SPEED_KINDS:
        out[kind] = {}
        for label, (base, null, candidates) in plans.items():
            taking = [benches[base], benches[null], *(benches[c] for c in candidates)]
            before = machine_load()["load_average"]
            budgeted = cfg if kind == "forward" else dataclasses.replace(cfg, speed_budget=decode_budget)
            cmp = compare_kind(
                taking,
                kind,
                budgeted,
                base,
                null,
                progress,
                calls=steps if kind == "decode" else None,
                balanced=True,
            )
            unit = 1 if kind == "decode" else seq_len
            out[kind][label] = {
                "baseline": base,
                "ratios": {c: _ratio(cmp[c]) for c in candidates},
                "null_control": _ratio(cmp.null),
                "tokens_per_second": {n: unit / s for n, s in cmp.seconds_per_call.items()},
                "pairs": cmp.rounds,
                "stop_reason": cmp.stop_reason,
                "elapsed_s": round(cmp.elapsed_s, 1),
                "calls_per_sample": cmp.calls_per_sample,
                "load_before": before,
                "load_after": machine_load()["load_average"],
                "timing": cmp.to_json(samples=True),
            }
    return out


def speed_goals(result: dict) -> dict:
    """The issue's goals, read off the lower ends of the intervals: forward ≥ 1.28 and decode ≥ 1.20
    against both baselines, every null control inside ±2 %."""
    need = {"forward": 1.28, "decode": 1.20}
    goals = {}
    for kind, floor in need.items():
        for label, run in result["speed"][kind].items():
            low = run["ratios"]["sliced"]["low"]
            goals[f"{kind} sliced {label} low >= {floor}"] = {"low": low, "met": low >= floor}
            null = run["null_control"]
            goals[f"{kind} null control {label} inside ±2%"] = {
                "interval": [null["low"], null["high"]],
                "met": 0.98 <= null["low"] and null["high"] <= 1.02,
            }
    return goals


def _speed_lines(result: dict) -> list[str]:
    f = result["facts"]
    lines = [
        f"width {f['hidden_size']} -> {f['width']} ({f['fraction']:.0%} deleted); parameters "
        + ", ".join(f"{k} {v:,}" for k, v in f["parameters"].items())
        + f"; FLOP bound x{f['flop_bound']:.3f} (per-layer x{f['flop_bound_per_layer']:.3f})"
    ]
    for kind, runs in result["speed"].items():
        for label, run in runs.items():
            ratios = "; ".join(
                f"{c} x{r['ratio']:.3f} [{r['low']:.3f}-{r['high']:.3f}] ({r['verdict']})"
                for c, r in run["ratios"].items()
            )
            n = run["null_control"]
            lines.append(
                f"{kind} {label.replace('_', ' ')}: {ratios}; null control x{n['ratio']:.3f} "
                f"[{n['low']:.3f}-{n['high']:.3f}] ({n['verdict']}); {run['pairs']} rounds, stopped: "
                f"{run['stop_reason']} after {run['elapsed_s']:.0f} s; load {run['load_before']} -> {run['load_after']}"
            )
    for goal, g in result["goals"].items():
        lines.append(f"goal {goal}: {'met' if g['met'] else 'NOT met'} ({g.get('low', g.get('interval'))})")
    return lines


# -- quality ------------------------------------------------------------------------------------


def held_out_perplexity(model, tokenizer, text: str) -> float:
    from normswap.evaluate.perplexity import perplexity

    return float(perplexity(model, tokenizer, text, seq_len=EVAL_SEQ_LEN, stride=EVAL_STRIDE).perplexity)


def measure_quality(spec: str, fractions, *, calibration_tokens: int, seed: int, say, eval_tokens: int = 0) -> dict:
    """One model's perplexity on the held-out books before healing: the original, the conversion,
    and every basis at every fraction, with parameter counts."""
    from normswap.checkpoint import load as ckload
    from normswap.convert import convert_model
    from normswap.data import load_text
    from normswap.evaluate.perplexity import truncate_text
    from normswap.slice import calibration_batches, slice_model
    from normswap.slice.calibrate import block_length
    from normswap.slice.model import parameter_count

    resolved = ckload.resolve(spec)
    original = ckload.load_model(resolved, task="causal-lm").eval()
    tokenizer = ckload.load_tokenizer(resolved)
    text, _ = truncate_text(load_text("embedded", "test"), tokenizer, eval_tokens)
    conversion = copy.deepcopy(original)
    convert_model(conversion, mode="exact")
    batches = calibration_batches(tokenizer, "embedded", calibration_tokens, block_length(original.config), seed=seed)
    say(f"{spec}: scoring the original and its conversion")
    row = {
        "model": spec,
        "hidden_size": int(original.config.hidden_size),
        "calibration_tokens": sum(int(b.numel()) for b in batches),
        "eval": {"split": "test", "max_tokens": eval_tokens, "seq_len": EVAL_SEQ_LEN, "stride": EVAL_STRIDE},
        "original": {
            "perplexity": held_out_perplexity(original, tokenizer, text),
            "parameters": parameter_count(original),
        },
        "conversion": {
            "perplexity": held_out_perplexity(conversion, tokenizer, text),
            "parameters": parameter_count(conversion),
        },
        "fractions": [],
    }
    for fraction in fractions:
        entry = {"fraction": fraction}
        for basis in QUALITY_BASES:
            say(f"{spec}: {basis} basis at {fraction:.0%}")
            r = slice_model(conversion, batches, fraction, basis=basis, seed=seed)
            entry["width"] = r.width
            entry[basis] = {
                "perplexity": held_out_perplexity(r.model.eval(), tokenizer, text),
                "parameters": r.parameters_after,
                "kept_energy": r.kept_energy_total,
            }
            del r
        row["fractions"].append(entry)
    return row


def count_shape_parameters(shape: dict, fractions, *, seed: int) -> dict:
    """Parameter counts of a GPT-2 of ``shape`` (random init) sliced at each fraction, one rotation
    and per layer (its shortcuts counted)."""
    from normswap.convert import convert_model
    from normswap.slice import slice_model
    from normswap.slice.model import parameter_count

    model = gpt2_shaped(**shape, seed=seed)
    original = parameter_count(model)
    convert_model(model, mode="exact")
    batches = random_batches(shape["vocab"], 256, 128, seed)
    rows = []
    for fraction in fractions:
        pca = slice_model(model, batches, fraction, basis="pca", seed=seed)
        per_layer = slice_model(model, batches, fraction, basis="per-layer", seed=seed)
        rows.append(
            {
                "fraction": fraction,
                "width": pca.width,
                "pca": pca.parameters_after,
                "per-layer": per_layer.parameters_after,
            }
        )
        del pca, per_layer
    return {"shape": shape, "original": original, "fractions": rows}


def quality_goals(rows: list[dict], fraction: float = 0.25) -> dict:
    """Default within 1 % of per-layer's perplexity at ``fraction``, far below random's (at least
    half of random's excess over the conversion); fewer parameters than the original at every F ≥ 0.1."""
    goals = {}
    for row in rows:
        for entry in row["fractions"]:
            if abs(entry["fraction"] - fraction) < 1e-9:
                pca, per, rnd = (entry[b]["perplexity"] for b in QUALITY_BASES)
                conv = row["conversion"]["perplexity"]
                goals[f"{row['model']} pca within 1% of per-layer at {fraction:.0%}"] = {
                    "ratio": pca / per,
                    "met": pca <= per * 1.01,
                }
                goals[f"{row['model']} pca far below random at {fraction:.0%}"] = {
                    "pca_excess": pca - conv,
                    "random_excess": rnd - conv,
                    "met": (pca - conv) < 0.5 * (rnd - conv),
                }
        fewer = all(e["pca"]["parameters"] < row["original"]["parameters"] for e in row["fractions"])
        goals[f"{row['model']} fewer parameters than the original at every fraction"] = {"met": fewer}
    return goals


def _quality_lines(result: dict) -> list[str]:
    lines = []
    for row in result["quality"]:
        lines.append(
            f"{row['model']} (width {row['hidden_size']}): original {row['original']['perplexity']:.3f} "
            f"({row['original']['parameters']:,} parameters), conversion {row['conversion']['perplexity']:.3f}"
        )
        lines.append("  fraction  width  " + "  ".join(f"{b:>22}" for b in QUALITY_BASES))
        for e in row["fractions"]:
            cells = "  ".join(f"{e[b]['perplexity']:>10.3f} ({e[b]['parameters']:>9,})" for b in QUALITY_BASES)
            lines.append(f"  {e['fraction']:>8.2f}  {e['width']:>5}  {cells}")
    shape = result.get("shape_parameters")
    if shape:
        lines.append(f"GPT-2 {shape['shape']}: original {shape['original']:,} parameters")
        for e in shape["fractions"]:
            lines.append(f"  {e['fraction']:.2f}: width {e['width']}, pca {e['pca']:,}, per-layer {e['per-layer']:,}")
    for goal, g in result["goals"].items():
        lines.append(f"goal {goal}: {'met' if g['met'] else 'NOT met'}")
    return lines


def slice_curve(quality: list[dict], speed: dict | None = None) -> dict:
    """results.json's ``slice_curve`` (docs/results-schema.md) from the quality rows and, when given,
    a speed run's result (the bench's JSON without --quality): what report/plots.py draws."""
    curve = {
        "perplexity": [
            {
                "model": row["model"],
                "original": row["original"]["perplexity"],
                "conversion": row["conversion"]["perplexity"],
                "points": [
                    {
                        "fraction": e["fraction"],
                        "width": e["width"],
                        "perplexity": {b: e[b]["perplexity"] for b in QUALITY_BASES},
                        "parameters": {b: e[b]["parameters"] for b in QUALITY_BASES},
                    }
                    for e in row["fractions"]
                ],
            }
            for row in quality
        ],
        "speed": [],
    }
    if speed:
        facts = speed["facts"]
        for kind, runs in speed["speed"].items():
            for run in runs.values():
                r = run["ratios"]["sliced"]
                curve["speed"].append(
                    {
                        "fraction": facts["fraction"],
                        "kind": kind,
                        "baseline": run["baseline"],
                        "ratio": r["ratio"],
                        "low": r["low"],
                        "high": r["high"],
                        "null_control": [run["null_control"]["low"], run["null_control"]["high"]],
                        "flop_bound": facts["flop_bound"],
                    }
                )
    return curve


def _fractions(text: str) -> tuple[float, ...]:
    from normswap.errors import NormswapError

    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise NormswapError(f"--fractions: a comma-separated list of numbers in (0, 1), got {text!r}") from None
    if not values or not all(0 < v < 1 for v in values):
        raise NormswapError(f"--fractions: every fraction must be in (0, 1), got {text!r}")
    return values


def run_slice(
    *, fraction, layers, width, heads, vocab, seq_len, cache_tokens, new_tokens, budget, decode_budget, repeats, target,
    threads, calibration_tokens, seed, quality, models, fractions, eval_tokens, shape_parameters, speed_json, plot_dir,
    json_out, echo=print,
) -> dict:  # fmt: skip
    """What `normswap bench slice` runs (its options, by name); each line of the outcome given to ``echo``."""
    import torch

    from normswap.evaluate.throughput import machine_load
    from normswap.progress import Heartbeat, stderr_lines

    fracs = _fractions(fractions)
    if json_out:
        check_output_file(json_out, force=True, reads=[("the model", m) for m in models], label="--save")
    torch.set_num_threads(threads)
    shape = {"layers": layers, "width": width, "heads": heads, "vocab": vocab}
    t0 = time.perf_counter()
    result: dict = {"threads": threads, "seed": seed, "machine_before": machine_load()}
    with Heartbeat(stderr_lines("normswap bench slice: ")) as beat:
        if quality:
            from normswap.benchmarks.decode import shipped

            result["quality"] = [
                measure_quality(
                    m,
                    fracs,
                    calibration_tokens=calibration_tokens or 32_768,
                    seed=seed,
                    say=beat.say,
                    eval_tokens=eval_tokens,
                )
                for m in (models or shipped())
            ]
            if shape_parameters:
                beat.say(f"counting parameters of the GPT-2 shape {shape}")
                result["shape_parameters"] = count_shape_parameters(shape, fracs, seed=seed)
            result["goals"] = quality_goals(result["quality"])
            speed = json.loads(Path(speed_json).read_text()) if speed_json else None
            result["slice_curve"] = slice_curve(result["quality"], speed)
            lines = _quality_lines(result)
            if plot_dir:
                from normswap.report.plots import slice_curve_plot

                Path(plot_dir).mkdir(parents=True, exist_ok=True)
                lines.append(f"plot: {slice_curve_plot(result, Path(plot_dir))}")
        else:
            arms, facts = build_speed_arms(
                shape, fraction, calibration_tokens=calibration_tokens or 1024, seed=seed, say=beat.say
            )
            result["facts"] = facts
            result["settings"] = {
                "seq_len": seq_len,
                "cache_tokens": cache_tokens,
                "decode_steps_per_block": new_tokens,
                "budget": budget,
                "decode_budget": decode_budget,
                "target": target,
                "repeats": repeats,
                "balanced": True,
            }
            result["speed"] = measure_speed(
                arms,
                seq_len=seq_len,
                cache_tokens=cache_tokens,
                steps=new_tokens,
                budget=budget,
                decode_budget=decode_budget,
                target=target,
                max_pairs=repeats,
                progress=beat.update,
            )
            result["goals"] = speed_goals(result)
            lines = _speed_lines(result)
    result["machine_after"] = machine_load()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    for line in lines:
        echo(line)
    if json_out:
        atomic_write_json(Path(json_out), result, indent=1)
    return result
