"""The peers benchmark's figure: CPU seconds a training round of each library, per method.

    .venv/bin/python benchmarks/peers/figure.py results/peers/cpu_2026-12-03.json [--out FILE.png]

One panel a method; a bar a library (the median of its runs' per-run medians), every timed round
of every run drawn as a dot over it, the ratio to the fastest peer that is not fedmeta printed on
the bar. The machine, the threads and what ran beside (nothing: the runner runs one process at a
time) go in the title.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {"pfllib": "#0072B2", "flbench": "#E69F00"}  # Okabe–Ito: colour-blind safe
FEDMETA = "#009E73"


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--out")
    return ap


def main():
    a = arguments().parse_args()
    report = json.loads(Path(a.results).read_text())
    runs = [r for r in report["runs"] if r["exit_code"] == 0 and r["result"]]
    methods = sorted({r["method"] for r in runs})
    peers = list(dict.fromkeys(r["peer"] for r in runs))
    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 3.6), sharey=True, squeeze=False)
    for ax, method in zip(axes[0], methods):
        medians = {}
        for i, peer in enumerate(peers):
            mine = [r["result"] for r in runs if r["peer"] == peer and r["method"] == method]
            if not mine:
                continue
            medians[peer] = statistics.median(r["cpu_s_per_round"] for r in mine)
            dots = [x["cpu_s"] for r in mine for x in r["rounds"] if x["index"] in r["timed_rounds"]]
            colour = FEDMETA if peer.startswith("fedmeta") else COLOURS.get(peer, "grey")
            ax.bar(i, medians[peer], color=colour, alpha=0.8, width=0.7)
            ax.scatter([i] * len(dots), dots, color="black", s=8, zorder=3)
        others = [v for p, v in medians.items() if not p.startswith("fedmeta")]
        if others:
            fastest = min(others)
            for i, peer in enumerate(peers):
                if peer in medians:
                    ax.text(
                        i, medians[peer] * 0.5, f"{medians[peer] / fastest:.2f}×", ha="center", color="white"
                    )
        ax.set_xticks(range(len(peers)), [p.replace("fedmeta-", "fedmeta\n") for p in peers], fontsize=8)
        ax.set_title(method)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("CPU s a training round")
    machine = report["machine"]
    fig.suptitle(
        f"{machine.get('cpu_model', '?')}, one thread a process, one process at a time "
        f"(×: to the fastest peer library; dots: every timed round)",
        fontsize=8,
    )
    fig.tight_layout()
    out = Path(a.out) if a.out else Path(a.results).with_suffix(".png")
    fig.savefig(out, dpi=130)
    print(out)


if __name__ == "__main__":
    main()
