"""``fedmeta tune METHOD``: an Optuna study over a method's search space (the ``tune:`` block of
configs/method/<method>.yaml; the budget in configs/tune.yaml).

Each trial is a plain ``fedmeta train`` of the method on the tuning setting and the tuning seed,
with the values TPE proposes; its new-client accuracy at each intermediate evaluation is reported
to the study, and the median pruner stops trials that fall below the median of the earlier ones at
the same round. The study lives in a database (SQLite under ``runs/tune/`` by default, or any
database URL several machines can share), so a study that is interrupted — or run from several
machines at once — continues where it is, but only under the settings it was started with. After
every finished trial the best settings so far are written to ``<config home>/variant/<method>/tuned.yaml``
(``variant=tuned``; the config home is $FEDMETA_CONFIG_HOME, else ~/.config/fedmeta, read before the
package's configs/) and the study's summary to ``tuned.study.md`` beside it. The package's committed
``configs/variant/<method>/tuned.yaml`` is replaced only with ``--replace-committed``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
import warnings
import zlib
from datetime import UTC, datetime
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fedmeta.config import CONFIG_DIR, compose, group_choices, method_card, setting_name, user_config_dir
from fedmeta.errors import FedmetaError

MARK = "# written by fedmeta tune:"  # in the header of a tuned.yaml this command may replace
# A running trial's process writes a heartbeat to the database this often; one silent for the grace
# period (its process was killed) is marked failed when a study is continued, so it neither counts
# as a trial nor stays "running" for ever. Long, since a trial on a busy CPU may stall for minutes.
HEARTBEAT_S, GRACE_S = 60, 600


def load_budget(config_dir: Path = CONFIG_DIR) -> DictConfig:
    return OmegaConf.load(config_dir / "tune.yaml").budget


def trial_seeded_sampler(seed: int, startup_trials: int):
    """Optuna's TPE sampler whose random draws for trial k come from (seed, k) alone. Seeded once
    instead, every process of a study shared by several (``fedmeta tune`` on each machine) drew the
    same start-up values for its first trial; trial numbers are unique in the study's storage, so
    each trial draws its own, and one process draws what it always would."""
    import optuna

    class TrialSeededTPE(optuna.samplers.TPESampler):
        def before_trial(self, study, trial) -> None:
            trial_seed = (seed + 1_000_003 * trial.number) % 2**32
            # Optuna 5 keeps its generators here (reseed_rng() can only reseed them at random)
            self._rng.rng.seed(trial_seed)
            self._random_sampler._rng.rng.seed(trial_seed)
            super().before_trial(study, trial)

    return TrialSeededTPE(seed=seed, n_startup_trials=startup_trials)


def preset_seeds(config_dir: Path = CONFIG_DIR) -> set[int]:
    """Every seed a preset scores: the tuning seed must be none of them."""
    seeds = set()
    for name in group_choices("preset", config_dir):
        seeds |= {int(s) for s in OmegaConf.load(config_dir / "preset" / f"{name}.yaml").get("seeds", [])}
    return seeds


def suggest(trial, space: dict) -> list[str]:
    """The trial's values for every key of ``space``, as ``key=value`` overrides."""
    overrides = []
    for key, kind in space.items():
        ((how, bounds),) = kind.items()
        if how == "log":
            value = trial.suggest_float(key, *bounds, log=True)
        elif how == "float":
            value = trial.suggest_float(key, *bounds)
        elif how == "int":
            value = trial.suggest_int(key, *bounds)
        elif how == "choices":
            value = trial.suggest_categorical(key, list(bounds))
        else:
            raise FedmetaError(
                f"a method's tune: block: {key} has kind {how!r}: use log, float, int or choices"
            )
        overrides.append(f"{key}={value}")
    return overrides


class Study:
    """One method's study: its budget, search space, storage and output files."""

    def __init__(
        self,
        method: str,
        overrides: list[str],
        trials: int | None,
        rounds: int | None,
        seed: int | None,
        storage: str | None,
        root: Path = Path("runs/tune"),
        config_dir: Path = CONFIG_DIR,
        overwrite: bool = False,
        new_study: bool = False,
        replace_committed: bool = False,
    ):
        tunable = [m for m in group_choices("method", config_dir) if method_card(m, config_dir).tune]
        if method not in tunable:
            raise FedmetaError(
                f"no search space for method {method!r} (a tune: block in its configs/method file): "
                f"choose one of {tunable}"
            )
        budget = load_budget(config_dir)
        self.method, self.space, self.config_dir = method, method_card(method, config_dir).tune, config_dir
        self.trials = trials if trials is not None else budget.trials
        self.rounds = rounds if rounds is not None else budget.rounds
        self.seed = seed if seed is not None else budget.seed
        if self.trials < 1 or self.rounds < 1:
            raise FedmetaError(f"--trials and --rounds must be ≥ 1, got {self.trials} and {self.rounds}")
        scored = preset_seeds(config_dir)
        if self.seed in scored:
            raise FedmetaError(
                f"--seed {self.seed} is a seed the presets score ({sorted(scored)}): tune on another one"
            )
        # Each method's sampler its own seed (one seed for all drew the same values for every study),
        # and TPE's random start-up at most half the trials, so the rest are proposed by the model.
        self.sampler_seed = zlib.crc32(f"{method}/{self.seed}".encode())
        self.startup_trials = max(1, min(10, self.trials // 2))
        evaluations = max(1, min(budget.evaluations, self.rounds))
        self.base = [
            *budget.overrides,
            *overrides,
            f"method={method}",
            f"seed={self.seed}",
            f"federation.rounds={self.rounds}",
            f"federation.eval_every={math.ceil(self.rounds / evaluations)}",
        ]
        cfg = compose(self.base, config_dir)  # bad overrides are refused before a study exists
        for key in self.space:
            if OmegaConf.select(cfg, key, default=None) is None:
                raise FedmetaError(
                    f"configs/method/{method}.yaml: its tune: block searches {key}, which its config does not have"
                )
        self.setting = setting_name(cfg)
        # What a study's trials must share; recorded in the study, compared when it is continued.
        self.settings = {"overrides": self.base, "space": self.space}
        digest = hashlib.sha1(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()[:8]
        self.name = f"{method}-{self.setting}-{self.rounds}rounds-seed{self.seed}" + (
            f"-{digest}" if new_study else ""
        )
        self.root = root / self.name
        if storage is not None and not storage.strip():
            raise FedmetaError(
                "--storage is empty: give a database URL (e.g. sqlite:///studies.db), or leave the option "
                "out for the default SQLite file under runs/tune/"
            )
        self._place_output(cfg.method.name, overwrite, replace_committed)
        root.mkdir(parents=True, exist_ok=True)  # every input checked: only now is anything created
        self.storage = storage or f"sqlite:///{(root / 'studies.db').resolve()}"
        self.storage_label = (
            storage or f"SQLite, {root / 'studies.db'}"
        )  # what the summary says: no machine's absolute path

    def _place_output(self, method: str, overwrite: bool, replace_committed: bool) -> None:
        """Where the best trial's values go (``out``: the user's config folder, or the committed
        variant with ``replace_committed``), what they would replace, and what they shadow."""
        variant_file = Path("variant") / method / "tuned.yaml"
        home = user_config_dir() if self.config_dir == CONFIG_DIR else self.config_dir
        self.out = (self.config_dir if replace_committed else home) / variant_file
        self.replaces = self._replaces(self.out)
        if self.replaces and not overwrite and not replace_committed:
            raise FedmetaError(
                f"{self.out} holds {self.replaces}: pass --overwrite to replace it with this study's values"
            )
        committed = self.config_dir / variant_file
        self.shadows = (
            f"; variant=tuned reads it before {committed} ({self._replaces(committed) or 'none'})"
            if self.out != committed and committed.is_file()
            else ""
        )

    def _replaces(self, path: Path) -> str | None:
        """What ``path`` holds that this study would replace: None when absent or this study's own."""
        if not path.is_file():
            return None
        text = path.read_text(errors="replace")[:2000]
        study = re.search(re.escape(MARK) + r" (\S+)", text)
        if study and study[1] == self.name:
            return None
        if not study:
            return "values written by hand, not by fedmeta tune"
        score = re.search(r"accuracy of that trial: ([\d.]+) %", text)
        size = re.search(r"The best of (\d+) trials", text)
        return f"the best of {size[1] if size else '?'} trials of study {study[1]}" + (
            f", {score[1]} %" if score else ""
        )

    def _unclaimed(self, study, optuna) -> int:
        """Trials no process has taken yet: the asked count less those finished or running (two
        ``fedmeta tune`` processes on one study share its count; a killed process's trial, silent past
        the heartbeat's grace, is marked failed first and no longer holds its place)."""
        with warnings.catch_warnings():  # experimental in Optuna's eyes, as the heartbeat is
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
        states = (
            optuna.trial.TrialState.COMPLETE,
            optuna.trial.TrialState.PRUNED,
            optuna.trial.TrialState.RUNNING,
        )
        return self.trials - sum(t.state in states for t in study.get_trials(deepcopy=False))

    def run(self, show_progress: bool = True) -> dict:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = self._open(optuna)
        self._check_settings(study)
        done = [
            t
            for t in study.trials
            if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        ]
        for _ in range(self.trials - len(done)):
            if self._unclaimed(study, optuna) <= 0:
                break  # another process on this study is running the rest
            study.optimize(
                lambda trial: self._objective(trial, show_progress), n_trials=1, catch=(FedmetaError,)
            )
            if any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials):
                self.write(study)
        if not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials):
            raise FedmetaError(
                f"no trial of study {self.name} finished (see {self.root}): check the method's settings"
            )
        self.write(study)
        return {
            "study": self.name,
            "best_accuracy": study.best_value,
            "best": study.best_params,
            "tuned": str(self.out)
            + (f" (replacing {self.replaces})" if self.replaces else "")
            + self.shadows,
        }

    def _check_settings(self, study) -> None:
        """A new study records its settings; a continued one must have been started with the same."""
        saved, settings = study.user_attrs.get("settings"), json.loads(json.dumps(self.settings))
        if saved is None:
            study.set_user_attr("settings", settings)
            return
        if saved == settings:
            return
        before, now = (dict(o.split("=", 1) for o in s["overrides"]) for s in (saved, settings))
        changes = [
            f"{key}={before.get(key, '(unset)')} then, {now.get(key, '(unset)')} now"
            for key in sorted(before.keys() | now.keys())
            if before.get(key) != now.get(key)
        ] + (["its search space"] if saved["space"] != settings["space"] else [])
        raise FedmetaError(
            f"study {self.name} was started under other settings ({'; '.join(changes)}): its trials would "
            "mix with these; run it with the settings it has, or pass --new-study to start a study of these"
        )

    def _open(self, optuna, attempts: int = 3):
        """The study, created or continued. Two studies started at once on a new database both
        create its tables, and the second finds them made: it tries again, and then opens them."""
        for attempt in range(attempts):
            try:
                with (
                    warnings.catch_warnings()
                ):  # Optuna 5 calls heartbeats experimental: no warning to every user
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    storage = optuna.storages.RDBStorage(
                        self.storage, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S
                    )
                return optuna.create_study(
                    study_name=self.name,
                    storage=storage,
                    load_if_exists=True,
                    direction="maximize",
                    sampler=trial_seeded_sampler(self.sampler_seed, self.startup_trials),
                    pruner=optuna.pruners.MedianPruner(n_startup_trials=2),
                )
            except Exception as exc:  # a bad URL, an unreachable server, a database of another program
                if "already exists" in str(exc) and attempt + 1 < attempts:
                    time.sleep(1.0)
                    continue
                raise FedmetaError(
                    f"cannot open the study database {self.storage} ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}): give a database URL, e.g. sqlite:///tune.db"
                ) from None

    def _objective(self, trial, show_progress: bool) -> float:
        import optuna

        from fedmeta.loop import train

        cfg = compose(
            [
                *self.base,
                *suggest(trial, self.space),
                f"output.root={self.root}",
                f"output.setting=trial{trial.number}",
                "output.overwrite=true",
            ],
            self.config_dir,
        )

        def report(round_: int, accuracy: float) -> None:
            trial.report(accuracy, round_)
            if round_ < self.rounds and trial.should_prune():
                raise optuna.TrialPruned(f"accuracy {accuracy:.4f} at round {round_}: below the median")

        try:
            summary = train(cfg, show_progress=show_progress, on_evaluation=report)
        except FedmetaError as exc:  # a diverged trial is a bad point of the space, not the study's end
            logging.getLogger("fedmeta").warning(f"trial {trial.number} failed: {exc}")
            raise
        return summary["accuracy"]

    def write(self, study) -> None:
        """tuned.yaml (the best trial's values) and tuned.study.md (every trial) from the study."""
        import optuna

        best, states = study.best_trial, optuna.trial.TrialState
        finished = [t for t in study.trials if t.state in (states.COMPLETE, states.PRUNED)]
        failed = [f"trial {t.number}" for t in study.trials if t.state == states.FAIL]
        tree = OmegaConf.create()
        for key, value in best.params.items():
            OmegaConf.update(tree, key, value, force_add=True)
        head = (
            f"# The best of {len(finished)} trials of {self.method}'s search space (TPE, median pruning) on "
            f"{self.setting}, {self.rounds} rounds, tuning seed {self.seed}.\n"
            f"# New-client accuracy of that trial: {100 * best.value:.2f} %. Every trial: tuned.study.md "
            "beside this file.\n"
            f"{MARK} {self.name} (trial {best.number} of {len(finished)})\n"
        )
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(head + OmegaConf.to_yaml(tree))
        rows = sorted(
            finished,
            key=lambda t: (
                -(t.value if t.value is not None else max(t.intermediate_values.values(), default=-1))
            ),
        )
        lines = [
            f"# Tuning study `{self.name}`",
            "",
            f"Written {datetime.now(UTC):%Y-%m-%d %H:%M} UTC by `fedmeta tune {self.method}` "
            f"(storage: {self.storage_label}). Setting `{' '.join(self.base)}`; TPE sampler (seed {self.sampler_seed}, "
            f"{self.startup_trials} random start-up trials), median pruner on the new-client accuracy at each "
            "intermediate evaluation.",
            "",
            f"Search space (the tune: block of configs/method/{self.method}.yaml): "
            + ", ".join(f"`{k}` {v}" for k, v in self.space.items()),
            "",
            f"Best: trial {best.number}, {100 * best.value:.2f} % → `{self.out.name}`.",
            "",
            *(
                [
                    f"Not counted: {', '.join(failed)} (failed: a run refused its values or its process was killed).",
                    "",
                ]
                if failed
                else []
            ),
            "| trial | state | accuracy (%) | last round | " + " | ".join(self.space) + " |",
            "|---|---|---|---|" + "---|" * len(self.space),
        ]
        for t in rows:
            last = max(t.intermediate_values, default=None)
            score = t.value if t.value is not None else t.intermediate_values.get(last)
            lines.append(
                f"| {t.number} | {t.state.name.lower()} | {'' if score is None else f'{100 * score:.2f}'} | "
                f"{last if last is not None else ''} | "
                + " | ".join(
                    f"{t.params.get(k, ''):.4g}"
                    if isinstance(t.params.get(k), float)
                    else str(t.params.get(k, ""))
                    for k in self.space
                )
                + " |"
            )
        self.out.with_name("tuned.study.md").write_text("\n".join(lines) + "\n")
