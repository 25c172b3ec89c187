"""The parts of `python -m recipe_hacpo.evaluate` (see that module for usage and metrics).

- `benchmarks`: benchmark names, files and the avg@k / best@k / pass@k metrics;
- `checkpoints`: from a row's path to a directory a generator can load (FSDP shard merging);
- `generators`: Hugging Face and vLLM generation behind one interface, GPU grouping;
- `tables`: Table 1 as Markdown and CSV.
"""

from __future__ import annotations


class EvalError(ValueError):
    """A checkpoint, benchmark file or option that cannot be evaluated; the message is one line."""
