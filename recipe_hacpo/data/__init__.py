"""Data for the recipe: verl's RL parquet schema and its validator, synthetic arithmetic, dataset conversion.

    schema     the Arrow schema, `write_rows`, `validate_rows` / `validate_file` (no tokenizer needed)
    synthetic  `python -m recipe_hacpo.data.synthetic`: deterministic add1 / add3 tasks
    prepare    `python -m recipe_hacpo.data.prepare`: MATH, MATH-500, GSM8K, AIME25, AMC23,
               Minerva, OlympiadBench from local files to verl parquet
"""

__all__ = ["DataFormatError", "validate_file", "validate_rows", "write_rows"]


def __getattr__(name: str):
    # Imported on first use so `python -m recipe_hacpo.data.schema` does not load the module twice.
    if name in __all__:
        from recipe_hacpo.data import schema

        return getattr(schema, name)
    raise AttributeError(f"module 'recipe_hacpo.data' has no attribute {name!r}")
