"""`normswap bench convert`: how fast and how lean is conversion, next to copying the files.

Builds a synthetic sharded checkpoint of a supported family at a requested parameter count
(random weights, the real layout: a config shape like the family's released sizes, the key names
stock transformers writes, a safetensors index), without ever holding the model in memory: each
tensor is generated from the meta-device skeleton's shapes and written in place. Then it runs,
each as its own process so that its peak RSS is its own (``os.wait4`` reports the child's
``ru_maxrss``):

- ``cp -r`` of the checkpoint (the floor: read + write every byte once),
- ``normswap convert --streaming --no-verify``,
- ``normswap convert --no-streaming --no-verify`` where the model fits comfortably in memory,

and checks the two conversions wrote bitwise-equal tensors. Goals (issue 7): streaming time at
most 2x the copy, streaming peak RSS at most 2x the largest shard.
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

import torch

from normswap.convert.apply import count_parameters
from normswap.errors import NormswapError

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
FAMILIES = ("gpt_neox", "gpt2", "opt", "bloom", "falcon")
_HIDDEN_LADDER = (256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)
GOAL_TIME_VS_COPY = 2.0
GOAL_RSS_VS_SHARD = 2.0


# -- a config of the requested size ------------------------------------------------------------

def family_config(family: str, hidden: int, layers: int, vocab: int | None = None):
    """A config shaped like the family's released checkpoints (heads of 64, MLP 4x)."""
    import transformers as T

    heads = max(1, hidden // 64)
    if family == "gpt_neox":
        cfg = T.GPTNeoXConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                              intermediate_size=4 * hidden, vocab_size=vocab or 50304, max_position_embeddings=2048,
                              tie_word_embeddings=False)
        arch = "GPTNeoXForCausalLM"
    elif family == "gpt2":
        cfg = T.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab or 50257, n_positions=1024)
        arch = "GPT2LMHeadModel"
    elif family == "opt":
        cfg = T.OPTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, ffn_dim=4 * hidden,
                          word_embed_proj_dim=hidden, vocab_size=vocab or 50272, max_position_embeddings=2048,
                          do_layer_norm_before=True)
        arch = "OPTForCausalLM"
    elif family == "bloom":
        cfg = T.BloomConfig(hidden_size=hidden, n_layer=layers, n_head=heads, vocab_size=vocab or 250880)
        arch = "BloomForCausalLM"
    elif family == "falcon":
        cfg = T.FalconConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                             vocab_size=vocab or 65024, parallel_attn=True, multi_query=True, bias=False)
        arch = "FalconForCausalLM"
    else:
        raise NormswapError(f"bench convert builds {', '.join(FAMILIES)}; got --family {family}")
    cfg.architectures = [arch]
    return cfg


def _meta(config, dtype=torch.float32):
    import transformers

    cls = getattr(transformers, config.architectures[0])
    with torch.device("meta"):
        return cls._from_config(config, dtype=dtype)


def config_for_params(family: str, params: float, vocab: int | None = None):
    """The (hidden, layers) closest to the family's usual depth/width (layers ~ hidden/64)."""
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


def synthetic_checkpoint(directory, *, family="gpt_neox", params=1.4e9, shards=4, dtype="bf16", seed=0,
                         config=None, progress=None) -> dict:
    """Write a random-weight checkpoint of about ``params`` parameters in ``shards`` files."""
    from normswap.checkpoint.shards import ShardWriter, default_metadata
    from normswap.convert.streaming import tie_groups

    say = progress or (lambda m: None)
    torch_dtype = DTYPES.get(str(dtype))
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
    files = ["model.safetensors"] if len(buckets) == 1 else [
        f"model-{i:05d}-of-{len(buckets):05d}.safetensors" for i in range(1, len(buckets) + 1)]
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
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(directory)
    return {
        "family": family, "parameters": n_params, "dtype": str(torch_dtype).replace("torch.", ""),
        "hidden_size": getattr(config, "hidden_size", None) or getattr(config, "n_embd", None),
        "layers": getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None),
        "vocab_size": config.vocab_size, "files": len(files), "bytes": total,
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
        proc = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, str(report), *map(str, cmd)], stdout=out, stderr=err,
                              env=env, cwd=cwd)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        if not report.is_file():
            raise NormswapError(f"bench: could not run {cmd[0]} (launcher exit {proc.returncode}): {stderr.strip()[-300:]}")
        rep = json.loads(report.read_text())
    return {
        "seconds": round(rep["seconds"], 3),
        "peak_rss_bytes": int(rep["maxrss_kb"]) * 1024,  # kilobytes on Linux
        "returncode": rep["status"],
        "stdout": stdout,
        "stderr_tail": stderr.strip().splitlines()[-3:],
    }


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def outputs_equal(a: Path, b: Path) -> bool:
    """Same weight files, same keys, dtypes and bits in each."""
    from safetensors import safe_open

    fa = sorted(p.name for p in Path(a).glob("*.safetensors"))
    fb = sorted(p.name for p in Path(b).glob("*.safetensors"))
    if fa != fb:
        return False
    for name in fa:
        with safe_open(str(Path(a) / name), "pt") as x, safe_open(str(Path(b) / name), "pt") as y:
            if sorted(x.keys()) != sorted(y.keys()):
                return False
            for k in x.keys():
                s, t = x.get_tensor(k), y.get_tensor(k)
                if s.dtype != t.dtype or s.shape != t.shape or not torch.equal(s.view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)):
                    return False
    return True


def _normswap_cmd(*args):
    return [sys.executable, "-m", "normswap", *map(str, args)]


def bench_convert(*, params=1.4e9, shards=4, dtype="bf16", family="gpt_neox", mode="auto", workdir=None, keep=False,
                  in_memory="auto", progress=None) -> dict:
    """Build the synthetic checkpoint, then time cp / streaming / in-memory as separate processes."""
    import psutil

    say = progress or (lambda m: None)
    load_at_start = round(os.getloadavg()[0], 2)
    root = Path(tempfile.mkdtemp(prefix="normswap-bench-convert-", dir=workdir))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    try:
        src = root / "src"
        t0 = time.perf_counter()
        info = synthetic_checkpoint(src, family=family, params=params, shards=shards, dtype=dtype, progress=say)
        info["build_seconds"] = round(time.perf_counter() - t0, 1)
        shard = info["largest_shard_bytes"]
        say(f"checkpoint: {info['parameters'] / 1e9:.2f}B parameters, {info['bytes'] / 1e9:.2f} GB in {info['files']} file(s)")

        rows = {}
        say("baseline: python + torch + transformers + normswap imports")
        rows["baseline"] = run_measured([sys.executable, "-c", "import sys, torch, transformers, normswap.convert.streaming, "
                                         "normswap.cli.convert\nfrom normswap.checkpoint.load import load_config\n"
                                         "from normswap.convert.pipeline import meta_model\nmeta_model(load_config(sys.argv[1]))",
                                         str(src)], env=env)
        say("copy: cp -r")
        rows["copy"] = run_measured(["cp", "-r", str(src), str(root / "copy")])
        shutil.rmtree(root / "copy", ignore_errors=True)
        convert_args = ["--mode", mode, "--no-verify", "--json", "--max-shard-size", str(shard)]
        say("streaming conversion")
        rows["streaming"] = run_measured(_normswap_cmd("convert", src, root / "out_streaming", "--streaming", *convert_args), env=env)
        avail = psutil.virtual_memory().available
        # in memory: the loaded model, the new state dict, float64 temporaries of the largest tensor
        need = 2.5 * info["bytes"] + rows["baseline"]["peak_rss_bytes"]
        run_mem = in_memory is True or (in_memory == "auto" and need < 0.5 * avail)
        if run_mem:
            say("in-memory conversion")
            rows["in_memory"] = run_measured(_normswap_cmd("convert", src, root / "out_memory", "--no-streaming", *convert_args), env=env)
        else:
            rows["in_memory"] = {"skipped": True, "reason": f"needs ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available"}
        equal = None
        if rows["streaming"]["returncode"] == 0 and rows["in_memory"].get("returncode") == 0:
            say("comparing the two outputs tensor by tensor")
            equal = outputs_equal(root / "out_streaming", root / "out_memory")
        for name, row in rows.items():
            if row.get("stdout", "").strip().startswith("{"):
                row["convert_seconds"] = json.loads(row["stdout"]).get("seconds")  # excludes start-up and imports
            if row.get("returncode") not in (None, 0):
                raise NormswapError(f"bench convert: the {name} step failed (exit {row['returncode']}): {' | '.join(row['stderr_tail'])}")
        base = rows["baseline"]["peak_rss_bytes"]
        copy_s = rows["copy"]["seconds"]
        stream = rows["streaming"]
        result = {
            "benchmark": "convert",
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {**machine(), "load_average_1m_at_start": load_at_start},
            "checkpoint": info,
            "mode": json.loads(stream["stdout"]).get("mode") if stream["stdout"].strip().startswith("{") else mode,
            "steps": {k: {kk: vv for kk, vv in v.items() if kk not in ("stdout", "stderr_tail")} for k, v in rows.items()},
            "outputs_bitwise_equal": equal,
            "streaming_vs_copy_time": round(stream["seconds"] / copy_s, 2) if copy_s else None,
            "streaming_peak_rss_vs_largest_shard": round(stream["peak_rss_bytes"] / shard, 2),
            "streaming_rss_growth_vs_largest_shard": round((stream["peak_rss_bytes"] - base) / shard, 2),
            "goals": {
                "time_le_2x_copy": bool(copy_s and stream["seconds"] <= GOAL_TIME_VS_COPY * copy_s),
                "peak_rss_le_2x_largest_shard": bool(stream["peak_rss_bytes"] <= GOAL_RSS_VS_SHARD * shard),
            },
            "notes": [
                "each step is a separate process; peak RSS is that process's ru_maxrss (wait4)",
                "baseline = peak RSS of a process that only imports torch, transformers, normswap and the model's "
                "modeling code (builds the meta-device skeleton)",
                "the source files were just written and read by cp, so reads come from the page cache",
                "conversions run with --no-verify (verification reloads the model in float32)",
                "wall seconds include process start-up and imports (see baseline); in-process seconds are convert's own",
            ],
        }
        if keep:
            result["workdir"] = str(root)
        return result
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def machine() -> dict:
    import psutil

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2), "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
    }


def _gb(n):
    return f"{n / 1e9:.2f} GB"


def markdown(result: dict) -> str:
    info, steps = result["checkpoint"], result["steps"]
    copy_s = steps["copy"]["seconds"]
    lines = [
        f"# normswap bench convert — {info['family']}, {info['parameters'] / 1e9:.2f}B parameters, {info['dtype']}",
        "",
        f"{result['date']} · {result['machine']['cpu']} · {result['machine']['cores']} cores · "
        f"{result['machine']['memory_gb']} GiB RAM · torch {result['machine']['torch']} · load average "
        f"{result['machine']['load_average_1m_at_start']} at start, {result['machine']['load_average_1m']} at end (shared machine)",
        "",
        f"Checkpoint: hidden {info['hidden_size']}, {info['layers']} layers, vocab {info['vocab_size']}; "
        f"{_gb(info['bytes'])} in {info['files']} safetensors files, largest shard {_gb(info['largest_shard_bytes'])}. "
        f"Mode: {result['mode']}.",
        "",
        "| step | wall seconds | × copy | in-process seconds | peak RSS | peak RSS − baseline | peak RSS × largest shard |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = steps["baseline"]["peak_rss_bytes"]
    labels = {"copy": "copy (`cp -r`)", "streaming": "streaming convert", "in_memory": "in-memory convert",
              "baseline": "baseline (imports + meta skeleton)"}
    for key in ("copy", "streaming", "in_memory", "baseline"):
        row = steps[key]
        if row.get("skipped"):
            lines.append(f"| {labels[key]} | skipped: {row['reason']} | | | | | |")
            continue
        rss = row["peak_rss_bytes"]
        growth = _gb(rss - base) if key in ("streaming", "in_memory") else ""
        inproc = f"{row['convert_seconds']:.1f}" if row.get("convert_seconds") is not None else ""
        lines.append(f"| {labels[key]} | {row['seconds']:.1f} | {row['seconds'] / copy_s:.2f} | {inproc} | {_gb(rss)} | {growth} | "
                     f"{rss / info['largest_shard_bytes']:.2f} |")
    g = result["goals"]
    lines += [
        "",
        f"Goals: streaming time ≤ 2× copy: **{'met' if g['time_le_2x_copy'] else 'not met'}** "
        f"({result['streaming_vs_copy_time']}×); streaming peak RSS ≤ 2× largest shard: "
        f"**{'met' if g['peak_rss_le_2x_largest_shard'] else 'not met'}** ({result['streaming_peak_rss_vs_largest_shard']}×).",
        f"Streaming and in-memory outputs bitwise equal: {result['outputs_bitwise_equal']}.",
        "",
    ]
    lines += [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"
