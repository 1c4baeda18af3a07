"""The results pages a command writes are what that command writes from the committed runs today.

Every number in them — a cell's mean ± sd, its n, a wall time, a unit's seconds per seed-round, a
projection — is then the statistic the generator computes for the cell, run or unit its row names:
a claim checked by construction, not a number found somewhere. The figures' captions are checked
the same way with their images (tests/test_figures.py)."""

import difflib
import re
from pathlib import Path

import pytest

from fedmeta import campaign, grid, report

ROOT = Path(__file__).resolve().parent.parent
TABLES = ROOT / "results" / "TABLES.md"
STAMP = re.compile(r"Written \d{4}-\d\d-\d\d \d\d:\d\d UTC")  # when it was written: not a result


def _difference(committed: str, regenerated: str) -> str:
    return "".join(list(difflib.unified_diff(committed.splitlines(True), regenerated.splitlines(True)))[:12])


def _sections() -> list[str]:
    return re.findall(r"<!-- preset (\S+) -->", TABLES.read_text())


def test_every_preset_with_kept_runs_has_its_section():
    assert {"quick", "zoo", "paper", "published", "cpu"} <= set(_sections())


@pytest.mark.parametrize("name", _sections())
def test_a_presets_section_of_the_tables_is_what_its_runs_give(name, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the section names the runs' folder as the command sees it
    preset = grid.load_preset(name)
    kept = Path("results") / "runs" / (preset.get("runs_in") or name)
    regenerated = report.write_tables(name, preset, kept, tmp_path / "TABLES.md", report.collect(kept))
    page = TABLES.read_text()
    start, end = f"<!-- preset {name} -->\n", f"<!-- end of preset {name} -->"
    committed = page[page.index(start) + len(start) : page.index(end)]
    committed, regenerated = STAMP.sub("Written", committed), STAMP.sub("Written", regenerated)
    assert regenerated == committed, (
        f"results/TABLES.md's section {name} is not what its runs give: "
        f"fedmeta table --preset {name} --no-run\n{_difference(committed, regenerated)}"
    )


@pytest.mark.parametrize(
    "plan_file, page",
    [
        ("configs/campaign.yaml", "results/campaign.md"),
        ("configs/campaign_cpu.yaml", "results/campaign-cpu.md"),
        ("configs/campaign_protocols.yaml", "results/campaign-protocols.md"),
        ("configs/campaign_headline.yaml", "results/campaign-headline.md"),
    ],
)
def test_a_campaigns_state_page_is_what_its_runs_and_jobs_give(plan_file, page, monkeypatch):
    monkeypatch.chdir(ROOT)
    plan = campaign.load(Path(plan_file))
    regenerated = campaign.status(plan, Path("results") / "runs" / plan.preset)
    committed = (ROOT / page).read_text()
    assert regenerated == committed, (
        f"{page} is not what its runs and jobs give: fedmeta campaign --config {plan_file}\n"
        f"{_difference(committed, regenerated)}"
    )
