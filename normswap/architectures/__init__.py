"""Per-architecture knowledge, as data: one YAML file per family under data/."""

from normswap.architectures.registry import all_families, family_for_config, get_family, has_family


def resolve_family(config, cls=None, family_file=None):
    """``family_file`` or the curated family file, else a discovered one; checked (see discover.py)."""
    from normswap.architectures.discover import resolve_family as resolve

    return resolve(config, cls, family_file)


__all__ = ["all_families", "family_for_config", "get_family", "has_family", "resolve_family"]
