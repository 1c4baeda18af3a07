"""Bad input: one clear line on stderr, exit code 2, nothing left in runs/."""

import json
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf
from test_properties import no_work, run_main  # noqa: F401 — no_work: a fixture, used by name

from fedmeta import grid
from fedmeta.cli import main
from fedmeta.config import CONFIG_DIR, group_choices, user_config_dir

BAD = [
    (["dataset=imagenet"], "unknown data set 'imagenet'"),
    (["method=sgd"], "unknown method 'sgd'"),
    (["partition=random"], "unknown partition 'random'"),
    (["partition=dirichlet", "partition.alpha=0"], "partition.alpha must be > 0"),
    (["partition=dirichlet", "partition.alpha=-0.5"], "partition.alpha must be > 0"),
    (["federation.rounds=0"], "federation.rounds must be ≥ 1"),
    (["federation.clients_per_round=81"], "clients_per_round must be between 1 and the 80"),
    (["federation.num_new_clients=100"], "num_new_clients"),
    (["method.modulation=c9"], "method.modulation must be one of c0, c1, c2"),
    (["fabric.precision=8-bit"], "fabric.precision must be one of"),
    (["no.such.key=1"], "unknown or invalid config key"),
    (["method=local", "variant=authors"], "method 'local' has no variant 'authors'"),
    (["method.outer_optimizer=adagrad"], "method.outer_optimizer must be one of adam_fresh, adam_kept, sgd"),
    (["method.batches=random"], "method.batches must be one of independent, stream"),
    (["method=fedavg", "method.train_split=test"], "method.train_split must be one of all, pers"),
    (["method=fedrep", "method.averaging=median"], "method.averaging must be one of samples, uniform"),
    (["method=fedrep", "method.head_batches=-1"], "method.head_batches must be an integer ≥ 0"),
    (
        ["personalization.held_out_batch_size=1"],
        "personalization.held_out_batch_size must be null (one pass) or ≥ 2",
    ),
    (
        ["personalization.batches=loop"],
        "personalization.batches must be one of independent, stream, stream_fixed",
    ),
    (
        ["variant=weird"],
        "method 'cafeme' has no variant 'weird': choose one of ['paper', 'authors', 'paper_text', 'tuned']",
    ),
    (["seed"], "overrides must be key=value"),
    (["federation.eval_every=0"], "federation.eval_every must be ≥ 1"),
    (["federation.held_out_fraction=1.5"], "held_out_fraction must be in (0, 1)"),
    (["federation.client_threads=0"], "federation.client_threads must be ≥ 1"),
    (["federation.checkpoint_every=-1"], "federation.checkpoint_every must be ≥ 0"),
    (["federation.client_failure_rate=1.0"], "federation.client_failure_rate must be in [0, 1)"),
    (["method.inner_lr=0"], "method.inner_lr must be > 0"),
    (["personalization.lr=-1"], "personalization needs steps ≥ 0, lr > 0"),
    (["method.context=oracle"], "method.context must be one of labelled, transductive"),
    (["method.client_state_dtype=int8"], "method.client_state_dtype must be one of float32, bfloat16"),
    (["wandb.mode=sometimes"], "wandb.mode must be offline, online or disabled"),
    (["partition.shards_per_client=1000"], "cannot be cut"),
    (["partition=iid", "federation.num_clients=20000"], "too few for personalization and held-out splits"),
    (["fabric.strategy=telepathy"], "fabric settings rejected"),
    (["fabric.devices=0"], "fabric.devices must be ≥ 1 (or -1: every device of the machine)"),
    # untyped command-line values are checked against each key's type, before anything is created
    (["federation.rounds=abc"], "federation.rounds must be an integer, got 'abc'"),
    (["federation.rounds=2.5"], "federation.rounds must be an integer, got 2.5"),
    (["federation.num_clients=10.5"], "federation.num_clients must be an integer"),
    (["seed=abc"], "seed must be an integer"),
    (["personalization.lr=nan"], "personalization.lr must be a finite number, got 'nan'"),
    (["personalization.lr=.inf"], "personalization.lr must be a finite number"),
    (["model.dense_units=5"], "model.dense_units must be a list"),
    (["partition.shards_per_client=0"], "partition.shards_per_client must be ≥ 1"),
    (["federation.rounds="], "federation.rounds needs a value"),
    (["federation.rounds=["], "cannot parse overrides"),
    (["model.kernel_size=40"], "the model does not fit 28×28 images"),
    (["model.kernel_size=27"], "use a smaller kernel"),
    (["seeds=[0,0]"], "seeds must be a list of distinct integers"),
    (["seeds=abc"], "seeds must be a list, e.g. seeds=[0,1,2]"),
    (["federation.vectorize_lanes=-1"], "federation.vectorize_lanes must be ≥ 0"),
    (["federation.lane_buckets=0"], "federation.lane_buckets must be an integer ≥ 1"),
    # paths: names from their folders only, settings without separators
    (["output.setting=x/../../escape"], "output.setting must be a plain folder name"),
    ([f"output.setting={'s' * 300}"], "output.setting must be a plain folder name"),
    (["method=../../somewhere/evil"], "unknown method '../../somewhere/evil'"),
    (["dataset=../configs/config"], "unknown data set"),
    (["fabric.precision=16-mixed"], "16-mixed needs a GPU; on the CPU use bf16-mixed"),
    # the run folder is named from method.name and variant: plain names only, never a path
    (["method.name=../../../../ESCAPED"], "method.name must be a plain name"),
    (["method.name=/tmp"], "method.name must be a plain name"),
    (["personalization.decay_every=0"], "personalization.decay_every must be an integer ≥ 1"),
    (["method=ifca", "method.local_optimizer=adam_kept"], "method.local_optimizer must be one of sgd"),
    (["method=ifca", "method.local_batches=5"], "method.local_batches must be one of 0"),
    # what only the data can refuse is refused before a run folder exists (a rehearsal of the first draws)
    (["variant=authors", "method.batch_size=100000"], "fewer than one batch of 100000"),
    (["federation.capture=graph"], "federation.capture=graph records CUDA graphs and needs a CUDA device"),
    (["federation.capture=sometimes"], "federation.capture must be one of"),
    (["federation.vectorize=maybe"], "federation.vectorize must be true, false or auto"),
    # interpolations are not taken on the command line (one rule, every key)
    (["output.root=${oc.env:HOME}"], "interpolations (${…}) are not taken on the command line"),
    (["federation.rounds=${federation.eval_every}"], "write the value itself, e.g. federation.rounds=1000"),
    (["=5"], "overrides must be key=value"),
    (["dataset="], "dataset= needs a name: choose one of"),
    # the keys a choice of config file sets are not changed alone: the run would be mislabelled or misplaced
    (["method.algorithm=fedavg"], "method.algorithm is set by method=<name>"),
    (["dataset.name=../../x"], "dataset.name is set by dataset=<name>"),
    # keys that may be null still have a type for their other values
    (["personalization.held_out_batch_size=abc"], "personalization.held_out_batch_size must be an integer"),
    (["method=ifca", "method.clusters=[1]"], "method.clusters must be an integer"),
    (["method=ifca", "method.clusters=1000"], "method.clusters must be an integer from 1 to the"),
    (["model.dense_units={a:1}"], "model.dense_units must be a list"),
    (["fabric={a:1}"], "unknown or invalid config key"),
    (["output.setting=[a]"], "output.setting must be a single value"),
    (["seed=-1"], "seed must be in [0, 2^32)"),
    ([f"seed={2**32}"], "seed must be in [0, 2^32)"),
    (["fabric.num_nodes=0"], "fabric.num_nodes must be ≥ 1"),
    (["fabric.num_nodes=2"], "fabric.num_nodes=2 needs every node started by a launcher"),
    (["model.dense_units=[0]"], "model.dense_units must list integers ≥ 1"),
    (["method=perfedavg", "method.batch_size=1"], "method.batch_size must be an integer ≥ 2"),
    (["personalization.batch_size=1"], "batch_size ≥ 2"),
    (["model.padding=[1]"], "model.padding must be an integer ≥ 0, same or valid"),
    (["model.modulator.after_mean=[a]"], "model.modulator.after_mean must list integers ≥ 1"),
    (  # a key under a value: a traceback from a later check before
        ["federation.rounds.x=3"],
        "federation.rounds.x: federation.rounds is a value, not a group of keys: set federation.rounds itself",
    ),
    (["model.dense_units.0=64"], "set model.dense_units itself, e.g. model.dense_units=[512]"),
    (["logger.x=1"], "logger.x: logger is a value, not a group of keys"),
    (["model.init_from.x=1"], "model.init_from is a value, not a group of keys"),
    (["personalization.steps=1000000000"], "personalization.steps must be at most 1000, got 1000000000"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_input_is_one_line(overrides, message, capsys, tmp_path):
    code = main(["train", *overrides, f"output.root={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and err.startswith("fedmeta: error: ")
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_gpu_asked_on_a_machine_without_one(capsys, tmp_path):
    assert main(["train", "fabric.accelerator=cuda", f"output.root={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fabric.accelerator=cuda: this machine has no CUDA device" in err
    assert not any(tmp_path.iterdir())


def test_missing_data_file_names_the_file(capsys, tmp_path, monkeypatch):
    empty = tmp_path / "nodata"
    code = main(
        ["train", f"dataset.dir={empty}", "dataset.download=false", f"output.root={tmp_path / 'runs'}"]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"{empty}/mnist.npz not found" in err and "FEDMETA_DATA" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_corrupt_data_file_is_reported(capsys, tmp_path):
    (tmp_path / "mnist.npz").write_bytes(b"not a zip archive")
    code = main(["train", f"dataset.dir={tmp_path}", f"output.root={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert code == 2 and "is not a readable .npz archive" in err and err.count("\n") == 1


@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_console_script_exits_nonzero_with_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "fedmeta.cli", "train", "method=nope", f"output.root={tmp_path}"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("fedmeta: error: unknown method 'nope': choose one of ['apfl', 'cafeme', ")
    assert line.endswith(f"(the files in {user_config_dir() / 'method'} and {CONFIG_DIR / 'method'})")


def test_diverging_run_stops_naming_round_and_client(capsys, tmp_path, mnist_dir):
    code = main(
        [
            "train",
            "method=fedavg",
            "method.local_batches=2",
            "method.local_lr=1e6",
            "federation.rounds=3",
            "model.conv_channels=[8,16]",
            "model.dense_units=[32]",
            "wandb.mode=disabled",
            f"dataset.dir={mnist_dir}",
            f"output.root={tmp_path}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar
    assert code == 2 and re.match(r"fedmeta: error: round \d: client \d+ produced a non-finite", err)
    assert not list(tmp_path.rglob("summary.json"))


def test_data_describe_prints_statistics_and_saves_histograms(capsys, tmp_path, mnist_dir):
    code = main(
        ["data", "describe", "rmnist", "shards", f"dataset.dir={mnist_dir}", f"output.root={tmp_path}"]
    )
    out = capsys.readouterr().out
    stats = json.loads(out[: out.rindex("}") + 1])
    assert code == 0 and stats["clients"] == 100 and stats["samples_per_client"]["min"] == 600
    assert stats["classes_per_client"]["mean"] <= 2.1
    png = tmp_path / "rmnist-shards" / "clients.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["data", "describe", "mnist"]) == 2
    assert "unknown data set 'mnist'" in capsys.readouterr().err


@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_evaluate_repeats_a_runs_personalization_and_varies_it(capsys, tmp_path, mnist_dir, monkeypatch):
    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    assert (
        main(
            [
                "train",
                "method=ditto",
                "federation.rounds=2",
                "federation.num_new_clients=5",
                "federation.clients_per_round=2",
                "personalization.steps=2",
                "model.conv_channels=[8,16]",
                "model.dense_units=[32]",
                f"output.root={tmp_path}",
            ]
        )
        == 0
    )
    run = tmp_path / "rmnist-shards" / "ditto" / "seed0"
    summary = json.loads((run / "summary.json").read_text())
    progress = (
        capsys.readouterr().err
    )  # the final evaluation, often longer than the rounds, has a bar of its own
    assert "round 2: personalizing the new clients:   0%| | 0/5" in progress.replace("          ", " ")

    assert main(["evaluate", str(run)]) == 0  # the same procedure on the same model: the same numbers
    assert main(["evaluate", str(run), "personalization.lr=0.05"]) == 0
    # a setting Ditto's file marks test_time (its new clients read λ), and each line records it
    assert main(["evaluate", str(run), "personalization.lr=0.05", "method.lam=2.0"]) == 0
    same, faster, pulled = [json.loads(line) for line in (run / "evaluations.jsonl").read_text().splitlines()]
    assert same["curve"] == summary["curve"] and same["accuracy"] == summary["accuracy"]
    assert faster["personalization"]["lr"] == 0.05 and faster["curve"][1:] != summary["curve"][1:]
    assert faster["curve"][0] == summary["curve"][0]  # step 0 is the model itself
    assert same["method"] == faster["method"] == {"lam": 0.1} and pulled["method"] == {"lam": 2.0}
    assert pulled["curve"][1:] != faster["curve"][1:]

    capsys.readouterr()
    assert main(["evaluate", str(run), "federation.rounds=3"]) == 2
    said = capsys.readouterr().err
    assert (
        said.count("\n") == 1
        and "only personalization.* settings, evaluation.protocol, and ditto's method.lam" in said
    )
    (run / "checkpoint.ckpt").write_bytes(b"not a checkpoint")
    assert main(["evaluate", str(run)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "it is corrupt or not a fedmeta checkpoint" in error


def test_train_help_lists_every_choice_with_one_line(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for group in ("dataset", "partition", "method"):
        for name in group_choices(group):
            assert re.search(rf"\n  {name} +\S", text), name
    assert "  cafeme/authors " in text and "  fedrep/tuned " in text
    assert "\n  iid          An i.i.d. equal split" in text  # a sentence, not cut at an abbreviation


@pytest.mark.parametrize(
    "args,message",
    [
        (["sweep", "method=local", "--executor", "slurm"], "--executor slurm needs SLURM's sbatch"),
        (["sweep", "method=local", "--executor", "ray"], "--executor must be one of pool, local, slurm"),
        (["sweep", "method=local,,fedavg"], "a sweep value is empty"),
        (["sweep", "method.no_such_key=1,2"], "unknown or invalid config key"),
        (["sweep", "method=local", "--executor", "local", "--slurm", "partition"], "--slurm takes key=value"),
        (["tune", "nope"], "no search space for method 'nope'"),
        (["tune", "cafeme", "--seed", "0"], "--seed 0 is a seed the presets score"),
        (["tune", "cafeme", "--trials", "0"], "--trials and --rounds must be ≥ 1"),
        (["tune", "cafeme", "--storage", "nosuchdb://x"], "cannot open the study database"),
        (["tune", "fedavg"], "holds values written by hand, not by fedmeta tune: pass --overwrite"),
    ],
)
def test_sweep_and_tune_bad_input_is_one_line(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tuned = tmp_path / "home" / "variant" / "fedavg" / "tuned.yaml"  # the user's own values
    tuned.parent.mkdir(parents=True)
    tuned.write_text("method:\n  local_lr: 0.05\n")
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("shutil.which", lambda name: None)  # no SLURM on this machine, whatever the CI has
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["flower", "sim", "--nodes", "0"], "--nodes must be ≥ 1 and --timeout > 0"),
        (["flower", "deploy", "--timeout", "0"], "--nodes must be ≥ 1 and --timeout > 0"),
        (["flower", "sim", "method=nope"], "unknown method 'nope'"),
        (["flower", "deploy", "--print", "--port", "99999"], "--port must leave room"),
    ],
)
def test_flower_bad_input_is_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_flower_dp_out_of_range_is_one_line(capsys):
    pytest.importorskip("flwr", reason="Flower is an optional extra: pip install -e '.[flower]'")
    assert main(["flower", "sim", "--dp", "0", "1", "1", "1e-5"]) == 2
    err = capsys.readouterr().err
    assert "--dp needs CLIP > 0" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "args,message",
    [
        (["flower", "sim", "--timeout", "nan"], "--timeout > 0 (a finite number of seconds), got 4 and nan"),
        (["flower", "sim", "--timeout", "inf"], "--timeout > 0 (a finite number of seconds), got 4 and inf"),
        (["flower", "deploy", "--max-seconds", "-5"], "--max-seconds must be a finite number of seconds > 0"),
        (["flower", "deploy", "--print", "--max-seconds", "nan"], "--max-seconds must be a finite number"),
        (["flower", "sim", "--dp", "nan", "1", "1", "0.1"], "all finite, got [nan, 1.0, 1.0, 0.1]"),
        (["flower", "sim", "--dp", "1", "1", "inf", "0.1"], "all finite, got [1.0, 1.0, inf, 0.1]"),
    ],
)
@pytest.mark.usefixtures("no_work")
def test_flower_numbers_that_are_not_finite_and_positive_are_one_line(args, message):
    """Refused before Flower is imported: the same line whether it is installed or not."""
    code, err = run_main(args)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_key_given_twice_takes_its_last_value_as_the_docs_say(capsys):
    assert main(["train", "--print-config", "federation.rounds=3", "federation.rounds=4"]) == 0
    assert OmegaConf.create(capsys.readouterr().out).federation.rounds == 4


@pytest.mark.parametrize(
    "values,message",
    [
        (["seed=0,0"], "seed=0,0 repeats 0: give each value once, e.g. seed=0"),
        (["method=local,fedavg,local"], "repeats local: give each value once, e.g. method=local,fedavg"),
        (["seed=0,1", "seed=2"], "seed is given twice (seed=0,1 and seed=2): give its values once"),
        (
            ["seed=0,1", "personalization.lr=0.1,0.10"],
            "personalization.lr=0.1 and seed=0 personalization.lr=0.10",
        ),
    ],
)
def test_a_sweep_that_would_run_a_point_twice_is_refused_before_any_run(
    values, message, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(grid, "run", lambda *args, **kwargs: pytest.fail("a run started"))
    assert main(["sweep", *values]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())


def test_data_describe_takes_a_key_value_after_the_data_set_as_an_override(capsys, monkeypatch):
    described = []
    monkeypatch.setattr("fedmeta.describe.describe", lambda cfg: described.append(cfg) or ({}, "x.png"))
    assert main(["data", "describe", "rmnist", "federation.num_clients=30"]) == 0
    assert described[0].federation.num_clients == 30 and described[0].partition.name == "shards"
    assert main(["data", "describe", "rmnist", "dirichlet", "federation.num_clients=30"]) == 0
    assert described[1].federation.num_clients == 30 and described[1].partition.name == "dirichlet"
    capsys.readouterr()
    assert main(["data", "describe", "folder", "key=value"]) == 2  # before: "unknown partition 'key=value'"
    err = capsys.readouterr().err
    assert "unknown or invalid config key 'key'" in err and err.count("\n") == 1


def test_one_name_is_a_list_of_one(capsys):
    assert main(["train", "--print-config", "logger=tensorboard"]) == 0
    assert "logger:\n- tensorboard\n" in capsys.readouterr().out
    assert (
        main(["train", "--print-config", "model.dense_units=5"]) == 2
    )  # a number is not a name: refused, with an example
    assert "model.dense_units must be a list, e.g. model.dense_units=[512]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["bench", "--datasets", "rmnsit", "fabric.accelerator=cpu", "--no-memory"],
            "--datasets rmnsit: not a data set of bench.yaml",
        ),
        (["bench", "--methods", "fedprx", "--no-memory"], "--methods fedprx: no such method"),
        (["bench", "--datasets", "fabric.accelerator=cpu"], "--datasets needs at least one name"),
        (["table", "--no-run", "--methods", "bogus"], "unknown method 'bogus'"),
        (["table", "--no-run", "--methods", "fedrep-nope"], "method 'fedrep' has no variant 'nope'"),
        (
            ["table", "--preset", "paper", "--no-run", "--methods", "fedproto"],
            "--methods: fedproto is not one of the preset's methods",
        ),
        (["table", "--no-run", "--executor", "bogus"], "--executor must be one of pool, local, slurm"),
        (
            ["table", "--no-run", "--datasets", "rmnsit", "federation.rounds=2"],
            "no setting of the preset is or uses ['rmnsit']",
        ),
        (["table", "--no-run", "--seeds", "0", "x"], "--seeds takes integers"),
        (["sweep", "method=local", "output.root=elsewhere"], "a sweep's runs go under --root"),
        (["tune", "fedrep", "--storage", ""], "--storage is empty"),
    ],
)
def test_a_typo_in_a_command_is_one_line_and_writes_nothing(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    (results / "bench.json").write_text("{}")  # a committed result a typo must not replace
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and err.startswith("fedmeta: error: "), err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["bench.json", "results"]
    assert (results / "bench.json").read_text() == "{}"


def test_overrides_after_a_list_option_are_overrides():
    """--datasets a b key=value: the names stop at the first key=value (they used to swallow it)."""
    import argparse

    from fedmeta.cli import Names

    parser = argparse.ArgumentParser()
    parser.add_argument("--datasets", nargs="+", action=Names)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(
        ["--datasets", "rmnist", "cifar10-shards,femnist", "fabric.accelerator=cuda", "seed=1"]
    )
    assert args.datasets == ["rmnist", "cifar10-shards", "femnist"]
    assert args.moved_overrides == ["fabric.accelerator=cuda", "seed=1"]


def test_the_package_lists_every_subpackage_and_ships_the_configs():
    """pyproject.toml names the packages (configs/ is mapped into fedmeta.configs): a new subpackage
    must be added there, or `pip install .` would leave it out."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "fedmeta").rglob("__init__.py")}
    # each configs folder is listed too (setuptools warns once per folder it ships but was not told of)
    folders = {
        ".".join(("fedmeta", *d.relative_to(root).parts)) for d in (root / "configs").rglob("*") if d.is_dir()
    }
    assert set(setuptools["packages"]) == found | {"fedmeta.configs"} | folders
    assert setuptools["package-dir"] == {"fedmeta.configs": "configs"}
    assert setuptools["package-data"] == {"*": ["*.yaml"]}


def test_overrides_may_follow_options():
    """argparse fills a positional list once, before the options: key=value words after an option
    are joined to the overrides (they were refused as unrecognized); other strays still are."""
    from fedmeta.cli import parse

    assert parse(["tune", "ditto", "--trials", "30", "partition=dirichlet"]).overrides == [
        "partition=dirichlet"
    ]
    assert parse(["sweep", "seed=0,1", "--parallel", "2", "method=cafeme"]).values == [
        "seed=0,1",
        "method=cafeme",
    ]
    assert main(["tune", "ditto", "--trials", "30", "--bogus"]) == 2
    assert main(["data", "download", "mnist", "seed=1"]) == 2


def test_every_key_a_method_accepts_is_read_by_that_method():
    """A method's config keys (its own file and those it inherits) are read by its algorithm or its
    model, or refused when set: IFCA inherits FedAvg's keys, and the two it does not use are refused."""
    import inspect
    import re

    import fedmeta.algorithms as algorithms
    from fedmeta.config import compose, group_choices
    from fedmeta.errors import FedmetaError

    refused = {"ifca": {"local_optimizer": "adam_kept", "local_batches": 3}}
    for method in group_choices("method"):
        cfg = compose([f"method={method}"])
        cls = algorithms.algorithm_class(cfg.method.algorithm)
        source = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("fedmeta"))
        read = set(re.findall(r"cfg(?:\.method)?\.(\w+)", source)) | set(
            re.findall(r"""cfg\.get\(["'](\w+)""", source)
        )
        unread = {k for k in cfg.method if k not in read} - {"name", "algorithm"}
        assert unread == set(refused.get(cfg.method.algorithm, {})), (method, unread)
        for key, value in refused.get(cfg.method.algorithm, {}).items():
            with pytest.raises(FedmetaError, match=f"method.{key} must be one of"):
                compose([f"method={method}", f"method.{key}={value}"])


def test_a_method_file_that_inherits_personalization_steps_0_is_noted_once(tmp_path, monkeypatch, capsys):
    """FedAvg's file sets personalization.steps: 0 (plain FedAvg is scored without fine-tuning); a
    method file that inherits it and does not say otherwise gets one note — setting the key in the
    file, a variant or on the command line says it was meant. No shipped method file draws it."""
    from fedmeta import config
    from fedmeta.config import compose, group_choices

    (tmp_path / "method").mkdir()
    for name, extra in (("silent", ""), ("said", "personalization:\n  steps: 0\n")):
        (tmp_path / "method" / f"{name}.yaml").write_text(
            f"# A method of mine.\ninherits: fedavg\nlabel: Mine\nmethod:\n  name: {name}\n{extra}"
        )
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(tmp_path))
    monkeypatch.setattr(config, "_NOTED", set())
    for overrides in (["method=said"], ["method=silent", "personalization.steps=0"], ["method=silent"]):
        compose(overrides)
    compose(["method=silent"])  # a second time: no second note
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert len(notes) == 1 and "method silent takes personalization.steps: 0 from fedavg.yaml" in notes[0]
    assert str(tmp_path / "method" / "silent.yaml") in notes[0]
    assert compose(["method=silent", "personalization.steps=5"]).personalization.steps == 5

    monkeypatch.delenv("FEDMETA_CONFIG_HOME")
    monkeypatch.setattr(config, "_NOTED", set())
    for method in group_choices("method"):
        compose([f"method={method}"])
    assert "note:" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "words,status", [(["train", "--help"], 0), (["train", "--print-config"], 141)]
)  # argparse's help ignores a closed pipe itself
@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_a_reader_that_stops_reading_ends_the_command_quietly(words, status):
    """`fedmeta … | grep -q x` under pipefail: the reader closes the pipe before fedmeta writes; that
    was "fedmeta: error: Broken pipe: check the path…" and exit 2 (or a traceback for --help)."""
    import os
    import subprocess
    import sys

    reader, writer = os.pipe()
    os.close(reader)  # gone before the command writes a byte
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from fedmeta.cli import main; sys.exit(main(sys.argv[1:]))",
            *words,
        ],
        stdout=writer,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(writer)
    assert (done.returncode, done.stderr) == (status, "")


def test_a_person_at_a_terminal_hears_at_once_why_a_command_is_quiet(capsys, monkeypatch):
    """At a terminal, a command that imports PyTorch before its first line of its own says so first;
    piped (a log, a test), stderr holds only what the command itself says."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["train", "federation.rounds=-1"]) == 2
    first, *rest = capsys.readouterr().err.strip().splitlines()
    assert first.startswith("fedmeta train: loading PyTorch") and rest[-1].startswith("fedmeta: error:")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert main(["train", "federation.rounds=-1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_at_a_terminal_a_run_says_what_its_slow_start_is_doing(capsys, monkeypatch, tmp_path, mnist_dir):
    """At a terminal: the data and federation line before the round bar, which says while the first
    round runs that it is the first; piped, neither."""
    tiny = [
        "train",
        "federation.rounds=1",
        "personalization.steps=1",
        "model.conv_channels=[4]",
        "model.dense_units=[8]",
        "logger=[]",
        f"dataset.dir={mnist_dir}",
    ]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main([*tiny, f"output.root={tmp_path / 'tty'}"]) == 0
    said = capsys.readouterr().err
    data = said.index(
        "fedmeta: rmnist: 60,000 images over 80 training and 20 new clients (shards), seed 0, in "
    )
    assert said.index("first round: its kernels and caches warm up") > data
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert main([*tiny, f"output.root={tmp_path / 'piped'}"]) == 0
    assert "fedmeta: rmnist:" not in capsys.readouterr().err


def test_ctrl_c_after_the_stop_line_ends_the_process_at_once_with_130(monkeypatch, capsys):
    """Once a run has said it stopped, a Ctrl-C during the way out (exit handlers, loggers) exits at
    once with 130 and one line, not with a KeyboardInterrupt traceback and the stop's 75."""
    import signal

    import fedmeta.cli as cli
    from fedmeta.errors import RunStopped

    def stops(args):
        raise RunStopped("stopped after round 3 of 10 (Ctrl-C); checkpointed in runs/x")

    monkeypatch.setitem(cli.COMMANDS, "sweep", stops)
    previous = signal.getsignal(signal.SIGINT)
    try:
        monkeypatch.setattr(sys, "argv", ["fedmeta", "sweep", "seed=0"])  # the command's own process
        assert main() == RunStopped.EXIT_STATUS
        handler = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    exits = []
    monkeypatch.setattr(cli.os, "_exit", exits.append)
    handler(signal.SIGINT, None)
    assert exits == [130] and capsys.readouterr().err.strip().endswith("Ctrl-C again: stopped at once")


def test_a_stopped_run_leaves_its_process_at_once_after_the_stop_line(monkeypatch, capsys):
    """``fedmeta train`` as its own process: once the stop line is out (files written, loggers
    closed), the process ends with 75 without the interpreter's teardown; called from Python, main
    returns 75."""
    import fedmeta.cli as cli
    from fedmeta.errors import RunStopped

    def stops(args):
        raise RunStopped("stopped after round 3 of 10 (output.stop_at); checkpointed in runs/x")

    monkeypatch.setitem(cli.COMMANDS, "train", stops)
    exits = []
    monkeypatch.setattr(cli.os, "_exit", lambda code: exits.append((code, capsys.readouterr().err)))
    monkeypatch.setattr(sys, "argv", ["fedmeta", "train"])
    main()
    assert exits[0][0] == RunStopped.EXIT_STATUS and "stopped after round 3 of 10" in exits[0][1]
    assert main(["train"]) == RunStopped.EXIT_STATUS and len(exits) == 1


@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_the_commands_that_only_read_runs_do_not_load_pytorch_or_lightning():
    """``fedmeta table --no-run`` reads kept runs: the grid, the report and a run's identity come
    without PyTorch and Lightning (seconds and a gigabyte at every start); a run's loggers bring them."""
    probe = (
        "import sys, fedmeta.grid, fedmeta.report, fedmeta.checkpoint, fedmeta.runs; "
        "print(sorted(m for m in ('torch', 'lightning_fabric') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    done = subprocess.run(
        [sys.executable, "-c", "import sys, fedmeta.loggers; print('lightning_fabric' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "True"  # the probe would see them
