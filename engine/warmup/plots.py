"""PNG plots of a warmup profile: step latency over the bucket grid, and each strategy's padding
waste."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    return plt


def latency_plot(entries: list[dict], phase: str, size_key: str, path: Path) -> Path | None:
    """Each bucket at (size, batch size), coloured by its median step latency."""
    rows = [e for e in entries if e["phase"] == phase]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = ax.scatter(
        [e[size_key] for e in rows],
        [e["batch_size"] for e in rows],
        c=[e["latency_s"] * 1e3 for e in rows],
        s=60,
        cmap="viridis",
    )
    fig.colorbar(points, ax=ax, label="median step latency (ms)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel(size_key.replace("_", " "))
    ax.set_ylabel("batch size")
    ax.set_title(f"{phase} step latency per bucket ({len(rows)} buckets)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def waste_plot(reports: list[dict], path: Path) -> Path:
    """Grouped bars: prefill token waste, decode row waste and decode block waste per strategy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [
        ("prefill tokens", lambda r: r["prefill"]["waste"]),
        ("decode rows", lambda r: r["decode"]["waste"]),
        ("decode blocks", lambda r: r["decode"]["block_waste"]),
    ]
    width = 0.8 / len(series)
    for i, (label, value) in enumerate(series):
        ax.bar(
            [x + i * width for x in range(len(reports))],
            [100 * value(r) for r in reports],
            width,
            label=label,
        )
    ax.set_xticks([x + width for x in range(len(reports))])
    ax.set_xticklabels([f"{r['strategy']}\n{r['graphs']} graphs" for r in reports])
    ax.set_ylabel("padding waste on the trace (%)")
    ax.set_title("padding waste of each bucket strategy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
