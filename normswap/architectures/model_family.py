"""The family description of one model a user names (`normswap families discover MODEL`): discovered
from a tiny randomised instance and checked by converting it, or read back from a checkpoint normswap
converted with a discovered family; saved as a family file when asked."""

from __future__ import annotations

from pathlib import Path

from normswap.architectures.family_check import Converter


def load_config(spec):
    """A config from a model directory, hub id, normswap:NAME, or a config.json file."""
    from normswap.checkpoint import load as ckload
    from normswap.errors import NormswapError

    path = Path(spec).expanduser()
    if path.exists() and not path.is_dir():  # a config file (a FIFO or device is named by the loader)
        from transformers import AutoConfig

        from normswap.checkpoint.sizes import check_without_weights, read_config

        raw = read_config(path, str(path))  # bounded, every declared size checked before transformers reads it
        try:
            config = AutoConfig.for_model(raw.pop("model_type"), **raw)
        except (KeyError, ValueError, TypeError) as e:
            raise NormswapError(f"{spec} is not a transformers config.json ({type(e).__name__}: {e})") from None
        check_without_weights(config.to_dict(), str(path))
        return config
    return ckload.load_config(ckload.resolve(spec))


def family_description(spec, out, *, convert: Converter) -> dict:
    """Discover (or, for a converted checkpoint, read back) a family description; save it if asked."""
    import yaml

    from normswap.architectures.family_check import discover_family
    from normswap.errors import DiscoveryError, NormswapError

    config = load_config(spec)
    block = getattr(config, "normswap", None)
    if isinstance(block, dict) and block.get("format_version"):
        description = block.get("discovered_family")
        if not description:
            raise NormswapError(
                f"{spec} was converted with the curated family {block.get('family')!r}: see `normswap families`"
            )
        check = {
            "exact": block.get("mode") == "exact" or None,
            "reason": "recorded in the converted checkpoint",
            "max_abs_diff": None,
        }
        model_type = block.get("source_model_type", "?")
    else:
        try:
            _, check = discover_family(config, convert=convert)
        except DiscoveryError as e:
            raise NormswapError(str(e)) from None
        description = check.pop("description")
        model_type = config.model_type
        if check["exact"] is False:
            raise NormswapError(
                f"{model_type}: the discovered plan is not exact on a tiny randomised instance "
                f"({check['reason']}); nothing written"
            )
    text = "# Discovered by `normswap families discover` and checked by converting a tiny randomised instance.\n"
    text += yaml.safe_dump(description, sort_keys=False, width=120)
    if out:
        from normswap.publish import atomic_write_text

        atomic_write_text(out, text)
    return {"model_type": model_type, "check": check, "description": description, "yaml": text, "out": out}
