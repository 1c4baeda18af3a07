"""Every command shown in README.md and docs/ does what its text says, checked without running it:
``make`` targets through ``make -n`` (the fedmeta command they would run), fedmeta commands
through their parser and the same validation the command does first (``--print-config`` for
train), shell scripts through ``bash -n`` and their arguments, Python scripts through their own
parser. Each ``key=value`` of a command must reach the config it was written for — not be
swallowed by a list option."""

import functools
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fedmeta import bench, campaign, grid
from fedmeta.cli import parse
from fedmeta.config import CONFIG_DIR, GROUPS, compose, compose_with_choices, load_mapping
from fedmeta.data.download import known
from fedmeta.data.sources import CANONICAL
from fedmeta.reevaluate import rescorable_keys
from fedmeta.tune import Study

ROOT = Path(__file__).resolve().parent.parent
# docs/extending.md's commands need the files the guide adds: tests/test_extending.py adds them and runs those
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "extending.md")]
# placeholders in the prose's commands → an example value of their kind
EXAMPLES = {
    "<rows>": "configs/bench.yaml",
    "NAME=...": "NAME=femnist",
    "data download NAME": "data download femnist",
    "SETTING": "rmnist-shards",
    "SECONDS": "480",
    "BENCH_JSON": "results/bench.json",
    "tune METHOD": "tune fedrep",
    "client_failure_rate=p": "client_failure_rate=0.1",
}
OTHER_PROGRAMS = {"pip", "tar", "wandb", "tensorboard"}  # not ours: shown for context, not checked here


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every command line of the code blocks and every `fedmeta …`/`make …`
    span of the prose; elided ones (with …) are fragments of a command shown whole elsewhere."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    found.append((path.name, line))
        found += [
            (path.name, " ".join(span.split())) for span in re.findall(r"`((?:fedmeta|make) [^`]+)`", text)
        ]
    commands = []
    for where, command in found:
        for placeholder, example in EXAMPLES.items():
            command = command.replace(placeholder, example)
        if "…" not in command and (where, command) not in commands:
            commands.append((where, command))
    return commands


COMMANDS = documented_commands()


def make_runs(command: str) -> list[list[str]]:
    """The fedmeta command lines ``make`` would run for a documented make command."""
    dry = subprocess.run(
        ["make", "-n", "-o", ".venv/.ready", *shlex.split(command)[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert dry.returncode == 0, dry.stderr
    lines = [shlex.split(line) for line in dry.stdout.replace("\\\n", " ").splitlines() if line.strip()]
    lines = [line[: line.index("||")] if "||" in line else line for line in lines]  # `… || [ $? -eq 75 ]`
    return [line[1:] for line in lines if line and line[0].endswith("bin/fedmeta")]


def overrides_in(argv: list[str]) -> list[str]:
    """The key=value words of a command line that are config overrides (not --slurm's parameters)."""
    return [
        word
        for previous, word in zip(["", *argv], argv)
        if "=" in word and previous != "--slurm" and not word.startswith("-")
    ]


def check_config(cfg, overrides: list[str]) -> None:
    for override in overrides:
        key, value = override.split("=", 1)
        if key in GROUPS:
            assert (cfg.variant if key == "variant" else cfg[key].name) == value, override
        else:
            expected = OmegaConf.create({"v": OmegaConf.from_dotlist([f"v={value}"]).v}).v
            got = OmegaConf.select(cfg, key)
            assert (
                (list(got) if OmegaConf.is_list(got) else got)
                == (list(expected) if OmegaConf.is_list(expected) else expected)
                or [got] == [expected]
                or (OmegaConf.is_list(got) and list(got) == [expected])
            ), f"{override}: the config has {got}"


@functools.cache
def any_test_time_key() -> set[str]:
    """The method settings some method's new clients read (a re-scoring of its runs may change them)."""
    methods = [p.stem for p in (CONFIG_DIR / "method").glob("*.yaml")]
    return set().union(*(rescorable_keys(compose_with_choices([f"method={m}"])[1]) for m in methods))


def dry_run(argv: list[str], tmp_path: Path) -> None:
    """What the command checks before it starts anything, and where its overrides go."""
    args = parse(argv)
    written = overrides_in(argv)
    if args.command == "sweep":
        assert set(written) <= set(args.values), written
        grid.sweep_plan(args.values, tmp_path / "sweep")
        return
    assert sorted(written) == sorted(getattr(args, "overrides", [])), f"overrides misrouted: {args}"
    if args.command == "train":
        check_config(compose(args.overrides), args.overrides)
    elif args.command == "evaluate":
        assert all(
            o.startswith("personalization.") or o.split("=")[0] in any_test_time_key() for o in args.overrides
        )
        check_config(compose(args.overrides), args.overrides)
    elif args.command in ("table", "figures"):
        preset = grid.load_preset(args.preset)
        grids = ["table"] if args.command == "table" else ["heterogeneity", "images_per_client"]
        jobs = grid.plan(
            preset, tmp_path / "runs", grids, args.datasets, args.methods, args.seeds, args.overrides
        )
        assert jobs or args.command == "figures"
        for job in jobs[:3]:
            check_config(compose(list(job.overrides)), args.overrides)
    elif args.command == "campaign":
        plan = campaign.load() if args.config is None else campaign.load(ROOT / args.config)
        check_config(compose([*plan.overrides, *args.overrides]), args.overrides)
    elif args.command == "bench":
        config = load_mapping(
            ROOT / args.config if args.config else bench.CONFIG_DIR / "bench.yaml", "a bench config"
        )
        assert set(args.datasets or ()) <= set(config.datasets)
        compose(args.overrides)
        if args.project:
            grid.load_preset(args.project)
    elif args.command == "tune":
        Study(
            args.method,
            args.overrides,
            args.trials,
            args.rounds,
            args.seed,
            args.storage,
            root=tmp_path / "tune",
        )
    elif args.command == "flower":
        check_config(compose(args.overrides), args.overrides)
    elif args.command == "data":
        if args.data_command == "download":
            assert CANONICAL.get(args.name, args.name) in known()  # a data set's name fetches its file
        else:
            compose(
                [
                    f"dataset={args.dataset}",
                    *([f"partition={args.partition}"] if args.partition else []),
                    *args.overrides,
                ]
            )


def test_the_docs_show_commands_of_every_kind():
    programs = {shlex.split(c)[0].split("/")[-1] for _, c in COMMANDS}
    assert {"make", "fedmeta", "gpu_job.sh", "python"} <= programs
    assert len(COMMANDS) > 80


@pytest.mark.parametrize("where,command", COMMANDS, ids=[f"{w}:{c[:60]}" for w, c in COMMANDS])
def test_every_documented_command_parses_to_what_it_says(where, command, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    words = shlex.split(command)
    if words[:2] == ["taskset", "-c"]:  # pinned to a core: the command after the core list
        words = words[3:]
    program = words[0].split("/")[-1]
    if program in OTHER_PROGRAMS:
        pytest.skip(f"{program} is not fedmeta's")
    if program == "make":
        runs = make_runs(command)
        target = words[1] if len(words) > 1 and "=" not in words[1] else "train"
        if target in ("train", "config", "table", "figures", "bench", "describe", "download"):
            assert len(runs) == 1, f"make -n ran {runs}"
            written = [w for w in words if "=" in w and w.split("=")[0] == "ARGS"]
            args_overrides = shlex.split(written[0].split("=", 1)[1]) if written else []
            assert all(o in runs[0] for o in args_overrides), f"ARGS not passed on: {runs[0]}"
            for argv in runs:
                dry_run(argv, tmp_path)
        return
    if program.endswith(".sh"):
        assert subprocess.run(["bash", "-n", ROOT / "scripts" / program]).returncode == 0
        if program == "gpu_job.sh":  # [SECONDS] | --outputs | --collect DIR
            assert words[1:2] in ([], ["--outputs"], ["--collect"]) or words[1].isdigit(), words
            return
        settings = grid.load_preset("paper").settings
        assert all(w in settings for w in words[1:] if not w.isdigit()), (
            f"{words[1:]}: not settings of the paper preset"
        )
        return
    if program == "python":  # one of scripts/*.py or benchmarks/: its own parser takes the arguments
        script = ROOT / words[1]
        # a name of its own, registered while it runs: a dataclass looks its module up in sys.modules
        name = f"documented_{script.parent.name}_{script.stem}"
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        module.arguments().parse_args(words[2:])
        return
    assert program == "fedmeta", command
    if (
        all(w.isalpha() for w in words[1:]) and len(words) <= 3 and words[1] != "bench"
    ):  # a command's name in the prose
        with pytest.raises(SystemExit) as shown:
            parse([*words[1:], "--help"])
        assert shown.value.code == 0
        return
    dry_run(words[1:], tmp_path)


def test_a_swallowed_override_would_be_caught(tmp_path):
    """The check above fails where an override does not reach the config it was written for."""
    with pytest.raises(AssertionError, match="the config has"):
        check_config(compose(["federation.rounds=7"]), ["federation.rounds=8"])
    assert CONFIG_DIR.is_dir()
