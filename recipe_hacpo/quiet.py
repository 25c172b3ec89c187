"""Known, harmless third-party messages, silenced once per process.

Imported by `recipe_hacpo.plugin`, which verl imports on `import verl` in the driver, the
TaskRunner and every Ray worker, so the filters below are in place before verl emits them:

- `<engine> engine is not available: ImportError(...)` — `verl.workers.engine` tries every
  optional training backend (torchtitan, veomni, automodel, mindspeed, megatron) at import and
  warns for each one that is not installed; this recipe uses FSDP only. Five lines per process.
- `No model-specific Continuous Token builder is registered for config.json model_type=...` —
  verl's agent loop picks a tokenizer helper by model type and falls back to the generic one
  for model types it does not list (the tiny agents' `qwen2` / `llama` among them); it logs
  this once per request, hundreds of times per step.

- torch's `is_fx_tracing will return true ...` advice, once per process that trains.
- the "Loading weights" / "Writing model shards" progress bars of Hugging Face loading and
  saving, one pair per model load in every worker.

`HACPO_VERBOSE=1` (set by `trainer.verbose=true`, inherited by Ray workers) keeps everything.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

VERBOSE_ENV = "HACPO_VERBOSE"
_ON = {"1", "true", "yes", "on"}

# (category, regex matched against the start of the warning message)
KNOWN_WARNINGS = (
    (UserWarning, r"(torchtitan|veomni|automodel|mindspeed|megatron) engine is not available"),
    # torchdata's StatefulDataLoader calls a deprecated torch hook on every construction
    (UserWarning, r"'set_vital' is deprecated"),
)
# logger name -> message prefix of the records to drop
KNOWN_LOG_RECORDS = {
    "verl.utils.tokenizer.continuous_token_wiring": "No model-specific Continuous Token builder",
    # torch advises on an API verl's FSDP code path calls, once per process (driver and workers)
    "torch.fx._symbolic_trace": "is_fx_tracing will return true",
}

_HF_BARS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"
_installed = False
_set_hf_env = False


def is_verbose() -> bool:
    """True when the user asked for every third-party message (`HACPO_VERBOSE=1`)."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in _ON


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def install() -> bool:
    """Install the filters (idempotent); returns whether they are active in this process."""
    global _installed
    if _installed:
        return True
    if is_verbose():
        return False
    for category, pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name, prefix in KNOWN_LOG_RECORDS.items():
        logging.getLogger(name).addFilter(_DropPrefix(prefix))
    _hf_progress_bars(False)
    _installed = True
    return True


def _hf_progress_bars(on: bool) -> None:
    # transformers reads the hub's switch when it is first imported; later, its own function
    global _set_hf_env
    if not on and _HF_BARS_ENV not in os.environ:
        os.environ[_HF_BARS_ENV] = "1"
        _set_hf_env = True
    elif on and _set_hf_env:
        os.environ.pop(_HF_BARS_ENV, None)
        _set_hf_env = False
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        (hf_logging.enable_progress_bar if on else hf_logging.disable_progress_bar)()


def release() -> None:
    """Undo `install` in this process and mark it verbose for the processes it starts."""
    global _installed
    os.environ[VERBOSE_ENV] = "1"
    if not _installed:
        return
    patterns = {p for _, p in KNOWN_WARNINGS}
    warnings.filters[:] = [f for f in warnings.filters if not (f[0] == "ignore" and f[1] is not None
                                                                and f[1].pattern in patterns)]
    for name in KNOWN_LOG_RECORDS:
        lg = logging.getLogger(name)
        for f in [f for f in lg.filters if isinstance(f, _DropPrefix)]:
            lg.removeFilter(f)
    _hf_progress_bars(True)
    _installed = False


install()
