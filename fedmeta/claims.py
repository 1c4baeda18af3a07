"""Claims a results page makes, written where a test can read them and checked against the runs.

A hand-written page (results/NOTES.md) follows the numbers of a sentence with the statistics they
claim, in an HTML comment a reader of the rendered page does not see::

    CAFeMe 96.88 ± 0.66 against FedAvg 43.19 ± 6.47 (n = 3)<!--= ms cpu/rmnist-shards/cafeme;
    ms cpu/rmnist-shards/fedavg; n cpu/rmnist-shards/fedavg -->

The comment's items, separated by ``;``, give in order the numbers written since the previous
comment (or the start of the list item, table cell or paragraph); each is computed and must read
as the number written, at the decimals written. A section (``##``) with a claim in it is checked
whole: every number in its prose must be claimed (numbers in code spans are names, not results).
Items (``R`` a run folder, ``G`` a folder of seeds, both under ``results/runs/`` unless the path
starts with ``results/``; ``{a,b}`` expands an item into one per name, in order):

    ms G [@r] [k=s] [seeds=0,1] [tc|tcw]   the seeds' mean ± sd of new-client accuracy (%): two
                                  numbers (tc: the training clients' accuracy instead, their mean
                                  over clients; tcw: sample-weighted, as the peers print it)
    mean G … / sd G …             one of them
    n G [so-far]                  the seeds that finished (so-far: and those under way)
    min G … / max G …             the lowest / highest seed
    acc R [@r] [k=s] [tc|tcw]     one run's new-client (or training-client) accuracy (%)
    csd R [@r]                    its new clients' standard deviation (%)
    step0 R [@r]                  its accuracy before personalization (%)
    spr R / spr G                 seconds a round (a run's, or the seeds' mean)
    rounds R                      the rounds it trained
    behind R                      the rounds a chain's stage has behind it, its own with them
    evaluated R|G r [so-far]      r, where every run was evaluated at round r ("at round r")
    diff G1 G2 [@r] [k=s]         mean(G1) − mean(G2), points
    paired G1 G2 [@r] [k=s]       G1 − G2 seed by seed, over the seeds both finished: their mean ± sd
                                  (a seed draws the same clients for every method: a paired gap)
    tc-gap G [@r] [tcw]           a group's training clients less its new clients, run by run (both
                                  scored in the same run): the mean ± sd over its seeds, points
    paper SETTING METHOD          the paper's mean ± sd (configs/paper_results.yaml): two numbers
    paper-mean SETTING METHOD     its mean alone
    paper-diff SETTING M1 M2      the paper's mean of M1 less M2's, points
    paper-gap SETTING METHOD G    the paper's mean less the group's, points
    file PATH KEY                 a number in a kept file: a JSON key path (a.b.0.c), or /regex/
                                  whose first group is the number, in a text file
    row PATH KEY COLUMN           a number in a Markdown table of a kept file: the row whose first
                                  cell is KEY, under the header COLUMN (``_`` for its spaces)
    pct PATH KEY                  the same, a fraction written as a percentage
    key PATH KEY                  the last part of a JSON key path that holds a number ("at round 50")
    reeval R i / reeval-csd R i   the i-th re-evaluation of a run (``fedmeta evaluate``): accuracy, clients' sd
    cfg PATH KEY                  a setting in a config file (a YAML key path; a list: its length)

and assertions, which claim an order and write no number: ``above G1 G2`` (mean(G1) > mean(G2)),
``best G`` (G's mean above every other method's of its setting, tuned against tuned, untuned against untuned),
``level G1 G2`` (the means closer than either group's sd: a gap its seeds do not settle), ``apart
G1 G2`` (further apart than both sds), ``each G1 G2`` (G1 above G2 at every seed both finished, at
least two). ``@r`` is an evaluated round (default: the run's last),
``k=s`` a personalization step of the curve at that round (default: the protocol's last); a group
is its finished seeds, with ``so-far`` (and an ``@r``) also its seeds still under way."""

from __future__ import annotations

import argparse
import bisect
import csv
import io
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RUNS = Path("results") / "runs"
# a claim to its end, or (no end in its paragraph) to the paragraph's: an error, found in one pass
CLAIM = re.compile(r"<!--=(?:(.*?)-->|.*)", re.S)
# a number as prose writes it: 1,024 · 96.44 · −0.8 · +1.2 (not a part of a name: CIFAR-10, fp32, v2)
NUMBER = re.compile(r"(?<![\w.,/^-])(?:[-−+](?=\d))?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\w|\.\d)")
# names, not results: code, link targets, comments, addresses, a seed's index ("seed 0", "seeds 0–4"),
# a part of a paper ("Algorithm 1", "Table 2"); an unclosed comment hides the rest, as a renderer does,
# and a link target stops at a ``]``: neither is searched again from each later start
CODE = re.compile(
    r"`[^`]*`|\]\([^)\]]*\)|<!--(?:.*?-->|.*)|https?://\S+"
    r"|\b[Ss]eeds? \d+(?:(?:,\s?\d+)*\s+and\s+\d+|[–-]\d+|(?:,\d+)+)?"
    r"|\b(?:Algorithm|Table|Figure|Section|Eq\.|line)s? \d+",
    re.S,
)
BRACES = re.compile(r"\{([^{}]*)\}")
# bounds on what a page makes the checker do: a page is prose, a kept file a run's record, and a claim's
# {a,b} groups multiply (24 of them would be 2^24 items); more is a mistake, said as one
PAGE_BYTES = 8 * 2**20
KEPT_BYTES = 64 * 2**20
EXPANSION = 4096
# what each kind of claim takes, for the error of a claim that gives too little
ARGUMENTS = {
    **dict.fromkeys(("ms", "mean", "sd", "min", "max", "n", "best", "tc-gap"), "G"),
    **dict.fromkeys(("acc", "csd", "step0", "rounds", "behind"), "R"),
    **dict.fromkeys(("diff", "above", "level", "apart", "paired", "each"), "G1 G2"),
    **dict.fromkeys(("file", "cfg", "pct", "key"), "PATH KEY"),
    **dict.fromkeys(("paper", "paper-mean"), "SETTING METHOD"),
    **dict.fromkeys(("reeval", "reeval-csd"), "R i"),
    "spr": "R|G",
    "evaluated": "R|G r",
    "paper-diff": "SETTING M1 M2",
    "paper-gap": "SETTING METHOD G",
    "row": "PATH KEY COLUMN",
}
PAPER = "configs/paper_results.yaml"


class ClaimError(ValueError):
    """A claim that cannot be computed: a folder with no runs, a round never evaluated, a bad item."""


@dataclass(frozen=True)
class Problem:
    line: int
    message: str
    broken: bool = False  # a claim that cannot be computed, not one whose number differs

    def __str__(self) -> str:
        return f"{self.line}: {self.message}"


def _text(path: Path, limit: int) -> str:
    """A file's text, read no further than ``limit`` bytes: /dev/zero or a 2 GB file is never read whole."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except IsADirectoryError:
        raise ClaimError("a folder, not a file") from None
    except FileNotFoundError:
        raise ClaimError("no such file") from None
    except OSError as exc:
        raise ClaimError(f"cannot be read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise ClaimError(f"more than {limit // 2**20} MiB")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise ClaimError(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


@cache  # resolving costs a system call a part: a page may name one folder thousands of times
def _inside(path: Path) -> None:
    """Refuses a path that leaves the repository once its links are resolved (results/x -> /etc)."""
    try:
        inside = path.resolve().is_relative_to(ROOT.resolve())
    except (OSError, RuntimeError):  # a loop of links
        inside = False
    if not inside:
        raise ClaimError(
            f"{path.relative_to(ROOT)}: leads out of the repository: a claim reads what it keeps"
        )


def _path(name: str) -> Path:
    path = Path(name) if name.startswith(("results/", "configs/")) else RUNS / name
    if path.is_absolute() or ".." in path.parts or "\0" in name:
        raise ClaimError(f"{name}: a claim reads only what the repository keeps")
    _inside(ROOT / path)
    return ROOT / path


@cache
def _read(path: Path) -> str:
    """A kept file's text, inside the repository and of a bounded size."""
    _inside(path)
    try:
        return _text(path, KEPT_BYTES)
    except ClaimError as exc:
        raise ClaimError(
            f"{path.relative_to(ROOT)}: {exc}: a claim reads a kept text file (UTF-8, "
            f"at most {KEPT_BYTES // 2**20} MiB)"
        ) from None


def _loads(text: str, where: str, as_yaml: bool = False):
    try:
        return yaml.safe_load(text) if as_yaml else json.loads(text)
    except RecursionError:
        raise ClaimError(f"{where}: nested too deeply to read: keep it a few levels deep") from None
    except (ValueError, yaml.YAMLError) as exc:
        kind = "YAML" if as_yaml else "JSON"
        raise ClaimError(f"{where}: not {kind} ({' '.join(str(exc).split())})") from None


@cache
def _data(path: Path):
    """A kept JSON (or YAML) file's data."""
    return _loads(_read(path), str(path.relative_to(ROOT)), path.suffix in (".yaml", ".yml"))


def _table(path: Path, *columns: str) -> list[dict]:
    """A kept CSV file's rows, which have the columns a claim reads."""
    try:
        reader = csv.DictReader(io.StringIO(_read(path)))
        rows = list(reader)
    except csv.Error as exc:
        raise ClaimError(f"{path.relative_to(ROOT)}: not a CSV table ({exc})") from None
    for column in columns:
        if column not in (reader.fieldnames or []):
            raise ClaimError(f"{path.relative_to(ROOT)} has no column {column!r}")
    return rows


def _number(value, where: str, scale: float = 1) -> float:
    """A number a kept file holds (scaled): a boolean is none (JSON's true is no 1), and neither is a NaN
    or an infinity, which no number written reads as and which break the statistics."""
    try:
        number = math.nan if isinstance(value, bool) else scale * float(value)
    except (TypeError, ValueError, OverflowError):  # not a number, or an integer beyond a float's range
        number = math.nan
    if not math.isfinite(number):
        shown = {dict: "an object", list: "a list"}.get(type(value)) or json.dumps(value, default=str)
        shown = shown if len(shown) <= 40 else f"{shown[:40]}…"
        raise ClaimError(f"{where} is {shown}, not a finite number: fix the file or claim another number")
    return number


def _int(word, what: str) -> int:
    """A whole number a claim (or a kept table) writes."""
    if not isinstance(word, str) or not re.fullmatch(r"[-+]?[0-9]{1,18}", word.strip()):
        raise ClaimError(f"{what} is {str(word)[:40]!r}, not a whole number")
    return int(word)


def _key(data, key: str, name: str):
    """The value at a key path (a.b.0.c) of a kept file's data, or an error that says what it lacks where."""
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if isinstance(data, list) and re.fullmatch(r"[0-9]{1,18}", part) and int(part) < len(data):
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            at = f" at {'.'.join(parts[:depth])}" if depth else ""
            lacks = (
                f"item {part!r}{at} (a list of {len(data)})"
                if isinstance(data, list)
                else f"key {part!r}{at}"
            )
            raise ClaimError(f"{name} has no {lacks}")
    return data


@cache
def _run(folder: Path) -> dict:
    """A finished run's summary, its evaluated rounds (round → metrics row) and its curves."""
    name, summary = str(folder.relative_to(ROOT)), {}
    if (folder / "summary.json").is_file():
        summary = _data(folder / "summary.json")
        if not isinstance(summary, dict):
            raise ClaimError(f"{name}/summary.json: not a JSON object")
    elif not (folder / "metrics.csv").is_file():  # a run still under way keeps its evaluations so far
        raise ClaimError(f"{name}: no run (summary.json, metrics.csv)")
    rows, where = {}, f"{name}/metrics.csv: a round"
    if (folder / "metrics.csv").is_file():
        rows = {
            _int(r["round"], where): r
            for r in _table(folder / "metrics.csv", "round")
            if r.get("eval_accuracy")
        }
    curves: dict[int, dict[int, float]] = {}
    if (folder / "curves.csv").is_file():
        where = f"{name}/curves.csv"
        for r in _table(folder / "curves.csv", "round", "step", "accuracy"):
            step = _int(r["step"], f"{where}: a step")
            curves.setdefault(_int(r["round"], f"{where}: a round"), {})[step] = _number(
                r["accuracy"], f"{where}: an accuracy"
            )
    return {"name": name, "summary": summary, "rows": rows, "curves": curves}


def _finished(folder: Path, key: str, scale: float = 1) -> float:
    """A number of a finished run's summary (a run under way keeps none)."""
    run = _run(folder)
    name = f"{run['name']}/summary.json"
    if not run["summary"]:
        raise ClaimError(f"{name}: none kept: the run has not finished")
    return _number(_key(run["summary"], key, name), f"{name}: {key}", scale)


@cache  # a group's runs, found once for the claims that read them
def _runs(group: Path, so_far: bool) -> list[Path]:
    patterns = ("seed*/summary.json", "seed*/metrics.csv") if so_far else ("seed*/summary.json",)
    return sorted({p.parent for pattern in patterns for p in group.glob(pattern)})


def _seeds(group: Path, seeds: list[int] | None, so_far: bool = False) -> list[Path]:
    """The group's finished seeds; with ``so_far`` its runs still under way too (their evaluations so far)."""
    runs = _runs(group, so_far)
    if seeds is not None:
        runs = [r for r in runs if r.name in {f"seed{s}" for s in seeds}]
    if not runs:
        raise ClaimError(f"{group.relative_to(ROOT)}: no seed has run")
    return runs


TRAINING_CLIENTS = {"tc": "accuracy", "tcw": "weighted_accuracy"}


def _accuracy(folder: Path, at: int | None, step: int | None, what: str = "accuracy") -> float:
    run = _run(folder)
    summary, rows = run["summary"], run["rows"]
    last = max(rows) if rows else summary.get("rounds")
    if not isinstance(last, int) or isinstance(last, bool):
        raise ClaimError(
            f"{run['name']}: not evaluated yet (no evaluated round in metrics.csv, "
            "no whole rounds in summary.json)"
        )
    at = last if at is None else at
    if what == "step0":
        what, step = "accuracy", 0
    if what in TRAINING_CLIENTS:
        if step is not None:
            raise ClaimError("the training clients are scored at their last step only: no k=")
        return _training_clients(folder, at, last, TRAINING_CLIENTS[what])
    if step is not None:
        where = f"{run['name']}: the personalization curve at round {at}, step {step}"
        curve = run["curves"].get(at)
        if curve is None and at == last and isinstance(summary.get("curve"), list):  # scored, trained none
            curve = dict(enumerate(summary["curve"]))
        if curve is None or step not in curve:
            raise ClaimError(f"{where}: none kept")
        return _number(curve[step], where, 100)
    column = {"accuracy": "eval_accuracy", "csd": "eval_accuracy_std"}[what]
    if at not in rows or not rows[at].get(column):
        if at == last:  # a run that keeps no metrics row for its end: its summary
            return _finished(folder, "accuracy" if what == "accuracy" else "accuracy_std", 100)
        raise ClaimError(f"{run['name']}: round {at} was not evaluated")
    return _number(rows[at][column], f"{run['name']}/metrics.csv: {column} at round {at}", 100)


def _training_clients(folder: Path, at: int, last: int, key: str) -> float:
    run = _run(folder)
    row = run["rows"].get(at, {})
    if row.get(f"training_clients_{key}"):
        where = f"{run['name']}/metrics.csv: training_clients_{key} at round {at}"
        return _number(row[f"training_clients_{key}"], where, 100)
    if at == last and run["summary"].get("training_clients"):
        return _finished(folder, f"training_clients.{key}", 100)
    raise ClaimError(f"{run['name']}: its training clients were not scored at round {at}")


def _options(words: list[str]) -> tuple[int | None, int | None, list[int] | None, bool, str]:
    at = step = seeds = None
    so_far = "so-far" in words
    what = next((w for w in words if w in TRAINING_CLIENTS), "accuracy")
    for word in (w for w in words if w != "so-far" and w not in TRAINING_CLIENTS):
        if word.startswith("@"):
            at = _int(word[1:], "@round")
        elif word.startswith("k="):
            step = _int(word[2:], "k=step")
        elif word.startswith("seeds="):
            seeds = [_int(s, "seeds=a,b") for s in word[6:].split(",")]
        else:
            raise ClaimError(f"{word!r}: an option is @round, k=step, seeds=a,b, so-far, tc or tcw")
    if so_far and at is None:
        raise ClaimError("so-far takes the round it reads: @round")
    return at, step, seeds, so_far, what


def _group(name: str, options: list[str]) -> list[float]:
    at, step, seeds, so_far, what = _options(options)
    return [_accuracy(run, at, step, what) for run in _seeds(_path(name), seeds, so_far)]


def _gaps(first: str, second: str, options: list[str]) -> list[float]:
    """``first`` less ``second`` at each seed both finished (their folders' seed numbers)."""
    at, step, seeds, _, what = _options(options)
    runs = [{run.name: run for run in _seeds(_path(name), seeds)} for name in (first, second)]
    common = sorted(runs[0].keys() & runs[1].keys())
    if not common:
        raise ClaimError(f"{first} and {second}: no seed that both finished")
    return [_accuracy(runs[0][s], at, step, what) - _accuracy(runs[1][s], at, step, what) for s in common]


def _mean_sd(values: list[float]) -> tuple[float, float]:
    # a gap of two numbers near a float's limit: statistics fails on it with an AttributeError
    if not all(map(math.isfinite, values)):
        raise ClaimError("the numbers it reads are beyond a float's range")
    try:
        return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
    except OverflowError:
        raise ClaimError("the numbers it reads are beyond a float's range") from None


def _file(name: str, key: str) -> float:
    path = _path(name)
    if key.startswith("/") and key.endswith("/") and len(key) > 1:
        try:
            pattern = re.compile(key[1:-1])
        except re.error as exc:
            raise ClaimError(
                f"{key}: not a regular expression ({exc}): write /regex/ with ( ) around the number"
            ) from None
        if not pattern.groups:
            raise ClaimError(f"{key}: no group: write /regex/ with ( ) around the number")
        found = pattern.search(_read(path))
        if not found or found[1] is None:
            raise ClaimError(f"{name}: nothing matches {key}")
        return _number(found[1].replace(",", ""), f"{name}: what {key} matches")
    found = _key(_data(path), key, name)
    return _number(len(found) if isinstance(found, list) else found, f"{name}: {key}")


def _paper(setting: str, method: str) -> tuple[float, ...]:
    """The paper's mean and sd of a method in a setting."""
    pair = _key(_data(_path(PAPER)), f"{setting}.{method}", PAPER)
    if not (isinstance(pair, list) and len(pair) == 2):
        raise ClaimError(f"{PAPER}: {setting}.{method} is not a [mean, sd] pair")
    return tuple(_number(value, f"{PAPER}: {setting}.{method}") for value in pair)


def evaluate(item: str) -> list[float] | bool:
    """The numbers one item claims, or for an assertion whether it holds."""
    words = item.split()
    if not words:
        raise ClaimError("an empty claim")
    kind, args = words[0], words[1:]
    if len(args) < len(ARGUMENTS.get(kind, "").split()):
        raise ClaimError(f"too short: write {kind} {ARGUMENTS[kind]} (fedmeta/claims.py lists the kinds)")
    if kind in ("ms", "mean", "sd", "min", "max"):
        values = _group(args[0], args[1:])
        mean, sd = _mean_sd(values)
        return {"ms": [mean, sd], "mean": [mean], "sd": [sd], "min": [min(values)], "max": [max(values)]}[
            kind
        ]
    if kind == "n":
        return [float(len(_seeds(_path(args[0]), None, "so-far" in args[1:])))]
    if kind in ("acc", "csd", "step0"):
        at, step, _, _, what = _options(args[1:])
        return [_accuracy(_path(args[0]), at, step, what if kind == "acc" else kind)]
    if kind == "spr":
        path = _path(args[0])
        runs = [path] if (path / "summary.json").is_file() else _seeds(path, None)
        return [_mean_sd([_finished(r, "seconds_per_round") for r in runs])[0]]
    if kind == "evaluated":
        at = _int(args[1], "the round")
        for run in (
            _seeds(_path(args[0]), None, "so-far" in args[2:])
            if not (_path(args[0]) / "summary.json").is_file()
            else [_path(args[0])]
        ):
            _accuracy(run, at, None)  # raises where the round was not evaluated
        return [float(at)]
    if kind == "behind":  # the rounds of a chain's stages up to and with this one, each an init_from deeper
        path, key = _path(args[0]), "rounds"
        total, stage = _finished(path, key), _run(path)["summary"].get("init_from")
        while stage:
            key = f"init_from.{key}"
            total += _finished(path, key)  # a stage that is a mapping with its rounds, or an error
            stage = stage.get("init_from")
        return [total]
    if kind == "rounds":
        return [_finished(_path(args[0]), "rounds")]
    if kind == "best":
        group = _path(args[0])
        mine = statistics.mean(_group(args[0], args[1:]))
        tuned = group.name.endswith("-tuned")
        peers = [
            p
            for p in sorted(group.parent.iterdir())
            if p != group and p.name.endswith("-tuned") == tuned and list(p.glob("seed*/summary.json"))
        ]
        if not peers:
            raise ClaimError(f"{args[0]}: no other method beside it to be best among")
        return all(statistics.mean(_group(str(p.relative_to(ROOT)), args[1:])) < mine for p in peers)
    if kind in ("diff", "above", "level", "apart"):
        a, b = _group(args[0], args[2:]), _group(args[1], args[2:])
        (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
        if kind == "diff":
            return [ma - mb]
        return {"above": ma > mb, "level": abs(ma - mb) < min(sa, sb), "apart": abs(ma - mb) > max(sa, sb)}[
            kind
        ]
    if kind == "paired":
        return list(_mean_sd(_gaps(args[0], args[1], args[2:])))
    if kind == "tc-gap":
        at, step, seeds, _, what = _options(args[1:])
        scored = what if what in TRAINING_CLIENTS else "tc"
        runs = _seeds(_path(args[0]), seeds)
        return list(_mean_sd([_accuracy(r, at, None, scored) - _accuracy(r, at, step) for r in runs]))
    if kind == "each":
        gaps = _gaps(args[0], args[1], args[2:])
        return len(gaps) >= 2 and all(gap > 0 for gap in gaps)
    if kind in ("paper", "paper-mean"):
        mean, sd = _paper(args[0], args[1])
        return [mean, sd] if kind == "paper" else [mean]
    if kind == "paper-gap":  # the paper's mean less a group's
        return [_paper(args[0], args[1])[0] - statistics.mean(_group(args[2], args[3:]))]
    if kind == "paper-diff":
        return [_paper(args[0], args[1])[0] - _paper(args[0], args[2])[0]]
    if kind == "row":
        return [_row(args[0], args[1], args[2])]
    if kind in ("file", "cfg", "pct"):
        value = _file(args[0], " ".join(args[1:]))
        return [100 * value if kind == "pct" else value]
    if kind == "key":
        _file(args[0], args[1])  # raises where the file has no number there
        return [float(_int(args[1].rsplit(".", 1)[-1], f"the last part of {args[1]}"))]
    if kind in ("reeval", "reeval-csd"):
        path, index = _path(args[0]) / "evaluations.jsonl", _int(args[1], "the re-evaluation")
        if not path.is_file():
            raise ClaimError(f"{args[0]}: no evaluations.jsonl: re-evaluate the run (fedmeta evaluate) first")
        lines = _read(path).splitlines()
        if not 1 <= index <= len(lines):
            raise ClaimError(f"{args[0]}: no re-evaluation {index}: it keeps {len(lines)}")
        where = f"{path.relative_to(ROOT)}: line {index}"
        key = "accuracy" if kind == "reeval" else "accuracy_std"
        return [_number(_key(_loads(lines[index - 1], where), key, where), f"{where}: {key}", 100)]
    raise ClaimError(f"{kind!r}: not a kind of claim (fedmeta/claims.py lists them)")


def _row(name: str, key: str, column: str) -> float:
    """A number in a Markdown table of a kept file: the row whose first cell is ``key``, the column
    whose header is ``column`` (``_`` for its spaces)."""
    lines = [line for line in _read(_path(name)).splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    names = (column, column.replace("_", " "))
    header = next((row for row in cells if any(n in row for n in names)), None)
    if header is None:
        raise ClaimError(f"{name}: no table with a column {column}")
    index = header.index(next(n for n in names if n in header))
    for row in cells:
        if row and row[0].strip("`*") == key and index < len(row):
            found = re.search(r"[-−+]?\d[\d,]*(?:\.\d+)?", row[index])
            if found:
                return _number(found[0].replace(",", "").replace("−", "-"), f"{name}: {key} under {column}")
    raise ClaimError(f"{name}: no row {key} with a number under {column}")


def _expand(item: str, room: int) -> list[str]:
    """``item`` once for each name of its ``{a,b}`` groups, in order, or an error past ``room`` items (or
    16 MiB of them): a claim of 24 groups would be 2^24 items."""
    items = [item]
    while found := BRACES.search(items[0]):  # every item has the same groups left: a name holds no { } ,
        count = len(items) * (found[1].count(",") + 1)
        if count > room or count * len(item) > 2**24:
            short = item if len(item) <= 80 else f"{item[:80]}…"
            raise ClaimError(
                f"{short}: its {{a,b}} groups expand the claim past {EXPANSION} items: write fewer"
            )
        items = [
            e[: f.start()] + name + e[f.end() :]
            for e in items
            for f in [BRACES.search(e)]
            for name in f[1].split(",")
        ]
    return items


def _reads_as(value: float, written: str) -> bool:
    plain = written.replace(",", "").replace("−", "-")
    decimals = len(plain.split(".")[1]) if "." in plain else 0
    shown = f"{value:.{decimals}f}"
    return shown == plain.lstrip("+") or (shown == f"-{plain}" and float(plain) == 0)


def _blocks(text: str):
    """(first line, the text) of each list item, table row or paragraph: a claim reaches back to its start."""
    start, block = 0, []
    for i, line in enumerate(text.splitlines()):
        new = not line.strip() or line.startswith("#") or re.match(r"\s*(?:[-*] |\| |\d+\. )", line)
        if new and block:
            yield start, "\n".join(block)
            block = []
        if line.strip():
            if not block:
                start = i
            block.append(line)
    if block:
        yield start, "\n".join(block)


def claimed_sections(text: str, every: bool = False) -> list[tuple[int, int]]:
    """The (first, last) lines of each ``##`` section with a claim in it (``every``: of each section),
    checked whole."""
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("## ")] + [len(lines)]
    spans = [(0, heads[0])] + list(zip(heads, heads[1:]))
    return [(a, b) for a, b in spans if every or CLAIM.search("\n".join(lines[a:b]))]


def check(text: str, every_section: bool = False) -> list[Problem]:
    """Every claim of the page against what it claims, and every number of a claimed section claimed
    (with ``every_section``, of every section: a page written wholly in claims)."""
    return _check(text, every_section)[0]


def _check(text: str, every_section: bool = False) -> tuple[list[Problem], int, int]:
    """``check``'s problems, with the numbers its claims wrote and the sections it checked."""
    problems: list[Problem] = []
    numbers, outcomes = 0, {}
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m[0].count("\n"), text, flags=re.S | re.M)  # code
    lines = text.splitlines()
    sections = claimed_sections(text, every_section)
    for first, last in sections:
        section = "\n".join(lines[first:last])
        for start, block in _blocks(section):
            if block.startswith("    "):  # code: commands and their arguments, not results
                continue
            # a number's line by bisection, not by counting from the block's start: linear in the page
            newlines = [m.start() for m in re.finditer("\n", block)]
            position, line0 = 0, first + start + 1
            for claim in [*CLAIM.finditer(block), None]:
                end = claim.start() if claim else len(block)
                prose = CODE.sub(lambda m: " " * len(m[0]), block[position:end])
                written = [
                    (m[0], line0 + bisect.bisect_left(newlines, position + m.start()))
                    for m in NUMBER.finditer(prose)
                ]
                if claim is None:
                    problems += [
                        Problem(line, f"{number}: no claim says what it is") for number, line in written
                    ]
                    break
                if claim[1] is None:  # what it claims would be left unchecked
                    opening = " ".join(claim[0][:60].split())
                    problems.append(
                        Problem(
                            line0 + bisect.bisect_left(newlines, end),
                            f"{opening}…: a claim with no --> in its paragraph: close it there",
                            broken=True,
                        )
                    )
                    break
                problems += _check_claim(claim[1], written, line0, outcomes)
                numbers += len(written)
                position = claim.end()
    return problems, numbers, len(sections)


def _check_claim(
    source: str,
    written: list[tuple[str, int]],
    line0: int,
    outcomes: dict[str, list[float] | bool | ClaimError],
) -> list[Problem]:
    problems, expected, items = [], [], []
    where = written[0][1] if written else line0
    try:
        for part in source.split(";"):
            if part.strip():  # on one line: a claim may wrap, its messages may not
                items += _expand(" ".join(part.split()), EXPANSION - len(items))
    except ClaimError as exc:
        return [Problem(where, str(exc), broken=True)]
    for item in items:
        if item not in outcomes:  # a page repeats its items: each is computed once
            try:
                outcomes[item] = evaluate(item)
            except ClaimError as exc:
                outcomes[item] = exc
            except OSError as exc:  # a name the system refuses (too long): the claim's, not the repository's
                outcomes[item] = ClaimError(exc.strerror or str(exc))
        result = outcomes[item]
        if isinstance(result, ClaimError):
            problems.append(Problem(where, f"{item}: {result}", broken=True))
        elif isinstance(result, bool):
            if not result:
                problems.append(Problem(where, f"{item}: does not hold"))
        elif not all(map(math.isfinite, result)):  # a difference of two numbers near a float's limit
            problems.append(Problem(where, f"{item}: gives {result}, not finite numbers", broken=True))
        else:
            expected += [(item, v) for v in result]
    if problems:
        return problems
    if len(expected) != len(written):
        return [
            Problem(
                where,
                f"{len(written)} numbers written ({', '.join(n for n, _ in written) or 'none'}) "
                f"against {len(expected)} claimed ({' '.join(source.split())})",
            )
        ]
    return [
        Problem(line, f"{number}: {item} gives {value:.4f}")
        for (number, line), (item, value) in zip(written, expected)
        if not _reads_as(value, number)
    ]


def main(argv: list[str] | None = None) -> int:
    """``python -m fedmeta.claims PAGE …``: each page's claims that do not hold (on stdout: exit 1) and
    those that cannot be checked, or a page that cannot be read (on stderr: exit 2), one a line; a line
    for each page whose claims all hold (exit 0)."""
    parser = argparse.ArgumentParser(prog="python -m fedmeta.claims", description=__doc__.split("\n", 1)[0])
    parser.add_argument("pages", nargs="+", metavar="PAGE", help="a Markdown page, e.g. results/NOTES.md")
    status = 0
    for page in parser.parse_args(argv).pages:
        try:
            text = _text(Path(page), PAGE_BYTES)
        except ClaimError as exc:
            print(
                f"{page}: {exc}: give a Markdown page (UTF-8, at most {PAGE_BYTES // 2**20} MiB)",
                file=sys.stderr,
            )
            status = 2
            continue
        problems, numbers, sections = _check(text)
        for problem in problems:
            print(f"{page}:{problem}", file=sys.stderr if problem.broken else sys.stdout)
            status = max(status, 2 if problem.broken else 1)
        if not problems:
            print(f"{page}: {numbers} numbers in {sections} sections hold")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
