"""`normswap bench convert`: conversion next to copying the files.

Builds a synthetic sharded checkpoint of a supported family at a requested parameter count
(random weights, the real layout: a config shaped like the family's released sizes from the
FAMILIES table below, the key names stock transformers writes, a safetensors index), without
ever holding the model in memory: each tensor is generated from the meta-device skeleton's
shapes and written in place. Then, in rounds, each step as its own process so that its peak RSS
is its own (``os.wait4`` reports the child's ``ru_maxrss``):

- ``cp -r`` of the checkpoint (the floor: read + write every byte once),
- ``normswap convert --no-verify``,
- ``normswap convert`` with its defaults (verification on),

with the three interleaved in every round, so that the machine's load hits them alike. The page
cache is warm for every step: before each step the source files are read once (``cat`` to
/dev/null), so every step reads from memory and writes into the page cache (written pages are
flushed by the kernel in the background, for cp as for convert). Goals: --no-verify
≤ 2x the copy's wall time, peak RSS ≤ 2x the largest shard; verified ≤ 4x the copy, peak RSS ≤
2.5x the largest shard.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from normswap.errors import NormswapError

# torch and normswap's conversion modules are imported where used: `--help` stays instant
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}
_HIDDEN_LADDER = (256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)
GOALS = {  # step: (wall time ≤ x copy, peak RSS ≤ x largest shard)
    "convert_no_verify": (2.0, 2.0),
    "convert_verified": (4.0, 2.5),
}

# Each family's config at a given width and depth, shaped like its released checkpoints (heads of
# 64, MLP 4x): the config class, the architecture, which config fields carry the sizes, and fixed
# settings. ``None`` for a size field: the family has no such field.
FAMILIES = {
    "gpt_neox": {
        "config": "GPTNeoXConfig",
        "arch": "GPTNeoXForCausalLM",
        "vocab": 50304,
        "fields": {
            "hidden": "hidden_size",
            "layers": "num_hidden_layers",
            "heads": "num_attention_heads",
            "ffn": "intermediate_size",
        },
        "fixed": {"max_position_embeddings": 2048, "tie_word_embeddings": False},
    },
    "gpt2": {
        "config": "GPT2Config",
        "arch": "GPT2LMHeadModel",
        "vocab": 50257,
        "fields": {"hidden": "n_embd", "layers": "n_layer", "heads": "n_head", "ffn": None},
        "fixed": {"n_positions": 1024},
    },
    "opt": {
        "config": "OPTConfig",
        "arch": "OPTForCausalLM",
        "vocab": 50272,
        "fields": {
            "hidden": "hidden_size",
            "layers": "num_hidden_layers",
            "heads": "num_attention_heads",
            "ffn": "ffn_dim",
            "embed_proj": "word_embed_proj_dim",
        },
        "fixed": {"max_position_embeddings": 2048, "do_layer_norm_before": True},
    },
    "bloom": {
        "config": "BloomConfig",
        "arch": "BloomForCausalLM",
        "vocab": 250880,
        "fields": {"hidden": "hidden_size", "layers": "n_layer", "heads": "n_head", "ffn": None},
        "fixed": {},
    },
    "falcon": {
        "config": "FalconConfig",
        "arch": "FalconForCausalLM",
        "vocab": 65024,
        "fields": {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads", "ffn": None},
        "fixed": {"parallel_attn": True, "multi_query": True, "bias": False},
    },
}


# -- a config of the requested size ------------------------------------------------------------


def family_config(family: str, hidden: int, layers: int, vocab: int | None = None):
    """The FAMILIES entry at width ``hidden`` and depth ``layers``."""
    import transformers as T

    entry = FAMILIES.get(family)
    if entry is None:
        raise NormswapError(f"bench convert builds {', '.join(FAMILIES)}; got --family {family}")
    sizes = {"hidden": hidden, "layers": layers, "heads": max(1, hidden // 64), "ffn": 4 * hidden, "embed_proj": hidden}
    kwargs = {field: sizes[name] for name, field in entry["fields"].items() if field}
    cfg = getattr(T, entry["config"])(vocab_size=vocab or entry["vocab"], **kwargs, **entry["fixed"])
    cfg.architectures = [entry["arch"]]
    return cfg


def _meta(config, dtype=None):
    import torch
    import transformers

    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        return cls._from_config(config, dtype=dtype or torch.float32)


def config_for_params(family: str, params: float, vocab: int | None = None):
    """The (hidden, layers) closest to the family's usual depth/width (layers ~ hidden/64)."""
    from normswap.convert.execute import count_parameters

    best = None
    for hidden in _HIDDEN_LADDER:
        one = count_parameters(_meta(family_config(family, hidden, 1, vocab)))
        two = count_parameters(_meta(family_config(family, hidden, 2, vocab)))
        per, base = two - one, one - (two - one)
        layers = round((params - base) / per)
        if layers < 1:
            continue
        score = abs(math.log(layers / (hidden / 64)))
        if best is None or score < best[0]:
            best = (score, hidden, layers)
    if best is None:
        raise NormswapError(f"--params {params:.3g} is too small for {family} (its embeddings alone are larger)")
    return family_config(family, best[1], best[2], vocab)


# -- the synthetic checkpoint ------------------------------------------------------------------


def _disk_names(model, keys) -> dict:
    """Key names as stock transformers saves them (e.g. GPT-NeoX's lm_head is embed_out on disk)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {k: k for k in keys}
    sd = model.state_dict()
    out = {}
    for key in keys:
        try:
            renamed = list(revert_weight_conversion(model, {key: sd[key]}))
            out[key] = renamed[0] if len(renamed) == 1 else key
        except Exception:
            out[key] = key
    return out


def synthetic_checkpoint(
    directory, *, family="gpt_neox", params=1.4e9, shards=4, dtype="bf16", seed=0, config=None, progress=None
) -> dict:
    """Write a random-weight checkpoint of about ``params`` parameters in ``shards`` files."""
    import torch

    from normswap.checkpoint.shards import ShardWriter, default_metadata
    from normswap.convert.execute import count_parameters
    from normswap.convert.tensor_match import tie_groups

    say = progress or (lambda m: None)
    torch_dtype = getattr(torch, DTYPES[str(dtype)]) if str(dtype) in DTYPES else None
    if torch_dtype is None:
        raise NormswapError(f"--dtype must be one of {', '.join(DTYPES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = config if config is not None else config_for_params(family, params)
    config.dtype = torch_dtype
    model = _meta(config, torch_dtype)
    n_params = count_parameters(model)
    groups = tie_groups(model)
    sd = model.state_dict()
    keys = [k for k in sd if groups.get(k, [k])[0] == k]  # tied duplicates are not saved
    names = _disk_names(model, keys)
    specs = {names[k]: (torch_dtype, tuple(sd[k].shape)) for k in keys}
    sizes = {k: math.prod(s) * torch.empty((), dtype=d).element_size() for k, (d, s) in specs.items()}
    total = sum(sizes.values())
    per = total / max(1, shards)
    buckets: list[list[str]] = [[] for _ in range(max(1, shards))]
    offset = 0
    for k in specs:  # by position in the stream, so shards hold similar byte counts
        buckets[min(len(buckets) - 1, int((offset + sizes[k] / 2) // per))].append(k)
        offset += sizes[k]
    buckets = [b for b in buckets if b]
    files = (
        ["model.safetensors"]
        if len(buckets) == 1
        else [f"model-{i:05d}-of-{len(buckets):05d}.safetensors" for i in range(1, len(buckets) + 1)]
    )
    gen = torch.Generator().manual_seed(seed)
    piece = 8 * 2**20  # elements generated at a time
    for bucket, name in zip(buckets, files):
        say(f"generating {name} ({sum(sizes[k] for k in bucket) / 1e9:.2f} GB)")
        with ShardWriter(directory / name, {k: specs[k] for k in bucket}, default_metadata()) as w:
            for k in bucket:
                shape = specs[k][1]
                if len(shape) == 1:
                    t = torch.randn(shape, generator=gen)
                    t = 1 + 0.1 * t if k.endswith("weight") else 0.02 * t
                    w.write(k, t.to(torch_dtype))
                    continue
                row = math.prod(shape[1:])
                step = max(1, piece // row)
                for a in range(0, shape[0], step):
                    b = min(shape[0], a + step)
                    t = torch.randn((b - a, *shape[1:]), generator=gen).mul_(0.02).add_(0.001)
                    w.write(k, t.to(torch_dtype), row=a)
    if len(buckets) > 1:
        weight_map = {k: name for bucket, name in zip(buckets, files) for k in bucket}
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    config.save_pretrained(directory)
    return {
        "family": family,
        "parameters": n_params,
        "dtype": str(torch_dtype).replace("torch.", ""),
        "hidden_size": getattr(config, "hidden_size", None) or getattr(config, "n_embd", None),
        "layers": getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None),
        "vocab_size": config.vocab_size,
        "files": len(files),
        "bytes": total,
        "largest_shard_bytes": max(sum(sizes[k] for k in b) for b in buckets),
    }


# -- measuring a process ---------------------------------------------------------------------

# A launcher with nothing imported: a child's ru_maxrss keeps the high-water mark of the
# process it was forked from (Linux carries it across exec), so measuring from this Python
# (torch already imported) would add our own RSS to every figure, even to `cp`'s.
_LAUNCHER = """
import json, os, sys, time
t0 = time.perf_counter()
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
seconds = time.perf_counter() - t0
with open(sys.argv[1], "w") as f:
    json.dump({"seconds": seconds, "maxrss_kb": usage.ru_maxrss, "status": os.waitstatus_to_exitcode(status)}, f)
"""


def run_measured(cmd, *, env=None, cwd=None) -> dict:
    """Wall time and peak RSS of one child process (its own ru_maxrss, via wait4 in a bare launcher)."""
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        report = Path(tmp) / "report.json"
        proc = subprocess.run(
            [sys.executable, "-S", "-c", _LAUNCHER, str(report), *map(str, cmd)],
            stdout=out,
            stderr=err,
            env=env,
            cwd=cwd,
        )
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        if not report.is_file():
            raise NormswapError(
                f"bench: could not run {cmd[0]} (launcher exit {proc.returncode}): {stderr.strip()[-300:]}"
            )
        rep = json.loads(report.read_text())
    return {
        "seconds": round(rep["seconds"], 3),
        "peak_rss_bytes": int(rep["maxrss_kb"]) * 1024,  # kilobytes on Linux
        "returncode": rep["status"],
        "stdout": stdout,
        "stderr_tail": stderr.strip().splitlines()[-3:],
    }


def _normswap_cmd(*args):
    return [sys.executable, "-m", "normswap", *map(str, args)]


def _warm(directory: Path) -> None:
    """Read every file once so that the step after reads from the page cache."""
    subprocess.run(["sh", "-c", 'cat "$0"/* > /dev/null', str(directory)], check=True)


STEPS = ("copy", "convert_no_verify", "convert_verified")


def bench_convert(
    *,
    params=1.4e9,
    shards=5,
    dtype="bf16",
    family="gpt_neox",
    mode="auto",
    rounds=2,
    workdir=None,
    keep=False,
    progress=None,
    command=None,
) -> dict:
    """Build the synthetic checkpoint, then time cp / convert --no-verify / convert, interleaved in rounds."""
    say = progress or (lambda m: None)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    if workdir is not None and not Path(workdir).is_dir():
        raise NormswapError(f"--workdir {workdir}: no such directory (the checkpoint goes in a new one inside it)")
    root = Path(tempfile.mkdtemp(prefix="normswap-bench-convert-", dir=workdir))
    # the RMSNorm's torch implementation: a first build of the compiled CPU kernel (about a minute)
    # would otherwise land in whichever step runs first; norms are a sliver of the probe's compute
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", NORMSWAP_KERNEL="torch")
    try:
        src = root / "src"
        t0 = time.perf_counter()
        info = synthetic_checkpoint(src, family=family, params=params, shards=shards, dtype=dtype, progress=say)
        info["build_seconds"] = round(time.perf_counter() - t0, 1)
        shard = info["largest_shard_bytes"]
        say(
            f"checkpoint: {info['parameters'] / 1e9:.2f}B parameters, "
            f"{info['bytes'] / 1e9:.2f} GB in {info['files']} file(s)"
        )

        say("baseline: python + torch + transformers + normswap imports and the meta skeleton")
        baseline = run_measured(
            [
                sys.executable,
                "-c",
                "import sys, normswap.cli.convert_command, normswap.convert.pipeline\n"
                "from normswap.checkpoint.load import load_config\nfrom normswap.convert.tensor_match import skeleton\n"
                "skeleton(load_config(sys.argv[1]))",
                str(src),
            ],
            env=env,
        )
        convert_args = ["--mode", mode, "--json", "--max-shard-size", str(shard)]
        commands = {
            "copy": lambda out: ["cp", "-r", str(src), str(out)],
            "convert_no_verify": lambda out: _normswap_cmd("convert", src, out, "--no-verify", *convert_args),
            "convert_verified": lambda out: _normswap_cmd("convert", src, out, *convert_args),
        }
        runs, loads = _timed_rounds(commands, src, root, rounds, env, say)
        summary = _summarise(runs, shard)
        verified = runs["convert_verified"][-1].get("verification") or {}
        return {
            "benchmark": "convert",
            "command": command,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {**machine(), "load_average_at_start": load_at_start, "load_average_1m_after_each_step": loads},
            "checkpoint": info,
            "mode": runs["convert_no_verify"][-1].get("mode", mode),
            "rounds": rounds,
            "baseline": {k: v for k, v in baseline.items() if k not in ("stdout", "stderr_tail")},
            "steps": summary,
            "runs": runs,
            "verification": verified,
            "page_cache": "warm for every step: the source files are read once (cat > /dev/null) right before "
            "each step; outputs go to the page cache and are flushed by the kernel in the background",
            "notes": [
                "each step is a separate process; peak RSS is that process's ru_maxrss (wait4), imports included",
                "baseline = a process that only imports normswap's convert modules (torch, transformers) and builds "
                "the meta-device skeleton: the part of every convert step's wall time and RSS that is not conversion",
                "steps are interleaved (copy, --no-verify, verified) in every round; medians over rounds "
                "(the upper one of two)",
                "NORMSWAP_KERNEL=torch for every step: no first build of the compiled CPU kernel inside a timed step",
                "wall seconds include process start-up and imports; in-process seconds are convert's own "
                "(in-process × copy: those seconds over the copy's wall seconds)",
                "verification runs the probe through the source and the written checkpoint in float32, module by "
                "module; for 16-bit outputs a third float32 pass (the converted weights before rounding) gives the "
                "rounding floor when the difference exceeds --tolerance; the float64 noise-floor pass runs only when "
                "the difference still exceeds the threshold",
            ],
            **({"workdir": str(root)} if keep else {}),
        }
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def _timed_rounds(commands, src, root, rounds, env, say):
    """Each step as its own process, interleaved (copy, --no-verify, verified) in every round, on a warm
    page cache; returns the runs per step and the load average after each."""
    runs: dict = {k: [] for k in STEPS}
    loads = []
    for r in range(rounds):
        for step in STEPS:
            out = root / f"out_{step}"
            _warm(src)
            say(f"round {r + 1}/{rounds}: {step}")
            row = run_measured(commands[step](out), env=env)
            loads.append(round(os.getloadavg()[0], 2))
            if row["returncode"] != 0:
                raise NormswapError(
                    f"bench convert: {step} failed (exit {row['returncode']}): {' | '.join(row['stderr_tail'])}"
                )
            if row["stdout"].strip().startswith("{"):
                summary = json.loads(row["stdout"])
                row["convert_seconds"] = summary.get("seconds")  # in-process: no start-up, no imports
                row["verification"] = summary.get("verification")
                row["mode"] = summary.get("mode")
            runs[step].append({k: v for k, v in row.items() if k not in ("stdout", "stderr_tail")})
            shutil.rmtree(out, ignore_errors=True)
    return runs, loads


def _summarise(runs, shard) -> dict:
    """Per step: medians over rounds, × the copy's time, peak RSS × the largest shard, the goals."""

    def median(step, field):
        values = sorted(x[field] for x in runs[step] if x.get(field) is not None)
        return values[len(values) // 2] if values else None

    copy_s = median("copy", "seconds")
    summary = {}
    for step in STEPS:
        row = {
            "seconds_median": median(step, "seconds"),
            "seconds_all": [x["seconds"] for x in runs[step]],
            "convert_seconds_median": median(step, "convert_seconds"),
            "peak_rss_bytes_max": max(x["peak_rss_bytes"] for x in runs[step]),
        }
        row["x_copy"] = round(row["seconds_median"] / copy_s, 2)
        row["peak_rss_x_largest_shard"] = round(row["peak_rss_bytes_max"] / shard, 2)
        if step in GOALS:
            t_goal, rss_goal = GOALS[step]
            row["goal_time_x_copy"], row["goal_rss_x_shard"] = t_goal, rss_goal
            row["time_goal_met"] = bool(row["x_copy"] <= t_goal)
            row["rss_goal_met"] = bool(row["peak_rss_x_largest_shard"] <= rss_goal)
        summary[step] = row
    return summary


def machine() -> dict:
    import psutil
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def _gb(n):
    return f"{n / 1e9:.2f} GB"


def markdown(result: dict) -> str:
    info, steps, m = result["checkpoint"], result["steps"], result["machine"]
    lines = [
        f"# normswap bench convert — {info['family']}, {info['parameters'] / 1e9:.2f}B parameters, {info['dtype']}",
        "",
        f"Command: `{result.get('command')}`",
        "",
        f"{result['date']} · {m['cpu']} · {m['cores']} cores · {m['memory_gb']} GiB RAM · torch {m['torch']} · "
        f"load average (1, 5, 15 min) {m['load_average_at_start']} at start; 1-min load after each step "
        f"{m['load_average_1m_after_each_step']} (shared machine)",
        "",
        f"Checkpoint: hidden {info['hidden_size']}, {info['layers']} layers, vocab {info['vocab_size']}; "
        f"{_gb(info['bytes'])} in {info['files']} safetensors files, largest shard {_gb(info['largest_shard_bytes'])}. "
        f"Mode: {result['mode']}. {result['rounds']} interleaved rounds; page cache: {result['page_cache']}.",
        "",
        "| step | wall s (median) | all rounds | × copy | in-process s | in-process × copy | peak RSS "
        "| × largest shard | goal |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    labels = {
        "copy": "copy (`cp -r`)",
        "convert_no_verify": "`normswap convert --no-verify`",
        "convert_verified": "`normswap convert` (verified)",
    }
    for key, row in steps.items():
        goal = ""
        if "goal_time_x_copy" in row:
            goal = (
                f"time ≤ {row['goal_time_x_copy']}×: **{'met' if row['time_goal_met'] else 'not met'}**; "
                f"RSS ≤ {row['goal_rss_x_shard']}×: **{'met' if row['rss_goal_met'] else 'not met'}**"
            )
        inproc = row.get("convert_seconds_median")
        inproc_x = f"{inproc / steps['copy']['seconds_median']:.2f}" if inproc is not None else ""
        inproc = f"{inproc:.1f}" if inproc is not None else ""
        lines.append(
            f"| {labels[key]} | {row['seconds_median']:.1f} | {', '.join(f'{x:.1f}' for x in row['seconds_all'])} | "
            f"{row['x_copy']:.2f} | {inproc} | {inproc_x} | {_gb(row['peak_rss_bytes_max'])} | "
            f"{row['peak_rss_x_largest_shard']:.2f} | {goal} |"
        )
    base = result["baseline"]
    lines.append(
        f"| baseline (imports + meta skeleton) | {base['seconds']:.1f} | | "
        f"{base['seconds'] / steps['copy']['seconds_median']:.2f} | | | "
        f"{_gb(base['peak_rss_bytes'])} | {base['peak_rss_bytes'] / info['largest_shard_bytes']:.2f} | |"
    )
    ver = result.get("verification") or {}
    if ver.get("max_abs_diff") is not None:
        lines += [
            "",
            f"Verification of the last verified run: {ver.get('probe_tokens')} probe tokens, max |Δ log-prob| "
            f"{ver['max_abs_diff']:.3g}, rounding floor {ver.get('rounding_floor')}, "
            f"noise floor {ver.get('noise_floor')} ({ver.get('noise_floor_note', 'measured')}), "
            f"threshold {ver.get('threshold'):.3g}, passed {ver.get('passed')}.",
        ]
    lines += [""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"
