"""Never lose a run, never a traceback: run folders, locks, resume edge cases, data files, evaluate."""

import contextlib
import errno
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmeta.cli import main
from fedmeta.config import compose
from fedmeta.data.convert import _load_pickle
from fedmeta.data.sources import _fingerprint, read_canonical
from fedmeta.errors import FedmetaError, RunStopped
from fedmeta.loggers import WANDB_INIT_TIMEOUT
from fedmeta.loop import train
from fedmeta.runs import atomic_write_text

QUICK = [
    "method=local",
    "federation.rounds=2",
    "federation.eval_every=2",
    "federation.num_new_clients=2",
    "personalization.steps=1",
    "wandb.mode=disabled",
]


def run_args(tmp_path, mnist_dir, *extra):
    return ["train", *QUICK, f"dataset.dir={mnist_dir}", f"output.root={tmp_path}", *extra]


def unfinished_run(tmp_path, mnist_dir):
    """A run whose folder holds a checkpoint and metrics but no summary (interrupted at the end)."""
    assert main(run_args(tmp_path, mnist_dir)) == 0
    run = tmp_path / "rmnist-shards" / "local" / "seed0"
    (run / "summary.json").unlink()
    return run


def test_rerunning_an_interrupted_run_keeps_its_checkpoint(tmp_path, mnist_dir, capsys):
    run = unfinished_run(tmp_path, mnist_dir)
    checkpoint = (run / "checkpoint.ckpt").read_bytes()
    capsys.readouterr()
    assert main(run_args(tmp_path, mnist_dir)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "output.resume=true" in err and "output.overwrite=true" in err
    assert (run / "checkpoint.ckpt").read_bytes() == checkpoint  # nothing was deleted
    assert (
        main(run_args(tmp_path, mnist_dir, "output.overwrite=true")) == 0 and (run / "summary.json").exists()
    )


def test_a_locked_run_folder_is_refused_and_a_stale_lock_taken_over(tmp_path, mnist_dir, capsys):
    lock = tmp_path / "rmnist-shards" / "local" / "seed0.lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(f"{holder.pid}@{os.uname().nodename}")
        assert main(run_args(tmp_path, mnist_dir)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "in use by another fedmeta process" in err and str(holder.pid) in err
        assert not (tmp_path / "rmnist-shards" / "local" / "seed0").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(run_args(tmp_path, mnist_dir)) == 0  # its process is gone: the lock is stale
    assert not lock.exists()  # released at the end


def test_resume_at_the_checkpoints_round_evaluates_and_finishes(tmp_path, mnist_dir, monkeypatch):
    import fedmeta.loop as loop

    honest = loop.federated_rounds

    def interrupted_in_round_3(runs, round_, *args, **kwargs):
        if round_ == 3:
            raise KeyboardInterrupt
        return honest(runs, round_, *args, **kwargs)

    args = [*QUICK, f"dataset.dir={mnist_dir}", f"output.root={tmp_path}", "federation.checkpoint_every=2"]
    monkeypatch.setattr(loop, "federated_rounds", interrupted_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        train(compose([*args, "federation.rounds=4", "federation.eval_every=4"]), show_progress=False)
    monkeypatch.setattr(loop, "federated_rounds", honest)
    run = tmp_path / "rmnist-shards" / "local" / "seed0"
    (run / "checkpoint.ckpt.tmp").write_bytes(b"x" * 1000)  # a checkpoint write cut off by a kill
    assert not (run.parent / "seed0.lock").exists()  # the interrupted run let go of its folder
    summary = train(
        compose([*args, "federation.rounds=2", "federation.eval_every=4", "output.resume=true"]),
        show_progress=False,
    )
    assert summary["resumed_at_round"] == 2 and summary["rounds"] == 2 and 0 <= summary["accuracy"] <= 1
    assert not (run / "checkpoint.ckpt.tmp").exists()


def test_evaluate_refuses_unfinished_runs_unknown_keys_and_bad_values(
    tmp_path, mnist_dir, capsys, monkeypatch
):
    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    run = unfinished_run(tmp_path, mnist_dir)
    capsys.readouterr()
    for extra, message in [
        ([], "holds an unfinished run"),
        (["personalization.stepz=1", "--unfinished"], "personalization.stepz"),
        (["personalization.lr=-1", "--unfinished"], "lr > 0"),
        (["personalization.steps=abc", "--unfinished"], "must be an integer"),
        (["federation.rounds=5", "--unfinished"], "evaluate changes only personalization.*"),
    ]:
        assert main(["evaluate", str(run), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (extra, err)
    assert main(["evaluate", str(run), "--unfinished"]) == 0


def canonical(tmp_path, **arrays):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(
    "arrays,message",
    [
        (
            dict(x=np.zeros((6, 8, 8), np.uint8), y=np.array([0, 1, 2, 0, 1, 2.5])),
            "labels y must be one integer per image",
        ),
        (dict(x=np.zeros((6, 8, 8), np.uint8), y=np.array([0, 1, -1, 0, 1, 0])), "labels y must be ≥ 0"),
        (dict(x=np.zeros((6, 8, 8), np.uint8), y=np.zeros(6, np.int64)), "at least 2 classes"),
        (
            dict(
                x=np.zeros((6, 8, 8), np.uint8), y=np.array([0, 1, 5, 0, 1, 0]), classes=np.array(["a", "b"])
            ),
            "has no entry",
        ),
        (dict(x=np.zeros((6, 8, 8, 4), np.uint8), y=np.array([0, 1, 0, 1, 0, 1])), "N×H×W×3"),
        (dict(x=np.zeros((6, 8, 8), np.float32), y=np.array([0, 1, 0, 1, 0, 1])), "uint8 images"),
        # labels name the model's outputs: a stray 200000 would build a 200,001-class model
        (dict(x=np.zeros((6, 8, 8), np.uint8), y=np.array([0, 1, 200000, 0, 1, 0])), "labels must be 0…K−1"),
        (
            dict(
                x=np.zeros((6, 8, 8), np.uint8), y=np.array([0, 1, 0, 1, 0, 1]), split=np.zeros(4, np.uint8)
            ),
            "split must hold one",
        ),
        (
            dict(
                x=np.zeros((6, 8, 8), np.uint8), y=np.array([0, 1, 0, 1, 0, 1]), split=np.zeros(6, np.float32)
            ),
            "split must hold one",
        ),
    ],
)
def test_data_files_are_validated_when_loaded(tmp_path, arrays, message):
    with pytest.raises(FedmetaError, match=message):
        read_canonical(canonical(tmp_path, **arrays))


def test_devices_are_not_read_as_data(tmp_path, capsys):
    assert main(["train", "dataset=folder", "dataset.options.path=/dev/zero", f"output.root={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither a regular file nor a folder" in err


def test_pickles_that_name_code_are_refused():
    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        _load_pickle(io.BytesIO(pickle.dumps(Exploit())))
    plain = {b"data": np.arange(6, dtype=np.uint8).reshape(2, 3), b"labels": [0, 1], b"batch_label": b"x"}
    assert _load_pickle(io.BytesIO(pickle.dumps(plain)))[b"labels"] == [0, 1]


def test_an_edit_inside_an_image_tree_changes_its_cache_key(tmp_path):
    image = tmp_path / "tree" / "train" / "cat" / "1.png"
    image.parent.mkdir(parents=True)
    image.write_bytes(b"one")
    before = _fingerprint(tmp_path / "tree")
    image.write_bytes(b"other bytes")
    assert _fingerprint(tmp_path / "tree") != before


KEYS = [
    "federation.rounds",
    "federation.num_clients",
    "federation.clients_per_round",
    "federation.held_out_fraction",
    "personalization.lr",
    "personalization.steps",
    "seed",
    "seeds",
    "method.inner_lr",
    "partition.shards_per_client",
    "output.setting",
    "fabric.precision",
    "model.dense_units",
    "federation.vectorize",
    "no.such.key",
]
VALUES = st.one_of(
    st.integers(-5, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text("ab/.-_0129[],x ", max_size=12),
    st.lists(st.integers(-2, 64), max_size=3).map(str),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=4))
def test_generated_configs_give_exit_0_or_one_line(tmp_path, overrides):
    root = tmp_path / "root"
    args = ["train", "--print-config", f"output.root={root}", *(f"{k}={v}" for k, v in overrides)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(args)
    assert code in (0, 2)
    if code == 2:
        assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("fedmeta: error: ")
    assert "Traceback" not in err.getvalue() and not root.exists()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.integers(0, 5),
    st.sampled_from([(8, 8), (8, 8, 3), (8, 8, 4), (0,), ()]),
    st.sampled_from(["uint8", "float32", "int64"]),
    st.lists(st.integers(-2, 4), max_size=6),
    st.sampled_from(["int64", "float64", "int8"]),
)
def test_generated_data_files_load_or_are_refused_in_one_line(tmp_path, n, shape, x_dtype, labels, y_dtype):
    path = canonical(tmp_path, x=np.zeros((n, *shape), x_dtype), y=np.array(labels, y_dtype))
    try:
        arrays = read_canonical(path)
    except FedmetaError as exc:
        assert "\n" not in str(exc)
    else:
        assert arrays["x"].dtype == np.uint8 and len(np.unique(arrays["y"])) >= 2


def test_run_folder_files_are_never_followed_out_of_it(tmp_path, mnist_dir, capsys):
    """A symbolic link or a FIFO in a run folder is refused in one line: a resume never writes
    through a link, an evaluation never appends through one, and nothing blocks on a pipe."""
    run = unfinished_run(tmp_path / "runs", mnist_dir)
    elsewhere = tmp_path / "elsewhere.csv"
    elsewhere.write_text("precious\n")
    (run / "metrics.csv").unlink()
    (run / "metrics.csv").symlink_to(elsewhere)
    capsys.readouterr()
    assert main(run_args(tmp_path / "runs", mnist_dir, "output.resume=true")) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "metrics.csv is a symbolic link" in err
        and elsewhere.read_text() == "precious\n"
    )
    (run / "metrics.csv").unlink()
    os.mkfifo(run / "checkpoint.ckpt.tmp")
    assert main(run_args(tmp_path / "runs", mnist_dir, "output.resume=true")) == 2
    assert "checkpoint.ckpt.tmp is not a regular file" in capsys.readouterr().err
    (run / "checkpoint.ckpt.tmp").unlink()
    (run / "evaluations.jsonl").symlink_to(elsewhere)
    assert main(["evaluate", str(run), "--unfinished"]) == 2
    assert (
        "evaluations.jsonl is a symbolic link" in capsys.readouterr().err
        and elsewhere.read_text() == "precious\n"
    )


def test_a_name_never_deletes_what_fedmeta_did_not_write(tmp_path, mnist_dir):
    """Replacing a run (output.overwrite=true) removes the run's own files only."""
    assert main(run_args(tmp_path, mnist_dir)) == 0
    run = tmp_path / "rmnist-shards" / "local" / "seed0"
    (run / "notes.txt").write_text("mine")
    assert main(run_args(tmp_path, mnist_dir, "output.overwrite=true")) == 0
    assert (run / "notes.txt").read_text() == "mine" and (run / "summary.json").exists()


def test_evaluate_and_resume_check_whose_checkpoint_it_is(tmp_path, mnist_dir, capsys):
    """Another seed's checkpoint in a run folder is refused by evaluate as by resume; a resume in
    another precision is refused unless asked for."""
    for seed in (0, 1):
        assert main(run_args(tmp_path, mnist_dir, f"seed={seed}")) == 0
    runs = tmp_path / "rmnist-shards" / "local"
    (runs / "seed0" / "checkpoint.ckpt").write_bytes((runs / "seed1" / "checkpoint.ckpt").read_bytes())
    capsys.readouterr()
    assert main(["evaluate", str(runs / "seed0")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "belongs to another experiment (seed: 1 there, 0 here)" in err
    (runs / "seed1" / "summary.json").unlink()
    assert (
        main(run_args(tmp_path, mnist_dir, "seed=1", "output.resume=true", "fabric.precision=64-true")) == 2
    )
    assert "was trained in fabric.precision=32-true" in capsys.readouterr().err
    assert (
        main(
            run_args(
                tmp_path,
                mnist_dir,
                "seed=1",
                "output.resume=true",
                "fabric.precision=64-true",
                "output.change_precision=true",
            )
        )
        == 0
    )


def test_ctrl_c_is_one_line_exit_130_and_the_lock_is_released(tmp_path, mnist_dir, capsys, monkeypatch):
    import fedmeta.loop

    def interrupted_round(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(fedmeta.loop, "federated_rounds", interrupted_round)
    assert main(run_args(tmp_path, mnist_dir)) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == "fedmeta: interrupted; resume with the same command and output.resume=true (make train RESUME=1)"
    )
    assert not list(tmp_path.rglob("*.lock"))


def test_ctrl_c_finishes_the_round_checkpoints_it_and_the_resume_continues_from_there(
    tmp_path, mnist_dir, capsys, monkeypatch
):
    """Ctrl-C (SIGINT) during a round: the round finishes and is checkpointed, as SIGTERM's stop is;
    the stop line gives the make form; the same command with output.resume=true continues at the
    next round and names the run folder at the end."""
    import os
    import signal

    import fedmeta.loop

    honest = fedmeta.loop.federated_rounds

    def ctrl_c_in_round_2(runs, round_, *args, **kwargs):
        if round_ == 2:
            os.kill(os.getpid(), signal.SIGINT)  # delivered to the Stopper's handler, mid-round
        return honest(runs, round_, *args, **kwargs)

    monkeypatch.setattr(fedmeta.loop, "federated_rounds", ctrl_c_in_round_2)
    before = signal.signal(
        signal.SIGINT, signal.default_int_handler
    )  # a terminal's (a test worker ignores it)
    args = run_args(
        tmp_path, mnist_dir, "federation.rounds=4", "federation.eval_every=4", "federation.checkpoint_every=0"
    )
    assert main(args) == RunStopped.EXIT_STATUS
    err = capsys.readouterr().err.strip().splitlines()
    assert any("Ctrl-C: the round under way finishes and is checkpointed" in line for line in err)
    assert err[-1].startswith("fedmeta: stopped after round 2 of 4 (Ctrl-C); checkpointed in ")
    assert err[-1].endswith("continue with output.resume=true (make train RESUME=1)")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is given back
    signal.signal(signal.SIGINT, before)
    monkeypatch.setattr(fedmeta.loop, "federated_rounds", honest)
    assert main([*args, "output.resume=true"]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "rmnist-shards" / "local" / "seed0"
    assert json.loads((run / "summary.json").read_text())["resumed_at_round"] == 2
    assert out.strip().splitlines()[-1] == f"run folder: {run}"


@pytest.mark.parametrize("minutes, resumed_at", [(1e-9, 2), (0, None)])
def test_checkpoints_come_by_time_as_well_as_by_rounds(
    tmp_path, mnist_dir, monkeypatch, caplog, minutes, resumed_at
):
    """With checkpoints every 50 rounds, a run stopped at once in round 3 (a second Ctrl-C) resumes
    from round 2 when a checkpoint is due by time after every round; without, its two recorded rounds
    are kept until starting over is asked for."""
    import fedmeta.loop

    honest = fedmeta.loop.federated_rounds

    def stopped_in_round_3(runs, round_, *args, **kwargs):
        if round_ == 3:
            raise KeyboardInterrupt
        return honest(runs, round_, *args, **kwargs)

    args = [*QUICK, f"dataset.dir={mnist_dir}", f"output.root={tmp_path}", "federation.rounds=4"]
    args += [f"federation.checkpoint_minutes={minutes}", "federation.checkpoint_every=50"]
    monkeypatch.setattr(fedmeta.loop, "federated_rounds", stopped_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        train(compose(args), show_progress=False)
    monkeypatch.setattr(fedmeta.loop, "federated_rounds", honest)
    if resumed_at is None:
        with pytest.raises(FedmetaError, match="records 2 rounds but holds no checkpoint.ckpt"):
            train(compose([*args, "output.resume=true"]), show_progress=False)
        args.append("output.overwrite=true")
    caplog.clear()
    summary = train(compose([*args, "output.resume=true"]), show_progress=False)
    assert summary["resumed_at_round"] == resumed_at and summary["rounds"] == 4
    said = "resumed from round 2 of 4"  # a resume says so
    assert (said in caplog.text) == (resumed_at == 2), caplog.text


def test_files_others_read_are_refused_or_skipped_in_one_line(tmp_path, capsys, caplog, monkeypatch):
    """A corrupt summary.json is skipped by the reports (said once); a config that does not parse
    or is not a mapping is one line, in bench and in evaluate."""
    monkeypatch.chdir(tmp_path)
    for method, text in (("cafeme", "{not json"), ("fedavg", ""), ("ditto", "[1, 2]")):
        seed = tmp_path / "results" / "runs" / "quick" / "rmnist-shards" / method / "seed0"
        seed.mkdir(parents=True)
        (seed / "summary.json").write_text(text)
    assert main(["table", "--no-run"]) == 0
    err = capsys.readouterr().err
    assert (
        caplog.text.count("skipping ") == 3
        and "Traceback" not in err
        and (tmp_path / "results" / "TABLES.md").exists()
    )

    (tmp_path / "bad.yaml").write_text("a: [\n")
    (tmp_path / "list.yaml").write_text("- a\n")
    for config, message in (("bad.yaml", "does not parse as YAML"), ("list.yaml", "is not a mapping")):
        assert main(["bench", "--config", config]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.ckpt").write_bytes(b"")
    (run / "summary.json").write_text("{}")
    for text, message in (
        ("- a\n", "is not a mapping"),
        ("a: [\n", "does not parse as YAML"),
        ("a: 1\n", "does not name its dataset"),
    ):
        (run / "config.yaml").write_text(text)
        assert main(["evaluate", str(run)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err


def test_an_image_claiming_ten_billion_pixels_is_one_line(tmp_path):
    """PIL's decompression-bomb limit bounds decoding: a PNG header of 100000×100000 is refused
    before anything is allocated, naming the file."""
    import struct
    import zlib

    from fedmeta.data.sources import _converted_tree

    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    chunk = (
        struct.pack(">I", len(header)) + b"IHDR" + header + struct.pack(">I", zlib.crc32(b"IHDR" + header))
    )
    image = tmp_path / "tree" / "train" / "cat" / "bomb.png"
    image.parent.mkdir(parents=True)
    image.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk)
    with pytest.raises(FedmetaError) as refused:
        _converted_tree(tmp_path / "tree", tmp_path / "cache.npz")
    assert "bomb.png is not an image PIL can decode within its size limit" in str(refused.value)
    assert "\n" not in str(refused.value) and not (tmp_path / "cache.npz").exists()


def test_a_run_that_fails_in_its_first_round_does_not_block_the_corrected_one(tmp_path, mnist_dir, capsys):
    fedavg = ["method=fedavg", "method.local_batches=2", "federation.clients_per_round=2", "logger=[]"]
    assert main(run_args(tmp_path, mnist_dir, *fedavg, "method.local_lr=1e30")) == 2
    assert "round 1: client" in capsys.readouterr().err
    assert main(run_args(tmp_path, mnist_dir, *fedavg)) == 0  # no "holds an unfinished run"
    # a metrics.csv that does not read as one is kept (found by the run-folder property test)
    run = tmp_path / "rmnist-shards" / "fedavg" / "seed0"
    for name in ("summary.json", "checkpoint.ckpt"):
        (run / name).unlink()
    (run / "metrics.csv").write_bytes(b"\x00\xff{[: not this")
    assert main(run_args(tmp_path, mnist_dir, *fedavg)) == 2
    assert "holds an unfinished run (metrics.csv)" in capsys.readouterr().err
    assert main(run_args(tmp_path, mnist_dir, *fedavg, "output.overwrite=true")) == 0


def test_a_full_disk_names_the_checkpoint_leaves_no_temporary_file_and_the_rerun_starts_over(
    tmp_path, mnist_dir, capsys, monkeypatch
):
    from lightning_fabric import Fabric

    def disk_full(self, path, state, filter=None):
        Path(path).write_bytes(b"\0" * 4096)  # what fitted before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device", "/tmp/tmpk1lq0x3z")  # Lightning's own file

    monkeypatch.setattr(Fabric, "save", disk_full)
    assert main(run_args(tmp_path, mnist_dir)) == 2
    err = capsys.readouterr().err
    run = tmp_path / "rmnist-shards" / "local" / "seed0"
    assert "Traceback" not in err and err.count("fedmeta: error: ") == 1, err  # the progress bars before it
    assert err.rstrip().splitlines()[-1] == (
        f"fedmeta: error: {run / 'checkpoint.ckpt'}: No space left on device: check the path and its "
        "permissions or free space"
    )
    assert not list(run.glob("*.tmp")) and not (run / "checkpoint.ckpt").exists()
    monkeypatch.undo()
    # its metrics.csv records rounds no checkpoint continues: kept until replacing them is asked for
    assert main(run_args(tmp_path, mnist_dir)) == 2
    assert "records 2 rounds but holds no checkpoint.ckpt" in capsys.readouterr().err
    assert (
        main(run_args(tmp_path, mnist_dir, "output.overwrite=true")) == 0 and (run / "summary.json").exists()
    )


def test_an_atomic_write_that_fails_keeps_the_old_file_and_leaves_no_temporary_one(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    target.write_text("old")
    honest = Path.write_text

    def half(self, text, *args, **kwargs):
        honest(self, text[:3], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half)
    with pytest.raises(OSError) as failed:
        atomic_write_text(target, "new content")
    monkeypatch.undo()
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(target)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def wandb_online(tmp_path, monkeypatch) -> None:
    """W&B online, as a user without `wandb login` has it: no key in the environment, an empty home."""
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(name, raising=False)


def test_wandb_online_without_an_api_key_is_one_line_before_the_run(tmp_path, mnist_dir, capsys, monkeypatch):
    wandb_online(tmp_path, monkeypatch)
    runs = tmp_path / "runs"
    assert main(run_args(runs, mnist_dir, "logger=[wandb]", "wandb.mode=online")) == 2  # a traceback before
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "wandb.mode=online needs a W&B API key and none is set" in err, err
    assert "`wandb login`" in err and "wandb.mode=offline" in err
    assert not runs.exists()


def test_wandb_online_without_a_network_is_one_line_and_the_rerun_offline_runs(
    tmp_path, mnist_dir, capsys, monkeypatch
):
    import wandb

    wandb_online(tmp_path, monkeypatch)
    monkeypatch.setattr(wandb, "login", lambda **kwargs: True)  # a key found, without storing one
    waited = []

    def no_network(settings, **kwargs):
        waited.append(settings.init_timeout)
        raise wandb.errors.CommError("Timed out while retrying: dial tcp: lookup api.wandb.ai: no such host")

    monkeypatch.setattr(wandb, "init", no_network)
    runs = tmp_path / "runs"
    assert main(run_args(runs, mnist_dir, "logger=[wandb]", "wandb.mode=online")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "W&B did not start the run online (CommError: Timed out" in err, err
    assert "check the network, or log offline with wandb.mode=offline" in err
    assert waited == [WANDB_INIT_TIMEOUT]  # not W&B's 90 s
    monkeypatch.undo()
    assert main(run_args(runs, mnist_dir, "logger=[csv]")) == 0  # the folder it left does not block
