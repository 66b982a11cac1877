"""Resolve and load the models normswap accepts.

A model spec is one of: a local directory, a hub id (``EleutherAI/pythia-160m``, only when
online), or ``normswap:NAME`` for a model shipped inside the package. Converted checkpoints carry
their own modeling file, so they load through ``trust_remote_code=True`` like any remote-code
model; loading them without it fails loudly because their ``model_type`` is normswap's own.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from normswap.errors import NormswapError

SHIPPED_PREFIX = "normswap:"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def resolve(spec) -> str:
    """Return a local directory path or a hub id for ``spec``; refuse anything else in one line."""
    spec = str(spec)
    if spec.startswith(SHIPPED_PREFIX):
        from normswap.assets.models import model_path

        return str(model_path(spec[len(SHIPPED_PREFIX):]))
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NormswapError(f"{spec} is a file; a model is a directory holding config.json and weights")
        if not (path / "config.json").is_file():
            raise NormswapError(f"{spec} is not a model directory: it has no config.json")
        return str(path)
    looks_local = spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").replace("/", "", 1)
    if looks_local or not _HUB_ID.match(spec):
        raise NormswapError(f"model not found: {spec} (give a local model directory, a hub id, or normswap:NAME; see `normswap models`)")
    if not _hub_reachable_or_cached(spec):
        raise NormswapError(f"model not found: {spec} is not a local directory, not in the hub cache, and the hub is unreachable")
    return spec


def _hub_reachable_or_cached(repo_id: str) -> bool:
    """Fail fast offline instead of waiting through the hub client's retries."""
    import socket
    from urllib.parse import urlparse

    try:
        from huggingface_hub import constants, try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id, "config.json")
        if isinstance(cached, str):
            return True
        if constants.HF_HUB_OFFLINE:
            return False
        host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    except Exception:
        host = "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def is_local(resolved: str) -> bool:
    return Path(resolved).is_dir()


def read_config_dict(resolved: str) -> dict:
    """config.json as a plain dict (local dirs only; hub ids go through AutoConfig)."""
    try:
        with open(Path(resolved) / "config.json") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise NormswapError(f"{resolved}/config.json is not valid JSON ({e.msg} at line {e.lineno})") from None


def load_config(spec):
    from transformers import AutoConfig

    resolved = resolve(spec)
    try:
        return AutoConfig.from_pretrained(resolved, trust_remote_code=True)
    except OSError as e:
        raise NormswapError(f"cannot read a model config from {spec}: {_first_line(e)}") from None
    except (ValueError, KeyError) as e:
        raise NormswapError(f"{spec} is not a model transformers understands: {_first_line(e)}") from None


def is_causal_lm(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        return True
    if archs:
        return False
    from transformers import AutoModelForCausalLM

    return type(config) in AutoModelForCausalLM._model_mapping


def _torch_dtype(dtype):
    import torch

    if dtype is None or dtype == "auto":
        return dtype
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, str(dtype))


def load_model(spec, *, dtype=None, device="cpu", task="auto", config=None, strict=False):
    """Load ``spec`` as an eval-mode transformers model.

    dtype: None -> float32 (what CPU evaluation and verification want), "auto" -> the
    checkpoint's own dtype, or any torch dtype / name. task: "causal-lm", "base" or "auto"
    (the class the checkpoint names: its auto_map or architectures, e.g. BertForMaskedLM).
    strict: refuse a checkpoint whose files lack weights the model needs (transformers would
    initialise them randomly and only warn) — convert must never fold random numbers.
    """
    import torch

    resolved = resolve(spec)
    config = config if config is not None else load_config(resolved)
    auto = model_class_for(config, task)
    torch_dtype = _torch_dtype(dtype) if dtype is not None else torch.float32
    try:
        model, info = auto.from_pretrained(resolved, config=config, dtype=torch_dtype, trust_remote_code=True,
                                           output_loading_info=True)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise NormswapError(f"cannot load weights of {spec}: {_first_line(e)}") from None
    except Exception as e:  # safetensors raises its own error type for truncated/corrupt files
        if type(e).__name__ in ("SafetensorError", "HeaderTooLarge", "HeaderTooSmall"):
            raise NormswapError(f"cannot load weights of {spec}: corrupted safetensors file ({_first_line(e)})") from None
        raise
    missing = list(info.get("missing_keys") or [])
    if strict and missing:
        raise NormswapError(f"{spec} lacks {len(missing)} weight(s) the model needs, e.g. {missing[0]} (incomplete or mismatched checkpoint)")
    model.to(device)
    model.eval()
    if is_local(resolved):
        # remembered so that a later save keeps the provenance and copies tokenizer files
        from normswap.checkpoint.manifest import read_manifest

        model.normswap_manifest = read_manifest(resolved)
        model.normswap_source_dir = resolved
    return model


def model_class_for(config, task="auto"):
    """The class to load: the checkpoint's own (auto_map / architectures) unless a task is forced."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    if task == "causal-lm":
        return AutoModelForCausalLM
    if task == "base":
        return AutoModel
    auto_map = getattr(config, "auto_map", None) or {}
    # a head class (the one that was converted) before the bare AutoModel
    for key in sorted(auto_map, key=lambda k: (k == "AutoModel", k)):
        if key != "AutoConfig" and hasattr(transformers, key):
            return getattr(transformers, key)
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None and hasattr(cls, "from_pretrained"):
            return cls
    return AutoModelForCausalLM if is_causal_lm(config) else AutoModel


def load_tokenizer(spec):
    from transformers import AutoTokenizer

    resolved = resolve(spec)
    try:
        tok = AutoTokenizer.from_pretrained(resolved, trust_remote_code=True)
    except (OSError, ValueError, KeyError, ImportError, TypeError) as e:
        raise NormswapError(f"cannot load a tokenizer from {spec}: {_first_line(e)}") from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def _first_line(e) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
