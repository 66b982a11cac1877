"""Per-architecture knowledge, as data: one YAML file per family under data/, and discovery of a
description for an architecture without one (discover.py). Which family a conversion uses, and the
check that a discovered one converts exactly, live beside the converter (convert/family_check.py)."""

from normswap.architectures.registry import all_families, family_for_config, get_family, has_family

__all__ = ["all_families", "family_for_config", "get_family", "has_family"]
