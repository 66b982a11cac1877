"""Load and look up family data files."""

from __future__ import annotations

import functools
from importlib import resources

import yaml

from normswap import bounded_load
from normswap.architectures.schema import Family, parse_family
from normswap.errors import NormswapError

# A family description is a page: the shipped ones are under 2 KB and 200 values, a discovered one a
# few KB. The bounds keep `--family-file /dev/zero` or a few lines of nested YAML aliases (which
# once wrote a 37 MB config.json, or ran past ten minutes) from costing more than a moment.
MAX_FAMILY_BYTES = 256 << 10
MAX_FAMILY_NODES = 20_000


@functools.lru_cache(maxsize=1)
def _load_all() -> dict[str, Family]:
    families: dict[str, Family] = {}
    seen_types: dict[str, str] = {}
    for entry in sorted(resources.files("normswap.architectures").joinpath("data").iterdir(), key=lambda p: p.name):
        if not entry.name.endswith(".yaml"):
            continue
        source = f"architectures/data/{entry.name}"
        try:
            raw = yaml.safe_load(entry.read_text())
        except yaml.YAMLError as e:
            raise NormswapError(f"invalid family file {source}: not valid YAML ({e})") from None
        fam = parse_family(raw, source)
        if fam.name != entry.name[: -len(".yaml")]:
            raise NormswapError(f"invalid family file {source}: name '{fam.name}' must match the file name")
        for mt in fam.model_types:
            if mt in seen_types:
                raise NormswapError(f"model_type {mt} is claimed by both {seen_types[mt]} and {fam.name}")
            seen_types[mt] = fam.name
        families[fam.name] = fam
    return families


def load_family_file(path) -> Family:
    """A family file outside the package (``normswap convert --family-file``), validated like the
    shipped ones. It is not curated: its description travels with the converted checkpoint, as a
    discovered one does, and it is used only after the same exactness check (family_check.resolve_family)."""
    import dataclasses

    try:
        raw = bounded_load.load_yaml(
            path, what="a family file", max_bytes=MAX_FAMILY_BYTES, max_nodes=MAX_FAMILY_NODES, follow=True
        )
    except bounded_load.BoundedLoadError as e:
        if e.syntax is None:
            raise
        raise NormswapError(f"invalid family file {path}: not valid YAML{e.syntax}") from None
    fam = parse_family(raw, str(path))
    return dataclasses.replace(fam, discovered=True, description=dict(raw))


def all_families() -> list[Family]:
    return list(_load_all().values())


def get_family(name: str) -> Family:
    fams = _load_all()
    if name not in fams:
        raise NormswapError(f"unknown family {name!r}; known: {', '.join(sorted(fams))}")
    return fams[name]


def supported_summary() -> str:
    return ", ".join(f.display for f in all_families())


def has_family(config) -> bool:
    """Whether a curated data file covers ``config.model_type``."""
    return any(getattr(config, "model_type", None) in fam.model_types for fam in all_families())


def family_for_config(config) -> Family:
    """The family whose data covers ``config.model_type``; refuse loudly, never guess."""
    model_type = getattr(config, "model_type", None)
    for fam in all_families():
        if model_type in fam.model_types:
            return fam
    archs = ", ".join(getattr(config, "architectures", None) or []) or "unknown architecture"
    raise NormswapError(
        f"unsupported architecture: model_type={model_type!r} ({archs}); supported families: {supported_summary()}"
    )
