"""Tables and figures from the finished runs of a preset (``runs/<preset>/<setting>/<method>/seed<s>/``):
``results/TABLES.md`` in the paper's layout with the paper's numbers beside ours, and the paper's
figures as PNG files. Only what the runs gave is shown; a missing run leaves a blank, never a guess.

Every finished run's small files (config, metrics, curves, summary, later evaluations, the grid command
that ran it: a few KB, no checkpoint) are first copied to ``results/runs/<preset>/``, which is committed;
the tables and figures are drawn from there, so ``fedmeta table --no-run`` rebuilds them from a fresh
clone and every number in them leads back to the run, its command, its config and its round-by-round
metrics."""

from __future__ import annotations

import csv
import functools
import logging
import os
import re
import shutil
import statistics
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from fedmeta.config import CONFIG_DIR, method_card, user_config_dir
from fedmeta.errors import FedmetaError
from fedmeta.runs import read_summary, rewinds

log = logging.getLogger("fedmeta")


@functools.cache
def _method_name(method: str) -> str:
    """The method's ``label`` in its config file; a run of a method no config names keeps its name."""
    try:
        return method_card(method).label
    except FedmetaError:
        return method


def method_label(method: str, runs: list[Path] = ()) -> str:
    """A row's name: "FedRep", or with its variant "FedRep (authors)"; a tuned variant says how many
    trials it is the best of, and which: "FedRep (tuned: trial 12 of 20)" — when its ``runs`` (their
    folders) ran the values the method's tuned.yaml holds now, else that they ran an earlier study's."""
    name, _, variant = method.partition("-")
    if variant == "tuned":
        variant += _tuning_record(name, runs)
    return _method_name(name) + (f" ({variant})" if variant else "")


def _tuning_record(method: str, runs: list[Path]) -> str:
    """ ": trial k of n" from the header fedmeta tune wrote into the method's tuned.yaml."""
    path = next(
        (
            d / "variant" / method / "tuned.yaml"
            for d in (user_config_dir(), CONFIG_DIR)
            if (d / "variant" / method / "tuned.yaml").is_file()
        ),
        None,
    )
    if path and any(not _ran(run, OmegaConf.load(path)) for run in runs):
        return ": an earlier study's values, not those of tuned.yaml now"
    header = path.read_text()[:1000] if path else ""
    picked = re.search(r"\(trial (\d+) of (\d+)\)", header)
    if picked:
        return f": trial {picked[1]} of {picked[2]}"
    counted = re.search(r"The best of (\d+) trials", header)  # written before the trial was recorded
    return f": best of {counted[1]} trials" if counted else ""


def _ran(run: Path, tuned: DictConfig) -> bool:
    """Whether the run in folder ``run`` used every value of ``tuned`` (a run without its config: unknown, yes)."""
    if not (run / "config.yaml").is_file():
        return True
    config = OmegaConf.load(run / "config.yaml")
    flat = [(f"{section}.{key}", value) for section, keys in tuned.items() for key, value in keys.items()]
    return all(OmegaConf.select(config, key, default=None) == value for key, value in flat)


RUN_FILES = ("config.yaml", "metrics.csv", "curves.csv", "summary.json", "evaluations.jsonl", "model.pt")
COMMAND_FILE = "command.txt"  # the grid command that ran the run, written beside its summary


def finished_runs(root: Path) -> dict[Path, int]:
    """The summary.json of every finished run under ``root`` → its modification time (ns)."""
    return {path: path.stat().st_mtime_ns for path in root.glob("*/*/seed*/summary.json")}


def record_command(root: Path, before: dict[Path, int], command: str, launched: set[Path]) -> list[Path]:
    """Write ``command`` beside every summary under ``root`` that is new since ``before``
    (:func:`finished_runs`) and whose folder is one the command ran (``launched``): a grid running
    beside it in the same folder finishes runs too, and those are not its. Returns their folders."""
    fresh = [
        path.parent
        for path, mtime in finished_runs(root).items()
        if before.get(path) != mtime and path.parent in launched
    ]
    for folder in fresh:
        (folder / COMMAND_FILE).write_text(command + "\n")
    return sorted(fresh)


def archive(runs_root: Path, kept_root: Path) -> int:
    """Copy the small files of every finished run under ``runs_root`` to the same place under
    ``kept_root``; returns how many runs were copied."""
    copied = 0
    for summary in sorted(runs_root.glob("*/*/seed*/summary.json")):
        target = kept_root / summary.parent.relative_to(runs_root)
        if problem := rewinds(summary.parent, target):  # a shorter run of the same folder: the kept one stays
            log.warning(problem)
            continue
        copied += 1
        target.mkdir(parents=True, exist_ok=True)
        for name in RUN_FILES:
            if (summary.parent / name).exists():
                shutil.copy2(summary.parent / name, target / name)
        command = summary.parent / COMMAND_FILE
        # older than the summary: the run was replaced since (fedmeta train output.overwrite=true)
        if command.is_file() and command.stat().st_mtime_ns >= summary.stat().st_mtime_ns:
            shutil.copy2(command, target / COMMAND_FILE)
        else:
            (target / COMMAND_FILE).unlink(missing_ok=True)
    return copied


def collect(root: Path) -> dict[tuple[str, str], list[dict]]:
    """(setting, method folder) → the summaries of its finished seeds, each with its metrics rows."""
    runs = defaultdict(list)
    for path in sorted(root.glob("*/*/seed*/summary.json")):
        if any(p.is_symlink() for p in (path, *path.parents[:3], path.parent / "metrics.csv")):
            log.warning(
                f"skipping {path.parent}: a symbolic link there may lead anywhere; replace it with the file"
            )
            continue
        summary = read_summary(path)
        if summary is None or not (path.parent / "metrics.csv").is_file():
            continue
        config = path.parent / "config.yaml"
        try:
            with open(path.parent / "metrics.csv", encoding="utf-8") as f:
                summary["metrics"] = [row for row in csv.DictReader(f) if row.get("eval_accuracy")]
            planned = OmegaConf.load(config).federation.rounds if config.exists() else None
        except Exception as exc:  # noqa: BLE001 — a cut-short, edited or foreign file: that run is skipped
            log.warning(
                f"skipping {path.parent}: its metrics.csv or config.yaml cannot be read ({type(exc).__name__})"
            )
            continue
        if not all(_evaluated_row(row) for row in summary["metrics"]):
            log.warning(
                f"skipping {path.parent}: its metrics.csv holds an evaluated round whose round or accuracy "
                "is not one a run writes; delete that run and run it again"
            )
            continue
        if planned is not None and summary.get("rounds") is not None and summary["rounds"] > planned:
            log.warning(
                f"skipping {path.parent}: its summary has {summary['rounds']} rounds, its config {planned}"
            )
            continue
        summary["folder"] = path.parent
        summary["command"] = _command(path.parent / COMMAND_FILE)
        runs[(path.parts[-4], path.parts[-3])].append(summary)
    return runs


def _evaluated_row(row: dict) -> bool:
    """A metrics.csv row with an evaluation reads as one: a round ≥ 1 and an accuracy in [0, 1]."""
    try:
        return int(row["round"]) >= 1 and 0.0 <= float(row["eval_accuracy"]) <= 1.0
    except (KeyError, TypeError, ValueError):
        return False


RECORDED_AFTERWARDS = "# recorded afterwards"  # a command.txt's second line: not the command that ran it


def _command(path: Path) -> str | None:
    """The recorded command of a run (its file's first line), on one line, with `` (recorded
    afterwards)`` where the file says the command was matched to the run later; None where none
    was recorded or it does not read."""
    if not path.is_file():  # absent, or a pipe whose read would block
        return None
    try:
        first, _, rest = path.read_text().partition("\n")
    except (OSError, ValueError):  # unreadable, or not text
        return None
    command = " ".join(first.split())
    if command and rest.startswith(RECORDED_AFTERWARDS):
        return command + AFTERWARDS
    return command or None


AFTERWARDS = " (recorded afterwards)"


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _dataset(setting: DictConfig) -> str | None:
    """The data set a preset's setting names (``dataset=<name>`` among its overrides), if any."""
    return next(
        (o.split("=", 1)[1] for o in setting.get("overrides") or [] if o.startswith("dataset=")), None
    )


def _paper_rounds(setting: DictConfig) -> int | None:
    """The paper's round budget for a setting: its data set's ``protocol.rounds``."""
    name = _dataset(setting)
    path = CONFIG_DIR / "dataset" / f"{name}.yaml"
    return OmegaConf.load(path).protocol.rounds if name and path.is_file() else None


def _tuned(method: str) -> bool:
    return method.partition("-")[2] == "tuned"


def write_tables(preset_name: str, preset: DictConfig, root: Path, out: Path, runs: dict) -> str:
    """The preset's section of TABLES.md from ``runs`` (:func:`collect` of ``root``), in place of
    that preset's earlier section (the other presets' stay as they are): accuracy mean ± std over
    seeds, the budget in each column's header, the paper's number and the difference only where
    the runs had the paper's budget, the tuned methods in a block of their own; then the budget,
    hardware and wall time of every cell."""
    paper = OmegaConf.load(CONFIG_DIR / "paper_results.yaml")
    settings = [name for name, s in preset.settings.items() if s.grid == "table"]
    methods = list(preset.methods)
    shown = [s for setting in settings for method in methods for s in runs.get((setting, method), [])]
    paper_rounds = {setting: _paper_rounds(preset.settings[setting]) for setting in settings}
    firsts = [done[0] for setting in settings for method in methods if (done := runs.get((setting, method)))]

    def budget(setting: str) -> str:
        rounds = sorted({s["rounds"] for m in methods for s in runs.get((setting, m), [])})
        trained = [str(r) for r in rounds if r]
        if not trained:
            return "no runs" if not rounds else "no rounds trained"
        # a chain's scoring stage trains none: it scores the model of the stage before it
        return f"{'/'.join(trained)} rounds" + ("; stages that only score: 0" if 0 in rounds else "")

    def at_paper_budget(summaries: list[dict], setting: str) -> bool:
        return bool(summaries) and all(s["rounds"] == paper_rounds[setting] for s in summaries)

    compared = any(at_paper_budget(runs.get((st, m), []), st) for st in settings for m in methods)
    lines = [
        f"## Preset `{preset_name}`",
        "",
        f"The plan: {preset.description}. New-client accuracy (%) after each method's test-time personalization "
        f"of at most {_steps(runs)} steps ({_rule_said(shown)}; 0 steps: scored as trained{_decay(firsts)}): "
        "the mean ± the standard deviation over seeds (n: the seeds of the cell that have finished, which may be "
        "fewer than planned; one seed has no spread) — what ± means in every table of this file. Each column's "
        "header gives the rounds its runs trained. "
        + (
            "Beside a cell whose runs trained the paper's rounds: the paper's number (5 seeds) and ours minus it (Δ), "
            "where the paper reports one"
            + (
                " — the paper scored each method at its own step size, so where a cell's step size was chosen by "
                "validation, Δ measures the rule as well as the run. "
                if any(s.get("lr_rule") == "selected" for s in shown)
                else ". "
            )
            if compared
            else "No cell here trained the paper's rounds (1000 for RMNIST and CIFAR-10, 2000 for FEMNIST and "
            "Meta-Dataset), so the paper's numbers are not set beside them: the difference would mostly measure "
            "the budget. "
        )
        + BEST_RULE
        + " Tuned methods are a block of their own.",
        "",
        *[f"**{setting}:** {note}" + "\n" for setting, note in (preset.get("notes") or {}).items()],
        f"Written {datetime.now(UTC):%Y-%m-%d %H:%M} UTC from `{root}/`. The commands that ran its cells:",
        "",
        *_commands(shown),
        "",
    ]
    blocks = [("", [m for m in methods if not _tuned(m)]), ("tuned", [m for m in methods if _tuned(m)])]
    for block, members in blocks:
        if members:
            lines += _table_block(block, members, settings, runs, paper, budget, at_paper_budget)
    lines += _training_block(methods, settings, runs, budget)
    lines += _cell_costs(preset_name, settings, methods, runs)
    text = "\n".join(lines) + "\n"
    replace_section(out, preset_name, text)
    return text


BEST_RULE = (
    "In bold: in each column and block, the highest mean among the cells that share their rounds and their "
    "n, whatever their test-time procedure (a cell with no such peer is not bold, cells with other rounds or "
    "n are not compared with it, and means that print the same are all bold). † beside a mean: a cell of "
    "the same group whose mean is within the bold mean's standard deviation over seeds of it, a difference "
    "its seeds do not settle."
)
TIE = "†"


def _hundredths(value: float) -> int:
    """``value`` as printed with two decimals, in hundredths: what the bold and the † compare."""
    return round(float(f"{value:.2f}") * 100)


def _standing(cells: dict[tuple[str, str], list[float]], rounds: dict) -> dict[tuple[str, str], str]:
    """Each cell (setting, method) of one block → "best" (bold), "tie" (†) or nothing, from its values
    over seeds (%): among the cells of its column with its rounds (``rounds[cell]``) and its n, the
    highest mean as printed is the best (several where they print the same); a cell whose mean is
    within the best one's sd over seeds of it (the largest such sd where several tie) is a tie its
    seeds do not settle. A cell with no such peer has no standing; the test-time procedure is not
    looked at: the best is the best whatever steps and step size it took."""
    groups = defaultdict(list)
    for (setting, method), values in cells.items():
        groups[(setting, rounds.get((setting, method)), len(values))].append((setting, method))
    standing = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        printed = {key: tuple(map(_hundredths, _mean_std(cells[key]))) for key in members}
        best = max(mean for mean, _ in printed.values())
        reach = max(sd for mean, sd in printed.values() if mean == best)
        for key, (mean, _) in printed.items():
            if mean == best:
                standing[key] = "best"
            elif best - mean <= reach:
                standing[key] = "tie"
    return standing


def _model_rounds(summary: dict) -> int:
    """The rounds behind the model a run scored: its own, or, for a chain's stage that only scores
    (0 rounds), those of the stage whose model it took: what bold compares cells by."""
    if summary["rounds"] == 0 and summary.get("init_from"):
        return summary["init_from"].get("rounds") or 0
    return summary["rounds"]


def _rule_said(shown: list[dict]) -> str:
    """The caption's words on step sizes: one rule for all (chosen by validation), or each method's own."""
    rules = {s.get("lr_rule", "method") for s in shown}
    if rules == {"selected"}:
        return (
            "every method that takes steps at the step size one rule chose for it: the best of the same grid on "
            'validation clients, at each evaluation (docs/protocol.md, "Equal footing"); the last column gives '
            "the steps and the grid, a cell the step size each seed chose; every training client trained on its "
            "data less the test split the rule keeps out"
        )
    said = (
        "the last column gives each method's steps and step size, its own (the paper's values, "
        "`personalization.lr_rule=method`), which differ between methods: a column compares step sizes as much "
        "as methods, and its bold is the best at these step sizes, not under one rule (docs/protocol.md, "
        '"Equal footing"; the presets `cpu_fair` and `headline` use one rule)'
    )
    return said if rules == {"method"} else said + "; cells whose step size was chosen by validation say so"


def _chosen(summaries: list[dict]) -> str:
    """ "<br>lr 0.1, 0.03, 0.1": the step size each seed's last evaluation chose, where one was chosen."""
    chosen = [s["personalization_lr"] for s in summaries if s.get("lr_selection")]
    if not chosen:
        return ""
    return "<br>chosen lr " + ", ".join(f"{lr:g}" for lr in chosen)


def _marked(mean: float, standing: str | None) -> str:
    """A cell's mean as printed: bold where it is the best, † where the seeds do not settle it apart."""
    return {"best": f"**{mean:.2f}**", "tie": f"{mean:.2f}{TIE}"}.get(standing, f"{mean:.2f}")


def _table_block(
    block: str, members: list[str], settings: list[str], runs: dict, paper, budget, at_paper_budget
) -> list[str]:
    """One block of the table (the methods as configured, or the tuned ones): a row per method, the
    best mean of each column's cells of equal rounds and n in bold whatever their test-time procedure
    and † beside those its seeds do not settle apart from it (:func:`_standing`), the paper's number
    beside a cell at the paper's budget, each method's test-time steps and step size last."""
    lines = []
    if block:
        lines += [
            "Tuned: each method with the settings `fedmeta tune` found (configs/variant/<method>/tuned.yaml, "
            "the study's best trial; searched on a seed these cells do not use). Compare them with each other, "
            "and with the block above only as far as their n allows.",
            "",
        ]
    lines += [
        "| method | "
        + " | ".join(f"{setting} ({budget(setting)})" for setting in settings)
        + " | new clients' test-time procedure |",
        "|---|" + "---|" * len(settings) + "---|",
    ]

    standing = _standing(
        {
            (setting, m): [100 * s["accuracy"] for s in runs[(setting, m)]]
            for setting in settings
            for m in members
            if runs.get((setting, m))
        },
        {key: tuple(sorted({_model_rounds(s) for s in done})) for key, done in runs.items()},
    )
    for method in members:
        cells = []
        for setting in settings:
            summaries = runs.get((setting, method), [])
            if not summaries:
                cells.append("–")
                continue
            mean, std = _mean_std([100 * s["accuracy"] for s in summaries])
            value = _marked(mean, standing.get((setting, method)))
            cell = value + (f" ± {std:.2f}" if len(summaries) > 1 else "") + f" (n={len(summaries)})"
            cell += _chosen(summaries)
            if method in paper.get(setting, {}) and at_paper_budget(summaries, setting):
                paper_mean, paper_std = paper[setting][method]
                cell += f"<br>paper {paper_mean:.2f} ± {paper_std:.2f}, Δ {mean - paper_mean:+.2f}"
            cells.append(cell)
        folders = [s["folder"] for setting in settings for s in runs.get((setting, method), [])]
        lines.append(
            f"| {method_label(method, folders)} | "
            + " | ".join(cells)
            + f" | {_procedures([runs[(st, method)][0] for st in settings if runs.get((st, method))])} |"
        )
    lines.append("")
    return lines


def _training_block(methods: list[str], settings: list[str], runs: dict, budget) -> list[str]:
    """The training clients' accuracy where the runs scored them too (``evaluation.protocol=both``):
    the mean over seeds of each run's mean over clients ± its sd over seeds, and, after the slash, the
    same of the sample-weighted accuracy the peer libraries print; the mean over clients bold and †
    as the new clients' are (:func:`_standing`, the tuned methods apart), and which methods were
    scored as trained (0 steps: they keep a model per client)."""
    scored = {
        key: [s["training_clients"] for s in summaries if "training_clients" in s]
        for key, summaries in runs.items()
    }
    if not any(scored.values()):
        return []
    rounds = {
        key: tuple(sorted({_model_rounds(s) for s in done if "training_clients" in s}))
        for key, done in runs.items()
    }
    standing = {}
    for tuned in (False, True):
        standing |= _standing(
            {
                (setting, m): [100 * b["accuracy"] for b in scored[(setting, m)]]
                for setting in settings
                for m in methods
                if _tuned(m) == tuned and scored.get((setting, m))
            },
            rounds,
        )
    kept = [
        _label_of(m, settings, runs)
        for m in methods
        if any(_kept_as_trained(runs.get((st, m), [])) for st in settings)
    ]
    lines = [
        "The same runs' **training clients**, each scored on a test split kept out of its training with "
        "the model its method keeps for it (docs/protocol.md): mean over clients / sample-weighted, each "
        "the mean ± sd over seeds; the two agree where every client's test split has the same size. "
        + (
            f"Scored as trained, 0 steps: the methods that keep a model per client ({', '.join(kept)}); "
            "the others' training clients take their new clients' steps at their step size (the last column "
            "above) on their own training data. "
            if kept
            else "Each method's training clients take its new clients' steps at its step size (the last column "
            "above) on their own training data. "
        )
        + "Bold and † as above, on the mean over clients.",
        "",
        "| method | " + " | ".join(f"{setting} ({budget(setting)})" for setting in settings) + " |",
        "|---|" + "---|" * len(settings),
    ]
    for method in methods:
        cells = []
        for setting in settings:
            blocks = scored.get((setting, method), [])
            if not blocks:
                cells.append("–")
                continue
            mean, std = _mean_std([100 * b["accuracy"] for b in blocks])
            weighted, weighted_std = _mean_std([100 * b["weighted_accuracy"] for b in blocks])
            spread = len(blocks) > 1
            cells.append(
                _marked(mean, standing.get((setting, method)))
                + (f" ± {std:.2f}" if spread else "")
                + f" / {weighted:.2f}"
                + (f" ± {weighted_std:.2f}" if spread else "")
                + f" (n={len(blocks)})"
            )
        if any(c != "–" for c in cells):
            lines.append(f"| {_label_of(method, settings, runs)} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _label_of(method: str, settings: list[str], runs: dict) -> str:
    """``method``'s row name from its runs in ``settings`` (a tuned one's record of its trial)."""
    return method_label(
        method, [s["folder"] for setting in settings for s in runs.get((setting, method), [])]
    )


def _cell_costs(preset_name: str, settings: list[str], methods: list[str], runs: dict) -> list[str]:
    """Every cell's seeds, rounds, seconds per round, wall time, hardware and what ran beside it."""
    lines = [
        f"### Every cell of `{preset_name}`: budget, hardware, wall time",
        "",
        "*beside*: the cores other processes kept busy while its rounds trained, the median over its "
        "runs' rounds (- where the runs are older than that measure).",
        "",
        "| setting | method | seeds | rounds | s/round (median) | wall time per run | hardware | beside |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for setting in settings:
        for method in methods:
            summaries = runs.get((setting, method), [])
            per_round = [s["seconds_per_round"] for s in summaries if s.get("seconds_per_round") is not None]
            beside = [s["beside_cores"] for s in summaries if s.get("beside_cores") is not None]
            if summaries:  # a chain's scoring stage trains no rounds: no time per round
                lines.append(
                    f"| {setting} | {method} | {','.join(str(s['seed']) for s in summaries)} | "
                    f"{'/'.join(sorted({str(s['rounds']) for s in summaries}))} | "
                    f"{f'{statistics.median(per_round):.2f}' if per_round else '-'} | "
                    f"{statistics.mean(s['seconds'] for s in summaries) / 60:.1f} min | "
                    f"{'; '.join(sorted({s.get('hardware', s['device']) for s in summaries}))} | "
                    f"{f'{statistics.median(beside):.2f}' if beside else '-'} |"
                )
    return lines


def _adapts_first(folders: list[Path]) -> bool:
    """Whether the method's new clients take steps of its own before the shared ones (FedMeta): its
    personalization curve's step 0 is then not the global model's."""
    try:
        return bool(OmegaConf.load(folders[0] / "config.yaml").method.get("test_inner_steps"))
    except Exception:  # noqa: BLE001 — no run, or a config that cannot be read
        return False


OWN_STEPS_FIRST = {
    "test_head_steps": "head",
    "test_bn_steps": "batch norm",
    "test_local_steps": "local layers",
}


def _test_time(folder: Path) -> dict | None:
    """A run's test-time procedure from the config.yaml it kept: its steps, its step size (or the
    grid one is chosen from at each evaluation) and its decay; None where no config can be read."""
    try:
        cfg = OmegaConf.load(Path(folder) / "config.yaml")
        pers = cfg.personalization
        return {
            "steps": int(pers.steps),
            "lr": float(pers.lr),
            "decay": float(pers.decay),
            "decay_every": int(pers.decay_every),
            "grid": tuple(pers.lr_grid) if pers.get("lr_rule") == "selected" else None,
        }
    except Exception:  # noqa: BLE001 — no run, or a config that cannot be read: nothing to say
        return None


def _kept_as_trained(done: list[dict]) -> bool:
    """Whether a cell's training clients were scored as their method keeps a model for each, no step
    taken (their curve one point long) where its new clients take steps (their curve longer)."""
    return any(
        len(s["training_clients"].get("curve") or [None, None]) == 1 and len(s.get("curve") or []) > 1
        for s in done
        if "training_clients" in s
    )


def _step_size(spec: dict) -> str:
    """ "lr 0.01", or the grid a step size is chosen from (``personalization.lr_rule=selected``)."""
    if spec["grid"]:
        return f"a step size chosen at each evaluation from {', '.join(f'{v:g}' for v in spec['grid'])}"
    return f"lr {spec['lr']:g}"


def _decay(firsts: list[dict]) -> str:
    """ "; every step size decays ×0.8 every 5 steps" where the runs that take steps agree on it."""
    decays = {
        (spec["decay"], spec["decay_every"])
        for summary in firsts
        if (spec := _test_time(summary["folder"])) and spec["steps"]
    }
    if len(decays) > 1:
        return "; each run's step size decays as its config.yaml states"
    if not decays:
        return ""
    decay, every = decays.pop()
    if decay == 1:
        return "; a constant step size"
    return f"; every step size decays ×{decay:g} every {every} step{'s' if every != 1 else ''}"


def procedure(folders: list[Path]) -> str:
    """How a method's new clients were scored, from the config its first run kept: the shared
    steps and their step size, and what the method does before or within them (a table's reader
    sees that rows differ in more than training)."""
    try:
        cfg = OmegaConf.load(folders[0] / "config.yaml")
        steps, lr, method = cfg.personalization.steps, cfg.personalization.lr, cfg.method
    except Exception:  # noqa: BLE001 — no run, or a config that cannot be read: nothing to say
        return "–"
    spec = _test_time(folders[0])
    at = _step_size(spec) if spec else f"lr {lr:g}"
    said = [f"{steps} steps at {at}" if steps else "scored as trained (0 steps)"]
    if method.get("test_inner_steps"):  # FedMeta: its step 0 is after its own adaptation
        n = method.test_inner_steps
        said.insert(
            0, f"{n} of its own adaptation step{'s' if n != 1 else ''} first (its step 0 comes after)"
        )
    said += [
        f"the first {method[key]} on its {what} alone"
        for key, what in OWN_STEPS_FIRST.items()
        if method.get(key)
    ]
    if method.get("algorithm") == "apfl":
        said.append("on the mix α·v + (1−α)·w, which moves at about 0.75 of the step at α = 0.5")
    if method.get("algorithm") == "pfedme":
        said.append("on pFedMe's Moreau-envelope problem (λ keeps them near the global model)")
    if method.get("algorithm") == "fedproto":
        said.append("from the initial model, on FedProto's loss with the global prototypes")
    if method.get("algorithm") == "fedpac":
        said.append("on FedPAC's loss with the global centroids, from the averaged extractor and head")
    if method.get("algorithm") == "fedrod":
        said.append("on a personalized head alone, from zero, over the trained generic model")
    if method.get("algorithm") == "fedgh":
        said.append("from the initial extractor under the global header")
    if method.get("algorithm") == "pfedhn":
        said.append("from the model the hypernetwork makes for the mean embedding")
    return "; ".join(said)


def _procedures(firsts: list[dict]) -> str:
    """A table row's test-time procedure from each setting's first run: one, or each with the data
    sets it holds for where they differ (Meta-Dataset's step size is not RMNIST's)."""
    held = defaultdict(list)
    for summary in firsts:
        datasets = held[procedure([summary["folder"]])]
        if summary.get("dataset") not in datasets:
            datasets.append(summary.get("dataset"))
    if len(held) <= 1:
        return next(iter(held), "–")
    return "<br>".join(f"{said} ({', '.join(map(str, datasets))})" for said, datasets in held.items())


# a command that names one method and one seed (no second number follows it)
ONE_RUN = re.compile(r"--methods (\S+) --seeds (\d+)(?!\s+\d)(?=\s|$)")


def _commands(summaries: list[dict]) -> list[str]:
    """One list item per distinct recorded command of ``summaries``, with how many runs it ran,
    sorted (a rewrite from the same runs gives the same lines); the runs without one counted last.
    Commands that each ran one method's one seed and differ in nothing else are one item that
    names the method and seed of each (a queue of one-run commands would otherwise fill the list);
    commands recorded afterwards are items of their own that say so."""
    counts = Counter(s["command"] for s in summaries)
    unrecorded = counts.pop(None, 0)
    items = {}
    singles = defaultdict(list)  # (the command with M and N for its method and seed, afterwards) → its runs
    for command, n in counts.items():
        afterwards = command.endswith(AFTERWARDS)
        command = command.removesuffix(AFTERWARDS)
        if n == 1 and (named := ONE_RUN.search(command)):
            template = ONE_RUN.sub("--methods M --seeds N", command, count=1)
            singles[(template, afterwards)].append((named[1], int(named[2]), command))
        else:
            items[(command, afterwards)] = f"`{command}` ({_runs(n)}"
    for (template, afterwards), runs in singles.items():
        if len(runs) == 1:
            items[(runs[0][2], afterwards)] = f"`{runs[0][2]}` (1 run"
            continue
        seeds = defaultdict(list)
        for method, seed, _ in sorted(runs):
            seeds[method].append(str(seed))
        each = "; ".join(f"{method} {', '.join(s)}" for method, s in seeds.items())
        items[(template, afterwards)] = f"`{template}` ({_runs(len(runs))}, a command each; M N: {each}"
    recorded = [
        f"- {items[key]}"
        + (
            "; recorded afterwards: the command that ran them was not kept, and each run's config.yaml is the "
            "one this command composes, so it reproduces them)"
            if key[1]
            else ")"
        )
        for key in sorted(items)
    ]
    return [*recorded, *([f"- command not recorded ({_runs(unrecorded)})"] if unrecorded else [])] or [
        "- none yet"
    ]


def _runs(n: int) -> str:
    return f"{n} run" + ("" if n == 1 else "s")


TABLES_TITLE = (
    "# Results\n\nOne section per preset, each written by `fedmeta table --preset <name>`. Two rules set the "
    'step size new clients are fine-tuned at (docs/protocol.md, "Equal footing"): most presets give each '
    "method its own, the paper's (CAFeMe's larger than its baselines'), so their columns compare step sizes as "
    "much as methods; `headline` and `cpu_fair` give every method a step size chosen the same way, by "
    "validation. Each section's caption says which.\n"
)


def replace_section(path: Path, name: str, text: str) -> None:
    """``path`` with the section of preset ``name`` (between its markers) replaced by ``text``, or
    added; written to a temporary file and renamed, so a reader never sees half a file."""
    start, end = f"<!-- preset {name} -->", f"<!-- end of preset {name} -->"
    old = path.read_text() if path.exists() else TABLES_TITLE
    if not old.startswith(
        "# Results\n"
    ):  # a file from before sections: every table in it is rebuilt from results/runs/
        old = TABLES_TITLE
    block = f"{start}\n{text}{end}\n"
    if start in old and end in old:
        new = old[: old.index(start)] + block + old[old.index(end) + len(end) + 1 :]
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new)
    os.replace(tmp, path)


def _steps(runs) -> int:
    # the longest curve: a method that does not personalize (FedAvg) has only step 0
    return max((len(s["curve"]) - 1 for summaries in runs.values() for s in summaries), default=50)


def log_report(
    preset_name: str, preset: DictConfig, runs: dict, written: list[Path], settings: DictConfig
) -> None:
    """The table of ``runs`` (as a W&B table) and the files just written (TABLES.md, the figures: as
    images and as one artifact) to a W&B run of their own, job type "report", in the project and
    mode of ``settings`` (a config's ``wandb`` section; $WANDB_MODE wins)."""
    mode = os.environ.get("WANDB_MODE", settings.mode)
    if mode == "disabled":
        return
    import wandb

    rows = [
        [
            setting,
            method,
            *_mean_std([100 * s["accuracy"] for s in runs[(setting, method)]]),
            len(runs[(setting, method)]),
        ]
        for setting in preset.settings
        for method in preset.methods
        if runs.get((setting, method))
    ]
    Path("runs").mkdir(exist_ok=True)
    with wandb.init(
        project=settings.project,  # where the runs log
        name=f"report-{preset_name}",
        group="report",
        job_type="report",
        mode=mode,
        dir=str(Path("runs").resolve()),
        reinit="create_new",
        settings=wandb.Settings(silent=True, console="off"),
    ) as run:
        run.log(
            {
                "table": wandb.Table(columns=["setting", "method", "accuracy", "std", "seeds"], data=rows),
                **{
                    f"figures/{path.stem}": wandb.Image(str(path))
                    for path in written
                    if path.suffix == ".png"
                },
            }
        )
        files = wandb.Artifact(f"report-{preset_name}", type="report")
        for path in written:
            files.add_file(str(path))
        run.log_artifact(files)


MIN_EVALUATIONS = 3  # a convergence curve needs this many evaluated rounds to be drawn
PANEL_METHODS = 8  # more methods than this in one figure: one row of panels per family
MARKERS = "osD^vP*Xh<>p"
# the project's method: drawn in every family's row, in one look, as the common yardstick
REFERENCE = "cafeme"
REFERENCE_LOOK = {"color": "black", "marker": "o", "linestyle": "-"}
OTHER = "other"  # the family of a method FAMILIES does not name: drawn in a row of its own, never left out
FAMILIES = {  # family → its methods (a variant, "fedrep-tuned", is its method's); the rows of a crowded figure
    "meta-learning": ("cafeme", "perfedavg", "fedmeta_maml", "fedmeta_metasgd", "pfedme"),
    "a global model, fine-tuned or regularized, or none (Local)": (
        "fedavg",
        "fedavg_ft",
        "fedprox",
        "scaffold",
        "feddyn",
        "ditto",
        "local",
    ),
    "a shared body, personal layers or prototypes": (
        "fedrep",
        "fedper",
        "fedbabu",
        "lgfedavg",
        "fedbn",  # its batch norm stays with each client: personal layers, as FedPer's head
        "fedrod",
        "fedpac",
        "fedproto",
    ),
    "clusters and interpolation": ("ifca", "ifca_ft", "apfl", "fedala"),
    # families added after the first ones, last: the looks of the earlier methods stay as they were
    "a global model, its local updates contrasted or normalized": ("moon", "fednova"),
    "a model per client, mixed from the others' on the server": ("fedamp", "fedfomo"),
    "features split per client; a header or models trained by the server": (
        "fedgh",
        "feddbe",
        "gpfl",
        "fedcp",
        "pfedhn",
    ),
}
LINE_AND_BAND = (
    "Line: the mean over seeds (a method with one point: a marker alone); band: ± 1 standard deviation over "
    "seeds, drawn only where a method has n ≥ 2 seeds (at a single point: a bar)."
)
POINT_AND_BAR = "Point: the mean over seeds; bar: ± 1 standard deviation over seeds, drawn only where n ≥ 2."
POINT_AND_BARS = (
    "Point: the mean over seeds; bars: ± 1 standard deviation over seeds of each score, "
    "drawn only where n ≥ 2."
)


def family(method: str) -> str:
    """The family FAMILIES gives ``method`` (or the method it is a variant of); OTHER where none does."""
    name = method.partition("-")[0]
    return next((group for group, members in FAMILIES.items() if name in members), OTHER)


# Okabe & Ito's colour-blind-safe palette (black is the reference's; its yellow last: faint on white)
PALETTE = ("#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7", "#999999", "#F0E442")


# the paper's baselines: distinct colours among themselves, as they share the paper's panels
PAPER_BASELINES = ("fedavg", "fedavg_ft", "ifca", "ifca_ft", "ditto", "fedrep", "perfedavg", "local")


@functools.cache
def _looks() -> dict[str, tuple[str, str]]:
    """Every FAMILIES method's (colour, marker), chosen once in a fixed order: the paper's baselines
    first, each a colour none of them has; then the rest, each a colour no method of its family has
    (a family is a row of panels); a marker that no method of the same colour has."""
    order = [m for m in PAPER_BASELINES] + [
        m for members in FAMILIES.values() for m in members if m != REFERENCE and m not in PAPER_BASELINES
    ]
    looks: dict[str, tuple[str, str]] = {}
    for method in order:
        taken = {looks[m][0] for m in looks if family(m) == family(method)}
        if method in PAPER_BASELINES:
            taken |= {looks[m][0] for m in looks if m in PAPER_BASELINES}
        free = [c for c in PALETTE if c not in taken] or list(PALETTE)
        colour = min(free, key=lambda c: (sum(look[0] == c for look in looks.values()), PALETTE.index(c)))
        used = {look[1] for look in looks.values() if look[0] == colour}
        looks[method] = (colour, next(m for m in MARKERS if m not in used))
    return looks


def style(method: str) -> dict:
    """``method``'s look in every figure: the reference's black circles; else a colour-blind-safe
    colour and a marker chosen once for it (``_looks``: the paper's baselines all apart, no two
    methods of a family — a row of panels — alike in colour, no two methods alike in both), the same
    whichever figure or preset draws it. A variant ("fedrep-tuned") is its method's look, dashed,
    its markers hollow."""
    name, _, variant = method.partition("-")
    if name == REFERENCE:
        look = dict(REFERENCE_LOOK)
    else:
        index = sum(map(ord, name))  # a method FAMILIES does not name: a look by its name
        colour, marker = _looks().get(name, (PALETTE[index % len(PALETTE)], MARKERS[index % len(MARKERS)]))
        look = {"color": colour, "marker": marker, "linestyle": "-"}
    return {**look, "linestyle": "--", "markerfacecolor": "none"} if variant else look


def draw_figures(preset_name: str, preset: DictConfig, runs: dict, out_dir: Path, kept: Path) -> list[Path]:
    """The paper's figures from whichever of the preset's ``runs`` (:func:`collect` of ``kept``)
    exist, and README.md beside them: each figure's caption (setting, budget, seeds, what the line
    and the band are, the runs that drew it). Returns the files written. A figure whose runs are
    gone is not drawn, and an old copy of it in ``out_dir`` is deleted."""
    figures = draw(preset_name, preset, runs, out_dir, kept)
    (out_dir / "README.md").unlink(missing_ok=True)
    if figures.written:
        (out_dir / "README.md").write_text(
            f"# Figures of the preset `{preset_name}`\n\nWritten by `fedmeta figures --preset {preset_name}` from "
            f"the kept runs in `{kept}/`.\n\n" + "\n".join(figures.captions)
        )
        figures.written.append(out_dir / "README.md")
    return figures.written


def draw(preset_name: str, preset: DictConfig, runs: dict, out_dir: Path, kept: Path) -> _Figures:
    """Every figure the preset's ``runs`` can draw, saved into ``out_dir``; returns them, each as its
    matplotlib figure too (``figures``: file name → figure), with their captions."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = _Figures(preset_name, preset, runs, out_dir, kept)
    for figure, xlabel in (
        ("heterogeneity", "heterogeneity of the partition (RMNIST)"),
        ("images_per_client", "images per client (Meta-Dataset)"),
    ):
        figures.points(figure, xlabel)
    for figure, spec in SERIES.items():
        figures.series(figure, *spec)
    figures.protocols()
    return figures


SERIES = {  # figure → (x label, y label, a run's (x, y) sequence, which runs can draw it, what it shows)
    "personalization": (
        "personalization step",
        "accuracy after k personalization steps (%)",
        lambda s: (list(range(len(s["curve"]))), s["curve"]),
        None,
        "New-client accuracy (%) after k steps of the shared personalization (k = 0: before any), "
        "at the end of training, one panel per setting.",
    ),
    "convergence": (
        "communication round",
        "new-client accuracy (%)",
        lambda s: (
            [int(r["round"]) for r in s["metrics"]],
            [float(r["eval_accuracy"]) for r in s["metrics"]],
        ),
        lambda done: min(len(s["metrics"]) for s in done) >= MIN_EVALUATIONS and not _roundless(done),
        "New-client accuracy (%) after the shared personalization, at each evaluated round, one panel per "
        f"setting (methods whose runs were evaluated at fewer than {MIN_EVALUATIONS} rounds are left out, and "
        "so are those whose accuracy is the same at every round: Local trains nothing over rounds).",
    ),
}


def _seed_range(counts) -> str:
    """How many seeds a legend entry names: "3", or "2–3" where its panels differ."""
    counts = sorted(set(counts))
    return f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"


def _roundless(done: list[dict]) -> bool:
    """Whether every run's evaluated accuracy is the same at every round: a method that does not
    train over rounds (Local), whose curve would read as converged from the first."""
    return all(len({r["eval_accuracy"] for r in s["metrics"]}) == 1 for s in done)


class _Figures:
    """One preset's figures, each drawn by a method of its own and saved with its caption."""

    def __init__(self, preset_name: str, preset: DictConfig, runs: dict, out_dir: Path, kept: Path):
        self.preset_name, self.preset, self.runs, self.out_dir, self.kept = (
            preset_name,
            preset,
            runs,
            out_dir,
            kept,
        )
        self.methods = [m for m in preset.methods if any(m == method for _, method in runs)]
        # the preset's CAFeMe, or its first variant of it where it has no plain one (published: the authors')
        self.reference = next((m for m in self.methods if m.partition("-")[0] == REFERENCE), None)
        self.table_settings = [name for name, s in preset.settings.items() if s.grid == "table"]
        self.captions: list[str] = []
        self.written: list[Path] = []
        self.figures: dict = {}  # file name → its matplotlib figure, closed but whole: what tests read

    def drawn(self, settings: list[str], among=None) -> list[tuple[str, str, list[dict]]]:
        return [
            (setting, method, self.runs[(setting, method)])
            for setting in settings
            for method in self.methods
            if self.runs.get((setting, method)) and (among is None or among(self.runs[(setting, method)]))
        ]

    def rows(self, cells) -> list[tuple[str, list[str]]]:
        """(family, its methods) per row of panels: one row of every method when they fit one panel,
        else a row per family present, the reference first in each."""
        methods = [m for m in self.methods if any(m == method for _, method, _ in cells)]
        if len(methods) <= PANEL_METHODS:
            return [("", methods)]
        grouped = defaultdict(list)
        for method in methods:
            if method != self.reference:
                grouped[family(method)].append(method)
        first = [self.reference] if self.reference in methods else []
        return [(name, first + grouped[name]) for name in (*FAMILIES, OTHER) if grouped[name]]

    def look(self, method: str, members: list[str]) -> dict:
        return dict(REFERENCE_LOOK) if method == self.reference else style(method)

    def grid(self, rows, columns: int, width: float = 4.8):
        """A panel per row and column, ``width`` inches wide; save() widens the figure for the legends."""
        import matplotlib.pyplot as plt

        # a row holds its legend beside it: tall enough for every entry (0.19 in at 8 pt)
        height = max(3.4, 0.19 * max(len(members) for _, members in rows) + 1.2)
        return plt.subplots(
            len(rows),
            columns,
            figsize=(width * columns, height * len(rows) + 0.5),
            squeeze=False,
            sharey="row",  # a row's panels read against one scale
            layout="constrained",
        )

    def caption(self, name: str, what: str, cells, shown: str, rows, training: bool = False) -> str:
        rounds = sorted({s["rounds"] for _, _, summaries in cells for s in summaries})
        clients = sorted({s.get("new_clients") for _, _, summaries in cells for s in summaries} - {None})
        seeds = "; ".join(
            f"{setting}: "
            + ", ".join(
                f"{method_label(m, [s['folder'] for s in done])} {len(done)}"
                for st, m, done in cells
                if st == setting
            )
            for setting in dict.fromkeys(st for st, _, _ in cells)
        )
        total = sum(len(done) for _, _, done in cells)
        return (
            f"## {name}\n\n{what} Budget: {', '.join(map(str, rounds))} rounds"
            f"{'' if len(rounds) == 1 else ' (as each run states)'}; each run's accuracy is the mean over its "
            f"{'/'.join(map(str, clients))} new clients.{self.test_time(cells, training)} {shown}"
            f"{self.notes(cells, rows)} Seeds per method — "
            f"{seeds}.\n\nDrawn from {total} runs in `{self.kept}/<setting>/<method>/seed*/` by "
            f"`fedmeta figures --preset {self.preset_name}`.\n"
        )

    def test_time(self, cells, training: bool = False) -> str:
        """The caption's sentence on each method's test-time steps and step size, as its runs' configs
        state them, the methods that share them named together (" Test time: 50 steps at lr 0.001
        (FedAvg-FT, Ditto), at lr 0.01 (CAFeMe); 0 steps, scored as trained (FedAvg, IFCA)."); with
        ``training``, which methods' training clients are scored as trained (0 steps) for keeping a
        model per client. Nothing where no run's config can be read."""
        groups = defaultdict(list)  # (steps, lr, step size as said) → the methods that took them
        unread, kept = [], []
        for method in dict.fromkeys(m for _, m, _ in cells):
            specs = defaultdict(list)  # (steps, lr, step size) → the settings where the method took them
            for setting, m, done in cells:
                if m == method and (spec := _test_time(done[0]["folder"])):
                    size = _step_size(spec) if spec["steps"] else ""
                    specs[(spec["steps"], spec["lr"] if spec["steps"] else 0.0, size)].append(setting)
                if m == method and method not in kept and _kept_as_trained(done):
                    kept.append(method)
            if not specs:
                unread.append(self.label(method))
            for key, where in specs.items():
                groups[key].append(self.label(method) + (f" on {', '.join(where)}" if len(specs) > 1 else ""))
        if not groups:
            return ""
        said = []
        for steps in sorted({steps for steps, _, _ in groups}, reverse=True):
            sizes = sorted((lr, size, names) for (n, lr, size), names in groups.items() if n == steps)
            if not steps:
                said.append(f"0 steps, scored as trained ({', '.join(sizes[0][2])})")
                continue
            said.append(
                f"{steps} steps " + ", ".join(f"at {size} ({', '.join(names)})" for _, size, names in sizes)
            )
        if unread:
            said.append(f"not recorded ({', '.join(unread)}: no config.yaml kept)")
        firsts = [done[0] for _, _, done in cells]
        text = f" Test time{' (new clients)' if training else ''}: {'; '.join(said)}{_decay(firsts)}."
        if training:
            text += (
                " Training clients: scored as trained, 0 steps, where the method keeps a model per client"
                + (f" ({', '.join(map(self.label, kept))})" if kept else " (none here)")
                + "; the others take their new clients' steps on the client's training data."
            )
        return text

    def notes(self, cells, rows) -> str:
        """The caption's sentences on the rows of families, the methods with one seed and those not drawn."""
        said = ""
        if len(rows) > 1 or rows[0][0]:
            families = "; ".join(
                f"{name}: {', '.join(self.label(m) for m in members if m != self.reference)}"
                for name, members in rows
            )
            said += (
                f" More than {PANEL_METHODS} methods: one row of panels per family of methods — {families}"
            )
            if self.reference:
                said += f" — with {self.label(self.reference)} (black circles) in every row as the common reference"
            said += (
                "; each method keeps one colour (Okabe and Ito's colour-blind-safe palette) and one marker "
                "in every figure, no two of a family alike in colour; a variant (tuned) is its method's look, "
                "dashed and hollow."
            )
        single = [f"{self.label(m)} ({st})" for st, m, done in cells if len(done) == 1]
        if single:
            said += f" One seed (n = 1: dotted, no band or bar): {', '.join(single)}."
        drawn = {m for _, m, _ in cells}
        absent = [self.label(m) for m in self.preset.methods if m not in drawn]
        if absent:
            said += f" Not drawn (no finished run here, or left out as said above): {', '.join(absent)}."
        return said

    def headline(self, cells, mark: str, subject: str = "", scored: str = "new clients") -> str:
        """The figure's title: the preset and budget, the methods drawn where only a few of the preset's
        are, and what the spread is, with how many methods have one seed (the caption names them)."""
        drawn = list(dict.fromkeys(m for _, m, _ in cells))
        about = f"{self.preset_name}: {subject}: " if subject else f"{self.preset_name}: "
        title = f"{about}{scored} after {self.budget_of(cells)} of federated training"
        others = len(self.preset.methods) - len(drawn)
        if len(drawn) <= 2 and others:  # a figure of one or two methods says so, lest it read as the preset's
            title += (
                f"; {' and '.join(self.label(m) for m in drawn)} only, the preset's other "
                f"{others} method{'s' if others > 1 else ''} not drawn"
            )
        single = list(dict.fromkeys(m for _, m, done in cells if len(done) == 1))
        if all(len(done) == 1 for _, _, done in cells):
            spread = f"one seed each (n = 1): the mean of one run, no {mark}"
        elif single:
            names = (
                ", ".join(map(self.label, single))
                if len(single) <= 2
                else f"{len(single)} methods, in the caption"
            )
            spread = f"mean ± 1 std over seeds ({mark} where n ≥ 2; n = 1, no {mark}: {names})"
        else:
            spread = f"mean ± 1 std over seeds ({mark} where n ≥ 2: every method here)"
        return f"{title}\n{spread}"

    def save(
        self,
        fig,
        name: str,
        axes,
        rows,
        what: str,
        cells,
        shown: str = LINE_AND_BAND,
        subject: str = "",
        scored: str = "new clients",
        training: bool = False,
    ) -> None:
        import matplotlib.pyplot as plt

        longest = 0
        for (family_name, _), row in zip(rows, axes):
            handles = {label: h for ax in row for h, label in zip(*ax.get_legend_handles_labels())}
            # each row's legend beside its last panel: never over the data, never taller than its row
            row[-1].legend(
                handles.values(),
                handles.keys(),
                loc="center left",
                bbox_to_anchor=(1.02, 0.5),
                fontsize=8,
                title=family_name or None,
                title_fontsize=8,
                alignment="left",
            )
            longest = max(longest, len(family_name), *map(len, handles))
        # the figure widens by the legend's width (≈ 0.06 in a character at 8 pt), the panels keep theirs
        fig.set_size_inches(fig.get_size_inches()[0] + 0.06 * longest + 0.6, fig.get_size_inches()[1])
        mark = "band" if shown == LINE_AND_BAND else "bar"
        fig.suptitle(self.headline(cells, mark, subject, scored), fontsize=10)
        fig.savefig(self.out_dir / name, dpi=120, bbox_inches="tight", metadata={"Software": None})
        plt.close(fig)
        self.figures[name] = fig
        self.written.append(self.out_dir / name)
        self.captions.append(self.caption(name, what, cells, shown, rows, training))

    def label(self, method: str, note: str = "") -> str:
        folders = [s["folder"] for (_, m), done in self.runs.items() if m == method for s in done]
        return method_label(method, folders) + note

    def band(self, ax, xs, samples_per_x, method, look: dict, note: str = "", n: str = "") -> None:
        """The mean over seeds: a line through two points or more, a marker alone at one (its legend a
        marker too); ±1 std around it only where there are two seeds or more. ``n``: the seeds the
        legend names, where the method's panels differ in them (say "2–3")."""
        means = np.array([100 * np.mean(v) for v in samples_per_x])
        seeds = min(len(v) for v in samples_per_x)
        label = self.label(method, note) + f" (n = {n or seeds})"
        if seeds < 2:  # one run: as precise as it looks only with seeds beside it
            look = {**look, "linestyle": ":"}
        if len(xs) < 2:
            ax.plot(xs, means, ms=6, label=label, gid=method, **{**look, "linestyle": "none"})
        else:
            every = max(1, len(xs) // 8)  # markers staggered: methods whose curves coincide stay visible
            offset = self.methods.index(method) % every
            ax.plot(xs, means, ms=4, markevery=(offset, every), label=label, gid=method, **look)
        if seeds < 2:
            return
        stds = np.array([100 * np.std(v, ddof=1) for v in samples_per_x])
        if len(xs) < 2:  # a band around one point would be a line of no width
            bars = ax.errorbar(xs, means, yerr=stds, fmt="none", ecolor=look["color"], capsize=3)
            bars.lines[2][0].set_gid(f"spread {method}")
        else:
            ax.fill_between(
                xs, means - stds, means + stds, color=look["color"], alpha=0.12, gid=f"spread {method}"
            )

    @staticmethod
    def budget_of(cells) -> str:
        rounds = sorted({s["rounds"] for _, _, done in cells for s in done})
        return f"{'/'.join(map(str, rounds))} rounds"

    def points(self, figure: str, xlabel: str) -> None:
        """A figure over the preset's categories (heterogeneity, images per client): a point with its
        spread per method and setting, side by side, never joined by lines; the methods drawn are those
        the figure's settings name, where some do."""
        axis = {  # a preset without this figure's axis draws none of it
            k: v
            for k, v in (self.preset.get(figure) or {}).items()
            if any((k, m) in self.runs for m in self.methods)
        }
        if len(axis) < 2:
            (self.out_dir / f"fig_{figure}.png").unlink(missing_ok=True)
            return
        # the methods its own settings name, where they name some (the CPU grid runs four at every α;
        # the table's other methods, at shards and α = 0.3 only, would be points without a trend)
        named = {m for k in axis for m in ((self.preset.settings.get(k) or {}).get("methods") or [])}
        cells = [cell for cell in self.drawn(list(axis)) if not named or cell[1] in named]
        rows = self.rows(cells)
        fig, axes = self.grid(rows, 1, width=7)  # the categories side by side, each with a point per method
        numeric = {
            k: float(v) for k, v in axis.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        logarithmic = len(numeric) >= 2  # a real axis (Dirichlet α): categories without a number after it
        if logarithmic:
            order = sorted(numeric, key=numeric.get, reverse=True) + [k for k in axis if k not in numeric]
            smallest = min(numeric.values())
            x = {
                k: numeric[k] if k in numeric else smallest / 10 ** (1 + i)
                for i, k in enumerate(order[len(numeric) :])
            }
            x.update({k: numeric[k] for k in numeric})
            xlabel = f"{xlabel}: Dirichlet α, log scale (i.i.d.-like on the left)"
        else:
            x = {k: float(i) for i, k in enumerate(axis)}
        for (_, members), (ax,) in zip(rows, axes):
            for index, method in enumerate(members):
                dodge = (index - (len(members) - 1) / 2) * 0.6 / len(members)
                at = {k: v * 10 ** (dodge / 2) if logarithmic else v + dodge for k, v in x.items()}
                self.point(ax, list(axis), method, at, self.look(method, members))
            if logarithmic:
                ax.set_xscale("log")
                ax.invert_xaxis()
                ax.minorticks_off()
            ax.set_xticks(
                [x[k] for k in axis], [f"{v:g}" if k in numeric else str(v) for k, v in axis.items()]
            )
            ax.set(xlabel=xlabel, ylabel="new-client accuracy (%)")
            ax.grid(alpha=0.3, axis="y")
        self.save(
            fig,
            f"fig_{figure}.png",
            axes,
            rows,
            f"New-client accuracy (%) after the shared personalization, against the {xlabel}: one point per "
            "method and setting, set side by side."
            + (
                " Drawn: only the methods its own settings run"
                f" ({', '.join(self.label(m) for m in self.methods if m in named)}); the preset's others ran at"
                " fewer of its points."
                if named
                else ""
            ),
            cells,
            POINT_AND_BAR,
        )

    def point(self, ax, settings: list[str], method: str, at: dict, look: dict) -> None:
        """One method's points over the categories (at ``at[setting]`` on the x-axis): a marker at the
        mean over seeds, a bar of ±1 std where it has two seeds or more."""
        done = [(at[s], self.runs[(s, method)]) for s in settings if (s, method) in self.runs]
        if not done:
            return
        xs = [x for x, _ in done]
        accuracies = [[100 * s["accuracy"] for s in summaries] for _, summaries in done]
        means = [np.mean(a) for a in accuracies]
        label = self.label(method) + f" (n = {_seed_range(len(a) for a in accuracies)})"
        ax.plot(xs, means, ms=5, label=label, gid=method, **{**look, "linestyle": "none"})
        spread = [(x, m, np.std(a, ddof=1)) for x, m, a in zip(xs, means, accuracies) if len(a) > 1]
        if spread:
            x, mean, std = zip(*spread)
            bars = ax.errorbar(x, mean, yerr=std, fmt="none", ecolor=look["color"], capsize=2)
            bars.lines[2][0].set_gid(f"spread {method}")

    def protocols(self) -> None:
        """The runs scored both ways (``evaluation.protocol=both``): each method a point at its new
        clients' accuracy (x) and its training clients' (y), a panel per setting, the diagonal where
        the two agree — which methods a protocol favours, and whether it reorders them."""
        name = "fig_protocols.png"
        cells = self.drawn(self.table_settings, lambda done: all("training_clients" in s for s in done))
        (self.out_dir / name).unlink(missing_ok=True)
        if not cells:
            return
        present = list(dict.fromkeys(setting for setting, _, _ in cells))
        rows = self.rows(cells)
        fig, axes = self.grid(rows, len(present), width=4.2)
        scores = {  # (setting, method) → (new clients, training clients) per seed, in %
            (setting, method): [(100 * s["accuracy"], 100 * s["training_clients"]["accuracy"]) for s in done]
            for setting, method, done in cells
        }
        seeds = defaultdict(set)  # a method's seeds in each panel: its legend entry names them all
        for _, method, done in cells:
            seeds[method].add(len(done))
        every = [v for pairs in scores.values() for pair in pairs for v in pair]
        limits = (
            max(0.0, min(every) - 5),
            min(100.0, max(every) + 5),
        )  # one scale: the diagonal reads as parity
        hidden = defaultdict(list)  # methods whose points coincide in a panel → the settings where they do
        for (_, members), row in zip(rows, axes):
            for column, (ax, setting) in enumerate(zip(row, present)):
                ax.plot(limits, limits, color="0.6", linestyle="--", linewidth=0.8, gid="diagonal")
                drawn = {}
                for method in (m for m in members if (setting, m) in scores):
                    label = self.label(method) + f" (n = {_seed_range(seeds[method])})"
                    at = self.pair(ax, method, scores[(setting, method)], self.look(method, members), label)
                    for other in (
                        o for o, there in drawn.items() if np.abs(np.subtract(at, there)).max() < 1
                    ):
                        hidden[(other, method)].append(setting)
                    drawn[method] = at
                ax.set(
                    title=setting,
                    xlim=limits,
                    ylim=limits,
                    xlabel="new clients (%)",
                    ylabel="training clients (%)" if column == 0 else "",
                )
                ax.grid(alpha=0.3)
        self.save(
            fig,
            name,
            axes,
            rows,
            "Each method's two scores from the same runs, at the end of training, one panel per setting: x, "
            "its new clients' accuracy after its test-time steps (the paper's protocol; each method's steps "
            "and step size below); y, its training clients' — each scored on a test split kept out of its "
            "training, with the model its method keeps for it as it is (0 steps), or, where it keeps none, "
            "after its new clients' steps — the mean over those clients (docs/protocol.md). On the dashed "
            "diagonal the two protocols agree; above it a method scores better on the clients it trained on "
            "than on clients it never saw."
            + (
                " Points within 1 point of each other on both axes hide one another (the table gives each): "
                + "; ".join(
                    f"{self.label(a)} and {self.label(b)} ({', '.join(at)})" for (a, b), at in hidden.items()
                )
                + "."
                if hidden
                else ""
            ),
            cells,
            POINT_AND_BARS,
            scored="training clients (y) against new clients (x)",
            training=True,
        )

    @staticmethod
    def pair(
        ax, method: str, scores: list[tuple[float, float]], look: dict, label: str
    ) -> tuple[float, float]:
        """One method's point at its seeds' mean (new clients, training clients), with a bar of ±1 std
        along each axis where it has two seeds or more; returns the point."""
        new, trained = np.array(scores).T
        look = {**look, "linestyle": "none"}
        ax.plot([new.mean()], [trained.mean()], ms=6, label=label, gid=method, **look)
        if len(new) > 1:
            bars = ax.errorbar(
                [new.mean()],
                [trained.mean()],
                xerr=[new.std(ddof=1)],
                yerr=[trained.std(ddof=1)],
                fmt="none",
                ecolor=look["color"],
                capsize=2,
            )
            for line in bars.lines[2]:
                line.set_gid(f"spread {method}")
        return new.mean(), trained.mean()

    def series(self, figure: str, xlabel: str, ylabel: str, xy, among, what: str) -> None:
        """A figure of curves (personalization steps, rounds): a column of panels per setting of the
        table, a row per family of methods where they are too many for one panel; one figure per data
        set where the runs span several (``fig_<figure>_<data set>.png``), so each stays readable."""
        for stale in self.out_dir.glob(f"fig_{figure}*.png"):
            stale.unlink()
        by_dataset = defaultdict(list)
        for cell in self.drawn(self.table_settings, among):
            by_dataset[_dataset(self.preset.settings[cell[0]])].append(cell)
        if len(by_dataset) == 1:
            self.panels(f"fig_{figure}.png", figure, xlabel, ylabel, xy, what, *by_dataset.values())
        for dataset, cells in by_dataset.items() if len(by_dataset) > 1 else ():
            about = f"{what} This figure: {dataset} (each data set has a figure of its own)."
            self.panels(f"fig_{figure}_{dataset}.png", figure, xlabel, ylabel, xy, about, cells, dataset)

    def panels(self, name: str, figure: str, xlabel: str, ylabel: str, xy, what: str, cells, subject=""):
        from matplotlib.ticker import MaxNLocator

        present = list(dict.fromkeys(setting for setting, _, _ in cells))
        rows = self.rows(cells)
        fig, axes = self.grid(rows, len(present))
        shown = {(setting, method) for setting, method, _ in cells}
        seeds = defaultdict(set)  # a method's seeds in each panel: its legend entry names them all
        for _, method, done in cells:
            seeds[method].add(len(done))
        for (_, members), row in zip(rows, axes):
            for column, (ax, setting) in enumerate(zip(row, present)):
                for method in members:
                    if (setting, method) not in shown:
                        continue
                    done = self.runs[(setting, method)]
                    curves = [xy(s) for s in done]
                    length = min(len(x) for x, _ in curves)
                    note = (
                        " (step 0 after its own adaptation)"
                        if figure == "personalization" and _adapts_first([s["folder"] for s in done])
                        else ""
                    )
                    samples = list(zip(*(y[:length] for _, y in curves)))
                    look = self.look(method, members)
                    self.band(
                        ax, curves[0][0][:length], samples, method, look, note, _seed_range(seeds[method])
                    )
                # a row's panels share their y scale: its label once, on the left
                ax.set(title=setting, xlabel=xlabel, ylabel=ylabel if column == 0 else "")
                # steps and rounds are counts: a tick at 2.5 would name none
                ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
                ax.grid(alpha=0.3)
        self.save(fig, name, axes, rows, what, cells, subject=subject)
