"""``fedmeta bench``: every row is measured in its own process, FLOPs are counted through the
differentiable inner loops, and peak memory does not grow with the number of clients."""

import json

import pytest
import torch

from fedmeta import bench
from fedmeta.cli import main

pytestmark = pytest.mark.slow  # make test-all; make test skips it

BENCH = """
warmup_rounds: 1
rounds: 1
personalize_clients: 1
matmul_size: 256
datasets: {rmnist: [dataset=rmnist, partition=shards]}
methods: [perfedavg]
extra_rows: [[method=cafeme, variant=authors]]
clients: [sequential, vmap, static]
evaluation_methods: [perfedavg]
seed_rows: [[method=perfedavg, "seeds=[0,1]", federation.vectorize=true]]
memory:
  overrides: [dataset=rmnist, partition=iid, federation.held_out_fraction=0.34, federation.num_new_clients=4]
  num_clients: [100, 1000]
  methods: []
  extra_rows: [[method=cafeme, variant=authors]]
  rounds: 1
"""
# Each row and memory row is a process of its own (about 10 s to start on 2 cores): the recorded
# layout is measured on CAFeMe alone, memory on CAFeMe alone (its clients keep state), and a round
# has 2 clients, not the paper's 5.
CLIENTS_PER_ROUND = 2


@pytest.fixture
def small_bench(tmp_path, monkeypatch, mnist_dir):
    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    config = tmp_path / "bench.yaml"
    config.write_text(BENCH)
    return config


def test_bench_measures_every_row_and_memory_stays_flat(small_bench, tmp_path):
    out = tmp_path / "bench.json"
    result = bench.run(
        # the paper's CNN: its FLOPs are checked against the authors' count
        extra=["personalization.steps=3", f"federation.clients_per_round={CLIENTS_PER_ROUND}"],
        out=out,
        config=small_bench,
        profile=True,
        projection="paper",
    )
    assert json.loads(out.read_text()) == result
    cpu = result["peaks"]["cpu"]
    assert cpu["fp32"] > 0 and cpu["bf16"] > 0 and "tf32" not in cpu  # TF32 is a GPU's
    assert [(r["method"], r["variant"], r["clients"], r["capture"], r["seeds"]) for r in result["rows"]] == [
        ("perfedavg", "paper", "sequential", "none", 1),
        ("perfedavg", "paper", "vmap", "none", 1),
        ("perfedavg", "paper", "vmap", "static", 1),
        ("cafeme", "authors", "sequential", "none", 1),
        ("cafeme", "authors", "vmap", "none", 1),
        ("cafeme", "authors", "vmap", "static", 1),
        ("perfedavg", "paper", "vmap", "none", 2),
    ]
    assert all(
        ("evaluation_seconds" in r) == (r["method"] == "perfedavg" and r["seeds"] == 1)
        for r in result["rows"]
    )
    # each vmap row and the stacked-seed row against the sequential row of its method, and the fixed-layout
    # rows against the eager vmapped row too, all from this run
    ratios = {(s["method"], s["clients"], s["capture"], s["seeds"]): s for s in result["speedups"]}
    assert set(ratios) == {
        ("perfedavg", "vmap", "none", 1),
        ("perfedavg", "vmap", "static", 1),
        ("cafeme", "vmap", "none", 1),
        ("cafeme", "vmap", "static", 1),
        ("perfedavg", "vmap", "none", 2),
    }
    assert all(s["round"] > 0 and s["personalize"] > 0 for s in ratios.values())
    assert ratios[("perfedavg", "vmap", "none", 1)]["evaluation"] > 0
    assert (
        ratios[("cafeme", "vmap", "static", 1)]["vs_eager"] > 0
        and "vs_eager" not in ratios[("cafeme", "vmap", "none", 1)]
    )
    # the paper preset's cost on this machine, from the rows measured
    # (RMNIST only, and only Per-FedAvg of the paper's methods)
    lines = result["projection"]["lines"]
    assert any(line.startswith("rmnist-shards: ") and "not measured: cafeme" in line for line in lines)
    assert "cifar10-shards: not measured" in lines and lines[-1].startswith(
        "total of the measured settings: "
    )
    for row in result["rows"]:
        assert row["seconds_per_round"] > 0 and row["gflop_per_round"] > 0 and row["peak_rss_mb"] > 100
        assert row["gflops"] == pytest.approx(row["gflop_per_round"] / row["seconds_per_round"])
        assert row["peak_fraction"] == pytest.approx(row["gflops"] / cpu["fp32"]) and row["device"] == "cpu"
        assert row["ops_per_round"] > 100 and "launches_per_round" not in row  # a CPU launches no kernels
        # the round's losses and checks read at once, for all clients and seeds (counts are per seed)
        assert row["host_reads_per_round"] * row["seeds"] == 1
    # A CAFeMe client: 5 inner steps on 30 images + one outer step on 180, through base and modulator
    # (≈ 13–16 GFLOP a client, as counted for the authors' code). FLOPs are counted through the
    # second-order inner loops too.
    assert 10 < result["rows"][3]["gflop_per_round"] / CLIENTS_PER_ROUND < 20
    assert result["rows"][6]["gflop_per_round"] == pytest.approx(
        result["rows"][0]["gflop_per_round"], rel=0.2
    )  # per seed
    profile = result["rows"][3]["profile"]  # the convolutions are where a CAFeMe round's time goes
    assert len(profile) == bench.PROFILE_TOP and any("convolution" in op["op"] for op in profile[:3])

    memory = {m["num_clients"]: m for m in result["memory"] if m["method"] == "cafeme"}
    assert memory[1000]["samples_per_client"] == 60
    assert memory[1000]["data_mb"] == memory[100]["data_mb"]
    assert memory[1000]["peak_rss_mb"] < memory[100]["peak_rss_mb"] + 150
    assert (
        memory[1000]["clients_with_state"] == CLIENTS_PER_ROUND and memory[1000]["state_mb_per_client"] > 0
    )  # one round: its clients' Adam


def test_bench_skips_rows_whose_data_is_missing(small_bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDMETA_DATA", str(tmp_path / "nowhere"))
    monkeypatch.setenv("FEDMETA_CACHE", str(tmp_path / "cache"))
    config = tmp_path / "bench-cifar.yaml"
    config.write_text(  # one row is enough to be skipped: each row is a process of its own
        small_bench.read_text()
        .replace("rmnist: [dataset=rmnist", "cifar10: [dataset=cifar10")
        .replace("extra_rows: [[method=cafeme, variant=authors]]\nmemory", "extra_rows: []\nmemory")
        .replace("clients: [sequential, vmap, static]", "clients: [sequential]")
        .replace("evaluation_methods: [perfedavg]", "evaluation_methods: []")
        .replace('seed_rows: [[method=perfedavg, "seeds=[0,1]", federation.vectorize=true]]', "seed_rows: []")
    )
    result = bench.run(memory=False, extra=["dataset.download=false"], out=tmp_path / "b.json", config=config)
    assert result["rows"] == [] and "cifar10" in result["skipped"][0]["reason"]
    assert "skipped" in capsys.readouterr().out


def test_bench_cli_rejects_unknown_method():
    assert main(["bench", "--methods", "no_such_method", "--no-memory", "--out", "/dev/null"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
@pytest.mark.parametrize("command", [["bench", "--datasets", "rmnist"], ["train", "federation.rounds=1"]])
def test_a_gpu_this_machine_lacks_is_refused_at_once_in_one_line(command, capsys):
    assert main([*command, "fabric.accelerator=cuda"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "fabric.accelerator=cuda: this machine has no CUDA device" in said[0]


def test_a_rows_speed_up_is_over_the_sequential_row_of_its_own_partition_and_says_its_buckets():
    """Dirichlet and shards rows of one data set are different experiments: each vmapped row is set
    against the sequential row of its own partition, and a bucketed row says so."""

    def row(partition, clients, seconds, buckets=1):
        return {
            "dataset": "rmnist", "partition": partition, "method": "fedavg_ft", "variant": "paper",
            "precision": "32-true", "matmul_precision": "highest", "client_threads": 1, "lane_buckets": buckets,
            "clients": clients, "capture": "none", "seeds": 1, "seconds_per_round": seconds,
            "personalize_seconds_per_client": 1.0,
        }  # fmt: skip

    rows = [
        row("dirichlet", "sequential", 8.0),
        row("dirichlet", "vmap", 16.0),
        row("dirichlet", "vmap", 10.0, buckets=2),
        row("shards", "sequential", 6.0),
        row("shards", "vmap", 7.5),
    ]
    ratios = {(s["partition"], s["lane_buckets"]): s["round"] for s in bench.speedups(rows)}
    assert ratios == {("dirichlet", 1): 0.5, ("dirichlet", 2): 0.8, ("shards", 1): 0.8}
    assert bench._clients(rows[2]) == "vmap/2b" and bench._setting(rows[2]) == "rmnist/dirichlet"
