"""Every figure committed under results/figures/ is what `fedmeta figures` draws from the committed
runs today: redrawn here into a scratch folder, each PNG must match pixel for pixel and each caption
file word for word, and no figure may be committed whose runs are gone."""

from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from fedmeta import grid, report

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = sorted(p for p in (ROOT / "results" / "figures").iterdir() if p.is_dir())


def test_every_committed_figure_folder_is_a_presets():
    assert {p.name for p in COMMITTED} >= {"quick", "zoo"}
    assert not list((ROOT / "results").glob("*.png"))  # figures live in results/figures/<preset>/ only


@pytest.mark.parametrize("folder", COMMITTED, ids=lambda p: p.name)
def test_a_presets_figures_are_redrawn_from_its_committed_runs(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the captions name the runs' folder as the command sees it
    preset = grid.load_preset(folder.name)
    kept = Path("results") / "runs" / (preset.get("runs_in") or folder.name)
    written = report.draw_figures(folder.name, preset, report.collect(kept), tmp_path, kept)
    assert sorted(p.name for p in written) == sorted(p.name for p in folder.iterdir()), (
        f"results/figures/{folder.name}/ is not what its runs draw: rebuild it with make figures PRESET={folder.name}"
    )
    for path in written:
        if path.suffix == ".png":
            assert np.array_equal(
                matplotlib.image.imread(path), matplotlib.image.imread(folder / path.name)
            ), (
                f"results/figures/{folder.name}/{path.name} differs from what its runs draw: "
                f"make figures PRESET={folder.name}"
            )
        else:
            assert path.read_text() == (folder / path.name).read_text()
