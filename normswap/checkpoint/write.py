"""Write checkpoints in normswap's format, atomically.

Layout of a converted checkpoint directory:
    config.json                  source config (its built-in model_type) + `normswap` block, auto_map
    modeling_normswap.py         rebuilds the converted module tree on top of the source class
    model.normswap.safetensors   (or model.normswap-0000k-of-0000n.safetensors +
                                 model.safetensors.index.normswap.json): the transformers variant
                                 "normswap", so a stock class finds no weights (shards.py says why)
    tokenizer / generation files copied from the source
    normswap_manifest.json       what was done, by which command, and the measurements
    README.md                    model card

Everything is written into a staging directory first and published with normswap.publish, so a
process killed at any instant leaves either no OUT or a complete one.
"""

from __future__ import annotations

import json
from pathlib import Path

from normswap.checkpoint.manifest import MANIFEST_NAME, read_manifest, write_manifest
from normswap.checkpoint.shards import WEIGHTS_VARIANT, ShardedCheckpoint
from normswap.checkpoint.side_files import copy_side_files
from normswap.model_facts import is_rmsnorm
from normswap.publish import check_output_path, publish_dir, staging_dir
from normswap.version import __version__

MODELING_FILE = "modeling_normswap.py"


# -- weights ---------------------------------------------------------------------------------


def unique_state_dict(model) -> dict:
    """State dict without storage-sharing duplicates (tied weights keep their first name)."""
    out, seen = {}, set()
    for key, tensor in model.state_dict().items():
        ident = (
            (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if tensor.device.type != "meta"
            else key
        )
        if ident in seen:
            continue
        seen.add(ident)
        out[key] = tensor.detach().contiguous()
    return out


def write_weights(tensors: dict, directory: Path, *, max_shard_size="5GB") -> list[str]:
    """safetensors, sharded with an index when above ``max_shard_size``; returns the file names."""
    specs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    with ShardedCheckpoint(directory, specs, max_shard_size) as files:
        for key, t in tensors.items():
            files.write(key, t.detach().cpu().contiguous())
    return files.names


# -- config and remote code -------------------------------------------------------------------


def auto_class_for(class_name: str) -> str:
    """The Auto class for a converted class that no transformers mapping lists (a fallback)."""
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


def registered_classes(model_type: str) -> dict:
    """{Auto class name: transformers model class} for every Auto model class that transformers'
    own mappings (``MODEL_*_MAPPING_NAMES`` behind each ``AutoModel*``) register for
    ``model_type``: the classes a user of the original can load it with. A class that does not
    import here (a backend missing) is left out."""
    import transformers
    from transformers.models.auto import modeling_auto

    out = {}
    for auto_name in sorted(dir(modeling_auto)):
        auto = getattr(modeling_auto, auto_name)
        names = getattr(getattr(auto, "_model_mapping", None), "_model_mapping", None)
        if not (isinstance(auto, type) and auto_name.startswith("Auto") and isinstance(names, dict)):
            continue
        if getattr(transformers, auto_name, None) is not auto:
            continue
        class_name = names.get(model_type)
        if isinstance(class_name, (list, tuple)):
            class_name = class_name[0] if class_name else None
        try:
            cls = getattr(transformers, class_name, None) if class_name else None
        except Exception:  # a class whose optional backend is not installed
            cls = None
        if isinstance(cls, type):
            out[auto_name] = cls
    return out


def checkpoint_classes(model) -> dict:
    """{Auto class name: source class} that the converted checkpoint offers: every one transformers
    registers for the source's model_type, and the converted class under its own Auto name."""
    block = getattr(model.config, "normswap", None) or {}
    model_type = block.get("source_model_type") or model.config.model_type
    own = _unwrap(type(model))
    classes = registered_classes(model_type)
    if own not in classes.values():
        auto = auto_class_for(own.__name__)
        # an Auto name the model type already gives another class keeps that class, as it does for the
        # original: AutoModel of a CLIPVisionModelWithProjection checkpoint is the bare CLIPVisionModel
        # tower (with pooler_output). The converted class is then listed under its own name, which
        # transformers' Auto classes never read and normswap's loader does (architectures names it)
        classes[own.__name__ if auto in classes else auto] = own
    return classes


def names_for(model) -> dict:
    block = getattr(model.config, "normswap", None) or {}
    own = _unwrap(type(model)).__name__
    return {
        "model_type": block.get("source_model_type") or model.config.model_type,  # built-in: see WEIGHTS_VARIANT
        "config_class": f"Normswap{own}Config",
        "model_class": f"Normswap{own}",
        "classes": {auto: f"Normswap{cls.__name__}" for auto, cls in checkpoint_classes(model).items()},
    }


def modeling_source(model, names: dict) -> str:
    """The text of modeling_normswap.py: an import header, the shared body, the classes."""
    body = (Path(__file__).parent / "remote_code.py").read_text()
    # a config or model that already is a normswap subclass (fine-tuning a converted model): use its base
    cfg_cls = _unwrap(type(model.config))
    sources = {}  # class name in the checkpoint -> source class, one per distinct class
    for cls in checkpoint_classes(model).values():
        sources.setdefault(f"Normswap{cls.__name__}", cls)
    aliases = {cls: f"_Source{i}" for i, cls in enumerate(dict.fromkeys(sources.values()))}
    own_auto = next(a for a, n in names["classes"].items() if n == names["model_class"])
    header = (
        f"# Generated by normswap {__version__}: stock transformers loads this converted checkpoint with\n"
        f"#   {own_auto}.from_pretrained(path, trust_remote_code=True)\n"
        f"# and with every other Auto class listed in config.json's auto_map.\n"
        f"from {cfg_cls.__module__} import {cfg_cls.__name__} as _SourceConfig\n"
        + "".join(f"from {cls.__module__} import {cls.__name__} as {alias}\n" for cls, alias in aliases.items())
        + "\n"
    )
    footer = (
        f"\n\n{names['config_class']}, _classes = normswap_classes(\n"
        f"    {names['model_type']!r}, {names['config_class']!r}, _SourceConfig,\n"
        f"    {{{', '.join(f'{k!r}: {aliases[v]}' for k, v in sources.items())}}}, "
        f"weights_variant={WEIGHTS_VARIANT!r},\n)\n" + "".join(f"{k} = _classes[{k!r}]\n" for k in sources)
    )
    return header + body + footer


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
    block["weights_variant"] = WEIGHTS_VARIANT
    d["normswap"] = block
    d["model_type"] = names["model_type"]
    d["architectures"] = [names["model_class"]]
    d["auto_map"] = {
        "AutoConfig": f"modeling_normswap.{names['config_class']}",
        **{auto: f"modeling_normswap.{name}" for auto, name in sorted(names["classes"].items())},
    }
    d.pop("transformers_version", None)
    d.pop("_name_or_path", None)  # where the config was loaded from: a local directory, never published
    import transformers

    d["transformers_version"] = transformers.__version__
    return d


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


def write_checkpoint_dir(
    model, directory: Path, *, tokenizer=None, source_dir=None, manifest=None, max_shard_size="5GB", dtype=None
) -> dict:
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
    for name, rec in block.get("norms", {}).items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if is_rmsnorm(module):
            rec["weight"] = getattr(module, "weight", None) is not None
            rec["bias"] = getattr(module, "bias", None) is not None


def save_checkpoint(
    model, out, *, tokenizer=None, manifest_updates=None, force=False, max_shard_size="5GB", dtype=None, source_dir=None
) -> Path:
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
        write_checkpoint_dir(
            model,
            tmp,
            tokenizer=tokenizer,
            source_dir=source_dir,
            manifest=manifest,
            max_shard_size=max_shard_size,
            dtype=dtype,
        )
        publish_dir(tmp, out, force=force)
    return out


__all__ = ["save_checkpoint", "write_checkpoint_dir", "read_manifest", "MANIFEST_NAME"]
