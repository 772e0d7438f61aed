"""`stalwart sim --plot PATH`: ETTR per system and policy, where the lost time went, and the spares trade-off."""

from __future__ import annotations

from pathlib import Path

from stalwart.errors import ConfigError
from stalwart.sim.engine import BADPUT, Result

COLORS = ("#1565c0", "#c62828", "#ef6c00", "#f9a825", "#37474f", "#6a1b9a")


def write(path: Path, results: list[Result], sweep: list[Result]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if path.suffix.lower() not in (".png", ".svg"):
        raise ConfigError(f"--plot {path}: give a .png or .svg file name")
    panels = 2 if sweep else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), layout="constrained", squeeze=False)
    ax = axes[0][0]
    labels = [f"{r.profile}\n{r.policy}" for r in results]
    left = [0.0] * len(results)
    for color, category in zip(COLORS, BADPUT, strict=True):
        widths = [100 * r.badput[category] for r in results]
        ax.barh(labels, widths, left=left, color=color, label=category.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, r in enumerate(results):
        ax.annotate(f" ETTR {100 * r.ettr:.1f}%", (left[y], y), va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("% of the wall time lost")
    ax.set_xlim(right=max([*left, 1.0]) * 1.35)
    ax.legend(fontsize=7, frameon=False, loc="lower right")
    ax.set_title(f"{results[0].gpus:,} GPUs, {results[0].days:g} days, {results[0].spares} spare nodes", fontsize=10)
    if sweep:
        ax2 = axes[0][1]
        xs = [max(r.spares, 0.5) for r in sweep]
        ax2.plot(xs, [r.cost_per_useful_gpu_hour for r in sweep], "o-", color=COLORS[0])
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(xs, [str(r.spares) for r in sweep])
        ax2.set_xlabel(f"spare nodes ({sweep[0].profile}, {sweep[0].policy})")
        ax2.set_ylabel("cost per useful GPU-hour")
        best = min(sweep, key=lambda r: r.cost_per_useful_gpu_hour)
        ax2.annotate(
            f"best: {best.spares}",
            (max(best.spares, 0.5), best.cost_per_useful_gpu_hour),
            textcoords="offset points",
            xytext=(0, 10),
            ha="center",
            fontsize=8,
        )
    try:
        fig.savefig(path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
