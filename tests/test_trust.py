"""What fedmeta reads from files others may have written — a shared run folder, the user's config
home, a tuning study — is data: it never chooses code to import, never breaks a command, and a
study never replaces or mixes results without being told to."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fedmeta.config import compose
from fedmeta.errors import FedmetaError

ROOT = Path(__file__).resolve().parent.parent


def shared_run(folder: Path, algorithm: str) -> Path:
    """A finished run's folder as someone might share it: its config naming ``algorithm``."""
    run = folder / "rmnist-shards" / "local" / "seed0"
    run.mkdir(parents=True)
    cfg = compose(["method=local"])
    cfg.method.algorithm = algorithm
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (run / "checkpoint.ckpt").write_bytes(b"")
    (run / "summary.json").write_text("{}")
    return run


def fedmeta(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m fedmeta.cli`` (as torchrun runs it): the working folder is first on its path."""
    return subprocess.run(
        [sys.executable, "-m", "fedmeta.cli", *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_a_run_folder_that_names_a_module_runs_nothing(tmp_path, monkeypatch, capsys):
    """The three probes: the Zen of Python printed, $BROWSER started, a file of the folder imported
    by ``python -m fedmeta.cli`` run inside it. Each is refused in one line before any import."""
    from fedmeta.cli import main

    outside = tmp_path / "written-outside"
    browser = tmp_path / "browser.sh"
    browser.write_text(f"#!/bin/sh\ntouch {outside}\n")
    browser.chmod(0o755)
    monkeypatch.setenv("BROWSER", str(browser))
    for probe in ("this:Y", "antigravity:X"):
        imported = set(sys.modules)
        assert main(["evaluate", str(shared_run(tmp_path / probe.split(":")[0], probe))]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"names method.algorithm {probe!r}" in err
        assert not {"this", "antigravity"} & (set(sys.modules) - imported)
    run = shared_run(tmp_path / "evil", "evil:X")
    (run / "evil.py").write_text(f"open({str(outside)!r}, 'w').write('ran')\nclass X: pass\n")
    result = fedmeta(["evaluate", "."], cwd=run)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "fedmeta imports no code a run folder names" in result.stderr
    assert not outside.exists()


def test_a_module_of_ones_own_is_not_imported_from_the_working_folder(tmp_path, monkeypatch):
    """``module:Class`` typed in one's own method file resolves through the installed packages and
    $PYTHONPATH; a same-named file in the working folder (first on ``python -m``'s path) is not read."""
    from fedmeta.algorithms import algorithm_class

    (tmp_path / "planted.py").write_text("raise SystemExit('imported from the working folder')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # as python -m fedmeta.cli, run here, would have it
    with pytest.raises(FedmetaError, match="cannot import planted"):
        algorithm_class("planted:Algorithm")


BROKEN_FILES = {
    "garbage": b"\x00\xff{[: not yaml",
    "a list": b"- a\n- b\n",
    "not UTF-8": b"method:\n  name: \xff\xfe\n",
    "empty": b"",
}


@pytest.mark.parametrize("kind", [*BROKEN_FILES, "fifo", "folder"])
def test_a_broken_file_in_the_config_home_is_skipped_with_one_notice(tmp_path, monkeypatch, kind):
    from fedmeta.cli import main

    home = tmp_path / "home"
    (home / "method").mkdir(parents=True)
    path = home / "method" / "mine.yaml"
    if kind == "fifo":
        os.mkfifo(path)  # read, it would block every command for ever
    elif kind == "folder":
        path.mkdir()
    else:
        path.write_bytes(BROKEN_FILES[kind])
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(home))
    result = fedmeta(["train", "--help"], cwd=tmp_path, env={"FEDMETA_CONFIG_HOME": str(home)})
    assert result.returncode == 0 and "cafeme" in result.stdout
    notes = [line for line in result.stderr.splitlines() if line.startswith("fedmeta: note: skipped")]
    assert len(notes) == (kind != "empty") == len(result.stderr.splitlines()), result.stderr
    assert main(["train", "method=cafeme", "--print-config"]) == 0  # every other choice still works


def test_the_config_home_is_read_first_in_a_checkout_too(tmp_path, monkeypatch):
    """An editable install reads $FEDMETA_CONFIG_HOME as an installed one does; an unknown name says
    where fedmeta looked."""
    home = tmp_path / "home"
    (home / "method").mkdir(parents=True)
    (home / "method" / "fedavg_slow.yaml").write_text(
        "# FedAvg at a tenth of the step size.\ninherits: fedavg\nmethod:\n  name: fedavg_slow\n  local_lr: 0.001\n"
    )
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(home))
    assert compose(["method=fedavg_slow"]).method.local_lr == 0.001
    with pytest.raises(FedmetaError, match=f"unknown method 'nope'.*{home / 'method'}"):
        compose(["method=nope"])
    (home / "method" / "loop.yaml").write_text("inherits: loop\n")
    with pytest.raises(FedmetaError, match="inherits itself"):
        compose(["method=loop"])


@pytest.mark.slow  # a pytest of the suite in a process of its own
def test_the_suite_never_reads_the_users_own_state(tmp_path):
    """A user who has run fedmeta tune once (a tuned variant in ~/.config/fedmeta) and keeps a broken
    method file of their own there: the tests that open studies and compose every method still pass,
    and nothing of the user's is written."""
    home = tmp_path / "user"
    own = home / ".config" / "fedmeta"
    (own / "variant" / "fedavg_ft").mkdir(parents=True)
    (own / "variant" / "fedavg_ft" / "tuned.yaml").write_text("method:\n  local_lr: 0.3\n")
    (own / "method").mkdir()
    (own / "method" / "fedavg.yaml").write_text("method: [broken\n")
    before = {p: p.read_bytes() for p in home.rglob("*") if p.is_file()}
    tests = [
        "tests/test_tune.py::test_each_study_draws_its_own_values_and_the_model_proposes_half_of_them",
        "tests/test_cli.py::test_a_method_file_that_inherits_personalization_steps_0_is_noted_once",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=dict(os.environ, HOME=str(home), FEDMETA_CONFIG_HOME=str(own)),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert {p: p.read_bytes() for p in home.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("module", ["this:Y", "antigravity:X"])
def test_a_method_file_of_ones_own_imports_nothing_that_cannot_define_its_method(
    tmp_path, module, mnist_dir, monkeypatch, capfd
):
    """A user's method file naming ``this:Y`` printed the Zen of Python, ``antigravity:X`` started
    $BROWSER, before "unknown algorithm": a module whose source holds no such name is not imported."""
    from fedmeta.cli import main

    home = tmp_path / "home"
    (home / "method").mkdir(parents=True)
    (home / "method" / "mine.yaml").write_text(
        f"inherits: fedavg_ft\nlabel: Mine\nmethod:\n  name: mine\n  algorithm: '{module}'\n"
    )
    outside = tmp_path / "written-outside"
    browser = tmp_path / "browser.sh"
    browser.write_text(f"#!/bin/sh\ntouch {outside}\n")
    browser.chmod(0o755)
    for name, value in {"FEDMETA_CONFIG_HOME": home, "BROWSER": browser, "FEDMETA_DATA": mnist_dir}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.chdir(tmp_path)
    imported = set(sys.modules)
    assert main(["train", "method=mine", "federation.rounds=1"]) == 2
    out, err = capfd.readouterr()
    assert err.strip().splitlines()[-1].startswith(f"fedmeta: error: unknown algorithm '{module}'")
    assert "Beautiful is better than ugly" not in out + err and not outside.exists()
    assert not {"this", "antigravity"} & (set(sys.modules) - imported)


def test_a_file_of_ones_own_that_replaces_a_shipped_method_is_noted_once(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    (home / "method").mkdir(parents=True)
    (home / "method" / "fedavg.yaml").write_text(
        "# FedAvg, my way.\nlabel: FedAvg\nmethod:\n  name: fedavg\n  algorithm: fedavg\n  local_epochs: 1\n"
        "  local_lr: 0.01\n  momentum: 0.0\n  batch_size: 16\n  train_split: all\n  drop_last: false\n"
        "  averaging: samples\n  local_optimizer: sgd\n  local_batches: 0\n  shuffle: every_epoch\n"
        "personalization:\n  steps: 0\n"
    )
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(home))
    assert compose(["method=fedavg"]).method.local_lr == 0.01
    compose(["method=fedavg"])
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert len(notes) == 1, notes
    assert (
        f"method fedavg is your own {home / 'method' / 'fedavg.yaml'}, read in place of the one" in notes[0]
    )
