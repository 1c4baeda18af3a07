"""Recorded rounds (federation.capture): the fixed layout they replay, the index batches gathered on
the device, the choice of engine per device, and the fallback to eager. The recordings themselves
(CUDA graphs, on a GPU) are compared with the eager path at the end, on a GPU only."""

import json
import logging

import pytest
import torch
from test_vectorize import FAST, SMALL

from fedmeta.assemble import make_engine, make_fabric
from fedmeta.capture import Capture, resolve
from fedmeta.config import compose
from fedmeta.data import Batch, ImageDataset, build_federation
from fedmeta.engine import DataBank, Engine, layout_of, merge_layouts, pad_to, to_device
from fedmeta.fastest import hardware_name, vmap_measured_faster
from fedmeta.rounds import Federated, evaluate_on_ranks, federated_round


def index_batch(n, lanes=2):
    return Batch(torch.arange(n).repeat(lanes, 1), torch.arange(n).repeat(lanes, 1))


def test_the_layout_only_grows_and_pads_every_round_to_it():
    first = {"steps": [index_batch(5), index_batch(5)], "outer": index_batch(4)}
    second = {"steps": [index_batch(3), index_batch(5), index_batch(5)], "outer": index_batch(4)}
    layout = merge_layouts(merge_layouts(None, layout_of(first)), layout_of(second))
    assert layout == {
        "steps": [("batch", 5, True, False), ("batch", 5, False, False), ("batch", 5, True, True)],
        "outer": ("batch", 4, False, False),
    }  # equal sizes stay unmasked: the same kernels as before
    for tree in (first, second):
        padded = pad_to(tree, layout)
        assert layout_of(padded) == layout  # every round the same shapes: one recording serves them all
    padded = pad_to(first, layout)
    assert padded["steps"][2].active.tolist() == [
        False,
        False,
    ]  # a step the first round did not have: idled through
    assert padded["steps"][0].mask.all()  # the first round's full batches, masked as the layout asks
    short = pad_to(second, layout)["steps"][0]
    assert short.x.shape == (2, 5) and short.mask.sum(1).tolist() == [3, 3]


def test_client_draws_as_indices_gather_the_same_batches(rmnist):
    data = ImageDataset(x=rmnist.x[:600], y=rmnist.y[:600], num_classes=10)
    federation = build_federation(data, {"name": "dirichlet", "alpha": 0.5}, 6, 2, 0.25, seed=0)
    client = federation.train_clients[0]
    drawn = client.epoch("pers", 8, client.generator(1))
    indexed = client.indexed().epoch("pers", 8, client.generator(1))
    assert [b.x.dtype for b in indexed] == [torch.int64] * len(indexed)
    for batch, gathered in zip(drawn, federation.gather(indexed)):
        assert torch.equal(batch.x, gathered.x) and torch.equal(batch.y, gathered.y)


def test_stacked_seeds_share_one_data_bank(rmnist):
    data = ImageDataset(x=rmnist.x[:600], y=rmnist.y[:600], num_classes=10)
    federations = [
        build_federation(data, {"name": "shards", "shards_per_client": 2}, 6, 2, 0.25, seed=s) for s in (0, 1)
    ]
    federations[1].x = federations[1].x.flip(
        0
    )  # another seed's data set (RMNIST's rotations depend on the seed)
    expected = [f.x[[3, 7]] for f in federations]
    bank = DataBank(federations)
    assert (
        federations[1].x.data_ptr() == bank.x[1].data_ptr()
    )  # the federations' tensors now live in the bank
    picked = bank.gather({"b": Batch(torch.tensor([[3, 7], [3, 7]]), None)}, torch.tensor([0, 1]))["b"]
    assert (
        torch.equal(picked.x[0], expected[0]) and torch.equal(picked.x[1], expected[1]) and picked.y is None
    )


def test_host_tensors_move_in_one_copy_per_dtype():
    tree = {
        "a": [index_batch(3)],
        "b": Batch(torch.ones(2, 4, dtype=torch.long), None, torch.ones(2, 4, dtype=torch.bool)),
    }
    assert to_device(tree, torch.device("cpu"))["b"].x is tree["b"].x  # already there: nothing copied
    meta = to_device(tree, torch.device("meta"))  # a device without data: shapes and dtypes only
    assert meta["a"][0].x.shape == (2, 3) and meta["b"].mask.dtype == torch.bool and meta["b"].y is None


def test_auto_engine_vmaps_and_records_on_a_gpu_and_not_on_a_cpu():
    cfg = compose(["wandb.mode=disabled"])
    assert (
        cfg.fabric.accelerator == "auto"
        and cfg.federation.vectorize == "auto"
        and cfg.federation.capture == "auto"
    )
    assert resolve("auto", "auto", torch.device("cpu")) == (False, "none")
    assert resolve("auto", "auto", torch.device("cuda")) == (True, "graph")
    assert resolve(True, "auto", torch.device("cpu")) == (True, "none")
    assert resolve(False, "auto", torch.device("cuda")) == (False, "none")
    engine = make_engine(
        compose(["federation.vectorize=true", "federation.capture=static"]), torch.device("cpu")
    )
    assert engine.vectorize and engine.capture.pads and engine.label() == "clients vmapped, fixed layout"
    with pytest.raises(Exception, match="needs a CUDA device"):
        make_engine(compose(["federation.capture=graph"]), torch.device("cpu"))


def test_two_cpu_generations_sold_under_one_name_are_told_apart(tmp_path, monkeypatch):
    """A virtual machine's CPU name is often the vendor's line only; the family and model numbers
    and torch's instruction set tell generations apart, so their timings and runs are not mixed."""
    import fedmeta.fastest

    def name(cpuinfo: str) -> str:
        path = tmp_path / "cpuinfo"
        path.write_text(cpuinfo)
        monkeypatch.setattr(fedmeta.fastest, "CPUINFO", path)
        return hardware_name(torch.device("cpu"))

    processor = "processor\t: {}\nmodel name\t: AMD EPYC\ncpu family\t: {}\nmodel\t\t: {}\n\n"
    zen4 = name(processor.format(0, 25, 17) + processor.format(1, 25, 17))
    zen5 = name(processor.format(0, 26, 2))
    capability = torch.backends.cpu.get_cpu_capability()
    threads = torch.get_num_threads()
    assert zen4 == f"AMD EPYC (family 25 model 17, {capability}), {threads} thread(s)"
    assert zen5 == f"AMD EPYC (family 26 model 2, {capability}), {threads} thread(s)"
    monkeypatch.setattr(fedmeta.fastest, "CPUINFO", tmp_path / "absent")
    assert hardware_name(torch.device("cpu")).endswith(f"({capability}), {threads} thread(s)")


def test_auto_on_a_cpu_takes_the_way_the_bench_measured_faster_on_this_cpu(tmp_path):
    cpu = torch.device("cpu")
    cfg = compose(["method=fedavg", "wandb.mode=disabled"])
    here = hardware_name(cpu)

    def row(clients, seconds, hardware=here, method="fedavg", **extra):
        return {
            "dataset": "rmnist",
            "method": method,
            "variant": "paper",
            "precision": "32-true",
            "client_threads": 1,
            "seeds": 1,
            "clients": clients,
            "seconds_per_round": seconds,
            "hardware": hardware,
            **extra,
        }

    def measured(*rows, config=cfg):
        path = tmp_path / "bench.json"
        path.write_text(json.dumps({"rows": list(rows)}))
        return vmap_measured_faster(config, cpu, path)

    assert measured(row("sequential", 5.0), row("vmap", 4.0)) is True
    assert measured(row("sequential", 5.0), row("vmap", 6.0)) is False
    # measured elsewhere, for another method, one way only, or vmap that fell back: not a measurement here
    assert measured(row("sequential", 5.0), row("vmap", 4.0, hardware="another CPU, 2 thread(s)")) is None
    assert measured(row("sequential", 5.0, method="ditto"), row("vmap", 4.0, method="ditto")) is None
    assert measured(row("vmap", 4.0)) is None
    assert measured(row("sequential", 5.0), row("vmap", 4.0, fallback="vmap failed")) is None
    # a config that chose its way, and a file that is not the bench's, leave the choice alone
    assert (
        measured(row("sequential", 5.0), row("vmap", 4.0), config=compose(["federation.vectorize=false"]))
        is None
    )
    (tmp_path / "bench.json").write_text("[not the bench's")
    assert vmap_measured_faster(cfg, cpu, tmp_path / "bench.json") is None
    assert resolve("auto", "auto", cpu, True) == (True, "none")
    assert resolve(False, "auto", cpu, True) == (False, "none")


def test_a_computation_that_cannot_be_recorded_runs_eagerly_with_one_notice(caplog):
    capture = Capture("graph")  # CUDA graphs of CPU tensors: the recorder refuses
    with caplog.at_level(logging.WARNING, logger="fedmeta"):
        results = [capture.run(("k",), lambda x: x * 2, (torch.ones(3),)) for _ in range(3)]
    assert all(torch.equal(r, torch.full((3,), 2.0)) for r in results)
    assert capture.failed and not capture.records and (capture.eager, capture.replayed) == (3, 0)
    assert len([r for r in caplog.records if "could not be recorded" in r.message]) == 1


def test_a_run_records_what_ran_in_its_summary(tmp_path, mnist_dir):
    from fedmeta.loop import train

    summary = train(
        compose(
            [
                *SMALL,
                f"dataset.dir={mnist_dir}",
                "federation.rounds=2",
                "federation.eval_every=2",
                "federation.num_new_clients=4",
                "federation.vectorize=true",
                "federation.capture=static",
                "method=fedavg_ft",
                "method.local_epochs=1",
                f"output.root={tmp_path}",
            ]
        ),
        show_progress=False,
    )
    assert summary["vectorized"] is True and summary["capture"] == "static" and summary["fallback"] is None
    assert summary["device"] == "cpu"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@cuda
@pytest.mark.parametrize("method", sorted(FAST))
def test_recorded_rounds_equal_eager_rounds_on_the_gpu(method, rmnist):
    """Three recorded rounds and one recorded evaluation against the same vmapped computation run
    eagerly, in float64 on the card (the tolerances of test_vectorize)."""
    name, *variant = method.split()
    cfg = compose([f"method={name}", *variant, *SMALL, *FAST[method], "fabric.accelerator=cuda"])
    fabric = make_fabric(cfg)
    data = ImageDataset(x=rmnist.x[:2400], y=rmnist.y[:2400], num_classes=10)
    results = []
    for capture in ("none", "graph"):
        federation = build_federation(
            data, {"name": "dirichlet", "alpha": 0.5}, 12, 4, 0.25, seed=0, device=fabric.device
        )
        federation.x = federation.x.double()
        fabric.seed_everything(0, verbose=False)
        from fedmeta.algorithms import build_algorithm

        algorithm = build_algorithm(cfg, 10).double().to(fabric.device)
        engine = Engine(True, capture=capture)
        losses = [federated_round(algorithm, federation, r, 4, seed=0, engine=engine).loss for r in (1, 2, 3)]
        curves = evaluate_on_ranks(
            fabric, [Federated(algorithm, federation, 0)], cfg.personalization, engine
        )[0].curves
        assert engine.describe()["fallback"] is None, engine.describe()
        if capture == "graph":  # every round and evaluation replayed a recording
            assert engine.describe()["calls_eager"] == 0 and engine.describe()["calls_replayed"] >= 4
        results.append((algorithm.global_params(), losses, curves))
    (eager_params, eager_losses, eager_curves), (params, losses, curves) = results
    for key in eager_params:
        torch.testing.assert_close(params[key], eager_params[key], rtol=1e-8, atol=1e-10)
    assert losses == pytest.approx(eager_losses, rel=1e-8)
    assert torch.equal(curves, eager_curves)
