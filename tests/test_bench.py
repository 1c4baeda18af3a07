"""``fedmeta bench``: every row is measured in its own process, FLOPs are counted through the
differentiable inner loops, and peak memory does not grow with the number of clients."""

import json

import pytest

from fedmeta import bench
from fedmeta.cli import main

BENCH = """
warmup_rounds: 1
rounds: 1
personalize_clients: 1
matmul_size: 256
datasets: {rmnist: [dataset=rmnist, partition=shards]}
methods: [perfedavg]
extra_rows: [[method=cafeme, variant=authors]]
memory:
  overrides: [dataset=rmnist, partition=iid, federation.held_out_fraction=0.34, federation.num_new_clients=4]
  num_clients: [100, 1000]
  methods: [perfedavg]
  extra_rows: [[method=cafeme, variant=authors]]
  rounds: 1
"""


@pytest.fixture
def small_bench(tmp_path, monkeypatch, mnist_dir):
    monkeypatch.setenv("FEDMETA_DATA", str(mnist_dir))
    config = tmp_path / "bench.yaml"
    config.write_text(BENCH)
    return config


def test_bench_measures_every_row_and_memory_stays_flat(small_bench, tmp_path):
    out = tmp_path / "bench.json"
    result = bench.run(extra=["personalization.steps=3"], out=out, config=small_bench, profile=True)
    assert json.loads(out.read_text()) == result
    assert result["peak_gflops"] > 0 and result["peak_gflops_bf16"] > 0
    assert [(r["method"], r["variant"]) for r in result["rows"]] == [("perfedavg", "paper"), ("cafeme", "authors")]
    for row in result["rows"]:
        assert row["seconds_per_round"] > 0 and row["gflop_per_round"] > 0 and row["peak_rss_mb"] > 100
        assert row["gflops"] == pytest.approx(row["gflop_per_round"] / row["seconds_per_round"])
    # A CAFeMe client: 5 inner steps on 30 images + one outer step on 180, through base and modulator
    # (≈ 13–16 GFLOP a client, SPEC §2). FLOPs are counted through the second-order inner loops too.
    assert 50 < result["rows"][1]["gflop_per_round"] < 100
    profile = result["rows"][1]["profile"]  # the convolutions are where a CAFeMe round's time goes
    assert len(profile) == bench.PROFILE_TOP and any("convolution" in op["op"] for op in profile[:3])

    memory = {(m["method"], m["num_clients"]): m for m in result["memory"]}
    assert memory[("perfedavg", 1000)]["samples_per_client"] == 60
    assert memory[("perfedavg", 1000)]["data_mb"] == memory[("perfedavg", 100)]["data_mb"]
    assert memory[("perfedavg", 1000)]["peak_rss_mb"] < memory[("perfedavg", 100)]["peak_rss_mb"] + 150
    authors = memory[("cafeme", 1000)]
    assert authors["clients_with_state"] == 5 and authors["state_mb_per_client"] > 0  # one round: 5 clients' Adam


def test_bench_skips_rows_whose_data_is_missing(small_bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDMETA_DATA", str(tmp_path / "nowhere"))
    monkeypatch.setenv("FEDMETA_CACHE", str(tmp_path / "cache"))
    config = tmp_path / "bench-cifar.yaml"
    config.write_text(small_bench.read_text().replace("rmnist: [dataset=rmnist", "cifar10: [dataset=cifar10")
                      .replace("extra_rows: [[method=cafeme, variant=authors]]\nmemory", "extra_rows: []\nmemory"))
    result = bench.run(memory=False, extra=["dataset.download=false"], out=tmp_path / "b.json", config=config)
    assert result["rows"] == [] and "cifar10" in result["skipped"][0]["reason"]
    assert "skipped" in capsys.readouterr().out


def test_bench_cli_rejects_unknown_method():
    assert main(["bench", "--methods", "fedprox", "--no-memory", "--out", "/dev/null"]) == 2
