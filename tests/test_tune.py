"""fedmeta tune: a real (tiny) Optuna study writes the best trial's settings as a variant, and a
study run again continues instead of starting over."""

import shutil

import pytest
from omegaconf import OmegaConf

from fedmeta.config import CONFIG_DIR, compose
from fedmeta.tune import MARK, Study

TINY = ["model.conv_channels=[8,16]", "model.dense_units=[32]", "personalization.steps=3", "federation.num_new_clients=4",
        "logger=[]"]


@pytest.mark.slow
def test_study_writes_the_best_trial_as_the_tuned_variant_and_resumes(tmp_path, mnist_dir):
    configs = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, configs)
    storage = f"sqlite:///{tmp_path / 'studies.db'}"

    def study(trials: int) -> Study:
        return Study("perfedavg", [f"dataset.dir={mnist_dir}", *TINY], trials, rounds=2, seed=None, storage=storage,
                     root=tmp_path / "runs", config_dir=configs)

    result = study(3).run(show_progress=False)
    tuned = configs / "variant" / "perfedavg" / "tuned.yaml"
    text = tuned.read_text()
    assert MARK in text and "tuning seed 100" in text
    best = OmegaConf.load(tuned)
    assert best.method.inner_lr == result["best"]["method.inner_lr"]
    space = OmegaConf.load(configs / "tune.yaml").spaces.perfedavg
    for key, bounds in space.items():
        low, high = bounds.log
        assert low <= OmegaConf.select(best, key) <= high
    cfg = compose(["method=perfedavg", "variant=tuned"], configs)  # the result is a variant like any other
    assert cfg.personalization.lr == result["best"]["personalization.lr"]
    table = (tuned.parent / "tuned.study.md").read_text()
    assert table.count("| complete |") + table.count("| pruned |") == 3
    assert sorted(p.name for p in (tmp_path / "runs").glob("*/trial*")) == ["trial0", "trial1", "trial2"]

    study(3).run(show_progress=False)  # the study holds 3 trials already: nothing runs
    assert len(list((tmp_path / "runs").glob("*/trial*"))) == 3
    study(4).run(show_progress=False)  # one more
    assert len(list((tmp_path / "runs").glob("*/trial*"))) == 4
