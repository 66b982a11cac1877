"""Per-architecture knowledge, as data: one YAML file per family under data/, and discovery of a
description for an architecture without one (discover.py), which family a conversion uses and the
check that a discovered one converts exactly (family_check.py, given the converter by its caller), what
`normswap families` lists (catalog.py, model_family.py) and the survey of every architecture (survey.py)."""

from normswap.architectures.registry import all_families, family_for_config, get_family, has_family

__all__ = ["all_families", "family_for_config", "get_family", "has_family"]
