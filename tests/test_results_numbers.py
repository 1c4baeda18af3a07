"""Every result the pages state comes from something kept, and the page names it. Each number
written to two decimals in the README, ``results/*.md`` and ``docs/*.md`` (accuracies, seconds per
round, measured ratios: from 1.00 up, as below it two decimals are mostly a setting such as lr
0.01) and every mean ± std must be among the values the kept runs and logs give that its list item
or table row names — else its paragraph, else its section (or an enclosing one): a run's accuracy,
its clients' spread, its curve, its seconds per round, its re-evaluations, a seed group's
mean ± std at any evaluated round, or a number written in a named log, bench or census file or
tuning study; where a run scored its training clients too, their mean and sample-weighted accuracy
likewise. A mean ± std must be a pair one source gives together. A section whose numbers carry
claims (fedmeta/claims.py) is checked by tests/test_claims.py instead, against the statistic each
claims: this test is the weaker check of the pages not yet written so. Numbers with units of size or
of a time span (MB, GB, M, min, h, ×, …) and approximate ones (fewer decimals) are not read."""

import csv
import json
import re
import statistics
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

from fedmeta import claims

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "results").glob("*.md"), *(ROOT / "docs").glob("*.md")])
# a path into what is kept, as pages write it: `results/runs/quick/<setting>/<method>-tuned/seed0`
SOURCE = re.compile(r"(?:results|configs)/[\w./*<>{}-]*[\w*>}]")
# a two-decimal number, not a version, a setting (``lr = 0.01``) or a formula's constant
# (``1.25/δ``), not followed by a unit of size, a time span or a factor
NUMBER = re.compile(
    r"(?<![\w.+-])(?<!Python )(?<!PyTorch )(?<!torch )(?<!CUDA )(?<!= )(\d{1,3}\.\d\d)(?![\d./])"
    r"(?!\s*(?:s\b|ms\b|µs|GB|MB|MiB|GiB|KB|TB|M\b|×|x\b|h\b|min\b|GFLOP|TFLOP|seconds|points))"
)
PAIR = re.compile(r"(\d{1,3}\.\d\d) ± (\d{1,3}\.\d\d)")


def _two(x: float) -> str:
    return f"{x:.2f}"


def _files(named: str) -> list[Path]:
    """The kept files a named path stands for (placeholders such as ``<method>`` match any name)."""
    pattern = re.sub(r"<[^>]*>|\{[^}]*\}", "*", named).rstrip("/.")
    if Path(pattern).is_absolute() or ".." in Path(pattern).parts:  # a source outside the repository
        return []
    found = []
    for path in ROOT.glob(pattern) if "*" in pattern else [ROOT / pattern]:
        found += sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [p for p in found if p.is_file() and p.suffix != ".png" and p.resolve().is_relative_to(ROOT)]


@cache
def given(named: tuple[str, ...]) -> tuple[frozenset, frozenset]:
    """(every value the named runs and logs give, every mean ± std pair one of them gives)."""
    values, pairs = set(), set()

    def add(value: float, spread: float | None = None) -> None:
        values.add(_two(value))
        if spread is not None:
            values.add(_two(spread))
            pairs.add((_two(value), _two(spread)))

    groups = defaultdict(lambda: defaultdict(list))  # a method's folder → what → one value a seed
    files = sorted({f for name in named for f in _files(name)})
    for path in files:
        if path.name == "summary.json" and "runs" in path.parts:
            summary, group = json.loads(path.read_text()), groups[path.parent.parent]
            accuracy = 100 * summary["accuracy"]
            spread = summary.get("accuracy_std")
            add(accuracy, 100 * spread if spread is not None else None)
            for point in summary.get("curve") or []:
                add(100 * point)
            group["accuracy"].append(accuracy)
            for key in ("accuracy", "weighted_accuracy"):  # the training clients', where it scored them
                if key in summary.get("training_clients", {}):
                    add(100 * summary["training_clients"][key])
                    group["training_clients", key].append(100 * summary["training_clients"][key])
            for key in ("seconds_per_round", "beside_cores"):  # medians the cell table prints
                if summary.get(key) is not None:
                    add(summary[key])
                    group[key].append(summary[key])
        elif path.name == "evaluations.jsonl" and "runs" in path.parts:  # a kept run scored again
            for evaluation in map(json.loads, path.read_text().splitlines()):
                add(100 * evaluation["accuracy"], 100 * evaluation["accuracy_std"])
                for point in evaluation.get("curve") or []:
                    add(100 * point)
        elif path.name == "metrics.csv" and "runs" in path.parts:
            group = groups[path.parent.parent]
            for row in csv.DictReader(open(path)):
                for column in ("eval_accuracy", "eval_step0_accuracy"):
                    if row.get(column):
                        spread = row.get("eval_accuracy_std") if column == "eval_accuracy" else ""
                        add(100 * float(row[column]), 100 * float(spread) if spread else None)
                        group[column, row["round"]].append(100 * float(row[column]))
        elif path.suffix in {".json", ".log", ".txt", ".md", ".yaml", ".jsonl"} and "runs" not in path.parts:
            text = path.read_text(errors="replace")
            for written in re.findall(r"\d+\.\d+(?:[eE][-+]?\d+)?", text):
                add(float(written))
                if float(written) <= 1:
                    add(100 * float(written))  # a fraction the pages write as a percentage
            pairs.update(PAIR.findall(text))
            pairs.update(
                re.findall(r"\[(\d+\.\d\d), (\d+\.\d\d)\]", text)
            )  # [mean, sd] (configs/paper_results.yaml)
    for group in groups.values():
        for seeds in group.values():
            add(min(seeds))
            add(max(seeds))
            if len(seeds) > 1:
                add(statistics.mean(seeds), statistics.stdev(seeds))
    return frozenset(values), frozenset(pairs)


ITEM = re.compile(r"\s*(?:[-*] |\| |\d+\. )")  # a list item or a table row starts a new item


def _named(lines: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(SOURCE.findall("\n".join(lines))))


PAPER = ("configs/paper_results.yaml",)  # "paper 98.82 ± 0.11" beside a table's cell: the paper's number


def _papers(line: str, match: re.Match) -> bool:
    """Whether a table cell writes the number as the paper's (``paper 98.82 ± 0.11``)."""
    return line[: match.start()].endswith("paper ")


def stated(text: str):
    """(line number, number, the kept paths it is read against, mean ± std pair or None) for each
    result the text writes. A number is read against the paths its list item or table row names,
    else those its paragraph (or table) names, else its section's: the first paths named in the
    section or an enclosing one."""
    lines = text.splitlines()
    paragraphs, start = [], 0
    for i, line in enumerate([*lines, ""]):
        if not line.strip() or line.startswith("#"):
            if i > start:
                paragraphs.append((start, lines[start:i]))
            if line.startswith("#"):
                paragraphs.append((i, [line]))
            start = i + 1
    headings: list[tuple[int, tuple[str, ...]]] = []  # (level, the paths that name the section)
    for start, block in paragraphs:
        if block[0].startswith("#"):
            level = len(block[0]) - len(block[0].lstrip("#"))
            headings = [h for h in headings if h[0] < level] + [(level, _named(block))]
            continue
        paragraph = _named(block)
        if headings and not headings[-1][1] and paragraph:
            headings[-1] = (headings[-1][0], paragraph)
        section = next((h[1] for h in reversed(headings) if h[1]), ())
        items = [i for i, line in enumerate(block) if ITEM.match(line)]
        for first, end in zip([0, *items], [*items, len(block)]):
            scope = _named(block[first:end]) or paragraph or section
            for offset in range(first, end):
                line = block[offset]
                papers = []  # the paper's pairs: their numbers are the paper's, read with the pair
                for match in PAIR.finditer(line):
                    own = PAPER if _papers(line, match) else scope
                    papers += [match] if own is PAPER else []
                    yield start + offset + 1, match[0], own, match.groups()
                for match in NUMBER.finditer(line):
                    if any(p.start() <= match.start(1) < p.end() for p in papers):
                        continue  # a paper's sd of 1 or more, as in "paper 87.08 ± 3.39"
                    if float(match[1]) >= 1:  # below 1, two decimals are mostly settings (lr 0.01)
                        own = PAPER if _papers(line, match) else scope
                        yield start + offset + 1, match[1], own, None


def unclaimed(text: str) -> str:
    """The text less its sections whose every number carries a claim (tests/test_claims.py checks those
    against the statistic each claims); their lines are kept blank, so line numbers stay."""
    lines = text.splitlines()
    for first, last in claims.claimed_sections(text):
        lines[first + 1 : last] = [""] * (last - first - 1)
    return "\n".join(lines)


def unkept(text: str) -> list[str]:
    missing = []
    for line, number, scope, pair in stated(unclaimed(text)):
        values, pairs = given(scope)
        if not scope:
            missing.append(f"{line}: {number} (names no kept run or log)")
        elif pair not in pairs if pair else number not in values:
            missing.append(f"{line}: {number} (not in {', '.join(scope)})")
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_number_a_page_states_comes_from_the_kept_run_or_log_it_names(page):
    missing = unkept(page.read_text())
    assert not missing, f"{page.relative_to(ROOT)}:\n" + "\n".join(missing)


def test_a_changed_digit_or_an_unnamed_source_is_caught():
    kept = "results/runs/quick/rmnist-shards/cafeme"
    said = f"## CAFeMe\n\nCAFeMe at its defaults: 96.44 ± 0.49 (n = 3; `{kept}`), seed 0 96.71 %.\n"
    assert unkept(said) == []
    assert unkept(said.replace("96.44", "96.45")) == [
        f"3: 96.45 ± 0.49 (not in {kept})",
        f"3: 96.45 (not in {kept})",
    ]
    assert unkept(said.replace("96.71", "96.61")) == [f"3: 96.61 (not in {kept})"]
    assert unkept(said.replace(f"; `{kept}`", "")) == [
        "3: 96.44 ± 0.49 (names no kept run or log)",
        "3: 96.44 (names no kept run or log)",
        "3: 96.71 (names no kept run or log)",
    ]


def test_the_papers_number_beside_a_cell_is_read_from_the_papers_file_whatever_its_sd():
    kept = "results/runs/quick/rmnist-shards/cafeme"
    said = f"## CAFeMe\n\nCAFeMe 96.44 ± 0.49 (n = 3; `{kept}`), FedAvg-FT's paper 87.08 ± 3.39.\n"
    assert unkept(said) == []  # the sd 3.39 is the paper's, not a number of the kept run
    assert unkept(said.replace("3.39", "3.38")) == ["3: 87.08 ± 3.38 (not in configs/paper_results.yaml)"]


def test_a_source_named_outside_the_repository_confirms_nothing():
    assert _files("../shared/notes.md") == [] and _files("/etc/hostname") == [] and _files("/*") == []
    assert _files("results/NOTES.md") == [ROOT / "results" / "NOTES.md"]
