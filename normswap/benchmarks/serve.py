"""The benchmark `normswap bench serve` runs: what a served model costs and knows, float32 and int8.

Variants: the LayerNorm original, its exact conversion and the sliced model (PCA, ``--fraction``),
each as a float32 ONNX graph and as int8 (export/int8.py: onnxruntime's quantize_dynamic, weights
per output channel, activations at run time). The conversion and the sliced model are quantized
twice, with and without the incoherence rotation (slice/incoherence.py) turning their stream first,
so the table shows what the rotation buys; the original is quantized without it (LayerNorm does not
commute with a rotation). Every graph is made by the code `normswap export --quantize` runs.

Speed (``--part speed``). A GPT-2-small-shaped model (12 × 768, 50,257 tokens, random init: the
arithmetic is what is timed) as generation graphs (export's default: key/value cache in and out,
onnx_generate.py) in onnxruntime on CPU, ``--threads`` intra-op threads (1 by default), timed by
normswap/timing.py's ``compare`` against the original's float32 graph, the null control being that
graph loaded a second time in a session of its own. Two kinds, each its own comparison: ``prefill``
(batch 1 × ``--prefill-tokens`` from an empty cache) and ``decode`` (batch 1, one token on a cache of
``--past-tokens`` made by one untimed prefill; every call repeats that step through OnnxGenerator's
own feed, so the past length is fixed). A ``--graphs`` folder holding a graph without the cache is
refused. The original's int8 graph is its float32 graph quantized (LayerNorm takes no rotation); the
conversion's and the sliced model's int8 graphs are traced turned by the incoherence rotation first,
as ``export --quantize int8`` makes them.

Quality (``--part quality``). For each model (default: the shipped kjv-gpt2 and kjv-neox): held-out
perplexity of every variant in onnxruntime on the embedded corpus's test split (128-token windows,
stride 64: the figure `eval ppl` and docs/models.md quote), and each int8 graph's agreement with its
own float32 graph: the share of positions of those windows whose greedy (argmax) next token is the
same. A fourth model, ``planted outlier``: the conversion with its stream turned (exactly: an
orthogonal map, checked) so that one coordinate carries the stream's loudest direction; the share of
energy each variant's loudest coordinate carries is reported beside it.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from normswap.errors import NormswapError
from normswap.publish import atomic_write_json, check_output_file

GPT2_SMALL = {"layers": 12, "width": 768, "heads": 12, "vocab": 50257}
SPEED_GRAPHS = ("original", "original int8", "conversion", "conversion int8", "sliced", "sliced int8")
NULL = "null control"
EVAL_SEQ_LEN, EVAL_STRIDE = 128, 64
EXACT_TOLERANCE = 1e-4  # a rotated float32 graph against its unrotated one (export's tolerance)


class GraphModel:
    """An onnxruntime session answering ``model(input_ids=...)`` as the perplexity code asks, keeping
    each call's greedy tokens so that two graphs scored on the same windows can be compared."""

    def __init__(self, path, config, threads: int):
        from normswap.export.onnx import session

        self.path, self.config = Path(path), config
        self.session = session(self.path, threads=threads)
        self.greedy: list = []

    def __call__(self, input_ids=None, use_cache=False, **unused):
        from normswap.export.onnx import run_session

        logits = run_session(self.session, input_ids)
        self.greedy.append(logits.argmax(-1).flatten())
        return SimpleNamespace(logits=logits)

    def parameters(self):
        return iter(())


def write_graph(
    model, directory: Path, *, quantize: bool, rotate: bool, seed: int = 0, with_past: bool = False
) -> dict:
    """The graph `export --format onnx [--quantize int8]` would write for ``model`` (in memory), into
    ``directory``/model.onnx (``with_past``: the generation graph with its key/value cache, export's
    default, else the forward alone); a rotated graph is checked against the model first (exactness)."""
    import torch

    from normswap.export.onnx import export_graph, run_session, session
    from normswap.export.onnx_generate import export_graph_with_cache
    from normswap.slice.incoherence import incoherence_rotate

    directory.mkdir(parents=True, exist_ok=True)
    final = directory / "model.onnx"
    traced = incoherence_rotate(model, seed).eval() if rotate else model
    fp32 = directory / "float32.onnx" if quantize else final
    (export_graph_with_cache if with_past else export_graph)(traced, fp32)
    record: dict = {"rotated": rotate, "with_past": with_past}
    if rotate:
        ids = torch.randint(0, int(model.config.vocab_size), (2, 32), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = model(input_ids=ids, use_cache=False).logits.double().log_softmax(-1)
        got = run_session(session(fp32, threads=1), ids).double().log_softmax(-1)
        record["rotation_max_abs_logprob_diff"] = diff = float((ref - got).abs().max())
        if not diff <= EXACT_TOLERANCE:
            raise NormswapError(f"internal error: the incoherence rotation moved the float32 graph by {diff:.3g}")
    if quantize:
        from normswap.export.int8 import quantize_graph

        record["quantization"] = quantize_graph(fp32, final)
        fp32.unlink()
    return record


# -- speed --------------------------------------------------------------------------------------


def require_generation_graphs(dirs: dict) -> None:
    """One line for a graph already in a --graphs folder that is not a generation graph (no key/value
    cache): decode is timed on the cache, and a forward-only graph left by an older run would time the
    recomputing forward under decode's name."""
    from normswap.export.onnx_generate import is_generation_ready

    for name, d in dirs.items():
        graph = Path(d) / "model.onnx"
        if graph.is_file():
            ready, why = is_generation_ready(graph)
            if not ready:
                raise NormswapError(
                    f"--graphs: the {name} graph {graph} is not a generation graph ({why}); bench serve times "
                    "decode on the key/value cache: give it an empty folder to build the graphs in"
                )


def build_speed_graphs(root: Path, *, fraction: float, seed: int, say, names=SPEED_GRAPHS) -> dict:
    """{graph name: directory}: the generation graphs (key/value cache) ``names`` of SPEED_GRAPHS (the
    original's float32 graph always: the baseline) of a GPT-2-small shape, written under ``root``, each
    recorded in graphs.json once whole (reused by a later run: building them is minutes, timing them is not)."""
    from normswap.benchmarks.slicing import gpt2_shaped, random_batches
    from normswap.convert import convert_model
    from normswap.export.int8 import quantize_graph
    from normswap.slice import slice_model

    names = ["original", *(n for n in SPEED_GRAPHS if n in names and n != "original")]
    dirs = {name: root / name.replace(" ", "-") for name in names}
    require_generation_graphs(dirs)
    done = root / "graphs.json"
    records = json.loads(done.read_text()) if done.is_file() else {}
    missing = [n for n in names if n not in records]
    if missing:
        say(f"building a GPT-2 of {GPT2_SMALL} (random init) for {', '.join(missing)}")
        models = {"original": gpt2_shaped(**GPT2_SMALL, seed=seed)}
        if any(not n.startswith("original") for n in missing):
            conversion = copy.deepcopy(models["original"])
            convert_model(conversion, mode="exact")
            models["conversion"] = conversion
            if any(n.startswith("sliced") for n in missing):
                say(f"slicing {fraction:.0%}")
                batches = random_batches(GPT2_SMALL["vocab"], 1024, 128, seed)
                models["sliced"] = slice_model(conversion, batches, fraction).model.eval()
        root.mkdir(parents=True, exist_ok=True)
        for name in missing:
            base = name.removesuffix(" int8")
            say(f"exporting {name} (generation graph, key/value cache)")
            if name == "original int8":
                # LayerNorm does not commute with a rotation (no rotated trace to make): the float32 graph quantized
                dirs[name].mkdir(parents=True, exist_ok=True)
                records[name] = {"rotated": False, "with_past": True,
                                 "quantization": quantize_graph(dirs["original"] / "model.onnx",
                                                                dirs[name] / "model.onnx")}  # fmt: skip
            else:  # conversion/sliced int8: turned by the incoherence rotation first, as export --quantize does
                q = name != base
                records[name] = write_graph(models[base], dirs[name], quantize=q, rotate=q, seed=seed, with_past=True)
            done.write_text(json.dumps(records, indent=1, default=str))
        require_generation_graphs(dirs)
    else:
        say(f"reusing the graphs in {root}")
    for name in names:
        say(f"optimising {name} once for the timed sessions")
        optimised(dirs[name])
    return dirs


def _prompt(tokens: int, vocab: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab, (1, tokens)).astype("int64")


def _decode_call(sess, graph: Path, past_tokens: int, vocab: int):
    """One decode step at batch 1 on a key/value cache of ``past_tokens`` tokens, through OnnxGenerator's
    own feed (its prefill run once here, untimed): every call repeats the same step, so the past length
    stays fixed and the calls are alike. ``graph``: the file ``sess`` was made of (its signature checked)."""
    from normswap.export.onnx_generate import OnnxGenerator

    gen = OnnxGenerator(graph.parent, model_file=graph.name, session=sess)
    gen.prefill(_prompt(past_tokens, vocab))
    feed, names = gen.step_feed(_prompt(1, vocab)), gen.output_names
    return lambda: sess.run(names, feed)


def _prefill_call(sess, prefill_tokens: int, vocab: int):
    """The prompt's forward at batch 1 from an empty cache (the feed `export`'s validation runs)."""
    from normswap.export.onnx_generate import prefill_feed

    feed = prefill_feed(sess, _prompt(prefill_tokens, vocab))
    return lambda: sess.run(None, feed)


OPTIMISED = "model.optimised.onnx"


def optimised(directory: Path) -> Path:
    """The graph onnxruntime runs for ``directory``/model.onnx (all its optimisations, export/onnx.py's
    level), written beside it once: optimising a GPT-2-small graph is tens of seconds a session on a
    loaded host, which a timed run of seven sessions would otherwise spend before its first pair."""
    from normswap.export.onnx import session

    out = directory / OPTIMISED
    if not out.is_file():
        session(directory / "model.onnx", threads=1, optimized_path=out)
    return out


def _ready_session(path: Path, threads: int):
    """A session of an already optimised graph, optimisations off (they ran when it was written)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    opts.intra_op_num_threads, opts.inter_op_num_threads = int(threads), 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def measure_speed(
    dirs: dict,
    *,
    kind,
    threads,
    seq_len,
    past_tokens,
    budget,
    target,
    min_pairs,
    block_s,
    progress,
    sessions: int = 1,
    balanced: bool = False,
) -> dict:
    """One kind (prefill or decode) of every graph against the original's float32 graph, null control included."""
    from normswap import timing as instrument
    from normswap.evaluate.throughput import machine_load

    vocab = GPT2_SMALL["vocab"]
    paths = {name: optimised(d) for name, d in dirs.items()}
    paths[NULL] = paths["original"]

    def make(sess, path):
        if kind == "decode":
            return _decode_call(sess, path, past_tokens, vocab)
        return _prefill_call(sess, seq_len, vocab)

    # ``sessions`` sessions a graph (the null control's its own: the same graph loaded again), made
    # round-robin and rotated by the instrument: one session's memory placement is a steady bias of
    # 1-3 % (bench onnx's finding), which several a side average out
    fns: dict = {name: [] for name in paths}
    for _ in range(sessions):
        for name, path in paths.items():
            fns[name].append(make(_ready_session(path, threads), path))
    calls = instrument.calibrate_calls(fns["original"][0], block_s)
    before = machine_load()["load_average"]
    cmp = instrument.compare(
        fns, "original", NULL, calls_per_sample=calls, budget_s=budget, target_halfwidth=target,
        min_pairs=min_pairs, progress=progress, balanced=balanced,
    )  # fmt: skip
    tokens = 1 if kind == "decode" else seq_len
    return {
        "kind": kind,
        "decode_kind": f"one step on a key/value cache of {past_tokens} tokens (batch 1)" if kind == "decode" else None,
        "past_tokens": past_tokens if kind == "decode" else 0,
        "tokens_per_call": tokens,
        "sessions_per_graph": sessions,
        "balanced": balanced,
        "tokens_per_second": {n: tokens / s for n, s in cmp.seconds_per_call.items()},
        "over_original": {n: r.to_json() for n, r in cmp.candidates.items()},
        "null_control": cmp.null.to_json(),
        "load_before": before,
        "load_after": machine_load()["load_average"],
        "timing": cmp.to_json(samples=True),
    }


def speed_goals(speed: dict) -> dict:
    """The issue's goals off the lower ends (decode): sliced ≥ ×1.25, sliced int8 ≥ ×2.3; nulls within ±2 %."""
    goals = {}
    run = speed.get("decode")
    if run:
        for name, floor in (("sliced", 1.25), ("sliced int8", 2.3)):
            low = run["over_original"][name]["low"]
            goals[f"decode {name} low >= {floor}"] = {"low": low, "met": low >= floor}
    for kind, r in speed.items():
        n = r["null_control"]
        goals[f"{kind} null control inside ±2%"] = {
            "interval": [n["low"], n["high"]],
            "met": 0.98 <= n["low"] and n["high"] <= 1.02,
        }
    return goals


# -- quality ------------------------------------------------------------------------------------


def plant_outlier(conversion, batches):
    """The conversion with its stream turned so that coordinate 0 carries the stream's loudest
    direction (the top eigenvector of its second moments within u⊥) and the other coordinates stay
    close to where they were (a Householder reflection): an orthogonal map, so exact, folded into
    the weights by slice's rotation (k = d − 1, only the unused all-ones direction deleted)."""
    import torch

    from normswap.slice import basis as bases
    from normswap.slice.calibrate import collect_moments
    from normswap.slice.model import rotate_model
    from normswap.slice.stream import stream_map

    stream = stream_map(conversion)
    d = stream.hidden_size
    moments, _ = collect_moments(conversion, list(batches), list(stream.norms))
    top = bases.pca_basis(sum(moments.values()))[0][:, 0]
    b = bases.complement_of_ones(d)
    v = b.T @ top
    w = v.clone()
    w[0] -= 1.0
    h = torch.eye(d - 1, dtype=torch.float64)
    if float(w.norm()) > 1e-12:
        w /= w.norm()
        h -= 2.0 * torch.outer(w, w)
    q = torch.cat([b @ h, bases.ones_direction(d)], dim=1)
    return rotate_model(conversion, stream, q, d - 1, fraction=0.0, basis="random").eval()


def _perplexity(graph: GraphModel, tokenizer, text: str) -> float:
    from normswap.evaluate.perplexity import perplexity

    # one window a call: the exported GPT-NeoX graph's RotaryEmbedding node (torch's exporter, onnxruntime
    # 1.23) takes a cos/sin cache of batch 1 and refuses a batch of 8 windows ("expected to have the same
    # shape as input 'x', got 1 and 128"); the windows and their scores are the same either way
    return float(perplexity(graph, tokenizer, text, seq_len=EVAL_SEQ_LEN, stride=EVAL_STRIDE, batch_size=1).perplexity)


def _agreement(a: GraphModel, b: GraphModel) -> float:
    import torch

    x, y = torch.cat(a.greedy), torch.cat(b.greedy)
    return float((x == y).double().mean())


def quality_of(spec: str, *, fraction, calibration_tokens, seed, eval_tokens, threads, scratch: Path, say) -> dict:
    """One model's rows: perplexity of every variant, float32 and int8 (with and without the rotation)."""
    from normswap.checkpoint import load as ckload
    from normswap.convert import convert_model
    from normswap.data import load_text
    from normswap.evaluate.perplexity import truncate_text
    from normswap.slice import calibration_batches, slice_model
    from normswap.slice.calibrate import block_length
    from normswap.slice.incoherence import coordinate_energy

    resolved = ckload.resolve(spec)
    original = ckload.load_model(resolved, task="causal-lm").float().eval()
    tokenizer = ckload.load_tokenizer(resolved)
    text, _ = truncate_text(load_text("embedded", "test"), tokenizer, eval_tokens or None)
    conversion = copy.deepcopy(original)
    convert_model(conversion, mode="exact")
    batches = calibration_batches(tokenizer, "embedded", calibration_tokens, block_length(original.config), seed=seed)
    sliced = slice_model(conversion, batches, fraction, seed=seed).model.eval()
    planted = plant_outlier(conversion, batches)
    row: dict = {"model": spec, "fraction": fraction, "eval": {"split": "test", "seq_len": EVAL_SEQ_LEN,
                 "stride": EVAL_STRIDE, "max_tokens": eval_tokens}, "variants": {}}  # fmt: skip
    for name, model in (("original", original), ("conversion", conversion), ("sliced", sliced),
                        ("planted outlier", planted)):  # fmt: skip
        say(f"{spec}: {name}")
        rotatable = name != "original"
        entry: dict = {}
        if rotatable:
            entry["loudest_coordinate"] = coordinate_energy(model, batches[:2])
        base = scratch / spec.replace(":", "-").replace("/", "-") / name.replace(" ", "-")
        arms = [("float32", False, False), ("int8", True, False)]
        arms += [("int8 rotated", True, True)] if rotatable else []
        graphs = {}
        for arm, q, rot in arms:
            if arm == "int8":  # the float32 graph just written, quantized: the same trace, no second one
                from normswap.export.int8 import quantize_graph

                (base / "int8").mkdir(parents=True, exist_ok=True)
                record = {"quantization": quantize_graph(base / "float32" / "model.onnx", base / "int8" / "model.onnx")}
            else:
                record = write_graph(model, base / arm.replace(" ", "-"), quantize=q, rotate=rot, seed=seed)
            graphs[arm] = GraphModel(base / arm.replace(" ", "-") / "model.onnx", model.config, threads)
            entry[arm] = {"perplexity": _perplexity(graphs[arm], tokenizer, text)}
            if q:
                entry[arm]["greedy_agreement_with_float32"] = _agreement(graphs[arm], graphs["float32"])
                entry[arm]["loss_vs_float32"] = entry[arm]["perplexity"] / entry["float32"]["perplexity"] - 1
                entry[arm]["matmuls_quantized"] = record["quantization"]["matmuls_quantized"]
            if rot:
                entry[arm]["rotation_max_abs_logprob_diff"] = record["rotation_max_abs_logprob_diff"]
        row["variants"][name] = entry
    return row


def quality_goals(rows: list[dict]) -> dict:
    goals = {}
    for row in rows:
        m = row["model"]
        for name, e in row["variants"].items():
            rot, plain = e.get("int8 rotated"), e["int8"]
            if name in ("conversion", "sliced") and rot:
                goals[f"{m} {name}: int8 rotated loses <= 1%"] = {"loss": rot["loss_vs_float32"],
                                                                  "met": rot["loss_vs_float32"] <= 0.01}  # fmt: skip
                goals[f"{m} {name}: rotated no worse than without"] = {
                    "rotated": rot["loss_vs_float32"], "unrotated": plain["loss_vs_float32"],
                    "met": rot["loss_vs_float32"] <= plain["loss_vs_float32"],
                }  # fmt: skip
            if name == "planted outlier":
                goals[f"{m} planted outlier: unrotated loses clearly more"] = {
                    "rotated": rot["loss_vs_float32"], "unrotated": plain["loss_vs_float32"],
                    "met": plain["loss_vs_float32"] > 2 * max(rot["loss_vs_float32"], 0.0) + 0.005,
                }  # fmt: skip
            for arm in ("int8", "int8 rotated"):
                if arm in e:
                    a = e[arm]["greedy_agreement_with_float32"]
                    goals[f"{m} {name} {arm}: greedy agreement >= 90%"] = {"agreement": a, "met": a >= 0.9}
    return goals


# -- output -------------------------------------------------------------------------------------


def result_lines(result: dict) -> list[str]:
    lines = []
    for kind, r in result.get("speed", {}).items():
        t = r["timing"]
        lines.append(
            f"{kind} ({r['tokens_per_call']} token(s) a call, {result['threads']} thread(s)): {t['rounds']} rounds, "
            f"stopped: {t['stop_reason']} after {t['elapsed_s']:.0f} s; load {r['load_before']} -> {r['load_after']}"
        )
        for name, tps in r["tokens_per_second"].items():
            c = r["over_original"].get(name) if name != "original" else None
            ratio = f"  x{c['ratio']:.3f} [{c['low']:.3f}-{c['high']:.3f}] ({c['verdict']})" if c else ""
            if name == NULL:
                n = r["null_control"]
                ratio = f"  x{n['ratio']:.3f} [{n['low']:.3f}-{n['high']:.3f}] ({n['verdict']})"
            lines.append(f"  {name:<16} {tps:9.1f} tokens/s{ratio}")
    for row in result.get("quality", []):
        lines.append(f"{row['model']}: held-out perplexity (test split, {EVAL_SEQ_LEN}/{EVAL_STRIDE} windows)")
        for name, e in row["variants"].items():
            cells = [f"float32 {e['float32']['perplexity']:.3f}"]
            for arm in ("int8", "int8 rotated"):
                if arm in e:
                    a = e[arm]
                    cells.append(
                        f"{arm} {a['perplexity']:.3f} ({a['loss_vs_float32']:+.2%}, greedy agree "
                        f"{a['greedy_agreement_with_float32']:.1%})"
                    )
            loud = e.get("loudest_coordinate")
            extra = f"; loudest coordinate x{loud['max_over_mean']:.1f} the mean" if loud else ""
            lines.append(f"  {name:<16} " + "; ".join(cells) + extra)
    for goal, g in result.get("goals", {}).items():
        detail = {k: v for k, v in g.items() if k != "met"}
        lines.append(f"goal {goal}: {'met' if g['met'] else 'NOT met'} {json.dumps(detail, default=float)}")
    return lines


def run_serve(
    *, part, threads, seq_len, budget, target, min_pairs, block_s, fraction, seed, models, calibration_tokens,
    eval_tokens, past_tokens=128, graphs_dir, kinds, save, as_json, say, echo, sessions=1, only=None, balanced=False,
) -> dict:  # fmt: skip
    """What `normswap bench serve` runs (its options by name)."""
    import onnxruntime
    import torch

    from normswap.evaluate.throughput import machine_load
    from normswap.export.onnx import require_packages

    require_packages()
    if save:
        check_output_file(save, force=True, reads=[("the model", m) for m in models], label="--save")
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    result: dict = {"threads": threads, "seed": seed, "fraction": fraction, "machine_before": machine_load(),
                    "onnxruntime": onnxruntime.__version__, "torch": torch.__version__}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="normswap-bench-serve-") as tmp:
        if part in ("speed", "both"):
            root = Path(graphs_dir) if graphs_dir else Path(tmp) / "speed"
            # fewer graphs a run (--only): only those built, and balanced rounds (every pair) stay affordable
            dirs = build_speed_graphs(root, fraction=fraction, seed=seed, say=say, names=only or SPEED_GRAPHS)
            graphs_json = root / "graphs.json"
            result["speed_graphs"] = json.loads(graphs_json.read_text()) if graphs_json.is_file() else None
            result["speed_settings"] = {"shape": GPT2_SMALL, "prefill_tokens": seq_len, "past_tokens": past_tokens,
                                        "budget": budget, "target": target}  # fmt: skip
            result["speed"] = {}
            for kind in kinds:
                say(f"timing {kind}")
                result["speed"][kind] = measure_speed(
                    dirs, kind=kind, threads=threads, seq_len=seq_len, past_tokens=past_tokens, budget=budget,
                    target=target, min_pairs=min_pairs, block_s=block_s, progress=say, sessions=sessions,
                    balanced=balanced,
                )  # fmt: skip
            result["goals"] = speed_goals(result["speed"])
        if part in ("quality", "both"):
            from normswap.benchmarks.decode import shipped

            result["quality"] = [
                quality_of(m, fraction=fraction, calibration_tokens=calibration_tokens, seed=seed,
                           eval_tokens=eval_tokens, threads=threads, scratch=Path(tmp) / "quality", say=say)
                for m in (models or shipped())
            ]  # fmt: skip
            result.setdefault("goals", {}).update(quality_goals(result["quality"]))
    result["machine_after"] = machine_load()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if save:
        atomic_write_json(Path(save), result, indent=1)
    if as_json:
        echo(json.dumps(result, default=float))
    else:
        for line in result_lines(result):
            echo(line)
    return result
