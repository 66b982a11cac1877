"""Per-architecture knowledge, as data: one YAML file per family under data/."""

from normswap.architectures.registry import all_families, family_for_config, get_family

__all__ = ["all_families", "family_for_config", "get_family"]
