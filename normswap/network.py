"""Fail fast when a command needs the Hub and cannot reach it.

Anything that downloads — a hub model id that is not cached, a hub dataset id, an lm-eval task
whose dataset lives on the Hub — is checked here *before* the first expensive step, so an offline
user gets one line in a second or two instead of a minute of retries after the work already done.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from normswap.errors import NormswapError

PROBE_TIMEOUT = 2.0  # seconds for the one TCP connection that decides "reachable"


# Any of these switches the Hub off for everything normswap does (models, datasets, lm-eval tasks):
# a user who set one of them expects no download at all, whichever library it was meant for.
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def offline_env() -> str | None:
    """The environment variable that switches the Hub off, as ``NAME=value`` (None: not set)."""
    for var in OFFLINE_VARS:
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]}"
    return None


def hub_host() -> str:
    try:
        from urllib.parse import urlparse

        from huggingface_hub import constants

        return urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    except Exception:
        return "huggingface.co"


def hub_problem(timeout: float = PROBE_TIMEOUT) -> str | None:
    """Why the Hub cannot be used now (None: it can). Costs at most ~``timeout`` seconds."""
    env = offline_env()
    if env:
        return f"offline mode is on ({env})"
    host = hub_host()
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return None
    except OSError as e:
        return f"{host} is unreachable ({type(e).__name__}: {e.strerror or e})"


def model_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:
        return False


def model_needs_hub(spec) -> bool:
    """A model spec that is neither shipped, nor a local path, nor already in the hub cache."""
    spec = str(spec)
    if spec.startswith("normswap:") or Path(spec).expanduser().exists():
        return False
    if spec.startswith((".", "/", "~")):
        return False  # a missing local path: the loader says so itself
    return not model_cached(spec)


# A hub dataset id, `id`, `org/id` or either with `:config` - the grammar normswap.data.sources
# accepts; repeated here because importing the data package would import torch, and this check
# must answer in well under a second.
HUB_DATASET_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")


def data_needs_hub(spec) -> bool:
    """A data spec that names a hub dataset (`id` or `id:config`) rather than a local source."""
    spec = str(spec)
    if spec in ("", "embedded") or Path(spec).expanduser().exists() or spec.startswith((".", "/", "~")):
        return False
    return bool(HUB_DATASET_ID.match(spec)) and Path(spec).suffix.lower() not in (
        ".txt",
        ".md",
        ".jsonl",
        ".json",
        ".parquet",
    )


def require_hub(*, models=(), data=None, hub_tasks=(), timeout: float = PROBE_TIMEOUT) -> None:
    """Raise a one-line NormswapError when something asked for needs the Hub and the Hub is out of reach.

    ``hub_tasks``: the lm-eval tasks whose datasets live on the Hub
    (``normswap.evaluate.lm_eval_adapter.hub_tasks`` tells them from normswap's own).
    """
    needs = [f"model {m}" for m in models if m and model_needs_hub(m)]
    if data is not None and data_needs_hub(data):
        needs.append(f"dataset {data}")
    needs += [f"lm-eval task {t}" for t in hub_tasks]
    if not needs:
        return
    problem = hub_problem(timeout)
    if problem:
        ways = (
            ["a local model directory or a shipped model (`normswap models` lists them)"]
            if any(n.startswith("model ") for n in needs)
            else []
        )
        ways += ["a local file or --data embedded"] if any(n.startswith("dataset ") for n in needs) else []
        ways += ["the shipped tasks (normswap_kjv)"] if hub_tasks else []
        raise NormswapError(
            f"{', '.join(needs)} must be downloaded from the Hub, but {problem}; use {' or '.join(ways)}"
        )
