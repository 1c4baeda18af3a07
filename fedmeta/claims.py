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

import csv
import json
import re
import statistics
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = Path("results") / "runs"
CLAIM = re.compile(r"<!--=(.*?)-->", re.S)
# a number as prose writes it: 1,024 · 96.44 · −0.8 · +1.2 (not a part of a name: CIFAR-10, fp32, v2)
NUMBER = re.compile(r"(?<![\w.,/^-])(?:[-−+](?=\d))?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\w|\.\d)")
# names, not results: code, link targets, comments, addresses, a seed's index ("seed 0", "seeds 0–4"),
# a part of a paper ("Algorithm 1", "Table 2")
CODE = re.compile(
    r"`[^`]*`|\]\([^)]*\)|<!--.*?-->|https?://\S+|\b[Ss]eeds? \d+(?:(?:,\s?\d+)*\s+and\s+\d+|[–-]\d+|(?:,\d+)+)?"
    r"|\b(?:Algorithm|Table|Figure|Section|Eq\.|line)s? \d+",
    re.S,
)


class ClaimError(ValueError):
    """A claim that cannot be computed: a folder with no runs, a round never evaluated, a bad item."""


@dataclass(frozen=True)
class Problem:
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.line}: {self.message}"


def _path(name: str) -> Path:
    path = Path(name) if name.startswith(("results/", "configs/")) else RUNS / name
    if path.is_absolute() or ".." in path.parts:
        raise ClaimError(f"{name}: a claim reads only what the repository keeps")
    return ROOT / path


@cache
def _run(folder: Path) -> dict:
    """A finished run's summary, its evaluated rounds (round → metrics row) and its curves."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):  # a run still under way: its evaluations so far
        if not (folder / "metrics.csv").is_file():
            raise ClaimError(f"{folder.relative_to(ROOT)}: no run (summary.json, metrics.csv)") from None
        summary = {}
    rows = {}
    if (folder / "metrics.csv").is_file():
        with open(folder / "metrics.csv", encoding="utf-8") as f:
            rows = {int(r["round"]): r for r in csv.DictReader(f) if r.get("eval_accuracy")}
    curves: dict[int, dict[int, float]] = {}
    if (folder / "curves.csv").is_file():
        with open(folder / "curves.csv", encoding="utf-8") as f:
            for r in csv.DictReader(f):
                curves.setdefault(int(r["round"]), {})[int(r["step"])] = float(r["accuracy"])
    return {"summary": summary, "rows": rows, "curves": curves}


def _seeds(group: Path, seeds: list[int] | None, so_far: bool = False) -> list[Path]:
    """The group's finished seeds; with ``so_far`` its runs still under way too (their evaluations so far)."""
    patterns = ("seed*/summary.json", "seed*/metrics.csv") if so_far else ("seed*/summary.json",)
    runs = sorted({p.parent for pattern in patterns for p in group.glob(pattern)})
    if seeds is not None:
        runs = [r for r in runs if int(r.name.removeprefix("seed")) in seeds]
    if not runs:
        raise ClaimError(f"{group.relative_to(ROOT)}: no seed has run")
    return runs


TRAINING_CLIENTS = {"tc": "accuracy", "tcw": "weighted_accuracy"}


def _accuracy(folder: Path, at: int | None, step: int | None, what: str = "accuracy") -> float:
    run = _run(folder)
    summary, rows = run["summary"], run["rows"]
    last = max(rows) if rows else summary.get("rounds")
    at = last if at is None else at
    if what == "step0":
        what, step = "accuracy", 0
    if what in TRAINING_CLIENTS:
        if step is not None:
            raise ClaimError("the training clients are scored at their last step only: no k=")
        return _training_clients(folder, at, last, TRAINING_CLIENTS[what])
    if step is not None:
        curve = run["curves"].get(at)
        if curve is None and at == last and summary.get("curve"):  # a run that scored and trained none
            curve = dict(enumerate(summary["curve"]))
        if curve is None or step not in curve:
            raise ClaimError(
                f"{folder.relative_to(ROOT)}: no personalization curve at round {at}, step {step}"
            )
        return 100 * curve[step]
    column = {"accuracy": "eval_accuracy", "csd": "eval_accuracy_std"}[what]
    if at not in rows or not rows[at].get(column):
        if at == last:  # a run that keeps no metrics row for its end: its summary
            return 100 * summary["accuracy" if what == "accuracy" else "accuracy_std"]
        raise ClaimError(f"{folder.relative_to(ROOT)}: round {at} was not evaluated")
    return 100 * float(rows[at][column])


def _training_clients(folder: Path, at: int, last: int, key: str) -> float:
    row = _run(folder)["rows"].get(at, {})
    if row.get(f"training_clients_{key}"):
        return 100 * float(row[f"training_clients_{key}"])
    scored = _run(folder)["summary"].get("training_clients")
    if at == last and scored:
        return 100 * scored[key]
    raise ClaimError(f"{folder.relative_to(ROOT)}: its training clients were not scored at round {at}")


def _options(words: list[str]) -> tuple[int | None, int | None, list[int] | None, bool, str]:
    at = step = seeds = None
    so_far = "so-far" in words
    what = next((w for w in words if w in TRAINING_CLIENTS), "accuracy")
    for word in (w for w in words if w != "so-far" and w not in TRAINING_CLIENTS):
        if word.startswith("@"):
            at = int(word[1:])
        elif word.startswith("k="):
            step = int(word[2:])
        elif word.startswith("seeds="):
            seeds = [int(s) for s in word[6:].split(",")]
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
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _key(data, key: str):
    for part in key.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def _file(name: str, key: str) -> float:
    path = _path(name)
    try:
        text = path.read_text()
    except OSError:
        raise ClaimError(f"{name}: not a kept file") from None
    if key.startswith("/") and key.endswith("/") and len(key) > 1:
        found = re.search(key[1:-1], text)
        if not found:
            raise ClaimError(f"{name}: nothing matches {key}")
        return float(found[1].replace(",", ""))
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        found = _key(data, key)
        return float(len(found) if isinstance(found, list) else found)
    except (KeyError, IndexError, ValueError, TypeError):
        raise ClaimError(f"{name}: no number at {key}") from None


def evaluate(item: str) -> list[float] | bool:
    """The numbers one item claims, or for an assertion whether it holds."""
    words = item.split()
    if not words:
        raise ClaimError("an empty claim")
    kind, args = words[0], words[1:]
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
        return [statistics.mean(_run(r)["summary"]["seconds_per_round"] for r in runs)]
    if kind == "evaluated":
        at = int(args[1])
        for run in (
            _seeds(_path(args[0]), None, "so-far" in args[2:])
            if not (_path(args[0]) / "summary.json").is_file()
            else [_path(args[0])]
        ):
            _accuracy(run, at, None)  # raises where the round was not evaluated
        return [float(at)]
    if kind == "behind":  # the rounds of a chain's stages up to and with this one
        stage, total = _run(_path(args[0]))["summary"], 0
        while stage:
            total += stage["rounds"]
            stage = stage.get("init_from")
        return [float(total)]
    if kind == "rounds":
        return [float(_run(_path(args[0]))["summary"]["rounds"])]
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
        mean, sd = _file_data("configs/paper_results.yaml")[args[0]][args[1]]
        return [mean, sd] if kind == "paper" else [mean]
    if kind == "paper-gap":  # the paper's mean less a group's
        return [
            _file_data("configs/paper_results.yaml")[args[0]][args[1]][0]
            - statistics.mean(_group(args[2], args[3:]))
        ]
    if kind == "paper-diff":
        table = _file_data("configs/paper_results.yaml")[args[0]]
        return [table[args[1]][0] - table[args[2]][0]]
    if kind == "row":
        return [_row(args[0], args[1], args[2])]
    if kind in ("file", "cfg", "pct"):
        value = _file(args[0], " ".join(args[1:]))
        return [100 * value if kind == "pct" else value]
    if kind == "key":
        _file(args[0], args[1])  # raises where the file has no number there
        return [float(args[1].rsplit(".", 1)[-1])]
    if kind in ("reeval", "reeval-csd"):
        lines = _path(args[0]).joinpath("evaluations.jsonl").read_text().splitlines()
        evaluation = json.loads(lines[int(args[1]) - 1])
        return [100 * evaluation["accuracy" if kind == "reeval" else "accuracy_std"]]
    raise ClaimError(f"{kind!r}: not a kind of claim (fedmeta/claims.py lists them)")


def _row(name: str, key: str, column: str) -> float:
    """A number in a Markdown table of a kept file: the row whose first cell is ``key``, the column
    whose header is ``column`` (``_`` for its spaces)."""
    try:
        lines = [line for line in _path(name).read_text().splitlines() if line.startswith("|")]
    except OSError:
        raise ClaimError(f"{name}: not a kept file") from None
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
                return float(found[0].replace(",", "").replace("−", "-"))
    raise ClaimError(f"{name}: no row {key} with a number under {column}")


@cache
def _file_data(name: str):
    import yaml

    return yaml.safe_load(_path(name).read_text())


def _expand(item: str) -> list[str]:
    found = re.search(r"\{([^{}]*)\}", item)
    if not found:
        return [item]
    return [
        e for name in found[1].split(",") for e in _expand(item[: found.start()] + name + item[found.end() :])
    ]


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


def _line(block: str, offset: int) -> int:
    return block.count("\n", 0, offset)


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
    problems: list[Problem] = []
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m[0].count("\n"), text, flags=re.S | re.M)  # code
    lines = text.splitlines()
    for first, last in claimed_sections(text, every_section):
        section = "\n".join(lines[first:last])
        for start, block in _blocks(section):
            if block.startswith("    "):  # code: commands and their arguments, not results
                continue
            position, line0 = 0, first + start + 1
            for claim in [*CLAIM.finditer(block), None]:
                end = claim.start() if claim else len(block)
                prose = CODE.sub(lambda m: " " * len(m[0]), block[position:end])
                written = [(m[0], position + m.start()) for m in NUMBER.finditer(prose)]
                if claim is None:
                    problems += [
                        Problem(line0 + _line(block, at), f"{number}: no claim says what it is")
                        for number, at in written
                    ]
                    break
                problems += _check_claim(claim[1], written, block, line0)
                position = claim.end()
    return problems


def _check_claim(source: str, written: list[tuple[str, int]], block: str, line0: int) -> list[Problem]:
    problems, expected = [], []
    where = line0 + _line(block, written[0][1]) if written else line0
    for item in [e for part in source.split(";") if part.strip() for e in _expand(part.strip())]:
        try:
            result = evaluate(item)
        except (ClaimError, KeyError, IndexError, ValueError) as exc:
            problems.append(Problem(where, f"{item}: {exc}"))
            continue
        if isinstance(result, bool):
            if not result:
                problems.append(Problem(where, f"{item}: does not hold"))
        else:
            expected += [(item, v) for v in result]
    if problems:
        return problems
    if len(expected) != len(written):
        return [
            Problem(
                where,
                f"{len(written)} numbers written ({', '.join(n for n, _ in written) or 'none'}) "
                f"against {len(expected)} claimed ({source.strip()})",
            )
        ]
    return [
        Problem(line0 + _line(block, at), f"{number}: {item} gives {value:.4f}")
        for (number, at), (item, value) in zip(written, expected)
        if not _reads_as(value, number)
    ]


def main(argv: list[str] | None = None) -> int:
    """``python -m fedmeta.claims PAGE …``: each page's claims that do not hold, one a line."""
    import sys

    pages = argv if argv is not None else sys.argv[1:]
    bad = 0
    for page in pages:
        for problem in check(Path(page).read_text()):
            print(f"{page}:{problem}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
