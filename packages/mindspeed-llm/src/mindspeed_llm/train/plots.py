"""The loss curve of a run, as a PNG next to its metrics."""

from __future__ import annotations

from pathlib import Path

from mindspeed_core.training import read_metrics


def plot_loss_curve(metrics_file: Path, out: Path) -> Path | None:
    """Plot training (and validation) loss against step; None when nothing was logged."""
    records = read_metrics(metrics_file) if metrics_file.is_file() else []
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(*zip(*train, strict=True), label="train")
    valid = [(r["step"], r["valid_loss"]) for r in records if "valid_loss" in r]
    if valid:
        ax.plot(*zip(*valid, strict=True), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
