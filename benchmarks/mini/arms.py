"""The compared methods: main arms and ablations, as trainer settings."""

from __future__ import annotations

from dataclasses import dataclass, field

@dataclass(frozen=True)
class Arm:
    mode: str
    group_mult: int = 1
    hacpo: dict = field(default_factory=dict)
    label: str = ""


ARMS = {
    "gspo": Arm("isolated", 1, label="GSPO (G)"),
    "gspo2x": Arm("isolated", 2, label="GSPO×2 (2G)"),
    "naive": Arm("naive", 1, label="Naive sharing (G each)"),
    "hacpo": Arm("hacpo", 1, label="HACPO (G each)"),
}

ABLATIONS = {
    "abl_no_cap_baseline": Arm("hacpo", 1, {"capability_baseline": False}, "HACPO − capability baseline"),
    "abl_no_discrepancy": Arm("hacpo", 1, {"discrepancy_coefficient": False}, "HACPO − discrepancy coefficient"),
    "abl_alpha0": Arm("hacpo", 1, {"alpha": 0.0}, "HACPO, α = 0"),
    "abl_clip_fixed": Arm("hacpo", 1, {"cross_clip": "fixed"}, "HACPO, cross clip fixed"),
    "abl_clip_none": Arm("hacpo", 1, {"cross_clip": "none"}, "HACPO, no cross clip"),
    "abl_no_guard": Arm("hacpo", 1, {"baseline_cap": "null"}, "HACPO − baseline guard"),
}

ALL_ARMS = {**ARMS, **ABLATIONS}
