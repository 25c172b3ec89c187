"""The demo's closing report, from the metrics file verl's `file` logger wrote.

    python -m recipe_hacpo.demo_report --metrics OUT/metrics.jsonl --out OUT [--seconds S]

prints a per-agent table (held-out accuracy before and after, mean on-policy reward of the
first and last few steps, mean ω of each peer, cross rows used per step) and writes beside the
metrics `summary.json`:
`{"agents": {"<name>": {"val_before", "val_after", ...}}, "steps": int, "seconds": float}`
and `learning_curve.png` (on-policy reward per step and held-out accuracy per agent).
A metrics file without a validation before and after training is an error (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

import numpy as np

from recipe_hacpo.methods.context import agent_of, unprefixed


class ReportError(ValueError):
    pass


def read_metrics(path: str) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) per line of a verl `file` logger JSONL, in file order."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rows.append((int(rec["step"]), dict(rec["data"])))
            except (ValueError, KeyError, TypeError) as err:
                raise ReportError(f"{path}:{n}: not a metrics record ({err})") from None
    return rows


def _agents(rows) -> list[str]:
    names: list[str] = []
    for _, m in rows:
        for k in m:
            split = agent_of(k)
            if split is not None and split[0] not in names:
                names.append(split[0])
    return names


def _val(m: dict[str, float], agent: str) -> float | None:
    vals = [v for k, v in unprefixed(m, agent).items() if k.startswith("val/") and "/mean@" in k]
    return float(np.mean(vals)) if vals else None


def summarize(rows, seconds: float, window: int = 5) -> dict:
    """The summary.json content; raises ReportError when a validation is missing."""
    agents = _agents(rows)
    if not agents:
        raise ReportError("no agent/<name>/... metrics in the metrics file")
    train = [(s, m) for s, m in rows if any(k.endswith("/reward/mean") for k in m)]
    steps = max((s for s, _ in train), default=0)
    out: dict = {"agents": {}, "steps": steps, "seconds": round(float(seconds), 1)}
    for a in agents:
        curve = [(s, _val(m, a)) for s, m in rows if _val(m, a) is not None]
        if len(curve) < 2 or curve[0][0] != 0:
            raise ReportError(f"agent '{a}': needs a validation before training (step 0) and after it")
        mine = [unprefixed(m, a) for _, m in train]
        rewards = [m["reward/mean"] for m in mine if "reward/mean" in m]
        omegas: dict[str, list[float]] = {}
        cross = []
        for m in mine:
            for k, v in m.items():
                if k.startswith("omega/"):
                    omegas.setdefault(k.rsplit("/", 1)[1], []).append(v)
            if "cross/rows" in m:
                cross.append(m["cross/rows"])
        out["agents"][a] = {
            "val_before": curve[0][1],
            "val_after": curve[-1][1],
            "val_curve": [[s, v] for s, v in curve],
            "reward_first": float(np.mean(rewards[:window])) if rewards else None,
            "reward_last": float(np.mean(rewards[-window:])) if rewards else None,
            "reward_curve": rewards,
            "omega_mean": {src: float(np.mean(v)) for src, v in omegas.items()},
            "cross_rows_per_step": float(np.mean(cross)) if cross else 0.0,
        }
    return out


def table(summary: dict) -> str:
    head = ("| agent | val acc before | val acc after | reward (first → last 5 steps) | mean ω (peer) "
            "| cross rows / step |\n|---|---|---|---|---|---|")
    lines = [head]
    for name, a in summary["agents"].items():
        rew = "—" if a["reward_first"] is None else f"{a['reward_first']:.3f} → {a['reward_last']:.3f}"
        om = ", ".join(f"{v:.2f} ({k})" for k, v in a["omega_mean"].items()) or "—"
        lines.append(f"| {name} | {100 * a['val_before']:.1f} % | {100 * a['val_after']:.1f} % | {rew} | {om} "
                     f"| {a['cross_rows_per_step']:.0f} |")
    lines.append(f"{summary['steps']} steps in {summary['seconds']:.0f} s")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, a in summary["agents"].items():
        left.plot(range(1, len(a["reward_curve"]) + 1), a["reward_curve"], label=name)
        s, v = zip(*a["val_curve"])
        right.plot(s, [100 * x for x in v], marker="o", label=name)
    left.set(title="on-policy train reward", xlabel="step", ylabel="mean reward")
    right.set(title="held-out accuracy (greedy)", xlabel="step", ylabel="accuracy %")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--metrics", required=True, help="JSONL written by verl's file logger")
    p.add_argument("--out", required=True, help="folder for summary.json and learning_curve.png")
    p.add_argument("--seconds", type=float, default=0.0, help="wall time of the run, for summary.json")
    a = p.parse_args(argv)
    try:
        summary = summarize(read_metrics(a.metrics), a.seconds)
    except (OSError, ReportError) as err:
        print(f"error: {a.metrics}: {err}", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(summary, os.path.join(a.out, "learning_curve.png"))
    print(table(summary))
    print(f"wrote {os.path.join(a.out, 'summary.json')} and {os.path.join(a.out, 'learning_curve.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
