"""Find a recipe (a path or a shipped name), parse it, apply ``--set`` overrides, validate it."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import yaml

from normswap import bounded_load
from normswap.errors import NormswapError
from normswap.recipes.schema import RecipeError, show, validate

# The shipped recipes live inside the package so that `normswap run quickstart` works after a
# plain `pip install`; the repository's top-level `recipes/` is a link to this directory.
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"


@dataclass
class LoadedRecipe:
    recipe: dict  # validated, defaults filled, overrides applied
    path: Path  # the file it came from
    original_text: str  # the file as written (provenance)
    overrides: list[str]  # the --set arguments, in order


def shipped_recipes() -> dict[str, Path]:
    """name -> path of every recipe shipped with normswap."""
    if not SHIPPED_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(SHIPPED_DIR.glob("*.yaml"))}


def find_recipe(arg: str) -> Path:
    """A YAML file path, or the bare name of a shipped recipe (``quickstart``)."""
    p = Path(arg).expanduser()
    if p.is_file() or (p.exists() and not p.is_dir()):  # a FIFO or a device is named by the loader
        return p
    if p.is_dir():
        raise NormswapError(
            f"{arg} is a directory; give a recipe YAML file or a shipped recipe name (see `normswap run --list`)"
        )
    shipped = shipped_recipes()
    name = arg[:-5] if arg.endswith(".yaml") else arg
    if "/" not in arg and name in shipped:
        return shipped[name]
    names = ", ".join(shipped) or "none installed"
    raise NormswapError(f"recipe not found: {arg} is neither a file nor a shipped recipe ({names})")


# A recipe is a page of settings. Bounds that no real recipe comes near keep a hostile file from
# costing unbounded time or memory: its size, and the size of the tree its aliases expand to
# (aliases share nodes, so a few lines can stand for billions: `b: [*a, *a]`, `c: [*b, *b]`, ...).
# The reading and parsing is normswap/bounded_load.py's, like every other file from a user.
MAX_RECIPE_BYTES = 1 << 20
MAX_EXPANDED_NODES = 10_000


def parse_yaml(text: str, where: str):
    if len(text) > MAX_RECIPE_BYTES:
        raise RecipeError(f"{where}: {len(text):,} characters; a recipe is at most {MAX_RECIPE_BYTES:,}")
    try:
        return bounded_load.parse_yaml(text, where, what="a recipe", max_nodes=MAX_EXPANDED_NODES, unique_keys=True)
    except bounded_load.BoundedLoadError as e:
        raise RecipeError(str(e)) from None


def parse_override(item: str) -> tuple[list[str], object]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as a YAML scalar)."""
    if "=" not in item:
        raise NormswapError(f"--set {item}: expected KEY=VALUE with a dotted key, e.g. --set finetune.steps=50")
    key, value = item.split("=", 1)
    parts = [p.strip() for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise NormswapError(f"--set {item}: expected KEY=VALUE with a dotted key, e.g. --set eval.max_tokens=4096")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value  # not valid YAML on its own (e.g. `a: b`): take the text as written
    if isinstance(parsed, (dict,)) and not value.strip().startswith("{"):
        parsed = value
    return parts, parsed


def apply_overrides(raw: dict, overrides: list[str], where: str) -> dict:
    """Apply ``--set`` items in order; a null value removes the key (its default applies again).

    ``finetune.X`` / ``convert.X`` / ``slice.X`` (no variant named) apply to every variant that has that
    section, which is what "make the demo's fine-tune shorter" means; ``models.`` is accepted as a
    spelling of ``variants.``.
    """
    raw = copy.deepcopy(raw) if isinstance(raw, dict) else raw
    if not isinstance(raw, dict):
        return raw
    if "models" in raw and "variants" not in raw:
        raw["variants"] = raw.pop("models")
    for item in overrides:
        parts, value = parse_override(item)
        if parts[0] == "models":
            parts[0] = "variants"
        if parts[0] in ("convert", "slice", "finetune") and len(parts) >= 2:
            variants = raw.get("variants")
            targets = [
                n for n, v in (variants or {}).items() if isinstance(v, dict) and isinstance(v.get(parts[0]), dict)
            ]
            if not targets:
                raise RecipeError(
                    f"{where}: --set {item}: no variant has a {parts[0]} section (use variants.NAME.{'.'.join(parts)})"
                )
            for n in targets:
                _set(raw, ["variants", n] + parts, value, item, where)
            continue
        _set(raw, parts, value, item, where)
    return raw


def _set(raw: dict, parts: list[str], value, item: str, where: str) -> None:
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise RecipeError(f"{where}: --set {item}: {'.'.join(parts[: i + 1])} is {show(nxt)}, not a section")
        node = nxt
    if value is None:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value


def load_recipe(arg: str, overrides: list[str] | tuple = ()) -> LoadedRecipe:
    path = find_recipe(arg)
    # UTF-8 takes up to 4 bytes a character; the character count is checked by parse_yaml
    text = bounded_load.read_text(path, what="a recipe", max_bytes=4 * MAX_RECIPE_BYTES, follow=True)
    where = str(path)
    raw = parse_yaml(text, where)
    raw = apply_overrides(raw, list(overrides), where)
    recipe = validate(raw, where)
    return LoadedRecipe(recipe=recipe, path=path, original_text=text, overrides=list(overrides))


def dump_recipe(recipe: dict) -> str:
    return yaml.safe_dump(recipe, sort_keys=False, default_flow_style=False, allow_unicode=True)
