"""Command line: ``fedmeta train [key=value ...]`` (see docs/running.md). Errors are one line, exit code 2."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time

from fedmeta.errors import FedmetaError, RunStopped


class Parser(argparse.ArgumentParser):
    """argparse with fedmeta's one-line errors (argparse prints its usage block first)."""

    def error(self, message: str):
        print(f"fedmeta: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


class Names(argparse.Action):
    """A multi-value option (``--datasets a b`` or ``--datasets a,b``) that stops at the first
    ``key=value``: overrides after it are the command's overrides, not names."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = [n for v in values if "=" not in v for n in v.split(",") if n]
        moved = [v for v in values if "=" in v]
        if moved and values.index(moved[0]) < len(values) - len(moved):
            parser.error(
                f"{option_string}: put key=value overrides after the names, not among them: {' '.join(values)}"
            )
        if not names:
            parser.error(
                f"{option_string} needs at least one name before any key=value, e.g. {option_string} "
                f"{self.metavar or 'a b'}"
            )
        if self.type_of is int:
            bad = [n for n in names if not n.lstrip("-").isdigit()]
            if bad:
                parser.error(f"{option_string} takes integers, e.g. {option_string} 0 1 2; got {bad[0]!r}")
            names = [int(n) for n in names]
        setattr(namespace, self.dest, names)
        namespace.moved_overrides = [*getattr(namespace, "moved_overrides", []), *moved]

    type_of: type = str


class Seeds(Names):
    type_of = int


BENCH_OUT = "results/bench.json"


def build_parser() -> Parser:
    parser = Parser(prog="fedmeta", description="Personalized federated learning with meta-learning.")
    commands = parser.add_subparsers(dest="command", required=True)
    grid_args = _grid_options()
    _train_parser(commands)
    _data_parser(commands)
    _evaluate_parser(commands)
    _table_parser(commands, grid_args)
    _campaign_parser(commands)
    _figures_parser(commands, grid_args)
    _sweep_parser(commands, grid_args)
    _flower_parser(commands)
    _bench_parser(commands)
    _tune_parser(commands)
    return parser


def _train_parser(commands) -> None:
    from fedmeta.config import catalog

    train_cmd = commands.add_parser(
        "train",
        help="run one experiment",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Run one experiment. Overrides are key=value: dataset=, partition=, method=, variant= pick config\n"
            "files in configs/; any other key (e.g. federation.rounds=100 fabric.devices=2) sets that value."
        ),
        epilog=catalog(),
    )
    train_cmd.add_argument("overrides", nargs="*", metavar="key=value")
    train_cmd.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def _data_parser(commands) -> None:
    data_cmd = commands.add_parser("data", help="inspect data sets").add_subparsers(
        dest="data_command", required=True
    )
    describe_cmd = data_cmd.add_parser(
        "describe", help="client statistics and class histograms of a partition"
    )
    describe_cmd.add_argument("dataset")
    describe_cmd.add_argument("partition", nargs="?", help="default: the data set's own")
    describe_cmd.add_argument("overrides", nargs="*", metavar="key=value")
    download_cmd = data_cmd.add_parser("download", help="fetch a data set from its publisher and convert it")
    download_cmd.add_argument(
        "name",
        help="mnist, cifar10, cifar100, fmnist, emnist, svhn, usps, tiny_imagenet, omniglot, gtsrb32, "
        "dtd32, femnist; through learn2learn: fgvc_aircraft32, cu_birds32, vgg_flowers32, cifar_fs32, "
        "mini_imagenet32; a data set's name (rmnist, mini_imagenet) fetches its file",
    )
    download_cmd.add_argument("--dir", help="where <name>.npz goes (default: $FEDMETA_DATA, else ./data)")
    download_cmd.add_argument(
        "--mirror", help="base URL that serves the publisher's files under their own names"
    )
    download_cmd.add_argument("--no-verify", action="store_true", help="skip the publisher's MD5 check")


def _evaluate_parser(commands) -> None:
    evaluate_cmd = commands.add_parser(
        "evaluate",
        help="re-run test-time personalization on a finished run",
        description=(
            "Personalize the new clients of a finished run again from its final model, with other personalization.* "
            "settings (e.g. personalization.lr=0.05); appended to the run's evaluations.jsonl."
        ),
    )
    evaluate_cmd.add_argument("run_dir")
    evaluate_cmd.add_argument(
        "overrides",
        nargs="*",
        metavar="personalization.key=value",
        help="also method.test_head_steps (FedRep) and method.lam (Ditto): read only by new clients",
    )
    evaluate_cmd.add_argument(
        "--unfinished", action="store_true", help="evaluate the last checkpoint of an unfinished run"
    )


def _grid_options() -> Parser:
    """The options every grid command shares (table, figures; sweep takes the executor's)."""
    grid_args = Parser(add_help=False)
    grid_args.add_argument("--preset", default="quick", help="configs/preset/<name>.yaml (quick | paper)")
    grid_args.add_argument(
        "--datasets",
        nargs="+",
        action=Names,
        metavar="NAME",
        help="only these data sets (cifar10) or settings (cifar10-shards); spaces or commas",
    )
    grid_args.add_argument("--methods", nargs="+", action=Names, metavar="NAME", help="default: the preset's")
    grid_args.add_argument("--seeds", nargs="+", action=Seeds, metavar="SEED", help="default: the preset's")
    grid_args.add_argument(
        "--parallel",
        type=int,
        help="processes at once (default: all of them on a GPU, whose card "
        "they share; 1 on a CPU, where one per core is the most that helps)",
    )
    grid_args.add_argument(
        "--executor",
        default="pool",
        help="pool: processes on this machine | slurm: an array job "
        "through submitit | local: submitit's local executor (the SLURM jobs, run here)",
    )
    grid_args.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="key=value[,key=value…]",
        help="submitit parameters for the jobs, e.g. --slurm partition=gpu,gpus_per_node=1,timeout_min=600",
    )
    grid_args.add_argument(
        "--wandb",
        action="store_true",
        help="log the table and figures to a W&B run of their own (done anyway after runs that log to W&B)",
    )
    grid_args.add_argument(
        "overrides", nargs="*", metavar="key=value", help="for every run, e.g. fabric.accelerator=cuda"
    )
    return grid_args


def _table_parser(commands, grid_args: Parser) -> None:
    table_cmd = commands.add_parser(
        "table", parents=[grid_args], help="run the paper's table grid, write results/TABLES.md"
    )
    table_cmd.add_argument(
        "--no-run", action="store_true", help="only write the table from the finished runs"
    )
    table_cmd.add_argument(
        "--budget",
        type=float,
        metavar="SECONDS",
        help="stop every run this many seconds from now at a round boundary, checkpointed "
        "(run the same command again to continue); for a job that is cut off, see fedmeta campaign",
    )
    table_cmd.add_argument(
        "--out", help="the tables' file (default: TABLES.md in the preset's results folder)"
    )


def _campaign_parser(commands) -> None:
    campaign_cmd = commands.add_parser(
        "campaign",
        help="the paper's table from short jobs: continue the unfinished units, start the next, stop in time",
        description="One job of a campaign (configs/campaign.yaml: the paper's table, unless --config): the "
        "unfinished units (setting × method × seeds) first, then the next ones, every run stopped at the "
        "deadline at a round boundary with a checkpoint; finished runs and unfinished checkpoints go to "
        "results/runs/<preset>/ for the next job, the state of every unit to results/campaign.md "
        "(results/campaign-<preset>.md for another preset). Without --budget: only the state.",
    )
    campaign_cmd.add_argument(
        "--config",
        metavar="FILE",
        help="the campaign's file (default configs/campaign.yaml; configs/campaign_cpu.yaml: the CPU grid)",
    )
    campaign_cmd.add_argument(
        "--budget", type=float, metavar="SECONDS", help="the job's time, from now to the last file written"
    )
    campaign_cmd.add_argument(
        "--until",
        type=float,
        metavar="UNIX_TIME",
        help="instead of --budget, the job's end as a Unix time (e.g. $(( $(date +%%s) + 540 ))): "
        "this command's own start counts against it, however long a loaded machine makes it",
    )
    campaign_cmd.add_argument("--parallel", type=int, help="units at once (default: configs/campaign.yaml's)")
    campaign_cmd.add_argument(
        "--start-ahead",
        type=int,
        metavar="N",
        help="units that set up while others train, then wait for a turn (default: configs/campaign.yaml's)",
    )
    campaign_cmd.add_argument(
        "--out",
        help="the state of every unit (default results/campaign.md; results/campaign-<preset>.md for another preset)",
    )
    campaign_cmd.add_argument(
        "--pack",
        metavar="FOLDER",
        help="keep in FOLDER, from the first checkpoint on, a whole archive of what the job has gained "
        "(a lent machine whose files come back only from there; see --collect)",
    )
    campaign_cmd.add_argument(
        "--carry-mib",
        type=float,
        metavar="MIB",
        help="what the job's unfinished runs may leave for the next (default: configs/campaign.yaml's carry_mib)",
    )
    campaign_cmd.add_argument(
        "--settings",
        metavar="A,B",
        help="the job takes only these of the campaign's settings, in its order (two jobs at once, on two "
        "cores or machines, each on settings of its own)",
    )
    campaign_cmd.add_argument(
        "--methods",
        metavar="A,B",
        help="the job takes only these of the campaign's methods (with --profile: measure a unit that is not next)",
    )
    campaign_cmd.add_argument(
        "--collect",
        metavar="FOLDER",
        help="take back what a job packed into FOLDER (the folder its files came back to), then write the state",
    )
    campaign_cmd.add_argument(
        "--profile",
        type=float,
        metavar="SECONDS",
        help="within SECONDS, measure the unit a job would run next alone: its speed, an evaluation, its top "
        "kernels and achieved GB/s and TFLOP/s (fedmeta.profiling); its kept runs are not touched",
    )
    campaign_cmd.add_argument(
        "overrides", nargs="*", metavar="key=value", help="for every run, e.g. federation.capture=none"
    )


def _figures_parser(commands, grid_args: Parser) -> None:
    figures_cmd = commands.add_parser(
        "figures", parents=[grid_args], help="draw the paper's figures into results/figures/<preset>/"
    )
    figures_cmd.add_argument(
        "--run", action="store_true", help="first run the figure grids (heterogeneity, images per client)"
    )
    figures_cmd.add_argument(
        "--out-dir", help="where the figures go (default: figures/<preset>/ in the preset's results folder)"
    )


def _sweep_parser(commands, grid_args: Parser) -> None:
    sweep_cmd = commands.add_parser(
        "sweep",
        help="run every combination of key=a,b,c values (skips finished runs)",
        description="Run every combination of the comma-separated values, e.g. "
        "fedmeta sweep method=cafeme,fedavg_ft method.inner_lr=0.01,0.05 seed=0,1 --parallel 2. "
        "Finished runs are skipped, unfinished ones resumed; a table of the points is printed "
        "and written to <root>/sweep.md.",
    )
    sweep_cmd.add_argument("values", nargs="+", metavar="key=a,b,...")
    sweep_cmd.add_argument("--root", default="runs/sweep", help="where the runs go (default runs/sweep)")
    for action in grid_args._actions:
        if action.dest in ("parallel", "executor", "slurm"):
            sweep_cmd._add_action(action)


def _flower_parser(commands) -> None:
    flower_cmd = commands.add_parser(
        "flower",
        help="run on Flower: simulated SuperNodes, or real ones on this machine (pip install -e '.[flower]')",
    ).add_subparsers(dest="flower_command", required=True)
    for name, text in (
        ("sim", "Flower's Simulation Engine (Ray): the run's clients on simulated SuperNodes"),
        (
            "deploy",
            "a SuperLink and SuperNodes as processes on this machine (loopback, insecure), "
            "the run submitted with flwr run; --print shows the commands to start by hand",
        ),
    ):
        flower_sub = flower_cmd.add_parser(
            name, help=text, description=text + ". Same overrides and run folder as fedmeta train."
        )
        flower_sub.add_argument("overrides", nargs="*", metavar="key=value")
        flower_sub.add_argument(
            "--nodes",
            type=int,
            default=4,
            help="SuperNodes; node p holds the clients with id ≡ p (mod nodes)",
        )
        flower_sub.add_argument(
            "--timeout",
            type=float,
            default=120,
            help="seconds a node may take per client (a round waits that times the most clients on one node)",
        )
        flower_sub.add_argument(
            "--dp",
            nargs=4,
            type=float,
            metavar=("CLIP", "SENSITIVITY", "EPSILON", "DELTA"),
            help="local differential privacy (Flower's LocalDpMod): each update clipped to L2 norm CLIP, "
            "Gaussian noise for (EPSILON, DELTA) at SENSITIVITY (e.g. 2×CLIP) added on the node",
        )
        if name == "deploy":
            flower_sub.add_argument(
                "--port", type=int, default=9091, help="the SuperLink's port (SuperNodes use the next ones)"
            )
            flower_sub.add_argument(
                "--folder", default="runs/flower", help="logs and Flower's files (FLWR_HOME)"
            )
            flower_sub.add_argument(
                "--max-seconds", type=float, default=24 * 3600, help="stop the deployment after this long"
            )
            flower_sub.add_argument("--print", action="store_true", help="print the commands, start nothing")


def _bench_parser(commands) -> None:
    bench_cmd = commands.add_parser(
        "bench", help="time, FLOP-count and memory-profile every method's round (configs/bench.yaml)"
    )
    bench_cmd.add_argument(
        "--datasets",
        nargs="+",
        action=Names,
        metavar="NAME",
        help="default: the bench config's (rmnist cifar10)",
    )
    bench_cmd.add_argument("--methods", nargs="+", action=Names, metavar="NAME", help="default: every method")
    bench_cmd.add_argument(
        "--no-memory", action="store_true", help="skip the 100/1,000/10,000-client memory rows"
    )
    bench_cmd.add_argument(
        "--profile",
        action="store_true",
        help="also list each row's most expensive operators (torch.profiler)",
    )
    bench_cmd.add_argument(
        "--count",
        action="store_true",
        help="count one lockstep round's operators, kernels, bytes and FLOPs instead (results/census.json)",
    )
    bench_cmd.add_argument(
        "--project", metavar="PRESET", help="also print the projected wall time of make table PRESET=…"
    )
    bench_cmd.add_argument(
        "--out", default=BENCH_OUT, help=f"default: {BENCH_OUT} (--count: results/census.json)"
    )
    bench_cmd.add_argument(
        "--config",
        help="the rows to run (default: configs/bench.yaml; the GPU check's: configs/bench_gpu.yaml)",
    )
    bench_cmd.add_argument(
        "overrides", nargs="*", metavar="key=value", help="for every row, e.g. fabric.accelerator=cuda"
    )


def _census_command(args, config) -> int:
    """``fedmeta bench --count``: the census rows of the bench config's data sets and methods."""
    from pathlib import Path

    from fedmeta import census
    from fedmeta.bench import checked_bench

    bench = checked_bench(config, args.datasets, args.methods)
    out = Path(args.out) if args.out != BENCH_OUT else Path("results/census.json")
    census.run(
        census.plan(bench, args.datasets, args.methods, args.overrides), out, bench.census.warmup_rounds
    )
    return 0


def _tune_parser(commands) -> None:
    tune_cmd = commands.add_parser(
        "tune",
        help="tune a method's settings with Optuna, write its tuned variant (variant=tuned)",
        description="An Optuna study (TPE, median pruning) over the search space in the tune: block of "
        "the method's own file, configs/method/<method>.yaml (the budget: configs/tune.yaml), on a seed no "
        "preset scores. Interrupted or re-run, it continues the study — only under the settings it was "
        "started with. The best values go to <config home>/variant/<method>/tuned.yaml (config home: "
        "$FEDMETA_CONFIG_HOME, else ~/.config/fedmeta), which variant=tuned reads before the package's.",
    )
    tune_cmd.add_argument("method")
    tune_cmd.add_argument(
        "--trials", type=int, help="finished trials the study should hold (default: configs/tune.yaml)"
    )
    tune_cmd.add_argument("--rounds", type=int, help="rounds per trial (default: configs/tune.yaml)")
    tune_cmd.add_argument(
        "--seed", type=int, help="the tuning seed (default: configs/tune.yaml); not one a preset scores"
    )
    tune_cmd.add_argument(
        "--storage",
        help="database URL of the study (default: sqlite under runs/tune/); "
        "one URL shared by several machines runs one study",
    )
    tune_cmd.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a tuned.yaml in the config home that another study wrote, or you by hand",
    )
    tune_cmd.add_argument(
        "--new-study",
        action="store_true",
        help="start a study of these settings beside one of the same name started under others",
    )
    tune_cmd.add_argument(
        "--replace-committed",
        action="store_true",
        help="write into the package's configs/variant/<method>/tuned.yaml, replacing the committed values",
    )
    tune_cmd.add_argument(
        "overrides", nargs="*", metavar="key=value", help="for every trial, e.g. partition=dirichlet"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as the commands take it: overrides that followed a list option joined to
    the others, --slurm's comma lists split. SystemExit for --help (0) and usage errors (2)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value words after an option (fedmeta tune ditto --trials 30 partition=dirichlet) are
    # overrides too: argparse fills a positional list once, before the options
    stray = [word for word in extra if "=" not in word or word.startswith("-")]
    if stray or (extra and not hasattr(args, "overrides") and not hasattr(args, "values")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        target = "overrides" if hasattr(args, "overrides") else "values"
        setattr(args, target, [*getattr(args, target), *extra])
    if hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *getattr(args, "moved_overrides", [])]
    if hasattr(args, "slurm"):
        args.slurm = [item for value in args.slurm for item in value.split(",") if item]
    return args


class Notes(logging.Handler):
    """fedmeta's log records on stderr, one line each: information as a note (nothing to do), the
    rest as warnings. Resolves stderr when it writes (tests and callers may replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        from lightning_fabric.utilities.rank_zero import rank_zero_only

        if record.levelno < logging.WARNING and getattr(rank_zero_only, "rank", 0) != 0:
            return  # a note is the run's, said once: by the first of its processes (DDP starts several)
        kind = "note" if record.levelno < logging.WARNING else "warning"
        print(f"fedmeta: {kind}: {record.getMessage()}", file=sys.stderr)


class Phases(logging.Handler):
    """The ``fedmeta.phase`` records (what a slow start is doing: the data, the model, the first
    round), for a person at a terminal only: logs and pipes get the results, not the waiting."""

    def emit(self, record: logging.LogRecord) -> None:
        if sys.stderr.isatty():
            print(f"fedmeta: {record.getMessage()}", file=sys.stderr, flush=True)


def _show_notes() -> None:
    log = logging.getLogger("fedmeta")
    if not any(isinstance(handler, Notes) for handler in log.handlers):
        log.addHandler(Notes())
        log.setLevel(logging.INFO)
    phases = logging.getLogger("fedmeta.phase")
    if not any(isinstance(handler, Phases) for handler in phases.handlers):
        phases.addHandler(Phases())
        phases.propagate = False  # not a note


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status. A reader that stops reading early
    (``fedmeta train --help | head -3``) ends the command quietly, with a pipe writer's status."""
    _show_notes()
    try:
        status = _main(argv)
        sys.stdout.flush()  # a buffered stdout (no PYTHONUNBUFFERED) meets a closed pipe here, not at exit
        return status
    except BrokenPipeError:
        _stdout_to_devnull()
        return 141  # 128 + SIGPIPE, as the shell reports a writer whose reader went away


def _stopped_while_starting(signum, frame) -> None:
    raise RunStopped(
        "stopped by SIGTERM while starting, before its first round: its last checkpoint, if any, is kept; "
        "run it again (output.resume=true continues one)"
    )


def _exit_at_once(signum, frame) -> None:
    """Ctrl-C after the stop line: out at once with 130, as the docs promise, the checkpoint already on
    disk (not a KeyboardInterrupt traceback from whatever exit handler it lands in)."""
    print("\nfedmeta: Ctrl-C again: stopped at once", file=sys.stderr, flush=True)
    os._exit(130)


def _stdout_to_devnull() -> None:
    """What is left in stdout's buffer goes nowhere: Python flushes it on exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# commands whose first line of their own comes after PyTorch's import (seconds; minutes at load 14)
SLOW_TO_START = {
    "train",
    "evaluate",
    "table",
    "figures",
    "sweep",
    "campaign",
    "bench",
    "tune",
    "flower",
    "describe",
}


def _main(argv: list[str] | None) -> int:
    try:
        args = parse(argv)
    except SystemExit as exit_:  # --help (0) or a usage error, said in one line (2)
        try:
            sys.stdout.flush()
        except BrokenPipeError:  # argparse's help ignores a reader that left; so does its flush
            _stdout_to_devnull()
        return int(exit_.code or 0)
    if args.command in SLOW_TO_START and sys.stderr.isatty():  # a person waiting: say why it is quiet
        print(
            f"fedmeta {args.command}: loading PyTorch, Lightning and the data "
            "(a few seconds; longer on a busy machine) …",
            file=sys.stderr,
            flush=True,
        )

    try:
        if args.command in ("table", "figures", "sweep") and args.parallel is not None and args.parallel < 1:
            raise FedmetaError(f"--parallel must be ≥ 1 (runs at once), got {args.parallel}")
        if args.command in ("table", "figures"):
            return _grid_command(args, argv if argv is not None else sys.argv[1:])
        return COMMANDS[args.command](args)
    except RunStopped as exc:  # SIGTERM, Ctrl-C or output.stop_at: checkpointed, to be continued
        said = str(exc)
        if args.command == "tune":  # a trial's run stopped: the study continues from its database
            print("\nfedmeta: interrupted; run the same command again: the study continues", file=sys.stderr)
            return RunStopped.EXIT_STATUS
        if args.command == "train":
            said = said.replace("output.resume=true", "output.resume=true (make train RESUME=1)")
        print(f"fedmeta: {said}", file=sys.stderr)
        if argv is None and args.command in ("train", "evaluate"):  # this process is the run's alone
            # its files are written and its loggers closed: the interpreter's teardown (freeing
            # PyTorch's objects, exit handlers; a second here, a minute under load) waits for nothing
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(RunStopped.EXIT_STATUS)
        if argv is None:  # the process is this command's (not a caller's): its way out may take a while
            signal.signal(signal.SIGINT, _exit_at_once)
        return RunStopped.EXIT_STATUS
    except FedmetaError as exc:
        print(f"fedmeta: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # the reader of our output went away: main ends quietly
    except OSError as exc:  # a read-only output root, a full disk, a folder in the way: name the path
        where = f"{exc.filename}: " if exc.filename else ""
        print(
            f"fedmeta: error: {where}{exc.strerror or exc}: check the path and its permissions or free space",
            file=sys.stderr,
        )
        return 2
    except (
        KeyboardInterrupt
    ):  # Ctrl-C: the run's lock is released and its last checkpoint kept on the way out
        hint = (
            " resume with the same command and output.resume=true (make train RESUME=1)"
            if args.command == "train"
            else " run the same command again: finished work is kept"
        )
        print(f"\nfedmeta: interrupted;{hint}", file=sys.stderr)
        return 130


def _train_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from omegaconf import OmegaConf

    from fedmeta.assemble import seed_configs
    from fedmeta.config import compose, run_name

    signal.signal(signal.SIGTERM, _stopped_while_starting)  # until the run's own Stopper takes over
    cfg = compose(args.overrides)
    if args.print_config:
        print(OmegaConf.to_yaml(cfg))
        return 0
    from fedmeta.loop import train

    summary = train(cfg)
    if summary is None:  # another process of a multi-process run: the main one reports
        return 0
    for one in summary if isinstance(summary, list) else [summary]:  # stacked seeds: one summary each
        print(
            json.dumps({k: one[k] for k in ("dataset", "partition", "method", "variant", "seed", "rounds")})
        )
        speed = (
            f"{one['seconds_per_round']:.3f} s/round"
            if one["seconds_per_round"] is not None
            else "no rounds trained"
        ) + (f" per seed ({one['seeds_stacked']} stacked)" if one["seeds_stacked"] > 1 else "")
        if one["protocol"] != "training_clients":
            print(
                f"new-client accuracy after {cfg.personalization.steps} personalization steps: "
                f"{100 * one['accuracy']:.2f} % (sd {100 * one['accuracy_std']:.2f} over its "
                f"{one['new_clients']} new clients; step 0: {100 * one['curve'][0]:.2f} %), {speed}"
            )
        if trained := one.get("training_clients"):
            print(
                f"training-client accuracy on their test splits: {100 * trained['accuracy']:.2f} % (sd "
                f"{100 * trained['accuracy_std']:.2f} over {trained['clients']} clients; sample-weighted "
                f"{100 * trained['weighted_accuracy']:.2f} %)"
                + (f", {speed}" if one["protocol"] == "training_clients" else "")
            )
    folders = [Path(cfg.output.root) / run_name(one) for one in seed_configs(cfg)]
    print(f"run folder: {folders[0]}" + (f" and {len(folders) - 1} more" if len(folders) > 1 else ""))
    return 0


def _evaluate_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedmeta.reevaluate import evaluate_run

    record = evaluate_run(Path(args.run_dir), args.overrides, args.unfinished)
    print(json.dumps(record["personalization"]))
    print(
        f"new-client accuracy: {100 * record['accuracy']:.2f} ± {100 * record['accuracy_std']:.2f} % "
        f"(step 0: {100 * record['curve'][0]:.2f} %)"
    )
    return 0


def _tune_command(args: argparse.Namespace) -> int:
    from fedmeta.tune import Study

    result = Study(
        args.method,
        args.overrides,
        args.trials,
        args.rounds,
        args.seed,
        args.storage,
        overwrite=args.overwrite,
        new_study=args.new_study,
        replace_committed=args.replace_committed,
    ).run()
    print(
        f"study {result['study']}: best new-client accuracy {100 * result['best_accuracy']:.2f} % with "
        f"{result['best']}; wrote {result['tuned']}"
    )
    return 0


def _bench_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedmeta import bench

    config = Path(args.config) if args.config else bench.CONFIG_DIR / "bench.yaml"
    if args.count:
        return _census_command(args, config)
    bench.run(
        args.datasets,
        args.methods,
        args.overrides,
        not args.no_memory,
        Path(args.out),
        config,
        profile=args.profile,
        projection=args.project,
    )
    return 0


def _data_command(args: argparse.Namespace) -> int:
    if args.data_command == "download":
        from fedmeta.data.download import download
        from fedmeta.data.sources import CANONICAL, data_dir

        name = CANONICAL.get(args.name, args.name)  # dataset=rmnist reads mnist.npz: fetch that
        print(f"wrote {download(name, data_dir(args.dir), args.mirror, verify=not args.no_verify)}")
        return 0
    from fedmeta.config import compose
    from fedmeta.describe import describe

    # argparse gives the optional partition the first word after the data set, even key=value
    moved = [args.partition] if args.partition and "=" in args.partition else []
    partition = None if moved else args.partition
    picks = [f"dataset={args.dataset}"] + ([f"partition={partition}"] if partition else [])
    stats, path = describe(compose([*picks, *moved, *args.overrides]))
    print(json.dumps(stats, indent=2))
    print(f"class histograms of 10 clients: {path}")
    return 0


def _grid_command(args: argparse.Namespace, argv: list[str]) -> int:
    """``fedmeta table`` / ``fedmeta figures``: run a preset's grid (finished runs skipped), then report."""
    import shlex
    from pathlib import Path

    from fedmeta import grid, report
    from fedmeta.config import compose

    preset = grid.load_preset(args.preset)
    folder = preset.get("runs_in") or args.preset  # a preset may draw on another's runs (zoo: quick's)
    root = Path("runs") / folder
    if args.executor not in grid.EXECUTORS:
        raise FedmetaError(f"--executor must be one of {', '.join(grid.EXECUTORS)}, got {args.executor!r}")
    grid.check_names(preset, args.datasets, args.methods)
    results = Path(preset.get("results", "results"))  # the tiny preset's: runs/tiny-results, never committed
    kept = results / "runs" / folder  # the runs' small files, committed: what the report reads
    grids = ["table"] if args.command == "table" else ["heterogeneity", "images_per_client"]
    should_run, failures = (not args.no_run if args.command == "table" else args.run), []
    jobs, fresh, stop = [], [], grid.GridStop()
    budget = args.budget if args.command == "table" else None
    if budget is not None and not (budget > 0 and math.isfinite(budget)):
        raise FedmetaError(f"--budget must be a number of seconds > 0, got {budget}")
    if should_run:
        jobs = grid.plan(preset, root, grids, args.datasets, args.methods, args.seeds, args.overrides)
        before = report.finished_runs(root)
        try:
            with stop.installed():
                failures = grid.run(
                    jobs,
                    root,
                    grid.default_parallel() if args.parallel is None else args.parallel,
                    kept,
                    args.executor,
                    args.slurm,
                    None if budget is None else time.time() + budget,
                    stop=stop,
                )
        finally:  # also the runs that finished before a Ctrl-C: the next grid counts them as done
            launched = set().union(*(job.folders(root) for job in jobs))
            fresh = report.record_command(root, before, shlex.join(["fedmeta", *argv]), launched)
        for line in failures:
            print(
                f"fedmeta: {'' if line.startswith(grid.STOPPED) else 'failed run: '}{line}", file=sys.stderr
            )
        failures = [line for line in failures if not line.startswith(grid.STOPPED)]
    report.archive(root, kept)
    runs = report.collect(kept)
    if args.command == "table":
        out = Path(args.out or results / "TABLES.md")
        print(report.write_tables(args.preset, preset, kept, out, runs))
        written = [out]
    else:
        out_dir = Path(args.out_dir or results / "figures" / args.preset)
        written = report.draw_figures(args.preset, preset, runs, out_dir, kept)
        for path in written:
            print(f"wrote {path}")
    # a W&B report run where asked, or after runs that logged to W&B: rewriting the table or the
    # figures from the kept runs leaves nothing but them behind
    if args.wandb or fresh:
        cfg = compose(list(jobs[0].overrides) if jobs else [*preset.overrides, *args.overrides])
        if args.wandb or "wandb" in cfg.logger:
            report.log_report(args.preset, preset, runs, written, cfg.wandb)
    if stop.asked.is_set():  # what finished is in the table; the rest continues when run again
        return RunStopped.EXIT_STATUS
    return 1 if failures else 0


def _campaign_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedmeta import campaign
    from fedmeta.config import compose

    plan = campaign.load() if args.config is None else campaign.load(Path(args.config))
    kept = Path("results") / "runs" / plan.preset
    if args.out is None:
        args.out = "results/campaign.md" if plan.preset == "paper" else f"results/campaign-{plan.preset}.md"
    if args.until is not None:
        if args.budget is not None or not math.isfinite(args.until):
            raise FedmetaError(
                f"--until takes the job's end as a Unix time, instead of --budget, got {args.until}"
            )
        args.budget = args.until - time.time()
    _check_campaign_numbers(args, plan.reserve_seconds)
    for flag, given in (("--settings", args.settings), ("--methods", args.methods)):
        if given is not None and args.budget is None and args.profile is None:
            raise FedmetaError(f"{flag} narrows a job or a profile: give it --budget, --until or --profile")

    def narrowed(plan):  # the job's settings and methods: --settings, --methods, else all of the campaign's
        return campaign.only(plan, args.settings, args.methods)

    if args.profile is not None:  # refused with --collect before anything is collected
        return _profile_next_unit(args, narrowed(plan), kept)
    if args.collect is not None:
        if args.budget is not None:
            raise FedmetaError("--collect takes back a job's files: run it without --budget")
        for line in campaign.collect(plan, Path(args.collect), kept, logs=Path("results") / "gpu"):
            print(line)
    if args.budget is not None:
        if any(o.split("=", 1)[0] == "output.root" for o in args.overrides):
            raise FedmetaError(
                "fedmeta campaign runs under runs/<preset>, where its kept runs resume: drop output.root="
            )
        plan.overrides = [*plan.overrides, *args.overrides]
        plan.command_overrides = list(args.overrides)  # what the runs' command.txt repeats
        compose(list(plan.overrides))  # a bad override: one line before anything runs
        _campaign_jobs(args, narrowed(plan), kept)
    if args.pack is not None:  # a lent machine: the state is written where its archive is collected
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(campaign.status(plan, kept))
    print(f"wrote {args.out}")
    return 0


CAMPAIGN_MAX_SECONDS = 30 * 24 * 3600  # a job's deadline beyond a month is a typo, not a plan
CAMPAIGN_MAX_PARALLEL = 64


def _check_campaign_numbers(args: argparse.Namespace, reserve_seconds: float) -> None:
    """``fedmeta campaign``'s numbers, each finite and within what a job can use, before anything runs."""
    if args.budget is not None and not (reserve_seconds < args.budget <= CAMPAIGN_MAX_SECONDS):
        raise FedmetaError(
            f"{'--until must leave' if args.until else '--budget must be'} a number of seconds above the "
            f"{reserve_seconds} s the job keeps for its files (configs/campaign.yaml: reserve_seconds) and "
            f"at most {CAMPAIGN_MAX_SECONDS} (30 days), got {args.budget:.6g}"
        )
    if args.profile is not None and not (0 < args.profile <= CAMPAIGN_MAX_SECONDS):
        raise FedmetaError(f"--profile takes a number of seconds above 0, got {args.profile:.6g}")
    if args.parallel is not None and not 1 <= args.parallel <= CAMPAIGN_MAX_PARALLEL:
        raise FedmetaError(
            f"--parallel must be 1 to {CAMPAIGN_MAX_PARALLEL} (units at once), got {args.parallel}"
        )
    if args.start_ahead is not None and not 0 <= args.start_ahead <= 8:
        raise FedmetaError(f"--start-ahead must be 0 to 8 (units setting up ahead), got {args.start_ahead}")
    if args.carry_mib is not None and not (0 <= args.carry_mib <= 1024**2):
        raise FedmetaError(f"--carry-mib must be a size in MiB, 0 to 1048576, got {args.carry_mib:.6g}")


def _campaign_jobs(args: argparse.Namespace, plan, kept) -> None:
    """``fedmeta campaign --budget|--until``: a job, and on a machine of its own (nothing packed for a
    lease) the next ones while its deadline leaves time and every unit a job took finished — a job
    takes a few units, and a CPU's deadline of hours outlasts them."""
    from pathlib import Path

    from fedmeta import campaign

    deadline = time.time() + args.budget
    while True:
        record = campaign.run(
            plan,
            deadline - time.time(),
            kept,
            Path("runs") / plan.preset,
            args.parallel,
            out=None if args.pack is None else Path(args.pack),
            carry_mib=args.carry_mib,
            ahead=args.start_ahead,
        )
        advanced = "; ".join(f"{unit}: {b} → {a}" for unit, (b, a) in record["units"].items())
        print(f"campaign: {record['seconds']:.0f} s; advanced: {advanced or 'nothing'}")
        left = deadline - time.time()
        if args.pack is not None or not campaign.finished_early(record) or left < plan.reserve_seconds + 60:
            return
        if campaign.next_unit(plan, kept, Path("runs") / plan.preset, args.carry_mib) is None:
            return  # the campaign is done, or what is left cannot run here
        print(
            f"campaign: every unit the job took finished with {left:.0f} s left: a next job takes the next units"
        )


def _profile_next_unit(args: argparse.Namespace, plan, kept) -> int:
    """``fedmeta campaign --profile``: the unit a job would run next, measured (fedmeta.profiling)."""
    from pathlib import Path

    from fedmeta import campaign
    from fedmeta.config import compose

    if args.budget is not None or args.collect is not None:
        raise FedmetaError(
            "--profile measures the next unit on its own: run it without --budget or --collect"
        )
    plan.overrides = [*plan.overrides, *args.overrides]
    compose(list(plan.overrides))  # a bad override: one line before anything runs
    root = Path("runs") / plan.preset
    found = campaign.next_unit(plan, kept, root, args.carry_mib)
    if found is None:
        print("profile: no unfinished unit whose data is here")
        return 0
    from fedmeta.profiling import profile_unit
    from fedmeta.stopping import process_seconds

    label, overrides = found
    partner = campaign.fill_partner(plan, kept, root, args.carry_mib, found)
    seconds = args.profile - process_seconds()  # the process's start is spent from it
    profile_unit(label, plan.preset, overrides, seconds, partner=partner)
    return 0


def _flower_command(args: argparse.Namespace) -> int:
    """``fedmeta flower sim|deploy``: the run's clients on Flower SuperNodes."""
    import shlex
    from pathlib import Path

    from fedmeta.config import compose

    # float options take nan and inf: a comparison alone lets them through (nan > 0 is false)
    if args.nodes < 1 or not (math.isfinite(args.timeout) and args.timeout > 0):
        raise FedmetaError(
            f"--nodes must be ≥ 1 and --timeout > 0 (a finite number of seconds), got {args.nodes} and {args.timeout}"
        )
    if args.flower_command == "deploy" and not (math.isfinite(args.max_seconds) and args.max_seconds > 0):
        raise FedmetaError(f"--max-seconds must be a finite number of seconds > 0, got {args.max_seconds}")
    if args.dp:
        clip, sensitivity, epsilon, delta = args.dp
        if not (
            all(map(math.isfinite, args.dp))
            and clip > 0
            and sensitivity >= 0
            and epsilon > 0
            and 0 < delta < 1
        ):
            raise FedmetaError(
                f"--dp needs CLIP > 0, SENSITIVITY ≥ 0, EPSILON > 0 and 0 < DELTA < 1, all finite, got {args.dp}"
            )
    highest = 65535 - 3 - args.nodes  # the SuperLink's port, its two of its own, then one per SuperNode
    if args.flower_command == "deploy" and highest < 1024:
        raise FedmetaError(
            f"--nodes {args.nodes} leaves no room for their ports in 1024..65535: at most {65535 - 3 - 1024}"
        )
    if args.flower_command == "deploy" and not 1024 <= args.port <= highest:
        raise FedmetaError(
            f"--port must leave room for the SuperLink's and {args.nodes} SuperNodes' ports in "
            f"1024..65535, got {args.port}; e.g. --port {min(9091, highest)}"
        )
    compose(args.overrides)  # bad overrides are refused before anything starts
    try:
        from fedmeta import flower
    except ImportError as exc:
        raise FedmetaError(f"Flower is not installed ({exc.name}): pip install -e '.[flower]'") from None
    dp = dict(zip(flower.DP_KEYS, args.dp)) if args.dp else None
    if args.flower_command == "sim":
        flower.simulate(args.overrides, args.nodes, args.timeout, dp)
        return 0
    deployment = flower.Deployment(args.nodes, Path(args.folder), args.port)
    if args.print:
        for command in deployment.commands():
            print(shlex.join(command))
        dp_config = "".join(f" {key}={value}" for key, value in (dp or {}).items())
        print(
            f'flwr run <app folder> <connection> --run-config \'overrides="{" ".join(args.overrides)}" '
            f"timeout={args.timeout:g}{dp_config}'"
        )
        return 0
    run_dir = flower.deploy(
        args.overrides, args.nodes, args.timeout, Path(args.folder), args.port, args.max_seconds, dp
    )
    print(f"finished: {run_dir / 'summary.json'}")
    return 0


def _sweep_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fedmeta import grid

    root = Path(args.root)
    jobs = grid.sweep_plan(args.values, root)
    parallel = grid.default_parallel() if args.parallel is None else args.parallel
    with (stop := grid.GridStop()).installed():
        failures = grid.run(jobs, root, parallel, None, args.executor, args.slurm, stop=stop)
    for line in failures:
        print(f"fedmeta: {'' if line.startswith(grid.STOPPED) else 'failed run: '}{line}", file=sys.stderr)
    table = grid.sweep_report(jobs)
    (root / "sweep.md").write_text(f"# Sweep: fedmeta sweep {' '.join(args.values)}\n\n{table}")
    print(table, end="")
    if stop.asked.is_set():  # what finished is in the report; the rest continues when run again
        return RunStopped.EXIT_STATUS
    return 1 if any(not line.startswith(grid.STOPPED) for line in failures) else 0


COMMANDS = {  # fedmeta <command> → what runs it (table and figures also read the command line)
    "train": _train_command,
    "evaluate": _evaluate_command,
    "tune": _tune_command,
    "flower": _flower_command,
    "bench": _bench_command,
    "campaign": _campaign_command,
    "sweep": _sweep_command,
    "data": _data_command,
}


if __name__ == "__main__":
    # ``python -m fedmeta.cli`` put the working folder first on the path (fedmeta itself is loaded by
    # now): what is imported later comes from the installed packages, not from files lying there
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    sys.exit(main())
