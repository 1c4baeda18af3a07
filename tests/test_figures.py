"""Every figure committed under results/figures/ is what `fedmeta figures` draws from the committed
runs today: redrawn here into a scratch folder, each PNG must match pixel for pixel and each caption
file word for word, and no figure may be committed whose runs are gone. Then the rules that keep a
figure readable with every method, read from the matplotlib artists of figures drawn from made-up
runs: families in rows, no two methods of a panel alike, a marker for one point, no spread for one
seed, integer ticks on counts."""

from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from omegaconf import OmegaConf

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


# The figures' rules, read from the matplotlib artists of figures drawn from made-up runs: a method's
# line and marker carry its name as gid, its spread (band or bar) "spread <method>".


def made_up_runs(tmp_path, methods, seeds=None, steps=None, rounds=(2, 4, 6), settings=("a", "b")):
    """(setting, method) → summaries as report.collect gives them: ``seeds[method]`` runs (default 3),
    a personalization curve of ``steps[method]`` + 1 points (default 10), evaluated at ``rounds``."""
    runs = {}
    for setting in settings:
        for index, method in enumerate(methods):
            runs[(setting, method)] = [
                {
                    "seed": seed,
                    "accuracy": 0.5 + 0.01 * index + 0.02 * seed,
                    "rounds": max(rounds),
                    "new_clients": 5,
                    "folder": tmp_path / "kept" / setting / method / f"seed{seed}",
                    "curve": [
                        0.3 + 0.01 * index + 0.02 * seed + 0.01 * k
                        for k in range((steps or {}).get(method, 10) + 1)
                    ],
                    "metrics": [{"round": str(r), "eval_accuracy": str(0.4 + 0.01 * r)} for r in rounds],
                }
                for seed in range((seeds or {}).get(method, 3))
            ]
    return runs


def drawn(tmp_path, methods, runs, heterogeneity=None):
    preset = OmegaConf.create(
        {
            "methods": methods,
            "settings": {"a": {"grid": "table"}, "b": {"grid": "table"}},
            "heterogeneity": heterogeneity or {},
            "images_per_client": {},
        }
    )
    return report.draw("made_up", preset, runs, tmp_path / "figures", tmp_path / "kept")


def curves(ax) -> dict:
    """The panel's methods → their Line2D (its mean, line or marker alone)."""
    return {line.get_gid(): line for line in ax.get_lines() if line.get_gid()}


def spreads(fig) -> set[str]:
    """The methods a band or a bar of ±1 std is drawn for, in any panel of ``fig``."""
    return {
        artist.get_gid().removeprefix("spread ")
        for ax in fig.axes
        for artist in ax.get_children()
        if (artist.get_gid() or "").startswith("spread ")
    }


def legend_entries(fig) -> dict:
    """Every legend's labels → their handles."""
    return {
        text.get_text().rsplit(" (n = ", 1)[0]: handle  # "FedAvg (n = 3)": the method's label
        for ax in fig.axes
        if ax.get_legend()
        for text, handle in zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles)
    }


EVERY_METHOD = sorted(p.stem for p in (ROOT / "configs" / "method").glob("*.yaml"))


def test_every_shipped_method_has_a_family_and_an_unknown_one_lands_in_other():
    named = [m for members in report.FAMILIES.values() for m in members]
    assert sorted(named) == EVERY_METHOD and len(set(named)) == len(named)
    assert report.family("fedrep-tuned") == report.family("fedrep") != report.OTHER
    assert report.family("no_such_method") == report.OTHER


@pytest.fixture(scope="module")
def crowded(tmp_path_factory):
    """Every shipped method and one no family names: more than a panel holds."""
    tmp_path = tmp_path_factory.mktemp("crowded")
    methods = [*EVERY_METHOD, "no_such_method"]
    return methods, drawn(tmp_path, methods, made_up_runs(tmp_path, methods), {"a": "A", "b": "B"})


@pytest.mark.slow  # the crowded preset's figures: 15 s to draw
def test_a_crowded_preset_is_drawn_a_row_per_family_with_cafeme_in_each(crowded):
    methods, figures = crowded
    fig = figures.figures["fig_personalization.png"]
    grid = np.array(fig.axes).reshape(-1, 2)  # a row per family, a column per setting
    families = [*report.FAMILIES, report.OTHER]
    assert [row[-1].get_legend().get_title().get_text() for row in grid] == families
    seen = []
    for family, row in zip(families, grid):
        for ax in row:
            lines = curves(ax)
            assert len(lines) <= report.PANEL_METHODS + 1
            assert lines["cafeme"].get_color() == "black"  # the common reference, one look in every row
            assert [report.family(m) for m in lines if m != "cafeme"] == [family] * (len(lines) - 1)
        seen += [m for m in curves(row[0]) if m != "cafeme"]
    assert sorted([*seen, "cafeme"]) == sorted(methods)  # none left out, none twice
    assert "no_such_method" in curves(grid[-1][0])
    fig.canvas.draw()
    boxes = [ax.get_window_extent() for ax in fig.axes]
    for row in grid:
        legend = row[-1].get_legend().get_window_extent()
        assert not any(legend.overlaps(box) for box in boxes)  # beside the panels, never over the data
        assert legend.height <= fig.bbox.height / len(grid)  # never taller than its row
    caption = next(c for c in figures.captions if c.startswith("## fig_personalization.png"))
    assert "one row of panels per family" in caption and "no_such_method" in caption


@pytest.mark.slow  # the crowded preset's figures: 15 s to draw
def test_no_two_methods_in_a_panel_share_colour_and_marker(crowded, tmp_path):
    few = EVERY_METHOD[: report.PANEL_METHODS]  # all in one panel
    for figures in (crowded[1], drawn(tmp_path, few, made_up_runs(tmp_path, few), {"a": "A", "b": "B"})):
        assert len(figures.figures) == 3
        for fig in figures.figures.values():
            for ax in fig.axes:
                looks = [(str(line.get_color()), line.get_marker()) for line in curves(ax).values()]
                assert looks and len(set(looks)) == len(looks)


def test_a_one_point_method_is_a_marker_and_its_legend_a_marker(tmp_path):
    methods = ["cafeme", "fedavg", "fedrep"]
    figures = drawn(tmp_path, methods, made_up_runs(tmp_path, methods, steps={"fedavg": 0}))
    fig = figures.figures["fig_personalization.png"]
    for ax in fig.axes:
        assert curves(ax)["fedavg"].get_linestyle() == "None" and curves(ax)["fedavg"].get_marker() != "None"
        assert curves(ax)["fedrep"].get_linestyle() == "-"
    entries = legend_entries(fig)
    assert entries["FedAvg"].get_linestyle() == "None" and entries["FedAvg"].get_marker() != "None"
    assert entries["FedRep"].get_linestyle() == "-"


def test_no_band_or_bar_where_a_method_has_one_seed_and_the_title_says_which(tmp_path):
    methods = ["cafeme", "fedavg_ft", "local"]
    runs = made_up_runs(tmp_path, methods, seeds={"local": 1})
    figures = drawn(tmp_path, methods, runs, {"a": "A", "b": "B"})
    for name, mark in (
        ("fig_personalization.png", "band"),
        ("fig_convergence.png", "band"),
        ("fig_heterogeneity.png", "bar"),
    ):
        fig = figures.figures[name]
        assert spreads(fig) == {"cafeme", "fedavg_ft"}
        assert f"{mark} where n ≥ 2; n = 1, no {mark}: Local" in fig.get_suptitle()
    assert all(
        "One seed (n = 1: dotted, no band or bar): Local (a), Local (b)." in c for c in figures.captions
    )
    one_seed = drawn(tmp_path, methods, made_up_runs(tmp_path, methods, seeds=dict.fromkeys(methods, 1)))
    assert not spreads(one_seed.figures["fig_personalization.png"])
    assert "one seed each (n = 1)" in one_seed.figures["fig_personalization.png"].get_suptitle()


def test_round_and_step_axes_have_integer_ticks(tmp_path):
    methods = ["cafeme", "local"]
    figures = drawn(tmp_path, methods, made_up_runs(tmp_path, methods, steps=dict.fromkeys(methods, 3)))
    for name in ("fig_convergence.png", "fig_personalization.png"):  # rounds 2, 4, 6; steps 0 … 3
        for ax in figures.figures[name].axes:
            ticks = ax.get_xticks()
            assert len(ticks) >= 2 and np.array_equal(ticks, np.round(ticks))


def test_a_title_names_the_methods_when_only_a_few_of_the_presets_are_drawn(tmp_path):
    methods = ["cafeme", "fedavg", "local"]
    runs = {key: done for key, done in made_up_runs(tmp_path, methods).items() if key[1] == "local"}
    figures = drawn(tmp_path, methods, runs)
    title = figures.figures["fig_convergence.png"].get_suptitle()
    assert "Local only, the preset's other 2 methods not drawn" in title
    assert (
        "Not drawn (no finished run here, or left out as said above): CAFeMe, FedAvg." in figures.captions[-1]
    )


def test_a_heterogeneity_axis_of_alphas_is_a_real_logarithmic_one_with_the_shards_after_it(tmp_path):
    """Settings whose axis value is a Dirichlet α sit at that α on a logarithmic axis, i.i.d.-like on
    the left; a partition without an α (shards) comes after the smallest."""
    methods = ["cafeme", "fedavg_ft"]
    runs = made_up_runs(tmp_path, methods, settings=("a", "b", "c"))
    fig = drawn(tmp_path, methods, runs, {"a": 1000, "b": 0.3, "c": "shards"}).figures[
        "fig_heterogeneity.png"
    ]
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.xaxis_inverted()
    ticks = dict(zip([t.get_text() for t in ax.get_xticklabels()], ax.get_xticks()))
    assert (
        ticks["1000"] == 1000 and ticks["0.3"] == pytest.approx(0.3) and ticks["shards"] < 0.3
    )  # the label says α
    xs = sorted(curves(ax)["cafeme"].get_xdata())  # near its setting's α, dodged a little
    assert xs[0] < 0.1 and 0.2 < xs[1] < 0.45 and 500 < xs[2] < 2000


@pytest.mark.slow  # the crowded preset's figures: 15 s to draw
def test_a_method_looks_the_same_in_every_figure_and_one_seed_or_no_rounds_show(crowded, tmp_path):
    """A method's colour and marker are its own whichever figure or row draws it (colour-blind-safe
    colours, distinct within a family's row), a row's panels share their y scale, a one-seed curve is
    dotted and its legend says n, and a method whose accuracy does not move over rounds (Local) is
    left out of the convergence figure."""
    few = ["cafeme", "fedavg_ft", "fedrep", "local"]
    runs = made_up_runs(tmp_path, few, seeds={"fedrep": 1})
    for setting in ("a", "b"):
        for summary in runs[(setting, "local")]:  # trains nothing over rounds: one accuracy at each
            summary["metrics"] = [{"round": str(r), "eval_accuracy": "0.3"} for r in (2, 4, 6)]
    alone = drawn(tmp_path, few, runs)
    looks = {}
    for figures in (alone, crowded[1]):
        for fig in figures.figures.values():
            for ax in fig.axes:
                for method, line in curves(ax).items():
                    look = (str(line.get_color()), line.get_marker())
                    assert looks.setdefault(method, look) == look, method
    for family, members in report.FAMILIES.items():
        colours = [looks[m][0] for m in members if m in looks and m != "cafeme"]
        assert len(set(colours)) == len(colours), family
    assert {looks[m][0] for m in looks if m != "cafeme"} <= set(report.PALETTE)
    personalization = alone.figures["fig_personalization.png"]
    first, second = personalization.axes[:2]
    assert first.get_ylim() == second.get_ylim()
    assert (
        curves(first)["fedrep"].get_linestyle() == ":" and curves(first)["fedavg_ft"].get_linestyle() == "-"
    )
    labels = [t.get_text() for t in personalization.axes[-1].get_legend().get_texts()]
    assert "FedRep (n = 1)" in labels and "FedAvg-FT (n = 3)" in labels
    convergence = alone.figures["fig_convergence.png"]
    assert all("local" not in curves(ax) and "fedavg_ft" in curves(ax) for ax in convergence.axes)
    assert "Local trains nothing over rounds" in next(c for c in alone.captions if "convergence" in c)


def test_a_preset_without_a_figures_axis_draws_the_others(tmp_path):
    """A preset that names no ``images_per_client`` (or no ``heterogeneity``) axis: those figures are
    not drawn, the others are (``fedmeta figures --preset cpu`` raised a KeyError)."""
    methods = ["cafeme", "fedavg_ft"]
    preset = OmegaConf.create(
        {"methods": methods, "settings": {"a": {"grid": "table"}, "b": {"grid": "table"}}}
    )
    figures = report.draw("made_up", preset, made_up_runs(tmp_path, methods), tmp_path / "figures", tmp_path)
    assert sorted(figures.figures) == ["fig_convergence.png", "fig_personalization.png"]


def test_runs_over_several_data_sets_draw_a_figure_per_data_set_whose_legend_names_every_panels_seeds(
    tmp_path,
):
    """A preset whose table spans data sets (the CPU grid: RMNIST, FEMNIST, Meta-Dataset …) draws
    one curve figure per data set, its settings as columns and its name in the title; an old
    single-file figure of the same kind is removed. A method with 3 seeds in one panel and 2 in the
    other has one legend entry naming both (the figure used to list it twice)."""
    methods = ["cafeme", "fedavg_ft"]
    runs = made_up_runs(tmp_path, methods, settings=("a", "b", "c"))
    runs[("b", "fedavg_ft")] = runs[("b", "fedavg_ft")][:2]
    preset = OmegaConf.create(
        {
            "methods": methods,
            "settings": {
                "a": {"grid": "table", "overrides": ["dataset=rmnist", "partition=shards"]},
                "b": {"grid": "table", "overrides": ["dataset=rmnist", "partition=dirichlet"]},
                "c": {"grid": "table", "overrides": ["dataset=femnist"]},
            },
        }
    )
    out = tmp_path / "figures"
    out.mkdir()
    (out / "fig_personalization.png").write_bytes(b"drawn before the runs spanned two data sets")
    figures = report.draw("made_up", preset, runs, out, tmp_path / "kept")
    assert sorted(p.name for p in out.glob("fig_personalization*.png")) == [
        "fig_personalization_femnist.png",
        "fig_personalization_rmnist.png",
    ]
    rmnist = figures.figures["fig_personalization_rmnist.png"]
    assert [ax.get_title() for ax in rmnist.axes] == ["a", "b"]
    assert "made_up: rmnist: new clients" in rmnist.get_suptitle()
    assert [ax.get_title() for ax in figures.figures["fig_personalization_femnist.png"].axes] == ["c"]
    labels = [t.get_text() for t in rmnist.axes[-1].get_legend().get_texts()]
    assert labels == ["CAFeMe (n = 3)", "FedAvg-FT (n = 2–3)"]
    assert rmnist.axes[0].get_ylabel() and not rmnist.axes[1].get_ylabel()  # the shared scale, named once
    caption = next(c for c in figures.captions if c.startswith("## fig_personalization_femnist.png"))
    assert "This figure: femnist" in caption


def test_runs_scored_both_ways_draw_each_method_at_its_two_scores_beside_the_diagonal(tmp_path):
    """A method's point is its seeds' mean new-client accuracy (x) against their training clients'
    mean over clients (y), with a bar of each spread; runs scored one way draw no such figure."""
    methods = ["cafeme", "fedrep", "fedavg_ft"]
    runs = made_up_runs(tmp_path, methods)
    assert "fig_protocols.png" not in drawn(tmp_path, methods, runs).figures
    for (setting, method), done in runs.items():
        for seed, s in enumerate(
            done
        ):  # FedRep's training clients well above its new clients, CAFeMe's on par
            if method == "fedavg_ft":  # on CAFeMe's point: the caption says the two hide each other
                s["accuracy"] = runs[(setting, "cafeme")][seed]["accuracy"] + 0.001
            s["training_clients"] = {"accuracy": s["accuracy"] + (0.2 if method == "fedrep" else 0.0)}
    figures = drawn(tmp_path, methods, runs)
    fig = figures.figures["fig_protocols.png"]
    assert "hide one another (the table gives each): CAFeMe and FedAvg-FT (a, b)." in figures.captions[-1]
    assert len(fig.axes) >= 2 and "training clients (y) against new clients (x)" in fig.get_suptitle()
    for ax in fig.axes[:2]:
        points = curves(ax)
        seeds = [100 * s["accuracy"] for s in runs[(ax.get_title(), "fedrep")]]
        assert points["fedrep"].get_xydata()[0].tolist() == pytest.approx(
            [np.mean(seeds), np.mean(seeds) + 20]
        )
        x, y = points["cafeme"].get_xydata()[0]
        assert x == pytest.approx(y)
        diagonal = points["diagonal"].get_xydata()
        assert diagonal[0][0] == diagonal[0][1] and diagonal[1][0] == diagonal[1][1]
        assert ax.get_xlim() == ax.get_ylim()
    assert spreads(fig) == {"cafeme", "fedrep", "fedavg_ft"}


def test_captions_state_each_methods_test_time_steps_and_step_size(tmp_path):
    """Each caption names the steps and step size each method's new clients took, as its runs'
    configs state them, methods that share them together (CAFeMe's lr 0.01 apart from the
    baselines' 0.001, FedAvg at 0 steps); the protocols figure's caption says the training clients
    of a method that keeps a model per client (FedRep: its training curve one point long) were
    scored as trained, at 0 steps, not after the new clients' 50."""
    methods = ["cafeme", "fedavg", "fedavg_ft", "fedrep"]
    runs = made_up_runs(tmp_path, methods, steps={"fedavg": 0})
    lr = {"cafeme": 0.01}
    for (_, method), done in runs.items():
        for s in done:
            s["folder"].mkdir(parents=True, exist_ok=True)
            steps = len(s["curve"]) - 1
            config = {
                "personalization": {
                    "steps": steps,
                    "lr": lr.get(method, 0.001),
                    "decay": 0.8,
                    "decay_every": 5,
                }
            }
            OmegaConf.save(OmegaConf.create(config), s["folder"] / "config.yaml")
            kept = method in ("fedrep", "fedavg")  # FedRep keeps a head per client; FedAvg takes no step
            s["training_clients"] = {
                "accuracy": s["accuracy"],
                "curve": s["curve"][:1] if kept else s["curve"],
            }
    figures = drawn(tmp_path, methods, runs)
    said = (
        "Test time: 10 steps at lr 0.001 (FedAvg-FT, FedRep), at lr 0.01 (CAFeMe); 0 steps, scored as trained "
        "(FedAvg); every step size decays ×0.8 every 5 steps."
    )
    personalization = next(c for c in figures.captions if c.startswith("## fig_personalization.png"))
    assert said in personalization
    protocols = next(c for c in figures.captions if c.startswith("## fig_protocols.png"))
    assert said.replace("Test time:", "Test time (new clients):") in protocols
    assert (
        "Training clients: scored as trained, 0 steps, where the method keeps a model per client (FedRep); "
        "the others take their new clients' steps" in protocols
    )
    assert "after the shared personalization" not in protocols and "as it is (0 steps)" in protocols
