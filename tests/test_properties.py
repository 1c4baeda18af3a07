"""Property tests of bad input: generated command lines for every subcommand, and generated run
folders (files missing, cut short, not mappings, links out of the folder, pipes, folders in a
file's place). Each ends in exit 0, or 2 with one line — never a traceback, a hang, or a write
outside the folders it was given. Where a command would start real work (a grid, a bench, a study,
a download, a Flower run), that work is replaced by a marker once its inputs have been checked."""

import contextlib
import io
import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedmeta.cli import main
from fedmeta.config import compose
from fedmeta.errors import FedmetaError

ROOT = Path(__file__).resolve().parent.parent


class WouldRun(Exception):
    """Raised where the command would start its work: its inputs were all accepted."""


def would_run(*args, **kwargs):
    raise WouldRun


@pytest.fixture
def no_work(monkeypatch):
    """Every command's work replaced by WouldRun; after its checks, nothing heavy runs."""
    from fedmeta import bench, campaign, grid, tune
    from fedmeta.data import download

    monkeypatch.setattr(grid, "run", would_run)
    monkeypatch.setattr(campaign, "run", would_run)
    monkeypatch.setattr(bench, "device_peaks", would_run)
    monkeypatch.setattr(tune.Study, "run", would_run)
    monkeypatch.setattr(download, "_fetch", would_run)
    monkeypatch.setattr(download, "_through_learn2learn", would_run)
    monkeypatch.setattr("fedmeta.describe.describe", would_run)
    monkeypatch.setattr("fedmeta.loop.train", would_run)
    with contextlib.suppress(ImportError):
        from fedmeta import flower

        monkeypatch.setattr(flower, "simulate", would_run)
        monkeypatch.setattr(flower, "deploy", would_run)


def run_main(argv: list[str], seconds: int = 120) -> tuple[object, str]:
    """(exit code or "ran", stderr) of fedmeta in this process; a hang fails after ``seconds``."""

    def hung(*_):
        raise TimeoutError(f"fedmeta {' '.join(argv)} ran over {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except WouldRun:
        code = "ran"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, err.getvalue()


def assert_exit_0_or_one_line(code, err: str) -> None:
    assert code in (0, 2, "ran"), (code, err)
    assert "Traceback" not in err
    if code == 2:
        errors = [line for line in err.splitlines() if line.startswith("fedmeta: error: ")]
        assert len(errors) == 1 and err.rstrip().endswith(errors[0][-40:]), err


def snapshot(*folders: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for folder in folders if folder.exists() for p in folder.rglob("*")}


# --- command lines -------------------------------------------------------------------------------------------

JUNK = st.text("ab/.-_0129[],x=${} ", max_size=10)
NAMES = (
    st.sampled_from(
        [
            "rmnist",
            "cifar10",
            "rmnist-shards",
            "cafeme",
            "fedavg_ft",
            "fedrep-tuned",
            "fedrep-nope",
            "bogus",
            "../x",
            "a,b",
            "0",
            "-1",
            "quick",
            "paper",
            "x=1",
            "folder",
        ]
    )
    | JUNK
)
NUMBERS = st.sampled_from(["0", "1", "2", "-3", "1e9", "nan", "inf", "abc", "", "1.5"])
OVERRIDES = st.tuples(
    st.sampled_from(
        [
            "federation.rounds",
            "seed",
            "method",
            "dataset",
            "partition",
            "variant",
            "fabric.accelerator",
            "personalization.lr",
            "output.root",
            "no.such",
            "logger",
            "federation.vectorize",
            "output.setting",
        ]
    ),
    st.sampled_from(
        [
            "1",
            "0",
            "-1",
            "cafeme",
            "rmnist",
            "dirichlet",
            "authors",
            "cpu",
            "cuda",
            "[]",
            "x/../../y",
            "${oc.env:HOME}",
            "true",
            "auto",
            "[csv]",
            "2.5",
            "",
        ]
    )
    | JUNK,
).map(lambda kv: f"{kv[0]}={kv[1]}")
GRID_OPTIONS = {
    "--preset": NAMES,
    "--datasets": NAMES,
    "--methods": NAMES,
    "--seeds": NUMBERS,
    "--parallel": NUMBERS,
    "--executor": st.sampled_from(["pool", "local", "slurm", "ray"]),
    "--slurm": JUNK,
}
COMMANDS = {
    ("table",): (
        {
            **GRID_OPTIONS,
            "--no-run": None,
            "--budget": NUMBERS,
            "--out": JUNK,
        },
        [],
    ),
    ("campaign",): (
        {"--budget": NUMBERS, "--parallel": NUMBERS, "--start-ahead": NUMBERS, "--out": JUNK},
        [OVERRIDES],
    ),
    ("figures",): ({**GRID_OPTIONS, "--run": None, "--out-dir": JUNK}, []),
    ("sweep",): (
        {"--root": JUNK, "--parallel": NUMBERS, "--executor": GRID_OPTIONS["--executor"]},
        [OVERRIDES],
    ),
    ("tune",): (
        {"--trials": NUMBERS, "--rounds": NUMBERS, "--seed": NUMBERS, "--storage": JUNK, "--overwrite": None},
        [NAMES],
    ),
    ("bench",): (
        {
            "--datasets": NAMES,
            "--methods": NAMES,
            "--no-memory": None,
            "--profile": None,
            "--project": NAMES,
            "--out": JUNK,
            "--config": st.sampled_from([str(ROOT / "configs/bench.yaml"), "nope.yaml", "bench.json"]),
        },
        [],
    ),
    ("data", "describe"): ({}, [NAMES, NAMES]),
    ("data", "download"): ({"--dir": JUNK, "--mirror": JUNK, "--no-verify": None}, [NAMES]),
    ("flower", "sim"): (
        {
            "--nodes": NUMBERS,
            "--timeout": NUMBERS,
            "--dp": st.lists(NUMBERS, min_size=4, max_size=4).map(" ".join),
        },
        [],
    ),
    ("flower", "deploy"): ({"--nodes": NUMBERS, "--port": NUMBERS, "--print": None, "--folder": JUNK}, []),
    ("evaluate",): ({"--unfinished": None}, [JUNK]),
    ("train",): ({"--print-config": None}, []),
}


@st.composite
def command_lines(draw) -> list[str]:
    words = draw(st.sampled_from(sorted(COMMANDS)))
    options, positionals = COMMANDS[words]
    argv = list(words) + [draw(p) for p in positionals[: draw(st.integers(0, len(positionals)))]]
    for option in draw(st.lists(st.sampled_from(sorted(options) or [""]), max_size=3, unique=True)):
        if option:
            value = options[option]
            argv += [option] + (
                [] if value is None else draw(value).split(" ") if option == "--dp" else [draw(value)]
            )
    return argv + draw(st.lists(OVERRIDES, max_size=3))


@pytest.mark.slow  # 100 command lines
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(command_lines())
def test_generated_command_lines_exit_0_or_2_in_one_line(tmp_path, monkeypatch, no_work, argv):
    work = tmp_path / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    (work / "bench.json").write_text('{"rows": []}')
    monkeypatch.chdir(work)
    before = snapshot(ROOT / "results", ROOT / "configs")
    code, err = run_main(argv)
    event(f"{argv[0]}: {code}")
    assert_exit_0_or_one_line(code, err)
    assert (
        snapshot(ROOT / "results", ROOT / "configs") == before
    )  # the checkout's results and configs untouched


# --- run folders ---------------------------------------------------------------------------------------------

RUN = [
    "method=local",
    "federation.rounds=2",
    "federation.eval_every=2",
    "federation.num_new_clients=2",
    "federation.num_clients=12",
    "federation.clients_per_round=3",
    "personalization.steps=1",
    "logger=[csv]",
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, mnist_dir) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("finished")
    args = [*RUN, f"dataset.dir={mnist_dir}", f"output.root={root}"]
    assert main(["train", *args]) == 0
    return root, args


DAMAGE = st.sampled_from(["missing", "empty", "cut", "list", "garbage", "link", "folder", "fifo", "module"])
# what a shared run folder's config.yaml could name as its method's code: never imported
MODULES = ["this:Y", "antigravity:X", "os:system", "fedmeta.algorithms:FedAvg", "builtins:print"]


@pytest.mark.slow
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "config.yaml",
                "checkpoint.ckpt",
                "summary.json",
                "metrics.csv",
                "curves.csv",
                "evaluations.jsonl",
            ]
        ),
        DAMAGE,
        min_size=1,
        max_size=3,
    ),
    st.sampled_from(["evaluate", "evaluate --unfinished", "resume", "overwrite"]),
    st.permutations(MODULES),
)
def test_generated_run_folders_are_used_or_refused_in_one_line(
    tmp_path, finished_run, damage, command, modules
):
    source, args = finished_run
    root = tmp_path / "root"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(source, root, symlinks=True)
    run = next(root.glob("*/*/seed0"))
    outside = tmp_path / "outside.txt"
    outside.write_text("someone else's file\n")
    for name, how in damage.items():
        path = run / name
        data = path.read_bytes() if path.is_file() else b""
        if path.exists() or path.is_symlink():
            path.unlink()
        if how == "missing":
            continue
        if how == "module":  # the config names code to run; other files get it as text that is no such file
            path.write_text(
                data.decode(errors="replace").replace("algorithm: local", f"algorithm: '{modules.pop()}'")
            )
        elif how == "link":
            path.symlink_to(outside)
        elif how == "folder":
            path.mkdir()
        elif how == "fifo":
            os.mkfifo(path)
        else:
            path.write_bytes(
                {
                    "empty": b"",
                    "cut": data[: len(data) // 2],
                    "list": b"- a\n- b\n",
                    "garbage": b"\x00\xff{[: not this",
                }[how]
            )
    argv = {
        "evaluate": ["evaluate", str(run)],
        "evaluate --unfinished": ["evaluate", str(run), "--unfinished"],
        "resume": ["train", *args[:-1], f"output.root={root}", "output.resume=true"],
        "overwrite": ["train", *args[:-1], f"output.root={root}", "output.overwrite=true"],
    }[command]
    imported = set(sys.modules)
    code, err = run_main(argv, seconds=180)
    event(f"{command}: {code}")
    assert_exit_0_or_one_line(code, err)
    assert not {"this", "antigravity"} & (set(sys.modules) - imported)  # a run folder names no code to import
    if damage.get("config.yaml") == "module" and command.startswith("evaluate"):
        assert code == 2
    assert outside.read_text() == "someone else's file\n"  # never written through a link
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt", "root"]  # nothing beside the roots


# --- kept runs read back by the reports ----------------------------------------------------------------------

KEPT_DAMAGE = {
    "summary.json": [
        lambda d: json.dumps(json.loads(d) | {"accuracy": 7.5}),
        lambda d: json.dumps(json.loads(d) | {"accuracy": float("nan")}),
        lambda d: json.dumps(json.loads(d) | {"accuracy": "high"}),
        lambda d: json.dumps(json.loads(d) | {"rounds": 99999}),
        lambda d: json.dumps(json.loads(d) | {"curve": [0.5, 3.0]}),
        lambda d: d[: len(d) // 2],
    ],
    "metrics.csv": [
        lambda d: d.replace(",0,", ",zz,", 1),
        lambda d: "\udcff".encode("utf-8", "surrogateescape").decode("latin-1") + d,
        lambda d: "round\n",
        lambda d: "",
    ],
    "config.yaml": [lambda d: "- a\n- list\n", lambda d: ""],
}


@pytest.mark.slow  # 25 tampered kept-run trees through table and campaign
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.dictionaries(
        st.sampled_from(sorted(KEPT_DAMAGE)), st.integers(min_value=0, max_value=5), min_size=1, max_size=3
    ),
    st.sampled_from(["", '{"started": "x", "hardware": 3', '{"units": 1}\n', "not json\n"]),
    st.sampled_from(["table", "campaign"]),
)
def test_tampered_kept_runs_are_skipped_or_refused_never_reported(
    tmp_path, finished_run, monkeypatch, damage, jobs, command
):
    """A finished run kept as results/runs/paper/rmnist-shards/local/seed0, then edited: the table and
    the campaign's state skip it with a warning (or refuse in one line); no value no run can have is
    printed, let alone bolded as the best of its column."""
    source, _ = finished_run
    work = tmp_path / "work"
    shutil.rmtree(work, ignore_errors=True)
    kept = work / "results" / "runs" / "paper" / "rmnist-shards" / "local" / "seed0"
    shutil.copytree(next(source.glob("*/*/seed0")), kept)
    summary = json.loads((kept / "summary.json").read_text())
    summary["rounds"] = 1000  # the paper preset's budget: the run counts as a finished cell
    (kept / "summary.json").write_text(json.dumps(summary))
    config = (kept / "config.yaml").read_text()
    (kept / "config.yaml").write_text(config.replace("rounds: 2\n", "rounds: 1000\n", 1))
    for name, which in damage.items():
        forms = KEPT_DAMAGE[name]
        text = (kept / name).read_text(encoding="latin-1")
        (kept / name).write_text(forms[which % len(forms)](text), encoding="latin-1")
    (kept.parents[2] / "jobs.jsonl").write_text(jobs)
    monkeypatch.chdir(work)
    argv = {
        "table": ["table", "--preset", "paper", "--no-run", "--out", str(work / "TABLES.md")],
        "campaign": ["campaign", "--out", str(work / "campaign.md")],
    }[command]
    code, err = run_main(argv, seconds=120)
    assert_exit_0_or_one_line(code, err)
    if command == "table" and code == 0:
        [row] = [
            line for line in (work / "TABLES.md").read_text().splitlines() if line.startswith("| Local |")
        ]
        assert "nan" not in row.lower() and all(float(v) <= 100 for v in re.findall(r"\d+\.\d+", row)), row


# --- the user's config home ------------------------------------------------------------------------------

BROKEN = st.sampled_from(
    ["garbage", "list", "not utf-8", "fifo", "folder", "empty", "no name", "loop", "wrong type"]
)
CONTENT = {
    "garbage": b"\x00\xff{[: not this",
    "list": b"- a\n- b\n",
    "not utf-8": b"method:\n  name: \xff\xfe\n",
    "empty": b"",
    "no name": b"method:\n  lr: 1\n",
    "loop": b"inherits: mine\n",
    "wrong type": b"inherits: fedavg\nfederation: 3\nmethod:\n  name: mine\n",
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.dictionaries(
        st.sampled_from(["method", "dataset", "partition", "variant/cafeme", "preset"]), BROKEN, min_size=1
    ),
    st.sampled_from(
        [
            ["--help"],
            ["train", "--help"],
            ["tune", "--help"],
            ["train", "--print-config"],
            ["train", "method=mine", "--print-config"],
            ["train", "dataset=mine", "--print-config"],
            ["train", "variant=mine", "--print-config"],
            ["table", "--preset", "mine", "--no-run"],
        ]
    ),
)
def test_a_config_home_with_broken_files_breaks_no_command(tmp_path, monkeypatch, no_work, files, argv):
    """Every broken file of the user's own is skipped with a note or refused in one line; help always works."""
    home = tmp_path / "home"
    shutil.rmtree(home, ignore_errors=True)
    for group, how in files.items():
        (home / group).mkdir(parents=True)
        path = home / group / "mine.yaml"
        if how == "fifo":
            os.mkfifo(path)
        elif how == "folder":
            path.mkdir()
        else:
            path.write_bytes(CONTENT[how])
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(home))
    work = tmp_path / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    monkeypatch.chdir(work)
    code, err = run_main(argv, seconds=60)
    event(f"{argv[0]}: {code}")
    assert_exit_0_or_one_line(code, err)
    if "--help" in argv or argv == ["train", "--print-config"]:
        assert code == 0, err


def _declared_ranges() -> list[tuple[str, str, dict]]:
    """(method, key, spec) of every ``ranges`` entry of configs/method/*.yaml."""
    import yaml

    from fedmeta.config import CONFIG_DIR

    found = []
    for path in sorted((CONFIG_DIR / "method").glob("*.yaml")):
        for key, spec in (yaml.safe_load(path.read_text()).get("ranges") or {}).items():
            if "range" in spec:
                found.append((path.stem, key, spec))
    return found


def _outside(spec: dict):
    """Values a key with this range must refuse."""
    from fedmeta.config import INTERVAL

    low_bracket, low, high, high_bracket = INTERVAL.fullmatch(spec["range"]).groups()
    options = [st.sampled_from([float("nan"), True])]
    if low != "-inf":
        options.append(st.floats(max_value=float(low), exclude_max=low_bracket == "[", allow_nan=False))
    if high != "inf":
        options.append(st.floats(min_value=float(high), exclude_min=high_bracket == "]", allow_nan=False))
    if spec.get("integer"):
        options.append(st.floats(min_value=0.01, max_value=1e6).filter(lambda v: v != int(v)))
    return st.one_of(options)


@pytest.mark.parametrize(
    "method, key, spec", _declared_ranges(), ids=lambda v: v if isinstance(v, str) else ""
)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_method_key_outside_its_range_is_refused_in_one_line(method, key, spec, data):
    value = data.draw(_outside(spec))
    with pytest.raises(FedmetaError) as error:
        compose([f"method={method}", f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"])
    said = str(error.value)
    assert "\n" not in said and key in said, said
