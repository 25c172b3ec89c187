"""The HACRL methods, one module each, behind one contract (`base.Method`).

    hacpo.py   HACPO, and the Naive and isolated baselines from its code   modes hacpo, naive, isolated
    graft.py   GRAFT, and its replay of a recorded peer                    mode graft
    sgt.py     SGT                                                          mode sgt

and what they are built from: the contract (`base.py`), the step's context a method receives
(`context.py`), the loss contract and frame (`objective.py`), the formulas (`core_algos.py` for
HACPO, `graft_formulas.py`, `sgt_formulas.py`, `groups.py` for what several share), the rows of
a learner batch (`rows.py`), the default mini-batch layout (`minibatch.py`) and GRAFT's recorded
peers (`replay.py`).

`METHODS` is the closed table from `algorithm.hacpo.mode` to its method; the trainer, the
config checks and the worker's loss ask `method_for`, and hold no branch on the mode. A new
method is a module here with a `Method` subclass and its objective, one entry in this table and
one in `hacpo_settings.MODES` (docs/ALGORITHM.md, "Adding a method"); a method kept outside the
package runs as `algorithm.hacpo.mode=package.module:Class`.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import TYPE_CHECKING

from recipe_hacpo.methods.base import Method

if TYPE_CHECKING:
    from recipe_hacpo.hacpo_settings import HacpoSettings

# mode → (module, class, keyword arguments); modules are imported on first use
METHODS: dict[str, tuple[str, str, dict]] = {
    "hacpo": ("recipe_hacpo.methods.hacpo", "Hacpo", {"shares": True}),
    "naive": ("recipe_hacpo.methods.hacpo", "Hacpo", {"shares": True, "naive": True}),
    "isolated": ("recipe_hacpo.methods.hacpo", "Hacpo", {"shares": False}),
    "graft": ("recipe_hacpo.methods.graft", "Graft", {}),
    "sgt": ("recipe_hacpo.methods.sgt", "Sgt", {}),
}


@lru_cache(maxsize=None)
def method_for(mode: str) -> Method:
    """The method of `algorithm.hacpo.mode`: a shipped one from `METHODS`, or one outside the
    package named by import path, `package.module:Class` (imported in the driver and in every
    actor worker, so the module must be importable there: on PYTHONPATH or installed)."""
    if mode in METHODS:
        module, name, kwargs = METHODS[mode]
        return getattr(importlib.import_module(module), name)(**kwargs)
    from recipe_hacpo.hacpo_settings import EXTERNAL_METHOD, ConfigError

    where = f"algorithm.hacpo.mode={mode!r}"
    if not EXTERNAL_METHOD.match(mode):
        raise ConfigError(f"{where}: no such method; known: {', '.join(METHODS)}, or package.module:Class")
    module, name = mode.split(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{where}: cannot import it ({type(exc).__name__}: {exc}); put its module on PYTHONPATH") from exc
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise ConfigError(f"{where}: {name} is not a recipe_hacpo.methods.Method subclass")
    try:
        return cls()
    except TypeError as exc:  # an abstract part of the contract (exchange, advantages) left undefined
        raise ConfigError(f"{where}: {exc}") from exc



def checked_settings(raw: dict) -> "HacpoSettings":
    """`algorithm.hacpo` typed and checked whole: each key (`HacpoSettings.from_dict`), then the
    rules its method sets between its mode and the other keys (`Method.check_settings`)."""
    from recipe_hacpo.hacpo_settings import HacpoSettings

    settings = HacpoSettings.from_dict(raw)
    method_for(settings.mode).check_settings(settings)
    return settings


def loss_settings(settings: "HacpoSettings") -> dict | None:
    """What every actor worker's loss receives (it rebuilds them with `checked_settings`): the
    method's effective settings as plain data; None for a method that shares nothing, whose
    workers keep verl's own loss."""
    method = method_for(settings.mode)
    return method.effective(settings).loss_kwargs() if method.shares else None


__all__ = ["METHODS", "Method", "checked_settings", "loss_settings", "method_for"]
