"""What a run logs, read back from its files: the offline W&B run (no server) and the
TensorBoard event files hold every round's training metrics, every evaluation, every evaluation's
personalization curve, the run's identity (group, job type, name, tags), system metrics and the
final model."""

import csv
import json
import shutil

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb_files import read_written_run

from fedmeta import report
from fedmeta.config import compose
from fedmeta.grid import load_preset
from fedmeta.loop import train

ROUNDS, EVAL_EVERY, STEPS = 4, 2, 3


@pytest.mark.slow
def test_wandb_and_tensorboard_hold_every_item(tmp_path, mnist_dir, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose(
        [
            f"dataset.dir={mnist_dir}",
            f"output.root={tmp_path}",
            "method=fedavg_ft",
            "variant=tuned",
            f"federation.rounds={ROUNDS}",
            f"federation.eval_every={EVAL_EVERY}",
            f"personalization.steps={STEPS}",
            "federation.num_new_clients=4",
            "logger=[csv,tensorboard,wandb]",
            "wandb.log_model=true",
        ]
    )
    summary = train(cfg, show_progress=False)
    run_dir = tmp_path / "rmnist-shards" / "fedavg_ft-tuned" / "seed0"
    evaluated = [2, 4]

    # W&B: one run per federation, named and grouped so that a group × job type is one method's seeds
    (wandb_dir,) = (run_dir / "wandb").glob("offline-run-*")
    logged = read_written_run(wandb_dir)
    assert (logged["name"], logged["group"], logged["job_type"]) == (
        "fedavg_ft-tuned-seed0",
        "rmnist-shards",
        "fedavg_ft-tuned",
    )
    assert {"rmnist", "shards", "fedavg_ft", "tuned", "32-true"} <= set(logged["tags"])
    assert any("thread" in tag or "GPU" in tag or "H100" in tag for tag in logged["tags"])  # the hardware
    assert logged["config"]["method"]["name"] == "fedavg_ft"
    rows = logged["history"]
    assert sorted(r["trainer/global_step"] for r in rows if "train/loss" in r) == list(range(1, ROUNDS + 1))
    assert all("train/round_seconds" in r for r in rows if "train/loss" in r)
    evals = {r["trainer/global_step"]: r for r in rows if "eval/accuracy" in r}
    assert sorted(evals) == evaluated and all(
        {"eval/accuracy_std", "eval/step0_accuracy"} <= set(r) for r in evals.values()
    )
    assert evals[ROUNDS]["eval/accuracy"] == summary["accuracy"]
    tables = [r for r in rows if "personalization/curves/path" in r]
    assert [t["trainer/global_step"] for t in tables] == evaluated  # a table at every evaluation...
    last = json.loads((wandb_dir / "files" / tables[-1]["personalization/curves/path"]).read_text())
    assert last["columns"] == ["round", "step", "accuracy"]  # ...the last one holding every curve so far
    assert [(r, s) for r, s, _ in last["data"]] == [(r, s) for r in evaluated for s in range(STEPS + 1)]
    assert [a for r, _, a in last["data"] if r == ROUNDS] == summary["curve"]
    assert "personalization/plot_table/path" in tables[-1]  # the line plot, one line per evaluation
    assert (
        logged["summary"]["final/accuracy"] == summary["accuracy"]
        and logged["summary"]["method"] == "fedavg_ft"
    )
    (model,) = [a for a in logged["artifacts"] if a["type"] == "model"]
    assert model["files"] == ["checkpoint.ckpt"]
    assert logged["stats"], "W&B system metrics were not recorded"

    # TensorBoard: the same series, and each evaluation's curve as a series over the steps
    rounds = EventAccumulator(str(run_dir / "tensorboard" / "rounds")).Reload()
    assert [e.step for e in rounds.Scalars("train/loss")] == list(range(1, ROUNDS + 1))
    assert [e.step for e in rounds.Scalars("eval/accuracy")] == evaluated
    assert abs(rounds.Scalars("eval/accuracy")[-1].value - summary["accuracy"]) < 1e-6
    assert {"train/round_seconds", "eval/accuracy_std", "eval/step0_accuracy"} <= set(
        rounds.Tags()["scalars"]
    )
    assert rounds.PluginTagToContent("hparams")  # the HParams tab: settings beside the result
    curves = EventAccumulator(str(run_dir / "tensorboard" / "personalization")).Reload()
    for round_ in evaluated:
        points = curves.Scalars(f"personalization/round_{round_:05d}")
        assert [e.step for e in points] == list(range(STEPS + 1))
    assert [round(e.value, 6) for e in curves.Scalars(f"personalization/round_{ROUNDS:05d}")] == [
        round(a, 6) for a in summary["curve"]
    ]

    # Fabric's CSVLogger beside the run's own metrics.csv, the same numbers
    with open(run_dir / "csv" / "metrics.csv") as f:
        fabric_rows = list(csv.DictReader(f))
    with open(run_dir / "metrics.csv") as f:
        own_rows = list(csv.DictReader(f))
    assert [float(r["train/loss"]) for r in fabric_rows] == [float(r["train_loss"]) for r in own_rows]

    # The report: TABLES.md and the figures of the kept runs, logged to a W&B run of their own
    monkeypatch.chdir(tmp_path)
    kept = tmp_path / "kept"
    shutil.copytree(
        run_dir,
        kept / "rmnist-shards" / "fedavg_ft-tuned" / "seed0",
        ignore=shutil.ignore_patterns("wandb", "*.ckpt"),
    )
    preset = load_preset("quick")
    preset.methods = ["fedavg_ft-tuned"]
    runs = report.collect(kept)
    report.write_tables("quick", preset, kept, tmp_path / "TABLES.md", runs)
    written = [
        tmp_path / "TABLES.md",
        *report.draw_figures("quick", preset, runs, tmp_path / "figures", kept),
    ]
    report.log_report("quick", preset, runs, written, cfg.wandb)
    (report_dir,) = (tmp_path / "runs" / "wandb").glob("offline-run-*")
    logged = read_written_run(report_dir)
    assert (logged["name"], logged["job_type"]) == ("report-quick", "report")
    (artifact,) = [a for a in logged["artifacts"] if a["type"] == "report"]
    assert sorted(artifact["files"]) == sorted(p.name for p in written) and any(
        p.suffix == ".png" for p in written
    )
    shown = logged["history"][0]
    assert shown["table/nrows"] == 1 and all(
        f"figures/{p.stem}/_type" in shown for p in written if p.suffix == ".png"
    )


def test_lightnings_tensor_core_advice_is_not_printed(caplog):
    """On tensor-core GPUs Lightning advises lowering the float32 matmul precision at every run;
    fedmeta makes that a config choice (fabric.matmul_precision) and drops the advice."""
    import logging

    from lightning_fabric.utilities.rank_zero import rank_zero_info

    from fedmeta.assemble import quiet_tensor_core_advice

    quiet_tensor_core_advice()  # as make_fabric does before Fabric checks the device
    with caplog.at_level(logging.INFO):
        rank_zero_info(
            "You are using a CUDA device ('H100') that has Tensor Cores: set `torch.set_float32_matmul_precision`"
        )
        rank_zero_info("another message")
    assert "Tensor Cores" not in caplog.text and "another message" in caplog.text
