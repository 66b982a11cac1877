"""Per-architecture knowledge, as data: one YAML file per family under data/."""

from normswap.architectures.registry import all_families, family_for_config, get_family, has_family


def resolve_family(config, cls=None):
    """Curated family file, else a discovered and checked one (see discover.py)."""
    from normswap.architectures.discover import resolve_family as resolve

    return resolve(config, cls)


__all__ = ["all_families", "family_for_config", "get_family", "has_family", "resolve_family"]
