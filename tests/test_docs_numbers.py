"""Numbers in the docs that can drift from their source are read from it: the memory table of
docs/performance.md from results/bench.json, the Python and torch versions from pyproject.toml
and scripts/install.sh."""

import json
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_memory_table_is_the_bench_results():
    rows = json.loads((ROOT / "results" / "bench.json").read_text())["memory"]
    measured = {
        (r["num_clients"], r["variant"]): round(r["peak_rss_mb"]) for r in rows if r["method"] == "cafeme"
    }
    table = re.findall(
        r"^\| ([\d,]+) \(\d+\) \| (\d+) MB \| (\d+) MB \|$",
        (ROOT / "docs" / "performance.md").read_text(),
        re.M,
    )
    assert len(table) == 3
    for clients, paper, authors in table:
        n = int(clients.replace(",", ""))
        assert (int(paper), int(authors)) == (measured[n, "paper"], measured[n, "authors"]), clients


def test_versions_are_said_where_they_are_set():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    python = project["requires-python"].removeprefix(">=")
    assert f"Python {python} or newer" in (ROOT / "README.md").read_text()
    install = (ROOT / "scripts" / "install.sh").read_text()
    for package in ("torch", "torchvision"):
        floor = (
            next(d for d in project["dependencies"] if re.match(rf"{package}\s*>=", d))
            .split(">=")[1]
            .split()[0]
        )
        pinned = re.search(rf'"{package}==([\d.]+)"', install)[1]
        assert pinned.startswith(floor), (
            package,
            floor,
            pinned,
        )  # install.sh installs the oldest version declared


def test_the_model_table_is_what_the_models_count(capsys):
    """docs/models.md's parameters and FLOPs are scripts/model_sizes.py's output, row for row."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("model_sizes", ROOT / "scripts" / "model_sizes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    documented = [
        line for line in (ROOT / "docs" / "models.md").read_text().splitlines() if line.startswith("| ")
    ]
    assert len(printed) == len(module.MODELS) + 1
    assert all(line in documented for line in printed), sorted(set(printed) - set(documented))
