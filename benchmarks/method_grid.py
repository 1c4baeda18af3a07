"""Run several methods on one setting side by side and tabulate new-client accuracy per round budget.

    .venv/bin/python benchmarks/method_grid.py --rounds 100 --eval-every 50 --parallel 16 \\
        --methods cafeme fedavg fedavg_ft --variants paper tuned --out results/grid.json -- fabric.accelerator=cuda

Each run is a plain ``fedmeta train``; runs still going at ``--time-limit`` are stopped, and every
run is reported at each evaluated round (metrics.csv), so budgets can be compared where all runs
got. Methods without a variant are skipped for it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fedmeta.config import compose, group_choices, run_name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--variants", nargs="+", default=["paper"])
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--eval-every", type=int, required=True)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=float("inf"), help="seconds; stop runs still going")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()

    jobs = []
    for variant in args.variants:
        for method in args.methods:
            if variant == "paper" or variant in group_choices(f"variant/{method}"):
                jobs.append([f"method={method}", f"variant={variant}", f"federation.rounds={args.rounds}",
                             f"federation.eval_every={args.eval_every}", "output.overwrite=true", *args.overrides])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    started, pending, running = time.time(), list(jobs), []
    while pending or running:
        running = [p for p in running if p.poll() is None]
        while pending and len(running) < args.parallel:
            cmd = [sys.executable, "-m", "fedmeta.cli", "train", *pending.pop(0)]
            running.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if time.time() - started > args.time_limit:
            for p in running:
                p.kill()
            break
        time.sleep(2)

    rows = []
    for job in jobs:
        cfg = compose(job)
        run_dir = Path(cfg.output.root) / run_name(cfg)
        metrics = list(csv.DictReader(open(run_dir / "metrics.csv"))) if (run_dir / "metrics.csv").exists() else []
        rows.append({
            "method": cfg.method.name, "variant": cfg.variant, "rounds_done": len(metrics),
            "seconds_per_round": statistics.median(float(r["round_seconds"]) for r in metrics) if metrics else None,
            "accuracy": {int(r["round"]): float(r["eval_accuracy"]) for r in metrics if r["eval_accuracy"]},
            "accuracy_std": {int(r["round"]): float(r["eval_accuracy_std"]) for r in metrics if r["eval_accuracy"]},
            "step0_accuracy": {int(r["round"]): float(r["eval_step0_accuracy"]) for r in metrics if r["eval_accuracy"]},
        })
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"overrides": args.overrides, "rounds": args.rounds, "rows": rows}, indent=1))
    budgets = sorted(set.intersection(*(set(r["accuracy"]) for r in rows))) if rows else []
    print(f"| method | variant | s/round | " + " | ".join(f"acc @ {b} rounds" for b in budgets) + " |")
    print("|---|---|---|" + "---|" * len(budgets))
    for r in rows:
        cells = " | ".join(f"{100 * r['accuracy'][b]:.2f} ± {100 * r['accuracy_std'][b]:.2f}" for b in budgets)
        print(f"| {r['method']} | {r['variant']} | {r['seconds_per_round'] or float('nan'):.3f} | {cells} |")


if __name__ == "__main__":
    main()
