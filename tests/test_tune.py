"""fedmeta tune: a real (tiny) Optuna study writes the best trial's settings as a variant, and a
study run again continues instead of starting over."""

import shutil
import sqlite3
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from fedmeta.config import CONFIG_DIR, compose, method_card
from fedmeta.errors import FedmetaError
from fedmeta.tune import MARK, Study

TINY = [
    "model.conv_channels=[8,16]",
    "model.dense_units=[32]",
    "personalization.steps=3",
    "federation.num_new_clients=4",
    "logger=[]",
]


@pytest.mark.slow
def test_study_writes_the_best_trial_as_the_tuned_variant_and_resumes(tmp_path, mnist_dir, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(home))
    committed = (CONFIG_DIR / "variant" / "perfedavg" / "tuned.yaml").read_bytes()
    storage = f"sqlite:///{tmp_path / 'studies.db'}"

    def study(trials: int) -> Study:
        return Study(
            "perfedavg",
            [f"dataset.dir={mnist_dir}", *TINY],
            trials,
            rounds=2,
            seed=None,
            storage=storage,
            root=tmp_path / "runs",
        )

    result = study(3).run(show_progress=False)
    tuned = home / "variant" / "perfedavg" / "tuned.yaml"  # the user's config home, not the package's
    assert (CONFIG_DIR / "variant" / "perfedavg" / "tuned.yaml").read_bytes() == committed
    assert "variant=tuned reads it before" in result["tuned"]
    text = tuned.read_text()
    assert MARK in text and "tuning seed 100" in text
    best = OmegaConf.load(tuned)
    assert best.method.inner_lr == result["best"]["method.inner_lr"]
    space = method_card("perfedavg").tune
    for key, bounds in space.items():
        low, high = bounds["log"]
        assert low <= OmegaConf.select(best, key) <= high
    cfg = compose(["method=perfedavg", "variant=tuned"])  # the result is a variant like any other
    assert cfg.personalization.lr == result["best"]["personalization.lr"]
    table = (tuned.parent / "tuned.study.md").read_text()
    assert table.count("| complete |") + table.count("| pruned |") == 3
    assert sorted(p.name for p in (tmp_path / "runs").glob("*/trial*")) == ["trial0", "trial1", "trial2"]

    study(3).run(show_progress=False)  # the study holds 3 trials already: nothing runs
    assert len(list((tmp_path / "runs").glob("*/trial*"))) == 3

    # A process killed in a trial leaves it "running", its heartbeat old: continuing the study marks
    # it failed, runs one more trial in its place and counts only the finished ones.
    import optuna

    killed = optuna.load_study(study_name=result["study"], storage=storage).ask()
    optuna.storages.RDBStorage(storage).record_heartbeat(killed._trial_id)
    with sqlite3.connect(tmp_path / "studies.db") as db:
        db.execute("UPDATE trial_heartbeats SET heartbeat = datetime('now', '-1 hour')")
    study(4).run(show_progress=False)
    trials = optuna.load_study(study_name=result["study"], storage=storage).trials
    assert trials[killed.number].state == optuna.trial.TrialState.FAIL
    assert len(trials) == 5 and len(list((tmp_path / "runs").glob("*/trial*"))) == 4
    assert f"Not counted: trial {killed.number} (failed" in (tuned.parent / "tuned.study.md").read_text()


def test_each_study_draws_its_own_values_and_the_model_proposes_half_of_them(tmp_path, monkeypatch):
    """One sampler seed for every study drew the same start-up values for every method; now each
    method's sampler has its own seed, and TPE's random start-up is at most half the trials."""
    import optuna

    from fedmeta import report

    studies = {
        m: Study(m, [], 20, 10, None, None, root=tmp_path / "runs") for m in ("fedrep", "ditto", "fedavg_ft")
    }
    assert len({s.sampler_seed for s in studies.values()}) == 3
    assert all(s.startup_trials == 10 < s.trials for s in studies.values())
    assert Study("fedrep", [], 6, 10, None, None, root=tmp_path / "runs").startup_trials == 3

    def first_draw(study: Study) -> float:
        sampler = optuna.samplers.TPESampler(seed=study.sampler_seed, n_startup_trials=study.startup_trials)
        return (
            optuna.create_study(sampler=sampler)
            .ask()
            .suggest_float("personalization.lr", 5e-4, 0.1, log=True)
        )

    assert len({first_draw(s) for s in studies.values()}) == 3

    tuned = tmp_path / "variant" / "fedrep" / "tuned.yaml"  # a tuned row names its trial and the study's size
    tuned.parent.mkdir(parents=True)
    tuned.write_text(
        f"# The best of 20 trials …\n{MARK} fedrep-rmnist-shards-10rounds-seed100 (trial 13 of 20)\n"
    )
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(tmp_path))
    assert report.method_label("fedrep-tuned") == "FedRep (tuned: trial 13 of 20)"


def test_two_studies_started_together_on_a_new_database_both_open_it(tmp_path, monkeypatch):
    """Two `fedmeta tune` started at once on the default database both create its tables; the
    second's CREATE TABLE fails (as it did for two studies started together): it opens the tables."""
    import sqlite3

    import optuna
    import sqlalchemy.exc

    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    real, calls = optuna.create_study, []

    def created_meanwhile(**kwargs):
        calls.append(kwargs["study_name"])
        if len(calls) == 1:  # the other process made the tables between our check and our CREATE
            optuna.storages.RDBStorage(storage)
            raise sqlalchemy.exc.OperationalError(
                "CREATE TABLE study_directions",
                {},
                sqlite3.OperationalError("table study_directions already exists"),
            )
        return real(**kwargs)

    monkeypatch.setattr(optuna, "create_study", created_meanwhile)
    monkeypatch.setattr("fedmeta.tune.time.sleep", lambda seconds: None)
    study = Study("fedrep", [], 4, 2, None, storage, root=tmp_path / "runs")._open(optuna)
    assert len(calls) == 2 and study.study_name == calls[0] and not study.trials

    def broken(**kwargs):
        raise sqlalchemy.exc.OperationalError(
            "SELECT", {}, sqlite3.OperationalError("file is not a database")
        )

    monkeypatch.setattr(optuna, "create_study", broken)
    with pytest.raises(FedmetaError, match="cannot open the study database"):
        Study("fedrep", [], 4, 2, None, storage, root=tmp_path / "runs")._open(optuna)


def test_a_tuned_row_run_with_an_earlier_studys_values_says_so(tmp_path, monkeypatch):
    """A table's tuned row names the study only when its runs used the values tuned.yaml holds now."""
    from fedmeta import report

    tuned = tmp_path / "variant" / "fedrep" / "tuned.yaml"
    tuned.parent.mkdir(parents=True)
    tuned.write_text(
        f"# The best of 20 trials …\n{MARK} fedrep-rmnist-shards-10rounds-seed100 (trial 13 of 20)\n"
        "method:\n  local_lr: 0.02\npersonalization:\n  lr: 0.01\n"
    )
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(tmp_path))
    same, earlier = tmp_path / "run0", tmp_path / "run1"
    for folder, lr in ((same, 0.02), (earlier, 0.05)):
        folder.mkdir()
        (folder / "config.yaml").write_text(f"method:\n  local_lr: {lr}\npersonalization:\n  lr: 0.01\n")
    assert report.method_label("fedrep-tuned", [same]) == "FedRep (tuned: trial 13 of 20)"
    assert report.method_label("fedrep-tuned", [same, earlier]) == (
        "FedRep (tuned: an earlier study's values, not those of tuned.yaml now)"
    )


def test_a_study_neither_replaces_a_committed_variant_nor_mixes_settings(tmp_path, monkeypatch):
    """`fedmeta tune fedavg_ft --trials 2 --rounds 1` once replaced the committed tuned.yaml (the
    best of 20 trials) unasked, and continued a study started under other settings."""
    import optuna

    home = tmp_path / "home"
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(home))
    storage = f"sqlite:///{tmp_path / 'studies.db'}"

    def study(overrides: list[str], **flags) -> Study:
        return Study("fedavg_ft", overrides, 2, 1, None, storage, root=tmp_path / "runs", **flags)

    first = study(["federation.clients_per_round=5"])
    assert first.out == home / "variant" / "fedavg_ft" / "tuned.yaml" and not first.replaces
    first._check_settings(first._open(optuna))  # a new study records its settings
    second = study(["federation.clients_per_round=2"])
    with pytest.raises(FedmetaError, match=r"other settings \(federation.clients_per_round=5 then, 2 now\)"):
        second._check_settings(second._open(optuna))
    third = study(["federation.clients_per_round=2"], new_study=True)
    assert third.name != first.name and third.name.startswith(first.name)
    third._check_settings(third._open(optuna))

    (home / "variant" / "fedavg_ft").mkdir(parents=True)
    shutil.copy(CONFIG_DIR / "variant" / "fedavg_ft" / "tuned.yaml", first.out)  # another study's values
    with pytest.raises(
        FedmetaError, match=r"holds the best of 20 trials of study .*98.46 %: pass --overwrite"
    ):
        study(["federation.clients_per_round=5"])
    assert study(["federation.clients_per_round=5"], overwrite=True).replaces.endswith("98.46 %")

    configs = tmp_path / "configs"  # the package's own file: replaced only when asked, naming what it held
    shutil.copytree(CONFIG_DIR, configs)
    replacing = Study(
        "fedavg_ft",
        [],
        2,
        1,
        None,
        storage,
        root=tmp_path / "runs",
        config_dir=configs,
        replace_committed=True,
    )
    assert replacing.out == configs / "variant" / "fedavg_ft" / "tuned.yaml"
    assert "98.46 %" in replacing.replaces


def test_two_processes_on_one_study_draw_distinct_trials(tmp_path):
    """`fedmeta tune` run on two machines at once, one study: each process's sampler, seeded alike,
    drew the same values for its first trial; now a trial's draws come from its own number."""
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    script = (
        "import optuna, sys\n"
        "from fedmeta.tune import trial_seeded_sampler\n"
        "optuna.logging.set_verbosity(optuna.logging.ERROR)\n"
        "study = optuna.create_study(study_name='s', storage=sys.argv[1], load_if_exists=True,\n"
        "                            sampler=trial_seeded_sampler(1234, 10))\n"
        "trial = study.ask()\n"
        "print(trial.number, trial.suggest_float('personalization.lr', 5e-4, 0.1, log=True))\n"
    )
    import optuna

    optuna.create_study(study_name="s", storage=storage)  # the tables, before both start
    processes = [
        subprocess.Popen([sys.executable, "-c", script, storage], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    drawn = [process.communicate(timeout=120)[0].split() for process in processes]
    assert sorted(int(number) for number, _ in drawn) == [0, 1]
    assert drawn[0][1] != drawn[1][1]


def test_a_trial_running_in_another_process_counts_toward_the_studys_trials(tmp_path, monkeypatch):
    """Two `fedmeta tune --trials 2` on one study end with 2 trials, not 4: each process starts a
    trial only while finished and running ones fall short of the count."""
    import optuna

    monkeypatch.chdir(tmp_path)
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    study = Study("fedrep", [], 2, 2, None, storage, root=tmp_path / "runs")
    opened = study._open(optuna)
    assert study._unclaimed(opened, optuna) == 2
    opened.ask()  # another process's trial, under way
    assert study._unclaimed(opened, optuna) == 1
    opened.add_trial(
        optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL)
    )  # a failure holds no place
    assert study._unclaimed(opened, optuna) == 1
    opened.add_trial(optuna.trial.create_trial(value=0.5, params={}, distributions={}))
    assert study._unclaimed(opened, optuna) == 0
