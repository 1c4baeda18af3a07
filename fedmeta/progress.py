"""What a run shows while it trains: the rounds' bar, whose rate is training's alone, and, once a warm
round is measured, a line saying what the rest will take (an evaluation has a bar of its own)."""

from __future__ import annotations

import logging

from lightning_fabric import Fabric
from omegaconf import DictConfig
from tqdm.auto import tqdm

log = logging.getLogger("fedmeta")

ANNOUNCED_AFTER_SECONDS = 600  # training left that is worth a line before it starts


def announce(cfg: DictConfig, round_: int, seconds: float) -> None:
    """Once the first warm round is measured: what the rest of the run will take (a paper budget on a
    CPU is hours; the bar's rate alone does not say so up front)."""
    fed = cfg.federation
    left = fed.rounds - round_
    evaluations = len(
        {r for r in range(round_ + 1, fed.rounds + 1) if r % fed.eval_every == 0} | {fed.rounds}
    )
    if left * seconds < ANNOUNCED_AFTER_SECONDS:  # a short run's bar says enough
        return
    hours = left * seconds / 3600
    took = f"{hours:.1f} h" if hours >= 1 else f"{left * seconds / 60:.0f} min"
    log.info(
        f"{left} rounds left at {seconds:.2f} s a round: about {took} of training, and {evaluations} "
        f"evaluation{'s' if evaluations > 1 else ''} (each its own bar; federation.rounds and "
        "federation.eval_every set both)"
    )


def round_bar(fabric: Fabric, cfg: DictConfig, seeds: int, engine, first: int, show_progress: bool):
    """The rounds from ``first`` with a progress bar that says once how the run runs."""
    label = (
        f"{cfg.method.name} {cfg.dataset.name}-{cfg.partition.name}"
        + (f" ×{seeds} seeds" if seeds > 1 else "")
        + f" [{fabric.device.type}, {engine.label()}]"
    )
    return tqdm(
        range(first, cfg.federation.rounds + 1),
        desc=label,
        disable=not (show_progress and fabric.is_global_zero),
        unit="round",
        initial=first - 1,
        total=cfg.federation.rounds,
        postfix="first round: its kernels and caches warm up" if first == 1 else None,
    )


def leave_out(bar, seconds: float) -> None:
    """``seconds`` (an evaluation's) out of the bar's elapsed time and rate: its rate stays the rounds'."""
    if not bar.disable:
        bar.start_t += seconds
        bar.last_print_t += seconds
