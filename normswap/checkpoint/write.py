"""Write checkpoints in normswap's format, atomically.

Layout of a converted checkpoint directory:
    config.json                  source config + `normswap` block, own model_type, auto_map
    modeling_normswap.py         rebuilds the converted module tree on top of the source class
    model.safetensors            (or model-0000k-of-0000n.safetensors + model.safetensors.index.json)
    tokenizer / generation files copied from the source
    normswap_manifest.json       what was done, by which command, and the measurements
    README.md                    model card

Everything is written into a staging directory first and published with normswap.publish, so a
process killed at any instant leaves either no OUT or a complete one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from normswap import __version__
from normswap.checkpoint.manifest import MANIFEST_NAME, read_manifest, write_manifest
from normswap.publish import check_output_path, publish_dir, staging_dir

MODELING_FILE = "modeling_normswap.py"
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "vocab.txt", "tokenizer.model", "spiece.model", "added_tokens.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json",
)


# -- weights ---------------------------------------------------------------------------------

def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("GIB", 2**30), ("MIB", 2**20)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(float(text))


def unique_state_dict(model) -> dict:
    """State dict without storage-sharing duplicates (tied weights keep their first name)."""
    out, seen = {}, set()
    for key, tensor in model.state_dict().items():
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)) if tensor.device.type != "meta" else key
        if ident in seen:
            continue
        seen.add(ident)
        out[key] = tensor.detach().contiguous()
    return out


def write_weights(tensors: dict, directory: Path, *, max_shard_size="5GB") -> list[str]:
    """safetensors, sharded with an index when above ``max_shard_size``; returns the file names."""
    limit = _parse_size(max_shard_size)
    shards, current, size = [], {}, 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[key] = t
        size += nbytes
    shards.append(current)
    meta = {"format": "pt", "producer": f"normswap {__version__}"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names, weight_map, total = [], {}, 0
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata=meta)
        names.append(name)
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    with open(directory / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


# -- config and remote code -------------------------------------------------------------------

def normswap_names(source_model_type: str, source_class: str, base_class: str | None = None) -> dict:
    return {
        "model_type": f"normswap_{source_model_type}",
        "config_class": f"Normswap{source_class}Config",
        "model_class": f"Normswap{source_class}",
        "base_class": f"Normswap{base_class}" if base_class else None,
    }


def auto_class_for(class_name: str) -> str:
    if class_name.endswith(("ForCausalLM", "LMHeadModel")):
        return "AutoModelForCausalLM"
    if class_name.endswith("ForMaskedLM"):
        return "AutoModelForMaskedLM"
    if class_name.endswith("ForSequenceClassification"):
        return "AutoModelForSequenceClassification"
    return "AutoModel"


def _unwrap(cls):
    while cls.__name__.startswith("Normswap") and len(cls.__mro__) > 1:
        cls = cls.__mro__[1]
    return cls


def base_class_of(model):
    """The bare model class (what AutoModel builds), when ``model`` is a head class."""
    base = getattr(model, "base_model", model)
    cls = _unwrap(type(base))
    return None if cls is _unwrap(type(model)) else cls


def modeling_source(model, names: dict) -> str:
    """The text of modeling_normswap.py: an import header, the shared body, the classes."""
    body = (Path(__file__).parent / "remote_code.py").read_text()
    # a config or model that already is a normswap subclass (fine-tuning a converted model): use its base
    cfg_cls = _unwrap(type(model.config))
    model_cls = _unwrap(type(model))
    base_cls = base_class_of(model)
    header = (
        f"# Generated by normswap {__version__}: stock transformers loads this converted checkpoint with\n"
        f"#   {auto_class_for(model_cls.__name__)}.from_pretrained(path, trust_remote_code=True)\n"
        f"from {cfg_cls.__module__} import {cfg_cls.__name__} as _SourceConfig\n"
        f"from {model_cls.__module__} import {model_cls.__name__} as _SourceModel\n"
        + (f"from {base_cls.__module__} import {base_cls.__name__} as _SourceBaseModel\n" if base_cls else "")
        + "\n"
    )
    sources = {names["model_class"]: "_SourceModel"}
    if base_cls is not None:  # the bare model (AutoModel): the same norms, without the head
        sources[names["base_class"]] = "_SourceBaseModel"
    footer = (
        f"\n\n{names['config_class']}, _classes = normswap_classes(\n"
        f"    {names['model_type']!r}, {names['config_class']!r}, _SourceConfig,\n"
        f"    {{{', '.join(f'{k!r}: {v}' for k, v in sources.items())}}},\n)\n"
        + "".join(f"{k} = _classes[{k!r}]\n" for k in sources)
    )
    return header + body + footer


def names_for(model) -> dict:
    block = getattr(model.config, "normswap", None) or {}
    model_type = block.get("source_model_type") or model.config.model_type
    base = base_class_of(model)
    return normswap_names(model_type, _unwrap(type(model)).__name__, base.__name__ if base else None)


def config_dict_for(model) -> dict:
    config = model.config
    d = config.to_dict()
    block = getattr(config, "normswap", None)
    if not block:
        return d
    names = names_for(model)
    src_class = _unwrap(type(model)).__name__
    block = dict(block)
    block.setdefault("source_model_type", model.config.model_type)
    block["source_class"] = src_class
    d["normswap"] = block
    d["model_type"] = names["model_type"]
    d["architectures"] = [names["model_class"]]
    d["auto_map"] = {
        "AutoConfig": f"modeling_normswap.{names['config_class']}",
        auto_class_for(src_class): f"modeling_normswap.{names['model_class']}",
    }
    if names["base_class"] and auto_class_for(src_class) != "AutoModel":
        d["auto_map"]["AutoModel"] = f"modeling_normswap.{names['base_class']}"
    d.pop("transformers_version", None)
    import transformers

    d["transformers_version"] = transformers.__version__
    return d


def copy_side_files(src_dir, directory: Path):
    if not src_dir or not Path(src_dir).is_dir():
        return
    for name in SIDE_FILES:
        p = Path(src_dir) / name
        if p.is_file() and not (directory / name).exists():
            shutil.copy2(p, directory / name)


def write_config_and_code(model, directory: Path) -> dict:
    """config.json (with the dtype actually written) and, for a converted model, the remote code.

    Reads only the module tree and the config, so the streaming path calls it with a meta model.
    """
    cfg = config_dict_for(model)
    param = next(model.parameters(), None)
    if param is not None:  # `dtype="auto"` loads what the config says: say what was written
        cfg["dtype"] = str(param.dtype).replace("torch.", "")
    # record what the live modules are now (a fine-tune may have added or trained γ)
    _sync_norm_records(model, cfg["normswap"])
    (directory / MODELING_FILE).write_text(modeling_source(model, names_for(model)))
    with open(directory / "config.json", "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    return cfg


def write_checkpoint_dir(model, directory: Path, *, tokenizer=None, source_dir=None, manifest=None,
                         max_shard_size="5GB", dtype=None) -> dict:
    """Write ``model`` (converted or stock) into an existing empty ``directory``."""
    directory = Path(directory)
    if dtype is not None:
        model = model.to(dtype)
    if getattr(model.config, "normswap", None):
        cfg = write_config_and_code(model, directory)
        files = write_weights(unique_state_dict(model), directory, max_shard_size=max_shard_size)
    else:
        model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
        cfg = json.loads((directory / "config.json").read_text())
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    gen = getattr(model, "generation_config", None)
    if gen is not None and not (directory / "generation_config.json").exists():
        try:
            gen.save_pretrained(directory)
        except Exception:  # an invalid generation config must not lose the weights
            pass
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    copy_side_files(source_dir or getattr(model, "normswap_source_dir", None), directory)
    if manifest is not None:
        write_manifest(directory, manifest)
        from normswap.checkpoint.card import write_model_card

        write_model_card(directory, manifest, cfg)
    return {"files": files}


def _sync_norm_records(model, block):
    from normswap.convert.plan import is_rmsnorm

    for name, rec in block.get("norms", {}).items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if is_rmsnorm(module):
            rec["weight"] = getattr(module, "weight", None) is not None
            rec["bias"] = getattr(module, "bias", None) is not None


def save_checkpoint(model, out, *, tokenizer=None, manifest_updates=None, force=False, max_shard_size="5GB",
                    dtype=None, source_dir=None) -> Path:
    """Write ``model`` to OUT atomically in convert's format (stock layout for stock models).

    The manifest is the model's own (read when it was loaded) with ``manifest_updates`` merged
    in at the top level; the model card is regenerated from it.
    """
    out = check_output_path(out, force=force, reads=[source_dir or getattr(model, "normswap_source_dir", None)])
    manifest = dict(getattr(model, "normswap_manifest", None) or {})
    manifest.setdefault("normswap_version", __version__)
    manifest.setdefault("history", [])
    for key, value in (manifest_updates or {}).items():
        manifest[key] = value
    with staging_dir(out) as tmp:
        write_checkpoint_dir(model, tmp, tokenizer=tokenizer, source_dir=source_dir, manifest=manifest,
                             max_shard_size=max_shard_size, dtype=dtype)
        publish_dir(tmp, out, force=force)
    return out


__all__ = ["save_checkpoint", "write_checkpoint_dir", "read_manifest", "MANIFEST_NAME"]
