"""federation.vectorize and stacked seeds compute what one client, and one seed, at a time compute.

The equivalence tests run in float64 on clients of different sizes (a Dirichlet partition), so
they exercise the padding: batches padded to the largest lane with a sample mask, and lanes with
fewer batches idling through the others' extra steps. In float64 the two paths agree to ~1e-10;
what remains is the order of floating-point sums (a grouped convolution over the stacked clients
against one convolution per client). In float32 the same rounding differences are amplified where
an algorithm amplifies noise — a fresh Adam's first step is ≈ β·sign(g), so a gradient component
within rounding of zero moves a weight by up to 2β either way; Per-FedAvg's finite differences
divide by 2δ = 0.002 — which is why the float32 end-to-end test compares accuracy curves, not weights.
"""

import csv
import logging
import re
from types import SimpleNamespace

import pytest
import torch

from fedmeta.algorithms import FedAvg, build_algorithm
from fedmeta.assemble import make_fabric
from fedmeta.config import compose
from fedmeta.data import Batch, ImageDataset, build_federation
from fedmeta.data.federation import Steps
from fedmeta.engine import Engine, stack
from fedmeta.loop import train
from fedmeta.rounds import Federated, evaluate_on_ranks, federated_round

SMALL = [
    "model.conv_channels=[8,16]",
    "model.dense_units=[32]",
    "wandb.mode=disabled",
    "personalization.steps=4",
    "personalization.lr=0.05",
]
FAST = {
    "fedavg": ["method.local_epochs=1", "method.local_lr=0.05"],
    "fedavg_ft": ["method.local_epochs=1", "method.local_lr=0.05"],
    "ifca": ["method.local_epochs=1"],
    "ifca_ft": ["method.local_epochs=1"],
    "ditto": ["method.local_epochs=1"],
    "fedrep": ["method.head_epochs=1"],
    "perfedavg": ["method.local_steps=2"],
    "perfedavg method.hessian=exact": ["method.local_steps=2"],  # forward-over-reverse under vmap
    "fedmeta_maml": ["method.inner_steps=2"],
    "fedmeta_metasgd": ["method.inner_steps=2"],  # the learned rates, and new clients' steps at them
    "fedper": ["method.local_epochs=1", "method.local_optimizer=adam_kept"],  # + a kept Adam
    "lgfedavg": ["method.local_epochs=1", "method.test_local_steps=2"],
    "fedbabu": ["method.local_epochs=1"],
    "fedbn": ["method.local_epochs=1", "method.test_bn_steps=2"],
    "fedprox": ["method.local_epochs=1", "method.local_lr=0.05"],
    "scaffold": ["method.local_epochs=1", "method.local_lr=0.05"],  # c and each client's c_i after 3 rounds
    "feddyn": ["method.local_epochs=1", "method.local_lr=0.05", "method.alpha=0.1"],  # h and each ∇L_k
    "fedproto": ["method.local_epochs=1", "method.local_lr=0.05"],  # each client's model, the prototypes
    "fedrod": ["method.local_epochs=1", "method.local_lr=0.05"],  # each client's personalized head
    "fedpac": ["method.local_epochs=1", "method.local_lr=0.05"],  # the server's heads, the centroids
    "fedala": [
        "method.local_epochs=1",
        "method.local_lr=0.05",
        "method.first_epochs=2",
    ],  # windows of 0, 1, 2 epochs
    "local": [],
    "cafeme": [
        "method.inner_steps=2",
        "model.modulator.before_mean=[8,16]",
        "model.modulator.after_mean=[16]",
    ],
    "cafeme variant=authors": [],
    "ditto variant=authors": [],
    "fedrep variant=authors": ["method.head_batches=2"],
    "perfedavg variant=authors": ["method.local_steps=2"],
    "pfedme": [
        "method.local_rounds=3",
        "method.inner_steps=2",
        "method.beta=2.0",
    ],  # β ≠ 1: the mixing aggregate
    "apfl": ["method.local_epochs=1", "method.local_lr=0.05"],  # each client's v and α kept
    "apfl method.mixing=outputs": ["method.local_epochs=1", "method.local_lr=0.05"],
    "moon": ["method.local_epochs=1", "method.local_lr=0.05"],  # each client's previous model, float16
    "fednova": ["method.local_epochs=1", "method.local_lr=0.05"],  # each client's steps, idle not counted
    "fedfomo": ["method.local_epochs=1", "method.local_lr=0.05", "method.models=2"],  # kept models, P
    "fedamp": ["method.local_epochs=1", "method.local_lr=0.05"],  # each client's cloud model
    "fedgh": ["method.local_epochs=1", "method.local_lr=0.05"],  # each client's extractor, the trained header
    "feddbe": ["method.local_epochs=1", "method.local_lr=0.05"],  # each client's PRBM, the global mean
    "gpfl": ["method.local_epochs=1", "method.local_lr=0.05"],  # each client's head and label shares
    "fedcp": ["method.local_epochs=1", "method.local_lr=0.05"],  # the policy's noise, each personalized head
    "pfedhn": ["method.local_epochs=1", "method.local_lr=0.05"],  # the server's network, a step per client
}


@pytest.fixture(scope="module")
def images(rmnist):
    """2,400 RMNIST images: Dirichlet(0.5) over 12 clients gives them 38 to 500 images, shards 200 each."""
    keep = torch.arange(2400)
    data = ImageDataset(x=rmnist.x[keep], y=rmnist.y[keep], num_classes=10)
    return data


DIRICHLET = {"name": "dirichlet", "alpha": 0.5}  # clients of many sizes
SHARDS = {"name": "shards", "shards_per_client": 2}  # 12 clients of 200 images


def paths(method: str, data: ImageDataset, partition: dict = DIRICHLET):
    """The same algorithm and federation twice, in float64: for the sequential and the vectorized engine."""
    name, *variant = method.split()
    cfg = compose([f"method={name}", *variant, *SMALL, *FAST[method]])
    fabric = make_fabric(cfg)
    built = []
    for _ in range(2):
        federation = build_federation(data, partition, 12, 4, 0.25, seed=0)
        federation.x = federation.x.double()
        fabric.seed_everything(0, verbose=False)
        algorithm = build_algorithm(cfg, 10).double()
        built.append((algorithm, federation))
    return fabric, cfg, built


BEFORE_BATCH_NORM = re.compile(r"(features\.blocks|dense)\.\d+\.0\.bias$")  # a conv's or dense layer's bias


# Eager vmapped lanes (capture=none) of each registered method's own config are held to one client
# at a time by tests/test_lanes.py; here only the configs it does not run: variants and options.
EAGER_ONLY_HERE = [
    "perfedavg method.hessian=exact",
    "fedmeta_metasgd",
    "fedper",
    "pfedme",
    "apfl method.mixing=outputs",
    *(name for name in FAST if "variant=" in name),
]


@pytest.mark.parametrize(
    "method, capture",
    [  # static (quick: it reaches more code) for every config; none for those test_lanes.py lacks
        *((method, "static") for method in sorted(FAST)),
        *(pytest.param(method, "none", marks=pytest.mark.slow) for method in sorted(EAGER_ONLY_HERE)),
    ],
)
def test_vectorized_rounds_and_evaluation_equal_sequential(method, capture, images):
    """Vmapped (``none``), and vmapped on the fixed layout a recorded round replays (``static``: every
    round padded to the largest batches and the most steps seen, the data gathered on the device
    from stacked indices), compute what one client at a time computes."""
    fabric, cfg, built = paths(method, images)
    sizes = {c.num_samples for c in built[0][1].train_clients}
    assert len(sizes) > 5  # clients of many sizes: padded batches and idle steps are exercised
    assert_vectorized_equals_sequential(fabric, cfg, built, capture)


@pytest.mark.parametrize("method, capture", [("fedavg_ft", "none"), ("cafeme", "static")])
def test_clients_bucketed_by_size_compute_what_one_at_a_time_computes(method, capture, images):
    """``lane_buckets``: a round's clients sorted by size into vmapped calls of similar clients, each
    padded only to its own largest, give what one client at a time gives, their results in lane order."""
    fabric, cfg, built = paths(method, images)
    assert_vectorized_equals_sequential(fabric, cfg, built, capture, lane_buckets=2)


def test_buckets_group_clients_of_similar_size_and_keep_each_lanes_place():
    sizes = [500, 38, 260, 41, 120]
    lanes = [(None, SimpleNamespace(num_samples=n)) for n in sizes]
    assert Engine(True)._chunks(lanes) == [(0, [0, 1, 2, 3, 4])]  # one call, as before
    assert Engine(True, lane_buckets=2)._chunks(lanes) == [(0, [1, 3, 4]), (1, [2, 0])]
    assert Engine(True, max_lanes=2, lane_buckets=2)._chunks(lanes) == [(0, [1, 3]), (0, [4]), (1, [2, 0])]
    assert Engine(True, lane_buckets=9)._chunks(lanes) == [(b, [i]) for b, i in enumerate([1, 3, 4, 2, 0])]
    results = Engine(True, lane_buckets=2)._in_chunks(
        lambda chunk, _: [c.num_samples for _, c in chunk], lanes
    )
    assert results == sizes


@pytest.mark.parametrize(
    "method",
    [  # quick: one representative of each draw (epochs; independent batches); CI runs the others
        "fedavg_ft",
        "perfedavg",
        pytest.param("cafeme", marks=pytest.mark.slow),
        pytest.param("fedrep", marks=pytest.mark.slow),
    ],
)
def test_clients_of_one_size_are_stacked_as_steps_and_compute_what_one_at_a_time_computes(method, images):
    """Clients of one size (shards) draw steps of the same sizes: the engine stacks their ``Steps``
    whole (two operations, one gather) instead of batch by batch — epochs (FedAvg-FT), two sets of
    epochs (FedRep), independent batches (CAFeMe's inner steps, Per-FedAvg's three a step)."""
    fabric, cfg, built = paths(method, images, SHARDS)
    algorithm, federation = built[1]
    assert len({c.num_samples for c in federation.train_clients}) == 1
    clients = federation.train_clients[:3]
    stacked = stack([algorithm.draw(c.indexed(), 1) for c in clients])
    assert any(isinstance(value, Steps) for value in stacked.values())  # the whole-steps path is taken
    assert_vectorized_equals_sequential(fabric, cfg, built, "static")


def assert_vectorized_equals_sequential(fabric, cfg, built, capture: str, lane_buckets: int = 1) -> None:
    """Three rounds and an evaluation, one client at a time and vmapped: the same parameters, losses,
    curves and kept states, in float64."""
    results = []
    for (algorithm, federation), vectorize in zip(built, (False, True)):
        # the 4 clients of a round in two vmapped calls: cut at 3, or two buckets of sizes
        engine = Engine(
            vectorize, max_lanes=3 if lane_buckets == 1 else 0, capture=capture, lane_buckets=lane_buckets
        )
        losses = [federated_round(algorithm, federation, r, 4, seed=0, engine=engine).loss for r in (1, 2, 3)]
        curves = evaluate_on_ranks(
            fabric, [Federated(algorithm, federation, 0)], cfg.personalization, engine
        )[0].curves
        assert (
            engine.vectorize == vectorize and engine.describe()["fallback"] is None
        )  # vmap did not fall back
        results.append((algorithm.global_params(), losses, curves, algorithm.client_states))
    (seq_params, seq_losses, seq_curves, seq_states), (vec_params, vec_losses, vec_curves, vec_states) = (
        results
    )
    for name in seq_params:
        # A bias right before a batch norm has a gradient of zero up to rounding (the normalization
        # removes any shift): under Adam, whose steps are lr·g/(|g| + ε) for such a g, that rounding
        # is its whole update, and it differs between the paths (1e-11 to 2e-9; every other
        # parameter agrees to 1e-15).
        atol = 1e-8 if BEFORE_BATCH_NORM.search(name) else 1e-10
        torch.testing.assert_close(vec_params[name], seq_params[name], rtol=1e-8, atol=atol)
    assert vec_losses == pytest.approx(seq_losses, rel=1e-8)
    assert torch.equal(vec_curves, seq_curves)  # float64: not a single held-out prediction differs
    assert not torch.equal(seq_curves[:, -1], seq_curves[:, 0])  # personalization moved the accuracies
    assert seq_states.keys() == vec_states.keys()  # FedRep heads / the authors' Adam moments, per client
    for client_id, state in seq_states.items():
        for seq, vec in zip(_leaves(state), _leaves(vec_states[client_id])):
            # states kept in float32 (client_state_dtype) round there: a last-bit flip is not a difference
            tight = seq.dtype == torch.float64
            torch.testing.assert_close(
                vec.double(), seq.double(), rtol=1e-8 if tight else 1.3e-6, atol=1e-10 if tight else 1e-8
            )


def _leaves(tree):
    if isinstance(tree, dict):
        return [leaf for key in sorted(tree) for leaf in _leaves(tree[key])]
    return [torch.as_tensor(tree)]  # tensors, and the count of batches a client's iterator has read


def test_stacking_pads_batches_with_a_mask_and_idles_short_lanes():
    def batch(n):
        return Batch(torch.ones(n, 1, 2, 2), torch.ones(n, dtype=torch.long))

    stacked = stack([{"epochs": [batch(5), batch(3)]}, {"epochs": [batch(4), batch(4), batch(2)]}])["epochs"]
    assert len(stacked) == 3 and stacked[0].x.shape == (2, 5, 1, 2, 2)
    assert stacked[0].mask.tolist() == [[True] * 5, [True] * 4 + [False]]
    assert stacked[1].active is None and stacked[1].mask.sum(1).tolist() == [3, 4]
    assert stacked[2].active.tolist() == [False, True]  # lane 0 has no third step: it idles through it
    assert (
        stack([{"b": batch(3)}, {"b": batch(3)}])["b"].mask is None
    )  # equal sizes: no mask, no masked kernels
    (idle,) = stack([{"e": []}, {"e": [batch(3)]}])["e"]  # a lane with no steps at all (FedALA's first round)
    assert idle.active.tolist() == [False, True]


def test_lanes_steps_of_equal_sizes_stack_step_by_step_and_others_as_padded_batches():
    first, second = torch.arange(6), torch.arange(6, 12)
    stacked = stack([Steps(first, first, (4, 2)), Steps(second, second, (4, 2))])
    assert isinstance(stacked, Steps) and stacked.y is stacked.x  # index batches: labels stacked once
    assert [b.x.tolist() for b in stacked] == [[[0, 1, 2, 3], [6, 7, 8, 9]], [[4, 5], [10, 11]]]
    assert stacked.lane.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1]  # whose each sample is
    assert all(b.x.is_contiguous() for b in stacked)  # a step's batch is a block, not a strided view
    ragged = stack([Steps(first, first, (4, 2)), Steps(second, second, (3, 3))])
    assert isinstance(ragged, list) and ragged[0].mask.tolist() == [[True] * 4, [True] * 3 + [False]]
    assert stack([{"e": Steps(first[:0], first[:0], ())}] * 2) == {"e": []}  # no steps at all


def test_a_method_vmap_cannot_run_falls_back_with_one_notice(images, monkeypatch, caplog):
    fabric, cfg, built = paths("fedavg_ft", images)
    honest = FedAvg.local_update

    def data_dependent(self, params, state, data):
        result = honest(self, params, state, data)
        float(result.loss)  # reading a value inside the update: vmap refuses it
        return result

    monkeypatch.setattr(FedAvg, "local_update", data_dependent)
    algorithm, federation = built[0]
    engine = Engine(True)
    with caplog.at_level(logging.WARNING, logger="fedmeta"):
        for r in (1, 2):
            outcome = federated_round(algorithm, federation, r, 4, seed=0, engine=engine)
    assert not outcome.dropped and not engine.vectorize
    assert (
        engine.describe()["vectorized"] is False and "could not be vmapped" in engine.describe()["fallback"]
    )
    notices = [r.message for r in caplog.records if "could not be vmapped" in r.message]
    assert len(notices) == 1 and "one at a time" in notices[0]


def test_out_of_memory_halves_the_lanes_per_call_and_keeps_vmapping(images, monkeypatch, caplog):
    fabric, cfg, built = paths("fedavg_ft", images)
    expected = [federated_round(*built[0], r, 4, seed=0, engine=Engine()).loss for r in (1, 2)]
    honest, sizes = Engine._vectorized_updates, []

    def small_memory(self, lanes, round_, bucket=0):  # a card that holds 2 lanes' activations, not 4
        sizes.append(len(lanes))
        if len(lanes) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return honest(self, lanes, round_, bucket)

    monkeypatch.setattr(Engine, "_vectorized_updates", small_memory)
    engine = Engine(True)
    with caplog.at_level(logging.WARNING, logger="fedmeta"):
        losses = [federated_round(*built[1], r, 4, seed=0, engine=engine).loss for r in (1, 2)]
    assert engine.vectorize and engine.max_lanes == 2 and sizes == [4, 2, 2, 2, 2]
    assert losses == pytest.approx(expected, rel=1e-8)  # the failed call left nothing behind
    assert [r.message for r in caplog.records if "did not fit" in r.message] == [
        "federation.vectorize_lanes: 4 lanes did not fit in memory; now 2 per vmapped call"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["cafeme variant=authors", "fedavg_ft"])
def test_stacked_seeds_are_the_seeds_run_alone(method, tmp_path, mnist_dir):
    """seeds=[0,1] in one process writes the two run folders that the two seeds' own runs write:
    the same numbers as each seed run alone through the same vectorized engine, and — float32
    rounding apart (see the top of this file) — as each seed run sequentially."""
    name, *variant = method.split()
    common = [
        f"method={name}",
        *variant,
        *SMALL,
        *FAST[method],
        f"dataset.dir={mnist_dir}",
        "federation.rounds=2",
        "federation.eval_every=1",
        "federation.num_new_clients=5",
        "personalization.lr=0.01",
    ]
    stacked = train(
        compose([*common, f"output.root={tmp_path / 'stacked'}", "seeds=[0,1]", "federation.vectorize=true"]),
        show_progress=False,
    )
    assert [s["seed"] for s in stacked] == [0, 1] and all(
        s["seeds_stacked"] == 2 and s["vectorized"] for s in stacked
    )
    alone = [
        train(
            compose(
                [*common, f"output.root={tmp_path / 'alone'}", f"seed={seed}", "federation.vectorize=true"]
            ),
            show_progress=False,
        )
        for seed in (0, 1)
    ]
    sequential = [
        train(
            compose([*common, f"output.root={tmp_path / 'sequential'}", f"seed={seed}"]), show_progress=False
        )
        for seed in (0, 1)
    ]
    for one, together, one_by_one in zip(alone, stacked, sequential):
        assert together["curve"] == pytest.approx(one["curve"], abs=0.02)
        assert together["curve"] == pytest.approx(one_by_one["curve"], abs=0.05)
        run = f"rmnist-shards/{name}{'-authors' if variant else ''}/seed{one['seed']}"
        rows = [
            list(csv.DictReader(open(tmp_path / root / run / "metrics.csv")))
            for root in ("sequential", "stacked")
        ]
        assert [r["round"] for r in rows[0]] == [r["round"] for r in rows[1]] == ["1", "2"]
        for a, b in zip(*rows):
            assert float(b["train_loss"]) == pytest.approx(float(a["train_loss"]), rel=1e-2)
        assert (tmp_path / "stacked" / run / "checkpoint.ckpt").exists()
    assert alone[0]["curve"] != alone[1]["curve"]  # the seeds are different federations


@pytest.mark.parametrize("method", ["fedavg_ft", pytest.param("cafeme", marks=pytest.mark.slow)])
def test_a_round_reads_computed_values_once_however_many_clients_and_seeds(method, images):
    """The round's losses and finiteness checks are reduced on the device and read by the host once
    (HostReads: each such read is a sync on a GPU), not once per client or seed."""
    from fedmeta.bench import HostReads
    from fedmeta.rounds import federated_rounds

    name, *variant = method.split()
    cfg = compose([f"method={name}", *variant, *SMALL, *FAST[method]])
    make_fabric(cfg).seed_everything(0, verbose=False)
    reads = {}
    for clients, seeds in ((2, 1), (4, 3)):
        runs = [
            Federated(
                build_algorithm(cfg, 10),
                build_federation(images, {"name": "dirichlet", "alpha": 0.5}, 12, 4, 0.25, seed=seed),
                seed,
            )
            for seed in range(seeds)
        ]
        engine = Engine(True)
        federated_rounds(runs, 1, clients, engine=engine)
        with HostReads() as counted:
            outcomes = federated_rounds(runs, 2, clients, engine=engine)
        assert all(o.error is None and o.loss > 0 for o in outcomes)
        reads[clients, seeds] = counted.count
    assert reads == {(2, 1): 1, (4, 3): 1}
