"""Resolve and load the models normswap accepts.

A model spec is one of: a local directory, a hub id (``EleutherAI/pythia-160m``, only when
online), or ``normswap:NAME`` for a model shipped inside the package.

No code from a model directory runs unless the user opts in (``--trust-remote-code``, see
``set_trust_remote_code``): a model is data. Converted checkpoints carry their own modeling file
for plain transformers users (``trust_remote_code=True``); normswap never imports it but builds
the same classes from its installed ``remote_code.py``, so they load here without the flag and a
replaced modeling file never runs.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

from normswap.checkpoint.sizes import check_against_weights, check_declared, read_config, weight_shapes
from normswap.errors import NormswapError, first_line

SHIPPED_PREFIX = "normswap:"
NORMSWAP_TYPE_PREFIX = "normswap_"
_trust_remote_code = False


def set_trust_remote_code(enabled: bool) -> None:
    """Allow (or forbid again) running Python files that source model directories ship."""
    global _trust_remote_code
    _trust_remote_code = bool(enabled)
    if enabled:
        print(
            "normswap: warning: --trust-remote-code: Python files shipped with the source models will run; "
            "use it only for sources you trust",
            file=sys.stderr,
        )


def remote_code_trusted(config=None) -> bool:
    """Whether transformers may import a model's own code: never for normswap's own checkpoints
    (their classes come from this package), else only after ``set_trust_remote_code(True)``."""
    return False if config is not None and _normswap_block(config) else _trust_remote_code


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def resolve(spec) -> str:
    """Return a local directory path or a hub id for ``spec``; refuse anything else in one line."""
    spec = str(spec)
    if spec.startswith(SHIPPED_PREFIX):
        from normswap.assets.models import model_path

        return str(model_path(spec[len(SHIPPED_PREFIX) :]))
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NormswapError(f"{spec} is a file; a model is a directory holding config.json and weights")
        if not (path / "config.json").is_file():
            raise NormswapError(f"{spec} is not a model directory: it has no config.json")
        from normswap.checkpoint.side_files import side_files

        side_files(path)  # a tokenizer file linked from outside is refused here, before any work
        return str(path)
    looks_local = spec.startswith((".", "/", "~")) or os.sep in spec.strip("/").replace("/", "", 1)
    if looks_local or not _HUB_ID.match(spec):
        raise NormswapError(
            f"model not found: {spec} (give a local model directory, a hub id, or normswap:NAME; see `normswap models`)"
        )
    if not _hub_reachable_or_cached(spec):
        raise NormswapError(
            f"model not found: {spec} is not a local directory, not in the hub cache, and the hub is unreachable"
        )
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


def load_config(spec):
    from transformers import AutoConfig, PretrainedConfig

    resolved = resolve(spec)
    raw = {}
    try:
        if is_local(resolved):  # a regular file of bounded size, checked before transformers reads it
            read_config(Path(resolved) / "config.json", str(spec))
        raw, _ = PretrainedConfig.get_config_dict(resolved)  # JSON only: runs nothing
        check_declared(raw, str(spec))  # before any config class computes with its sizes
        if _normswap_block(raw):
            return normswap_classes_for(raw)[0].from_pretrained(resolved)
        return AutoConfig.from_pretrained(resolved, trust_remote_code=_trust_remote_code)
    except OSError as e:
        raise NormswapError(f"cannot read a model config from {spec}: {first_line(e)}") from None
    except (ValueError, KeyError) as e:
        if "trust_remote_code" in str(e):
            raise NormswapError(_needs_code_message(spec, raw)) from None
        raise NormswapError(f"{spec} is not a model transformers understands: {_one_line(e)}") from None
    except Exception as e:
        if type(e).__name__.endswith(
            "ValidationError"
        ):  # huggingface_hub's strict config fields: the reason is on line 2
            raise NormswapError(f"{spec}/config.json has an invalid value: {_one_line(e)}") from None
        raise


def _needs_code_message(spec, raw) -> str:
    files = sorted({str(ref).split("--")[-1].split(".")[0] + ".py" for ref in (raw.get("auto_map") or {}).values()})
    return (
        f"{spec} can only be loaded by running its own Python code ({', '.join(files) or 'auto_map'}); normswap runs "
        "no code from model files unless you pass --trust-remote-code (only for a source you trust)"
    )


def _normswap_block(config) -> dict | None:
    """The ``normswap`` block of a converted checkpoint's config (dict or object), else None."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    block = get("normswap", None)
    if not isinstance(block, dict):
        return None
    # current checkpoints name their weights variant; older ones had a model type of their own
    if block.get("weights_variant") or str(get("model_type", "")).startswith(NORMSWAP_TYPE_PREFIX):
        return block
    return None


normswap_block = _normswap_block  # public: export reads it to tell a converted checkpoint from any other


def normswap_classes_for(raw: dict):
    """(config class, {auto class name: model class}) of a converted checkpoint, built from the
    installed remote_code.py and the source classes in transformers. They are deliberately not
    registered with transformers' Auto classes: plain ``from_pretrained`` without
    ``trust_remote_code`` must keep failing loudly in a process that has used normswap."""
    auto_map = raw.get("auto_map") or {}
    block = _normswap_block(raw)
    return _normswap_classes(
        raw["model_type"],
        block.get("source_model_type"),
        tuple(sorted((k, str(v).split(".")[-1]) for k, v in auto_map.items())),
        block.get("weights_variant"),
    )


@functools.cache
def _normswap_classes(model_type: str, source_model_type: str, auto_names: tuple, weights_variant: str | None):
    import transformers
    from transformers import CONFIG_MAPPING, PreTrainedModel

    from normswap.checkpoint.remote_code import normswap_classes

    names = dict(auto_names)
    if source_model_type not in CONFIG_MAPPING or not str(names.get("AutoConfig", "")).isidentifier():
        raise NormswapError(
            f"a normswap checkpoint of model type {model_type!r} whose source type {source_model_type!r} "
            "this transformers does not know (or with a damaged auto_map); it cannot be loaded"
        )
    sources = {}
    for auto_key, name in names.items():
        source = getattr(transformers, name.removeprefix("Normswap"), None)
        if auto_key == "AutoConfig" or not hasattr(transformers, auto_key):
            continue
        if not (name.startswith("Normswap") and isinstance(source, type) and issubclass(source, PreTrainedModel)):
            raise NormswapError(
                f"a normswap checkpoint names {name!r} for {auto_key}, which is not a transformers model class"
            )
        sources[name] = source
    config_cls, classes = normswap_classes(
        model_type, names["AutoConfig"], CONFIG_MAPPING[source_model_type], sources, weights_variant=weights_variant
    )
    return config_cls, {auto_key: classes[name] for auto_key, name in names.items() if name in classes}


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


def check_buildable(resolved, config, label: str) -> None:
    """Refuse a config whose sizes its weights (read from the file headers) cannot back, before any
    model — even a weightless one on the meta device — is built from it: a million declared layers
    beside weights for two would otherwise be built layer by layer until memory runs out."""
    if is_local(resolved):
        check_against_weights(config.to_dict(), weight_shapes(resolved), label)


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
    check_buildable(resolved, config, str(spec))
    kwargs = dict(
        config=config, dtype=torch_dtype, trust_remote_code=remote_code_trusted(config), output_loading_info=True
    )
    try:
        model, info = auto.from_pretrained(resolved, **kwargs)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        if "ignore_mismatched_sizes" in str(e):  # transformers points to a report it logged (and we silenced)
            raise NormswapError(f"cannot load weights of {spec}: {_shape_mismatch(auto, resolved, kwargs)}") from None
        raise NormswapError(f"cannot load weights of {spec}: {first_line(e)}") from None
    except Exception as e:  # safetensors raises its own error type for truncated/corrupt files
        if type(e).__name__ in ("SafetensorError", "HeaderTooLarge", "HeaderTooSmall"):
            raise NormswapError(
                f"cannot load weights of {spec}: corrupted safetensors file ({first_line(e)})"
            ) from None
        raise
    missing = list(info.get("missing_keys") or [])
    if strict and missing:
        raise NormswapError(
            f"{spec} lacks {len(missing)} weight(s) the model needs, e.g. {missing[0]} "
            "(incomplete or mismatched checkpoint)"
        )
    model.to(device)
    model.eval()
    if is_local(resolved):
        # remembered so that a later save keeps the provenance and copies tokenizer files
        from normswap.checkpoint.manifest import read_manifest

        model.normswap_manifest = read_manifest(resolved)
        model.normswap_source_dir = resolved
    return model


def _shape_mismatch(auto, resolved, kwargs) -> str:
    """What transformers' 'see the above report' refers to: one tensor whose shape on disk differs
    from the one the config implies (a matrix where one differs: it shows both sizes), and how many
    more do. transformers' list comes in no fixed order, so the choice is made here."""
    _, info = auto.from_pretrained(resolved, ignore_mismatched_sizes=True, **kwargs)
    bad = list(info.get("mismatched_keys") or [])
    if not bad:
        return "tensor shapes on disk differ from the ones config.json implies"
    key, disk, want = min(bad, key=lambda b: (-len(b[1]), b[0]))
    more = f" ({len(bad) - 1} more tensors differ)" if len(bad) > 1 else ""
    return (
        f"tensor {key} has shape {list(disk)} on disk but config.json implies {list(want)}{more}: "
        "the config does not belong to these weights"
    )


def model_class_for(config, task="auto"):
    """The class to load: the checkpoint's own (auto_map / architectures) unless a task is forced."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    auto_map = getattr(config, "auto_map", None) or {}
    if _normswap_block(config):  # normswap's own classes, never the checkpoint's modeling file
        own = normswap_classes_for(
            {"model_type": config.model_type, "normswap": config.normswap, "auto_map": auto_map}
        )[1]
        # "auto": the class that was converted (architectures names it), before any other the auto_map lists
        converted = set(getattr(config, "architectures", None) or [])
        wanted = {"causal-lm": ["AutoModelForCausalLM"], "base": ["AutoModel"]}.get(
            task, sorted(own, key=lambda k: (own[k].__name__ not in converted, k == "AutoModel", k))
        )
        for key in wanted:
            if key in own:
                return own[key]
    if task == "causal-lm":
        return AutoModelForCausalLM
    if task == "base":
        return AutoModel
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
    """The tokenizer of ``spec``, checked and built as data (docs/security.md, rounds 6 and 7): its ids
    bounded by the weights, its build and a probe run first in a child under a CPU budget, its encodes
    and decodes guarded. A refusal is a ``tokenizer_guard.TokenizerRefused``."""
    from transformers import AutoTokenizer

    from normswap.checkpoint import tokenizer_guard, tokenizer_vet

    resolved = resolve(spec)
    if is_local(resolved):  # ids no weight backs would make the library build tables of that length
        from normswap.checkpoint.token_ids import check_token_ids

        check_token_ids(resolved, str(spec))
    directory = resolved if is_local(resolved) else _hub_tokenizer_dir(resolved)
    if directory is not None:  # a build that runs away is ended in the child, before one starts here
        tokenizer_vet.vet(directory)
    # given to AutoTokenizer so that it need not look the config up (one of an older normswap
    # checkpoint would need code)
    if is_local(resolved) and (Path(resolved) / "config.json").is_file():
        # sizes a config declares are refused here too: AutoTokenizer, given no config, reads it itself
        check_declared(read_config(Path(resolved) / "config.json", str(spec)), str(spec))
    try:
        config = load_config(resolved)
    except NormswapError:
        config = None
    try:
        tok = AutoTokenizer.from_pretrained(
            resolved,
            trust_remote_code=remote_code_trusted(config),
            **({"config": config} if config is not None else {}),
        )
    except (OSError, ValueError, KeyError, ImportError, TypeError) as e:
        raise NormswapError(f"cannot load a tokenizer from {spec}: {first_line(e)}") from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    # its patterns run under a time budget, interruptible, a panic one line (tokenizer_guard.py)
    return tokenizer_guard.guard(tok, tokenizer_guard.where_of(resolved))


def optional_tokenizer(spec):
    """The tokenizer of ``spec``, or None where it has none that loads (a command that can do without one:
    convert's verification, export's check); a tokenizer normswap refuses (``TokenizerRefused``) refuses
    the command instead: it is never carried into OUT nor replaced by another one unsaid."""
    from normswap.checkpoint.tokenizer_guard import TokenizerRefused

    try:
        return load_tokenizer(spec)
    except TokenizerRefused:
        raise
    except NormswapError:
        return None


def _hub_tokenizer_dir(repo_id: str):
    """The hub-cache snapshot folder holding ``repo_id``'s tokenizer.json (fetched first, as transformers
    would fetch it), so that it is vetted before it is built; None when the repository has none."""
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        path = try_to_load_from_cache(repo_id, "tokenizer.json")
        if not isinstance(path, str):
            path = hf_hub_download(repo_id, "tokenizer.json")
        for name in ("tokenizer_config.json", "added_tokens.json"):  # the added tokens the vet adds
            if not isinstance(try_to_load_from_cache(repo_id, name), str):
                try:
                    hf_hub_download(repo_id, name)
                except Exception:  # absent: nothing to add
                    pass
    except Exception:  # none, or unreachable: transformers finds no tokenizer.json either
        return None
    return Path(path).parent


def _one_line(e, limit: int = 400) -> str:
    """The whole message on one line (a reason on a later line is kept), cut at ``limit``."""
    text = " ".join(line.strip() for line in str(e).strip().splitlines() if line.strip()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
