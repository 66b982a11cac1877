"""The reference models shipped inside the package, addressed as `normswap:NAME`.

Each lives in `normswap/assets/models/NAME/` as an ordinary Hugging Face checkpoint (config.json,
model.safetensors, tokenizer files) plus `normswap_model.json`, written by
scripts/train_reference.py, which records how it was trained and its held-out perplexity.
(This module and the `models/` data directory share a name on purpose: a directory without
`__init__.py` never shadows a module, so `normswap.assets.models` is this file.)
"""

from __future__ import annotations

import json
from pathlib import Path

from normswap.errors import NormswapError

MODELS_DIR = Path(__file__).resolve().parent / "models"
METADATA_FILE = "normswap_model.json"


SPEC_PREFIX = "normswap:"  # normswap:NAME names a shipped model wherever a model is accepted


def _names() -> list[str]:
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def model_path(name: str) -> Path:
    """Directory of the shipped model `name` (a leading `normswap:` is accepted)."""
    name = str(name)
    name = name.removeprefix(SPEC_PREFIX)
    names = _names()
    if name not in names:
        available = ", ".join(names) if names else "none are installed"
        raise NormswapError(f"no shipped model named {name!r}; available: {available} (see `normswap models`)")
    return MODELS_DIR / name


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise NormswapError(f"{path} is not valid JSON ({e.msg}); reinstall normswap") from None


def describe(name: str) -> dict:
    """One shipped model's summary (the same dict list_models returns for it)."""
    path = model_path(name)
    config = _read_json(path / "config.json")
    meta = _read_json(path / METADATA_FILE)
    evaluation = meta.get("evaluation", {})
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return {
        "name": name.removeprefix("normswap:"),
        "spec": f"normswap:{name.removeprefix('normswap:')}",
        "path": str(path),
        "family": meta.get("family") or config.get("model_type"),
        "model_type": config.get("model_type"),
        "parameters": meta.get("parameters"),
        "perplexity": evaluation.get("validation", {}).get("perplexity"),
        "test_perplexity": evaluation.get("test", {}).get("perplexity"),
        "perplexity_method": evaluation.get("method"),
        "context_length": config.get("n_positions") or config.get("max_position_embeddings"),
        "vocab_size": config.get("vocab_size"),
        "layers": config.get("n_layer") or config.get("num_hidden_layers"),
        "hidden_size": config.get("n_embd") or config.get("hidden_size"),
        "size_bytes": size,
        "description": meta.get("description", ""),
    }


def list_models() -> list[dict]:
    """Every shipped model, sorted by name."""
    return [describe(n) for n in _names()]


# GPT-2 small's shape (12 layers, width 768, 12 heads, 1024 positions); the vocabulary is the shipped
# kjv-gpt2 tokenizer's (4096), so the model runs on the embedded corpus offline
GPT2_SMALL = dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024)
GPT2_TINY = dict(n_layer=2, n_embd=64, n_head=4, n_positions=128)


def write_gpt2_shaped(out, shape: dict | None = None, seed: int = 0) -> int:
    """Write a randomly initialised GPT-2 (``shape``: GPT2Config fields, default GPT-2 small) with the
    shipped kjv-gpt2 tokenizer into ``out`` (a fresh directory): a real checkpoint built from a
    config, no hub. Returns its parameter count."""
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=4096, bos_token_id=0, eos_token_id=0, pad_token_id=0, **(shape or GPT2_SMALL))
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODELS_DIR / "kjv-gpt2" / name, out / name)
    return sum(p.numel() for p in model.parameters())
