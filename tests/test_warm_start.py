"""model.init_from: a run starts from another finished run's final global model — exactly that
model, placed in every IFCA model or in CAFeMe's base; refused in one line when it does not fit;
recorded in config.yaml and summary.json, and kept across a resume."""

import json
import shutil

import pytest
import torch

from fedmeta.algorithms import build_algorithm
from fedmeta.checkpoint import warm_start
from fedmeta.cli import main
from fedmeta.config import compose

TINY = [
    "federation.rounds=2",
    "federation.eval_every=2",
    "federation.num_new_clients=2",
    "federation.clients_per_round=2",
    "personalization.steps=1",
    "logger=[]",
    "method.local_batches=2",
]


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory, mnist_dir):
    root = tmp_path_factory.mktemp("source")
    assert (
        main(["train", "method=fedavg", *TINY, f"dataset.dir={mnist_dir}", f"output.root={root}", "seed=3"])
        == 0
    )
    return root / "rmnist-shards" / "fedavg" / "seed3"


def source_model(run):
    return torch.load(run / "checkpoint.ckpt", weights_only=True)["federation"]["model"]


@pytest.mark.parametrize("method", ["fedavg_ft", "ifca", "cafeme", "fedrep"])
def test_a_warm_start_loads_exactly_the_source_model(fedavg_run, method):
    cfg = compose([f"method={method}", f"model.init_from={fedavg_run.parent}/seed{{seed}}", "seed=3"])
    torch.manual_seed(0)
    algorithm = build_algorithm(cfg, 10)
    fresh = {k: v.clone() for k, v in algorithm.model.state_dict().items()}
    record = warm_start(algorithm, cfg)
    assert record["run"] == str(fedavg_run) and record["method"] == "fedavg" and record["rounds"] == 2
    source, loaded = source_model(fedavg_run), algorithm.model.state_dict()
    prefixes = (
        [f"nets.{c}." for c in range(cfg.method.clusters)]
        if method == "ifca"
        else ["base."]
        if method == "cafeme"
        else [""]
    )
    for prefix in prefixes:
        assert all(torch.equal(loaded[prefix + k], v) for k, v in source.items())
    rest = [k for k in loaded if not any(k.startswith(p) for p in prefixes)]
    assert all(torch.equal(loaded[k], fresh[k]) for k in rest) and bool(rest) == (
        method == "cafeme"
    )  # the modulator: fresh


def test_a_warm_start_that_does_not_fit_is_one_line_before_any_folder(
    fedavg_run, tmp_path, mnist_dir, capsys
):
    base = ["train", "method=fedavg", *TINY, f"dataset.dir={mnist_dir}", f"output.root={tmp_path / 'runs'}"]
    assert main([*base, f"model.init_from={fedavg_run}", "model.dense_units=[64]"]) == 2
    err = capsys.readouterr().err
    assert "its model does not fit this one" in err and err.count("\n") == 1
    assert main([*base, f"model.init_from={tmp_path}"]) == 2
    assert "not a finished run's folder" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "content,why",
    [
        ("[1, 2]", "a JSON list, not a mapping"),
        ("3", "a JSON int, not a mapping"),
        ("{cut", "JSONDecodeError"),
    ],
)
def test_a_source_whose_summary_is_not_a_mapping_is_one_line(
    fedavg_run, tmp_path, mnist_dir, capsys, content, why
):
    source = tmp_path / "source"
    shutil.copytree(fedavg_run, source)
    (source / "summary.json").write_text(content)
    base = ["train", "method=fedavg", *TINY, f"dataset.dir={mnist_dir}", f"output.root={tmp_path / 'runs'}"]
    assert main([*base, f"model.init_from={source}"]) == 2  # a traceback before
    err = capsys.readouterr().err
    assert (
        f"{source / 'summary.json'} is not a finished run's summary ({why})" in err and err.count("\n") == 1
    )
    assert not (tmp_path / "runs").exists()


def test_a_source_that_is_not_a_run_folder_is_told_what_one_holds(tmp_path, mnist_dir, capsys):
    """The hint says what to give, not the path given again."""
    base = ["train", "method=fedavg", *TINY, f"dataset.dir={mnist_dir}", f"output.root={tmp_path / 'runs'}"]
    assert main([*base, f"model.init_from={tmp_path}/fedavg/seed{{seed}}"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path}/fedavg/seed0 does not exist, so it is not a finished run's folder" in err
    assert "runs/<setting>/<method>/seed<k>" in err and "summary.json and checkpoint.ckpt" in err
    assert "{seed} in the path stands for this run's seed" in err and err.count("\n") == 1
    (tmp_path / "fedavg" / "seed0").mkdir(parents=True)
    (tmp_path / "fedavg" / "seed0" / "checkpoint.ckpt").write_bytes(b"")
    assert main([*base, f"model.init_from={tmp_path}/fedavg/seed{{seed}}"]) == 2
    assert "seed0 holds no summary.json, so it is not a finished run's folder" in capsys.readouterr().err


def test_a_warm_started_run_records_its_source_and_keeps_it_across_a_resume(fedavg_run, tmp_path, mnist_dir):
    args = [
        "train",
        "method=ifca",
        "method.clusters=2",
        "method.local_epochs=1",
        *TINY[:-1],
        "federation.checkpoint_every=1",
        f"dataset.dir={mnist_dir}",
        f"output.root={tmp_path}",
        f"model.init_from={fedavg_run}",
    ]
    assert main(args) == 0
    run = tmp_path / "rmnist-shards" / "ifca" / "seed0"
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["init_from"]["run"] == str(fedavg_run)
        and str(fedavg_run) in (run / "config.yaml").read_text()
    )
    (run / "summary.json").unlink()
    assert main([*args, "output.resume=true"]) == 0
    assert json.loads((run / "summary.json").read_text())["init_from"] == summary["init_from"]
