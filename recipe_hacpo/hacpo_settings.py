"""Every `algorithm.hacpo` key, declared once: its default, its meaning, its section of
docs/ALGORITHM.md, and the rule its value must follow.

Everything else derives from `HacpoSettings`: the `algorithm.hacpo` node of the YAML config
(registered with Hydra in `recipe_hacpo/configs/__init__.py`, so no YAML file repeats a
default), the keyword defaults of `recipe_hacpo.methods.core_algos`, the settings every actor worker's
loss receives, and the key table of docs/ALGORITHM.md (`markdown_table`, checked by a test).

`from_dict` checks each key; the rules between `mode` and the other keys belong to the methods
(`Method.check_settings`), which this ground module cannot import. `recipe_hacpo.methods.checked_settings`
runs both: the config check before Ray starts and every actor worker call it, and every error
is one line naming `algorithm.hacpo.<key>`.

Pure Python (no torch, no OmegaConf), so `core_algos` can import it.
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

PATH = "algorithm.hacpo"

MODES = ("hacpo", "naive", "isolated", "graft", "sgt")
"""hacpo: the paper's method | naive: shared rollouts without HACPO's corrections | isolated:
no sharing (the GSPO / GRPO / GSPO×2 baselines) | graft: GRAFT's whole-group replacement
(docs/ALGORITHM.md, GRAFT) | sgt: GRPO plus λ·NLL of one correct peer response where the
receiver failed (docs/ALGORITHM.md, SGT)."""

EXTERNAL_METHOD = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
"""`mode` may also name a method outside the package by import path, `package.module:Class` (a
`recipe_hacpo.methods.Method` subclass; docs/ALGORITHM.md, "Adding a method")."""

GRAFT_RATIO_LEVELS = ("token", "sequence")
"""GRAFT's ratio (G4): per token (the method) or one per sequence (ablation)."""

PEER_ORDERS = ("last", "first", "uniform")
"""Where GRAFT's mini-batches holding grafted groups go (G5): last (the method), first or anywhere."""

USER_CROSS_CLIPS = ("stepwise", "fixed", "none")
"""The cross clips a user may set (§5)."""

NAIVE_CROSS_CLIP = "gspo"
"""The cross clip the Naive baseline implies (§8): cross rows get the own-row GSPO term. Not
set by users: `mode=naive` selects it (`Method.effective`)."""

CROSS_CLIP_MODES = USER_CROSS_CLIPS + (NAIVE_CROSS_CLIP,)
"""Every cross clip the loss accepts."""

SHARE_SELECTIONS = ("all", "complementary")
"""Which peer rows a learner of the sharing modes trains on (§9, the selection as its own switch):
all (every peer row, HACPO and Naive as published) or complementary (GRAFT's G1 selection)."""

CROSS_RATIO_LENGTHS = ("each", "source")
"""Length normaliser of the cross ratio (§4): each (each tokenisation's own length, the authors'
code) or source (one exponent 1/|y^(j)|, the paper's Eq. 11)."""


class ConfigError(ValueError):
    """A configuration that cannot work; the message is one line naming the key at fault."""


def _key(default: Any, section: str, meaning: str, *, choices: tuple = (), rule: tuple | None = None):
    """One `algorithm.hacpo` key. `rule` is (predicate on the typed value, what it must be)."""
    return field(default=default, metadata={"section": section, "meaning": meaning, "choices": choices, "rule": rule})


@dataclass(frozen=True)
class HacpoSettings:
    """Typed `algorithm.hacpo`; each field's metadata holds its meaning and ALGORITHM.md section."""

    mode: str = _key(
        "hacpo", "§8", "`hacpo` (the method) | `naive` (joint group, plain mean/std, cross rows as GSPO "
        "rows against the source's log-probs, no ω, α = 0) | `isolated` (no sharing: GSPO / GRPO / GSPO×2) | `graft` "
        "(GRAFT: a receiver's failed groups replaced by a peer's whole group, weighted PPO-clip; keys `graft_*`) | `sgt` "
        "(SGT: GRPO plus λ·NLL of one correct peer response per prompt the receiver failed; key `sgt_lambda`)",
        choices=MODES,
    )
    capability_baseline: bool = _key(
        True, "§2", "ω-weighted baseline μ̂ = mean(ω⁽ᵏ,ˢʳᶜ⁾·R); `false`: plain group mean (ablation)"
    )
    discrepancy_coefficient: bool = _key(
        True, "§3", "multiply cross rows by ω⁽ʲ,ᵏ⁾; `false`: coefficient 1 (ablation)"
    )
    alpha: float = _key(
        1.0, "§4", "exponent α of c·sg(c)^α; 0 turns the reweighting off (paper: 3 for some pairs)",
        rule=(lambda v: v >= 0, "be >= 0 (0 turns §4 off)"),
    )
    cross_ratio_length: str = _key(
        "each", "§4", "length normaliser of s: `each` (mean over each agent's own tokens, as both of the "
        "authors' implementations compute) | `source` (paper's Eq. 11, one exponent 1/|y⁽ʲ⁾|)",
        choices=CROSS_RATIO_LENGTHS,
    )
    cross_clip: str = _key(
        "stepwise", "§5", "`stepwise` (paper) | `fixed` (δ_step = 0) | `none` (no cross clip)",
        choices=CROSS_CLIP_MODES,
    )
    delta: float = _key(
        0.2, "§5", "δ: the first lower bound is 1 − δ (paper: 0.1 for the Llama pair)",
        rule=(lambda v: 0 <= v < 1, "be in [0, 1) (first lower bound 1 − δ)"),
    )
    delta_step: float = _key(
        0.025, "§5", "δ_step: rise of the lower bound per optimizer update within a step (paper: 0.01 for some pairs)",
        rule=(lambda v: v >= 0, "be >= 0"),
    )
    window: int = _key(5, "§1", "K, steps in the capability window", rule=(lambda v: v >= 1, "be >= 1 (K steps)"))
    capability_floor: float = _key(
        0.001, "§1", "ε_P, floor of P̂ so ω stays finite", rule=(lambda v: v > 0, "be > 0")
    )
    omega_clip: tuple[float, float] = _key(
        (0.1, 10.0), "§1", "[ω_min, ω_max], clamp of every capability ratio",
        rule=(lambda v: 0 < v[0] <= 1 <= v[1], "satisfy 0 < ω_min <= 1 <= ω_max"),
    )
    norm_by_std: bool = _key(True, "§2", "divide by σ_g (`false`: Dr.GRPO style)")
    baseline_cap: float | None = _key(
        1.0, "§2", "baseline guard: a group whose μ̂ exceeds it uses the learner's own-sample mean (both of "
        "the authors' implementations; 1.0 is the ceiling of 0/1 rewards); `null`: no guard (the paper's formula)",
        rule=(lambda v: v is None or math.isfinite(v), "be a finite number (the reward ceiling) or null (no guard)"),
    )
    share_selection: str = _key(
        "all", "§9", "`mode=hacpo` and `naive`: which peer rows a learner trains on: `all` (every peer row, the methods "
        "as published) | `complementary` (peer S's rows for prompt q only where q is in GRAFT's selection for S→R, "
        "G1 with `graft_balance`; the other peer rows keep their place in the batch but are in neither the loss "
        "nor the §2 group statistics). `mode=graft`: implied (G1), not read; `isolated`, `sgt`: must be `all`",
        choices=SHARE_SELECTIONS,
    )
    graft_balance: bool = _key(
        True, "§9", "`mode=graft` (and `share_selection=complementary`): balance each pair of agents to "
        "m = min(|C_{S→R}|, |C_{R→S}|) groups per direction, ties with the m-th kept; `false`: every "
        "candidate group (ablation)"
    )
    graft_weight: bool = _key(
        True, "§9", "`mode=graft`: weigh each grafted response by w = 1[s > δ]·min(s, 1); `false`: w = 1 and "
        "nothing dropped (ablation: no compatibility weight)"
    )
    graft_floor: float | None = _key(
        0.8, "§9", "`mode=graft`: δ, grafted responses with s ≤ δ are dropped (the paper's value for every pair); "
        "`null`: no floor, w = min(s, 1) (ablation)",
        rule=(lambda v: v is None or 0 <= v < 1, "be in [0, 1) or null (no floor)"),
    )
    graft_ratio: str = _key(
        "token", "§9", "`mode=graft`: `token` (ρ per token, the method) | `sequence` (one ρ per response, ablation)",
        choices=GRAFT_RATIO_LEVELS,
    )
    graft_order: str = _key(
        "last", "§9", "`mode=graft`: mini-batches holding grafted groups train `last` (the method), `first` or "
        "`uniform`ly mixed (ablations)",
        choices=PEER_ORDERS,
    )
    replay_peer: str | None = _key(
        None, "§9", "`mode=graft`, one agent: a recorded agent's folder (`trainer.record_rollouts_dir`/<agent>) whose "
        "rollouts of each step stand in for a live peer (GRAFT's replay: one direction, no balancing, rewards "
        "re-verified); `null`: live peers",
    )
    sgt_lambda: float = _key(
        0.1, "§9", "`mode=sgt`: λ, weight of the token-mean NLL of the imitated peer responses added to the "
        "receiver's GRPO loss (the value GRAFT's paper ran SGT with); 0 leaves plain GRPO",
        rule=(lambda v: v >= 0 and math.isfinite(v), "be a finite number >= 0 (0: no imitation term)"),
    )
    method_options: dict = field(default_factory=dict, metadata={
        "section": "§8", "meaning": "a method's own settings, as the method declares them (`Method.options_type`, "
        "docs/ALGORITHM.md \"Adding a method\"); the shipped methods take none", "choices": (), "rule": None})

    def loss_kwargs(self) -> dict:
        """The settings as plain data, as they travel to every actor worker (the method's
        effective ones, `Method.effective`), which rebuilds and re-checks them."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "HacpoSettings":
        """The validation of `algorithm.hacpo` key by key: unknown keys, types, each key's rule.
        Missing keys take their default. The rules between `mode` and the other keys are the
        method's (`recipe_hacpo.methods.checked_settings` runs both)."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"{PATH}.{unknown[0]}: unknown key; known keys are {', '.join(sorted(known))}")
        typed = {name: _coerce(known[name], value) for name, value in raw.items()}
        settings = cls(**typed)
        for f in fields(cls):
            value = getattr(settings, f.name)
            rule = f.metadata["rule"]
            if rule is not None and not rule[0](value):
                raise ConfigError(f"{key_at(f.name, value)}: must {rule[1]}")
        return settings


DEFAULTS = HacpoSettings()
"""Every key at its default; `core_algos` takes its keyword defaults from here."""


def key_at(name: str, value: Any) -> str:
    """`algorithm.hacpo.<name>=<value>`, the head of every one-line error about a key."""
    shown = list(value) if isinstance(value, tuple) else value
    return f"{PATH}.{name}={shown!r}"


def _number(value: Any) -> float | None:
    """`value` as a float, or None when it is not a number (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _coerce(f, value: Any) -> Any:
    """`value` in the field's type, or a one-line ConfigError saying what the key takes."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key_at(f.name, value)}: must be true or false")
    if kind == "str":
        if value in f.metadata["choices"]:
            return value
        if f.name == "mode" and isinstance(value, str) and EXTERNAL_METHOD.match(value):
            return value  # a method outside the package, imported by recipe_hacpo.methods.method_for
        extra = " or package.module:Class (a method outside the package)" if f.name == "mode" else ""
        raise ConfigError(f"{key_at(f.name, value)}: must be one of {', '.join(f.metadata['choices'])}{extra}")
    if kind == "int":
        number = _number(value)
        if number is not None and number.is_integer():
            return int(number)
        raise ConfigError(f"{key_at(f.name, value)}: must be a whole number")
    if kind == "float" or (kind == "float | None" and value is not None):
        number = _number(value)
        if number is not None:
            return number
        raise ConfigError(f"{key_at(f.name, value)}: must be a number" + (" or null" if "None" in kind else ""))
    if kind == "float | None":
        return None
    if kind == "str | None":
        if value is None or (isinstance(value, str) and value):
            return value
        raise ConfigError(f"{key_at(f.name, value)}: must be a path or null")
    if kind == "dict":
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise ConfigError(f"{key_at(f.name, value)}: must be a map of option names to values")
    if kind == "tuple[float, float]":
        pair = [_number(v) for v in value] if isinstance(value, (list, tuple)) else []
        if len(pair) == 2 and None not in pair:
            return (pair[0], pair[1])
        raise ConfigError(f"{key_at(f.name, value)}: must be a list [low, high] of two numbers")
    raise TypeError(f"HacpoSettings.{f.name}: no coercion for type {kind}")  # a new field needs one here


def defaults_node() -> dict:
    """The `algorithm.hacpo` node of the YAML config: every key at its default, as plain data."""
    node = asdict(DEFAULTS)
    node["omega_clip"] = list(node["omega_clip"])
    return node


def _shown_default(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, tuple):
        return f"[{', '.join(str(v) for v in value)}]"
    if value == {}:
        return "{}"
    return str(value)


def markdown_table() -> str:
    """The key table of docs/ALGORITHM.md, generated from the declaration above."""
    lines = ["| key | default | § | meaning |", "|---|---|---|---|"]
    for f in fields(HacpoSettings):
        default = f.default_factory() if f.default is MISSING else f.default
        lines.append(
            f"| `{f.name}` | `{_shown_default(default)}` | {f.metadata['section']} | "
            + f.metadata["meaning"].replace("|", "\\|")
            + " |"
        )
    return "\n".join(lines)
