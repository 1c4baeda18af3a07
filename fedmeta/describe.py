"""What a partition looks like before any training: client statistics and class histograms of
example clients (the paper's Fig. 6)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from fedmeta.data import federation_of


def client_class_counts(cfg: DictConfig) -> tuple[np.ndarray, list[int]]:
    """(clients × classes) sample counts, in client-id order, and the ids of the new clients."""
    dataset, federation = federation_of(cfg)
    clients = sorted(federation.train_clients + federation.new_clients, key=lambda c: c.id)
    labels = dataset.y.numpy()
    counts = np.stack(
        [np.bincount(labels[c.indices("all").numpy()], minlength=dataset.num_classes) for c in clients]
    )
    return counts, [c.id for c in federation.new_clients]


def statistics(counts: np.ndarray, new_clients: list[int]) -> dict:
    sizes = counts.sum(1)
    present = (counts > 0).sum(1)
    return {
        "clients": len(counts),
        "new_clients": len(new_clients),
        "samples": int(sizes.sum()),
        "samples_per_client": {
            "min": int(sizes.min()),
            "median": float(np.median(sizes)),
            "max": int(sizes.max()),
        },
        "classes_per_client": {
            "min": int(present.min()),
            "mean": float(present.mean()),
            "max": int(present.max()),
        },
        "largest_class_share": float((counts.max(1) / sizes).mean()),
    }


def plot_histograms(counts: np.ndarray, path: Path, title: str, examples: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = counts[:examples]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(shown) + 1.5))
    left = np.zeros(len(shown))
    colours = plt.get_cmap("tab20" if counts.shape[1] <= 20 else "gist_ncar")(
        np.linspace(0, 1, counts.shape[1])
    )
    for c in range(counts.shape[1]):
        ax.barh(
            range(len(shown)),
            shown[:, c],
            left=left,
            color=colours[c],
            label=str(c) if counts.shape[1] <= 20 else None,
        )
        left += shown[:, c]
    ax.set_yticks(range(len(shown)), [f"client {i}" for i in range(len(shown))])
    ax.invert_yaxis()
    ax.set_xlabel("samples per class")
    ax.set_title(title)
    if counts.shape[1] <= 20:
        ax.legend(title="class", bbox_to_anchor=(1.01, 1), loc="upper left", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe(cfg: DictConfig) -> tuple[dict, Path]:
    counts, new_clients = client_class_counts(cfg)
    path = Path(cfg.output.root) / f"{cfg.dataset.name}-{cfg.partition.name}" / "clients.png"
    plot_histograms(
        counts, path, f"{cfg.dataset.name}, {cfg.partition.name} partition: class histograms of 10 clients"
    )
    return statistics(counts, new_clients), path
