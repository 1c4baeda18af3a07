"""``fedmeta evaluate RUN_DIR``: the shared test-time procedure again on a finished run's final
model, with other ``personalization.*`` settings; appended to the run's evaluations.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fedmeta import checkpoint
from fedmeta.assemble import make_engine, setup
from fedmeta.config import apply_overrides, compose_with_choices, load_mapping
from fedmeta.data import keeps_test_splits
from fedmeta.errors import FedmetaError
from fedmeta.rounds import Federated, evaluate_on_ranks
from fedmeta.runs import RunLock, append_text, check_run_folder


def rescorable_keys(ranges: dict) -> set[str]:
    """The method settings its file marks ``test_time: true`` in ``ranges``: new clients read them
    (FedRep's head-only steps, Ditto's λ, FedMeta's own steps), so a re-scoring may change them."""
    return {key for key, spec in ranges.items() if isinstance(spec, dict) and spec.get("test_time")}


def evaluate_run(run_dir: Path, overrides: list[str], unfinished: bool = False) -> dict:
    """The shared test-time procedure again on a finished run's final model, with other
    ``personalization.*`` settings (e.g. the step size); appended to the run's evaluations.jsonl.
    ``unfinished`` allows the last checkpoint of a run that has not finished."""
    check_run_folder(run_dir)
    has_model = (run_dir / "checkpoint.ckpt").exists() or (run_dir / checkpoint.MODEL).exists()
    if not has_model or not (run_dir / "config.yaml").exists():
        raise FedmetaError(
            f"{run_dir} holds no run to re-score (config.yaml, and checkpoint.ckpt or model.pt): give a run "
            "folder of a finished run (runs kept before model.pt was written hold neither: train them again)"
        )
    if not unfinished and not (run_dir / "summary.json").exists():
        raise FedmetaError(
            f"{run_dir} holds an unfinished run: finish it (output.resume=true), or evaluate its last "
            "checkpoint with --unfinished"
        )
    saved = load_mapping(run_dir / "config.yaml", "the config.yaml fedmeta wrote for this run")
    try:
        choices = [
            f"dataset={saved.dataset.name}",
            f"partition={saved.partition.name}",
            f"method={saved.method.name}",
            f"variant={saved.variant}",
        ]
    except Exception:  # noqa: BLE001 — OmegaConf's missing-key errors
        raise FedmetaError(
            f"{run_dir / 'config.yaml'} does not name its dataset, partition, method and variant: "
            "it is not the config.yaml fedmeta wrote for this run"
        ) from None
    base, ranges = compose_with_choices(choices)
    test_time = rescorable_keys(ranges)
    scoring = {*test_time, "evaluation.protocol"}  # which clients are scored changes no model
    model_keys = [
        o for o in overrides if not o.startswith("personalization.") and o.split("=", 1)[0] not in scoring
    ]
    if model_keys:
        its = f", and {saved.method.name}'s {', '.join(sorted(test_time))}" if test_time else ""
        raise FedmetaError(
            f"evaluate changes only personalization.* settings, evaluation.protocol{its} (the model is the "
            "run's; a method "
            f"file marks a setting new clients read with test_time: true in its ranges): got {model_keys}"
        )
    named = OmegaConf.select(saved, "method.algorithm", default=None)
    if named is not None and named != base.method.algorithm:
        # A run folder is data: it may come from anyone, and its config must never choose code to import.
        raise FedmetaError(
            f"{run_dir / 'config.yaml'} names method.algorithm {str(named)[:80]!r}, but method "
            f"{saved.method.name!r} is {base.method.algorithm!r} here: fedmeta imports no code a run folder "
            "names; evaluate it where that method's file is installed, or correct the file"
        )
    try:  # today's defaults under the saved config, so runs from before a new key still load
        OmegaConf.set_struct(base, False)
        cfg = OmegaConf.merge(base, saved)
        OmegaConf.set_struct(cfg, True)
    except Exception as exc:
        raise FedmetaError(
            f"{run_dir / 'config.yaml'} cannot be read as a fedmeta config ({exc})".splitlines()[0]
        ) from None
    trained_apart = keeps_test_splits(cfg)
    cfg = apply_overrides(cfg, overrides, ranges)  # the method's declared ranges, as train checks them
    if cfg.personalization.lr_rule == "selected" and any(
        o.startswith("personalization.lr=") for o in overrides
    ):
        raise FedmetaError(
            "personalization.lr is chosen by personalization.lr_rule=selected (this run's rule, or yours): add "
            "personalization.lr_rule=method to score at the step size you give"
        )
    if keeps_test_splits(cfg) and not trained_apart:
        raise FedmetaError(
            f"{run_dir} trained on all of its training clients' data: scoring them "
            "(evaluation.protocol=both or training_clients) or choosing the step size on them "
            "(personalization.lr_rule=selected) would read data the model was trained on; it needs a run "
            "trained with their test splits kept out"
        )
    lock = RunLock(
        run_dir
    ).acquire()  # not while a training process writes the folder, nor two evaluations at once
    try:
        return _evaluate_run(run_dir, cfg, test_time)
    finally:
        lock.release()


def _evaluate_run(run_dir: Path, cfg: DictConfig, test_time: set[str]) -> dict:
    fabric, federation, algorithm = setup(cfg)
    # the training clients' test splits (identity's "evaluation") matter to training only: a run that
    # kept them re-scores its new clients under either step-size rule (the opposite case is refused above)
    ignore = ("personalization.", "evaluation", *(f"{key}:" for key in test_time))
    if not (run_dir / "checkpoint.ckpt").exists():  # a kept run: its compact final model
        kept = checkpoint.load_model(run_dir / checkpoint.MODEL, algorithm)
        checkpoint.check_identity(run_dir / checkpoint.MODEL, kept["identity"], cfg, ignore=ignore)
        if cfg.evaluation.protocol != "new_clients" and algorithm.keeps_client_models and kept["left_out"]:
            raise FedmetaError(
                f"{run_dir / checkpoint.MODEL} left out {', '.join(kept['left_out'])} (over "
                "output.keep_model_mib): its training clients cannot be scored from it (its checkpoint can); "
                "score its new clients alone with evaluation.protocol=new_clients"
            )
        source = f"{checkpoint.MODEL} ({kept['dtype']})"
    else:
        try:
            state = fabric.load(run_dir / "checkpoint.ckpt", weights_only=True)
            saved = state["identity"]
        except Exception as exc:
            raise FedmetaError(
                f"{run_dir / 'checkpoint.ckpt'} cannot be read ({type(exc).__name__}): it is corrupt or not "
                "a fedmeta checkpoint"
            ) from None
        # another seed's or experiment's checkpoint in this folder: refused, as a resume refuses it
        checkpoint.check_identity(run_dir / "checkpoint.ckpt", saved, cfg, ignore=ignore)
        try:
            algorithm.load_federation_state(state["federation"])
        except Exception as exc:
            raise FedmetaError(
                f"{run_dir / 'checkpoint.ckpt'} cannot be loaded into this run's model "
                f"({type(exc).__name__}): it is corrupt or from another run"
            ) from None
        source = "checkpoint.ckpt"
    result = evaluate_on_ranks(
        fabric,
        [Federated(algorithm, federation, cfg.seed)],
        cfg.personalization,
        make_engine(cfg, fabric.device),
        protocol=cfg.evaluation.protocol,
    )[0]
    record = {
        "personalization": OmegaConf.to_container(cfg.personalization) | {"lr": result.lr},
        # every method setting new clients read, changed or not: what scored this line
        "method": {key.removeprefix("method."): OmegaConf.select(cfg, key) for key in sorted(test_time)},
        "protocol": cfg.evaluation.protocol,
        "model": source,  # a kept run's compact model re-scores within its float type's rounding
        "accuracy": result.accuracy,
        "accuracy_std": result.accuracy_std,
        "curve": result.curve,
        "personalization_lr": result.lr,
    }
    if result.lr_selection is not None:
        record["lr_selection"] = {f"{lr:g}": accuracy for lr, accuracy in result.lr_selection.items()}
    if (training := result.training_clients) is not None:
        record["training_clients"] = {
            "accuracy": training.accuracy,
            "accuracy_std": training.accuracy_std,
            "weighted_accuracy": training.weighted_accuracy,
            "curve": training.curve,
        }
    if fabric.is_global_zero:
        append_text(run_dir / "evaluations.jsonl", json.dumps(record) + "\n")
    return record
