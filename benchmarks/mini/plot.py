"""Learning curves: on-policy train reward and held-out accuracy per arm, mean over seeds."""

from __future__ import annotations

from mini.agents import PAIRS
from mini.arms import ALL_ARMS, FAMILY_ARMS
from mini.runs import step_zero_accuracy


def write_plot(path: str, summaries: list[dict], agents: dict, pair: str, smooth: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [agents[k]["agent"].name for k in PAIRS[pair]]
    fig, axes = plt.subplots(2, len(names), figsize=(6 * len(names), 8), squeeze=False)
    keys = [k for k in ALL_ARMS if any(s["arm"] == k and s["pair"] == pair for s in summaries)]
    for col, n in enumerate(names):
        ax, axv = axes[0][col], axes[1][col]
        for k in keys:
            runs = [s for s in summaries if s["arm"] == k and s["pair"] == pair]
            style = ":" if k not in FAMILY_ARMS else "-" if ALL_ARMS[k].family == "gspo" else "--"
            curves = [np.asarray(r["train_reward"][n], dtype=float) for r in runs]
            length = min(len(c) for c in curves)
            if length == 0:
                continue
            m = np.mean([c[:length] for c in curves], axis=0)
            w = max(1, min(smooth, length))
            sm = np.convolve(m, np.ones(w) / w, mode="valid")
            ax.plot(np.arange(w, length + 1), sm * 100, style, label=f"{ALL_ARMS[k].label} (n={len(runs)})")
            pts = {}
            for r in runs:
                for st, v in r["val"][n].items():
                    pts.setdefault(int(st), []).append(v)
            zero = step_zero_accuracy(summaries, runs[0], n)
            if zero is not None and 0 not in pts:
                pts[0] = [zero]
            xs = sorted(pts)
            axv.plot(xs, [np.mean(pts[x]) * 100 for x in xs], style, marker="o", label=ALL_ARMS[k].label)
        ax.set_title(f"{n}: on-policy train reward\n(T=1, moving avg {smooth} steps, mean over seeds)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("reward %")
        axv.set_title(f"{n}: held-out greedy accuracy (mean over seeds)", fontsize=10)
        axv.set_xlabel("step")
        axv.set_ylabel("accuracy %")
        ax.grid(alpha=0.3)
        axv.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
