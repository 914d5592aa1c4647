"""Throughput vs memory budget, one panel per network, one line per method (like ZNNi Fig. 5/7)."""

from __future__ import annotations

from pathlib import Path

GIB = 2**30
METHODS = (
    ("znni", "znni (autotuned plan)", "tab:red", "o"),
    ("dense", "PyTorch dense dilated", "tab:blue", "s"),
    ("naive", "PyTorch naive all-offsets", "tab:gray", "^"),
)


def sweep_plot(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nets = results["networks"]
    cols = min(4, len(nets))
    rows = (len(nets) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    for ax, nres in zip(axes.flat, nets):
        for key, label, color, marker in METHODS:
            pts = sorted((r["budget"] / GIB, r[key]["voxels_per_s"]) for r in nres["sweep"] if key in r)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker=marker, color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("memory budget (GiB)")
        ax.set_ylabel("output voxels / s")
        ax.set_title(f"{nres['network']} (width {nres['width']})")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(nets) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8, loc="best")
    m = results["machine"]
    fig.suptitle(
        f"Dense inference throughput vs memory - {m['cpu']}, {results['config']['threads']} threads", fontsize=10
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
