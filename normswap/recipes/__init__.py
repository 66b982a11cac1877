"""Recipes: YAML pipelines (source -> convert -> fine-tune -> evaluate -> report) for `normswap run`.

Public API:
    load_recipe(path_or_name, overrides=()) -> LoadedRecipe   (validated; errors are one line)
    run_recipe(loaded, out, resume=False, force=False, progress=None) -> dict   (run.json's content)
    shipped_recipes() -> {name: path}
    validate(raw_dict, where) -> resolved recipe dict; describe_fields() -> the schema as text
"""

from normswap.recipes.loader import LoadedRecipe, dump_recipe, load_recipe, shipped_recipes
from normswap.recipes.schema import RecipeError, describe_fields, validate


def run_recipe(loaded, out, **kwargs):
    from normswap.recipes.steps import run_recipe as _run

    return _run(loaded, out, **kwargs)


__all__ = [
    "LoadedRecipe",
    "RecipeError",
    "describe_fields",
    "dump_recipe",
    "load_recipe",
    "run_recipe",
    "shipped_recipes",
    "validate",
]
