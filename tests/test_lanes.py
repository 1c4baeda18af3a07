"""Every lane its own: for every registered method, vmapped clients compute what one client at a
time computes, and stacked seeds what each seed run alone computes — training and the new
clients' evaluation.

A lane is one client of one federation (fedmeta.engine). Vmapped, all lanes run through the pure
functions of one algorithm object, so whatever a method's training or evaluation reads per seed
or per client must come in the lane's own state, never from that object. The federation here is
uneven on purpose (Dirichlet 0.1: clients of very different sizes, some missing classes, among
them the class of the sample that padded rows repeat), so padding and idle steps are exercised;
everything runs in float64, where the paths differ by the order of floating-point sums only:
1e-10, or 1e-8 relative where a method amplifies rounding (a fresh Adam's first step is
≈ lr·sign(g), so a gradient component within rounding of zero moves a weight either way).
The methods are read from the registry: a method added later is held to the same contract.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import yaml

from fedmeta.algorithms import ALGORITHMS, build_algorithm
from fedmeta.config import CONFIG_DIR, compose
from fedmeta.data import ImageDataset, build_federation
from fedmeta.engine import Engine
from fedmeta.rounds import Federated, evaluate_on_ranks, federated_rounds

CLIENTS, NEW, ROUNDS, PER_ROUND, SEEDS = 10, 3, 2, 4, (0, 1)
TINY = [
    "model.conv_channels=[2,3]",
    "model.dense_units=[5]",
    "wandb.mode=disabled",
    f"federation.num_clients={CLIENTS}",
    f"federation.num_new_clients={NEW}",
    "personalization.steps=3",
    "personalization.lr=0.2",
]
# a few steps of everything a method repeats, where it has the key (the keys differ by method)
SHORT = {
    "method.local_epochs": 1,
    "method.head_epochs": 1,
    "method.body_epochs": 1,
    "method.local_steps": 2,
    "method.inner_steps": 2,
    "method.local_rounds": 2,
    "method.first_epochs": 2,
    "method.test_local_steps": 1,
    "method.test_bn_steps": 1,
    "method.test_inner_steps": 1,
}


def method_file(algorithm: str) -> str:
    """The method file that runs ``algorithm``: the one of its name, else the first that names it."""
    files = sorted((CONFIG_DIR / "method").glob("*.yaml"), key=lambda f: (f.stem != algorithm, f.stem))
    for file in files:
        if ((yaml.safe_load(file.read_text()) or {}).get("method") or {}).get("algorithm") == algorithm:
            return file.stem
    raise AssertionError(f"no configs/method file runs the registered algorithm {algorithm!r}")


@functools.cache
def config(algorithm: str):
    name = method_file(algorithm)
    method = compose([f"method={name}", *TINY]).method
    return compose(
        [f"method={name}", *TINY, *(f"{key}={value}" for key, value in SHORT.items() if key[7:] in method)]
    )


@pytest.fixture(scope="module")
def federations(rmnist):
    """Each seed's federation of the first 800 RMNIST images, Dirichlet(0.1) over 10 clients (3 new),
    in float64; built once, shared by every method (a run reads them, never changes their values)."""
    data = ImageDataset(x=rmnist.x[:800], y=rmnist.y[:800], num_classes=10)
    built = {}
    for seed in SEEDS:
        federation = build_federation(  # training clients keep test splits: both protocols score
            data, {"name": "dirichlet", "alpha": 0.1}, CLIENTS, NEW, 0.25, seed=seed, test_fraction=0.25
        )
        federation.x = federation.x.double()
        built[seed] = federation
    padding_class = int(built[0].y[0])  # a padded row repeats sample 0
    sizes = [c.num_samples for c in built[0].train_clients]
    assert max(sizes) > 5 * min(sizes)  # very different sizes: padded batches and idle steps
    assert any(  # a client lacking a class, the padding rows' among them
        padding_class not in set(built[0].y[c.indices("all")].tolist()) for c in built[0].train_clients
    )
    return built


def run(algorithm: str, federations: dict, seeds: tuple[int, ...], vectorize: bool, cfg=None) -> list[dict]:
    """``seeds``' runs of ``algorithm`` together (stacked when vectorized): per seed, the round
    losses, the dropped clients, the federation state after the last round, the new clients'
    curves and the training clients' (the training-clients protocol). ``cfg``: another config of
    the method (another model, tests/test_model_kinds.py)."""
    cfg = cfg or config(algorithm)
    classes = federations[seeds[0]].num_classes
    runs = []
    for seed in seeds:
        torch.manual_seed(seed)
        runs.append(Federated(build_algorithm(cfg, classes).double(), federations[seed], seed))
    engine = Engine(
        vectorize, max_lanes=3
    )  # a round's lanes in several vmapped calls, seeds split across them
    outcomes = [federated_rounds(runs, r, PER_ROUND, engine=engine) for r in range(1, ROUNDS + 1)]
    world = SimpleNamespace(world_size=1, global_rank=0)
    results = evaluate_on_ranks(world, runs, cfg.personalization, engine, protocol="both")
    assert engine.vectorize == vectorize and engine.describe()["fallback"] is None  # vmap did not fall back
    return [
        {
            "losses": [round_[k].loss for round_ in outcomes],
            "dropped": [line for round_ in outcomes for line in round_[k].dropped],
            "state": run_.algorithm.federation_state(),
            "curves": result.curves,
            "training_curves": result.training.curves,  # with the model each method keeps for each
        }
        for k, (run_, result) in enumerate(zip(runs, results))
    ]


def assert_same(got: dict, expected: dict, what: str) -> None:
    assert got["dropped"] == expected["dropped"] == [], f"{what}: clients dropped"
    assert got["losses"] == pytest.approx(expected["losses"], rel=1e-8, abs=1e-10), f"{what}: round losses"
    assert_same_tree(got["state"], expected["state"], f"{what}: federation state")
    for curves in ("curves", "training_curves"):
        torch.testing.assert_close(
            got[curves], expected[curves], rtol=0, atol=1e-10, msg=lambda m, c=curves: f"{what}: {c}: {m}"
        )


def assert_same_tree(got, expected, where: str, exact: bool = False) -> None:
    """``got`` equals ``expected`` leaf by leaf: tensors to the tolerances below, or with ``exact``
    bit for bit and type for type."""
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_same_tree(got[key], expected[key], f"{where}[{key!r}]", exact)
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same_tree(a, b, f"{where}[{i}]", exact)
    elif exact:
        same = torch.equal(got, expected) if isinstance(expected, torch.Tensor) else got == expected
        assert type(got) is type(expected) and getattr(got, "dtype", None) == getattr(expected, "dtype", None)
        assert same, where
    elif isinstance(expected, torch.Tensor):
        # float64 to 1e-10; what a method keeps in float32 (client_state_dtype) rounds there
        tight = expected.dtype == torch.float64
        torch.testing.assert_close(
            got.double(),
            expected.double(),
            rtol=1e-8 if tight else 1.3e-6,
            atol=1e-10 if tight else 1e-8,
            msg=lambda m: f"{where}: {m}",
        )
    else:
        assert got == expected, where


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_lane_computes_what_it_computes_alone(algorithm, federations):
    """(a) A seed's clients vmapped equal them one at a time; (b) two seeds stacked and vmapped
    equal each seed run alone, one client at a time: every round's loss, every tensor of the
    federation state (model, client states, server state) and every new client's curve."""
    alone = {seed: run(algorithm, federations, (seed,), False)[0] for seed in SEEDS}
    assert not torch.equal(alone[0]["curves"], alone[1]["curves"])  # the seeds are different runs
    assert_same(run(algorithm, federations, (0,), True)[0], alone[0], "vmapped clients")
    for seed, stacked in zip(SEEDS, run(algorithm, federations, SEEDS, True)):
        assert_same(stacked, alone[seed], f"seed {seed} stacked")


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_methods_kept_state_travels_to_a_flower_node_unchanged(algorithm, federations):
    """On Flower a client's kept state waits on its node between rounds as the bytes of
    ``fedmeta.flower._to_bytes``, read back with ``torch.load(weights_only=True)``: for every
    registered method, each client's state after training reads back equal, bit for bit and type
    for type (methods that keep none pass trivially). So tests/test_flower.py's simulations need
    one method per way state travels, not every method."""
    pytest.importorskip("flwr", reason="Flower is an optional extra: pip install -e '.[flower]'")
    import io

    from fedmeta.flower import _to_bytes

    torch.manual_seed(0)
    run_ = Federated(build_algorithm(config(algorithm), 10).double(), federations[0], 0)
    for round_ in range(1, ROUNDS + 1):
        federated_rounds([run_], round_, PER_ROUND, engine=Engine(False))
    for client_id, state in run_.algorithm.client_states.items():
        back = torch.load(io.BytesIO(_to_bytes(state)), weights_only=True)
        assert_same_tree(back, state, f"{algorithm}: client {client_id}'s state", exact=True)
