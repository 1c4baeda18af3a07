"""docs/extending.md, followed to the letter: every code block is written into the file its header
names in a copy of the package, the guide's commands run against that copy, and the new method
learns on the new data set and partition."""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "extending.md"
REGISTRY = re.compile(r"^[A-Z_]+(: [^=]+)? = \{$", re.M)  # ALGORITHMS: dict[...] = {, BUILDERS = {
ENTRY = re.compile(r'^\s+"\w+": \w+,$')


def guide_blocks() -> list[tuple[str, bool, str]]:
    """(path, adds to an existing file, code) for every block whose header names a file."""
    blocks = re.findall(r"```(?:python|yaml) (\S+)( \+)?\n(.*?)```", GUIDE.read_text(), re.S)
    return [(path, bool(plus), code) for path, plus, code in blocks]


def add_to(path: Path, code: str) -> None:
    """The guide's rule for `path +` blocks: imports beside the file's imports, `"name": f,` lines
    into its registry, anything else just above the registry."""
    text = path.read_text()
    (registry,) = REGISTRY.finditer(text)  # one registry per file, or the rule is ambiguous
    lines = code.rstrip("\n").splitlines()
    imports = [line for line in lines if re.match(r"(from \S+ )?import ", line)]
    entries = [line for line in lines if ENTRY.match(line)]
    body = "\n".join(line for line in lines if line not in imports and line not in entries).strip("\n")
    head, tail = text[: registry.start()], text[registry.end() :]
    text = head + (body + "\n\n\n" if body else "") + registry.group(0) + "\n" + "\n".join(entries) + tail
    for line in imports:  # in order among the file's own fedmeta imports, as ruff's isort wants them
        module = line.split()[1]
        after = [m for m in re.finditer(r"^from (fedmeta\S*) import .*$", text, re.M) if m.group(1) > module]
        at = (
            after[0].start()
            if after
            else list(re.finditer(r"^(from \S+ )?import .*$", text, re.M))[-1].end() + 1
        )
        text = text[:at] + line + "\n" + text[at:]
    path.write_text(text)


def kmnist_like(path: Path, seed: int = 0) -> None:
    """A stand-in for kmnist.npz (no download here): 10 classes of 28×28 grey images, each a
    class template plus noise — easy enough that 20 short rounds must learn it."""
    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, (10, 28, 28))
    y = rng.integers(0, 10, 3000)
    x = np.clip(templates[y] + rng.normal(0, 60, (3000, 28, 28)), 0, 255).astype(np.uint8)
    np.savez(path, x=x, y=y.astype(np.int64))


def without_feddyn(root: Path) -> None:
    """A copy of fedmeta as it would be before FedDyn: its file, config and registry lines gone."""
    (root / "fedmeta" / "algorithms" / "feddyn.py").unlink()
    (root / "configs" / "method" / "feddyn.yaml").unlink()
    registry = root / "fedmeta" / "algorithms" / "__init__.py"
    lines = registry.read_text().splitlines(keepends=True)
    registry.write_text("".join(line for line in lines if "feddyn" not in line.lower()))


@pytest.fixture(scope="module")
def extended(tmp_path_factory):
    """A copy of the package and its configs with the guide's blocks written in."""
    root = tmp_path_factory.mktemp("extended")
    shutil.copytree(ROOT / "fedmeta", root / "fedmeta", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs", root / "configs")
    without_feddyn(root)  # the guide adds it back
    blocks = guide_blocks()
    assert {path for path, _, _ in blocks} >= {
        "fedmeta/algorithms/fedavgm.py",
        "fedmeta/algorithms/__init__.py",
        "configs/method/fedavgm.yaml",
        "fedmeta/data/datasets.py",
        "configs/dataset/kmnist.yaml",
        "fedmeta/data/partition.py",
        "configs/partition/quantity.yaml",
        "fedmeta/algorithms/feddyn.py",
        "configs/method/feddyn.yaml",
    }
    for path, plus, code in blocks:
        target = root / path
        assert target.exists() == plus, (
            f"{path}: the guide's header says {'an existing' if plus else 'a new'} file"
        )
        if plus:
            add_to(target, code)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)  # examples/
            target.write_text(code)
    (root / "data").mkdir()
    kmnist_like(root / "data" / "kmnist.npz")
    (root / "work").mkdir()
    return root


def fedmeta(root: Path, words: list[str]) -> subprocess.CompletedProcess:
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(root),
        "FEDMETA_DATA": str(root / "data"),
        "FEDMETA_CACHE": str(root / "cache"),
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "HOME": str(root),
    }
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from fedmeta.cli import main; sys.exit(main(sys.argv[1:]))",
            *words,
        ],
        cwd=root / "work",
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def guide_commands(tag: str = "extending") -> list[list[str]]:
    (block,) = re.findall(rf"```bash {tag}\n(.*?)```", GUIDE.read_text(), re.S)
    commands = []
    for line in block.splitlines():
        words = line.split()
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # PYTHONPATH=examples fedmeta …
            words.pop(0)
        if words[:1] == ["fedmeta"]:
            commands.append(words[1:])
    return commands


def test_the_guides_code_is_what_make_lint_accepts(extended):
    written = [str(extended / path) for path, _, _ in guide_blocks() if path.endswith(".py")]
    ruff = [sys.executable, "-m", "ruff"]
    for check in (["check", "--no-cache", *written], ["format", "--check", "--no-cache", *written]):
        done = subprocess.run([*ruff, *check], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_following_the_guide_gives_a_method_a_data_set_and_a_partition_that_train(extended):
    help_, train, tune = guide_commands()
    listed = fedmeta(extended, help_)
    assert listed.returncode == 0, listed.stderr
    for name in ("fedavgm", "kmnist", "quantity"):
        assert re.search(rf"^\s+{name}\s+\S", listed.stdout, re.M), name  # with its file's first sentence

    run = fedmeta(extended, train)
    assert run.returncode == 0, run.stderr[-2000:]
    folder = extended / "work" / "runs" / "kmnist-quantity" / "fedavgm" / "seed0"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["rounds"] == 20 and summary["accuracy"] > 0.5  # chance: 0.1
    losses = [float(row.split(",")[1]) for row in (folder / "metrics.csv").read_text().splitlines()[1:]]
    assert losses[-1] < 0.5 * losses[0]
    config = (folder / "config.yaml").read_text()
    assert "server_momentum: 0.5" in config and "beta: 0.5" in config
    assert "note:" not in run.stderr  # the method's file says how its new clients are scored
    # the server's momentum buffer is part of the checkpointed federation state
    federation = torch.load(folder / "checkpoint.ckpt", weights_only=True)["federation"]
    velocity = federation["velocity"]
    assert velocity.keys() == federation["model"].keys() and any(v.abs().sum() > 0 for v in velocity.values())

    bad = fedmeta(extended, [*train, "method.server_update=adam"])
    assert bad.returncode == 2 and "method.server_update must be one of heavy_ball, nesterov" in bad.stderr

    # `fedmeta tune fedavgm …` finds FedAvg's space and the server's (the study itself is tune's tests' job)
    words = ", ".join(repr(w) for w in tune[2:])
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from fedmeta.tune import Study; print(sorted(Study('fedavgm', [{words}], None, "
            "None, None, None).space))",
        ],
        cwd=extended / "work",
        env={"PYTHONPATH": str(extended), "FEDMETA_DATA": str(extended / "data"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == (
        "['method.local_epochs', 'method.local_lr', 'method.server_lr', 'method.server_momentum']"
    ), probe.stderr


def test_the_method_class_can_live_in_a_package_of_ones_own(extended, tmp_path):
    """`algorithm: mypackage.fedavgm:FedAvgM` needs no registry line."""
    sys.path.insert(0, str(tmp_path))
    try:
        (tmp_path / "mypackage").mkdir()
        (tmp_path / "mypackage" / "__init__.py").write_text("")
        code = next(code for path, _, code in guide_blocks() if path == "fedmeta/algorithms/fedavgm.py")
        (tmp_path / "mypackage" / "fedavgm.py").write_text(code)
        from fedmeta.algorithms import FedAvg, algorithm_class
        from fedmeta.errors import FedmetaError

        cls = algorithm_class("mypackage.fedavgm:FedAvgM")
        assert cls.__name__ == "FedAvgM" and issubclass(cls, FedAvg)
        with pytest.raises(FedmetaError, match="cannot import"):
            algorithm_class("nopackage.fedavgm:FedAvgM")
        with pytest.raises(FedmetaError, match="Algorithm subclass"):
            algorithm_class("mypackage.fedavgm:FedAvgX")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mypackage.fedavgm", None)
        sys.modules.pop("mypackage", None)


def test_the_guides_feddyn_is_the_librarys():
    """The worked case of server and per-client state is fedmeta's own FedDyn, so the two cannot drift."""
    for path in ("fedmeta/algorithms/feddyn.py", "configs/method/feddyn.yaml"):
        (code,) = [code for at, _, code in guide_blocks() if at == path]
        assert code == (ROOT / path).read_text(), f"docs/extending.md's {path} is not the library's"


@pytest.mark.slow
def test_a_method_with_server_and_per_client_state_added_by_the_guide_trains_and_checkpoints_both(extended):
    """FedDyn, added to a copy of fedmeta without it: it trains, each client that took part keeps
    its ∇L_k, and the server's h (nonzero) is in the checkpoint."""
    (train,) = guide_commands("extending-state")
    run = fedmeta(extended, [*train, "output.root=feddyn-runs"])
    assert run.returncode == 0, run.stderr[-2000:]
    folder = extended / "work" / "feddyn-runs" / "kmnist-quantity" / "feddyn" / "seed0"
    losses = [float(row.split(",")[1]) for row in (folder / "metrics.csv").read_text().splitlines()[1:]]
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0]
    assert json.loads((folder / "summary.json").read_text())["accuracy"] > 0.5  # chance: 0.1
    federation = torch.load(folder / "checkpoint.ckpt", weights_only=True)["federation"]
    assert federation["h"].keys() == federation["model"].keys()
    assert any(h.abs().sum() > 0 for h in federation["h"].values())
    kept = federation["client_states"]
    assert kept and all(state["gradient"].keys() == federation["model"].keys() for state in kept.values())


def test_the_guides_server_that_learns_is_the_example_that_runs():
    (code,) = [code for at, _, code in guide_blocks() if at == "examples/server_head.py"]
    assert code == (ROOT / "examples" / "server_head.py").read_text()


@pytest.mark.slow  # three trainings
def test_a_server_network_trained_in_aggregate_gives_clients_their_own_heads_and_resumes_bit_exactly(
    tmp_path, monkeypatch, mnist_dir
):
    """The guide's ServerHead, from a config home as a user would add it: its server network learns
    by autograd in aggregate with its own Adam, the clients start from heads that differ, and a run
    stopped after round 1 resumes to the whole run's result — network and optimizer included."""
    from fedmeta.config import compose
    from fedmeta.errors import RunStopped
    from fedmeta.loop import train
    from fedmeta.stopping import Stopper

    (method_file,) = [code for at, _, code in guide_blocks() if at == "configs/method/server_head.yaml"]
    (tmp_path / "home" / "method").mkdir(parents=True)
    (tmp_path / "home" / "method" / "server_head.yaml").write_text(method_file)
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(tmp_path / "home"))
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    args = [
        "method=server_head",
        "federation.rounds=3",
        "federation.eval_every=3",
        "federation.num_new_clients=2",
        "personalization.steps=2",
        "method.local_epochs=1",
        "model.conv_channels=[8,16]",
        "model.dense_units=[32]",
        "logger=[]",
        f"dataset.dir={mnist_dir}",
    ]
    whole = train(compose([*args, f"output.root={tmp_path / 'whole'}"]), show_progress=False)
    cut = [*args, f"output.root={tmp_path / 'cut'}"]
    with monkeypatch.context() as stop_after_one_round:
        stop_after_one_round.setattr(Stopper, "MARGIN", 1e9)
        with pytest.raises(RunStopped, match="stopped after round 1 of 3"):
            train(compose([*cut, f"output.stop_at={time.time() + 3600:.0f}"]), show_progress=False)
    resumed = train(compose([*cut, "output.resume=true"]), show_progress=False)
    assert resumed["resumed_at_round"] == 1
    assert (resumed["accuracy"], resumed["curve"]) == (whole["accuracy"], whole["curve"])

    def federation(root):
        return torch.load(
            root / "rmnist-shards" / "server_head" / "seed0" / "checkpoint.ckpt", weights_only=True
        )["federation"]

    a, b = federation(tmp_path / "whole"), federation(tmp_path / "cut")
    assert all(torch.equal(a["network"][k], b["network"][k]) for k in a["network"])
    assert a["optimizer"]["state"][0]["step"] == 3  # one server step a round
    made = a["network"]["1.weight"] @ a["network"]["0.weight"].T  # each client's head correction
    assert made.abs().sum() > 0 and not torch.allclose(made[:, 0], made[:, 1])


def test_the_guides_server_that_keeps_models_is_the_example_that_runs():
    (code,) = [code for at, _, code in guide_blocks() if at == "examples/server_models.py"]
    assert code == (ROOT / "examples" / "server_models.py").read_text()


def server_models(cfg: dict):
    """The guide's ServerModels on a two-parameter model, the method file's keys as given."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from server_models import ServerModels
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from omegaconf import OmegaConf

    model = torch.nn.Linear(2, 1, bias=False)
    settings = {"local_lr": 0.1, "momentum": 0.0, "local_batches": 0, "local_optimizer": "sgd", **cfg}
    return ServerModels(model, OmegaConf.create(settings))


def test_a_client_starts_from_the_similarity_weighted_mean_of_the_kept_models_on_flower_too():
    """u_k by hand for three kept models; a client that sent none starts from the global model; a
    Flower node, which keeps no models, computes the same start from what the server sent."""
    from fedmeta.algorithms.base import ClientUpdate

    server = server_models({"self_weight": 0.5, "sharpness": 2.0, "lam": 0.1, "kept_dtype": "float32"})
    sent = {0: [1.0, 0.0], 1: [0.0, 1.0], 2: [1.0, 1.0]}
    server.aggregate([ClientUpdate(k, {"weight": torch.tensor([w])}, 1.0, 0.0) for k, w in sent.items()])
    glob = server.global_params()
    assert torch.allclose(glob["weight"], torch.tensor([[2 / 3, 2 / 3]]))  # FedAvg's mean
    # client 0: cos with client 1 is 0, with client 2 is 1/√2; the others share 1 − 0.5
    e1, e2 = np.exp(0.0), np.exp(2.0 / np.sqrt(2))
    hand = 0.5 * np.array([1.0, 0.0]) + 0.5 * (e1 * np.array([0.0, 1.0]) + e2 * np.array([1.0, 1.0])) / (
        e1 + e2
    )
    start = server.client_state(0, glob)["own"]["weight"]
    assert np.allclose(start.numpy().ravel(), hand)
    assert server.kept_model(glob, server.client_state(0, glob))["weight"].equal(start)  # scored as it starts
    assert torch.equal(server.client_state(7, glob)["own"]["weight"], glob["weight"])  # sent nothing yet
    node = server_models({"self_weight": 0.5, "sharpness": 2.0, "lam": 0.1, "kept_dtype": "float32"})
    node.load_broadcast_state(server.broadcast_state(0), 0)
    assert not node.sent and torch.equal(node.client_state(0, glob)["own"]["weight"], start)


@pytest.mark.slow  # two trainings
def test_a_server_keeping_a_model_per_client_trains_scores_them_and_checkpoints_them_in_half_the_bytes(
    tmp_path, monkeypatch, mnist_dir
):
    """The guide's ServerModels from a config home, run by the guide's command (a smaller federation
    and model): it learns, the training-clients protocol scores each client's own start model, every client that
    took part has its model in the checkpoint, and bfloat16 copies take half the bytes of float32."""
    from fedmeta.config import compose
    from fedmeta.loop import train

    (method_file,) = [code for at, _, code in guide_blocks() if at == "configs/method/server_models.yaml"]
    (tmp_path / "home" / "method").mkdir(parents=True)
    (tmp_path / "home" / "method" / "server_models.yaml").write_text(method_file)
    monkeypatch.setenv("FEDMETA_CONFIG_HOME", str(tmp_path / "home"))
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    (command,) = guide_commands("extending-server-models")
    assert command[0] == "train"
    args = [
        *(a for a in command[1:] if not a.startswith("federation.rounds=")),
        "federation.rounds=4",
        "federation.eval_every=4",
        "federation.num_clients=20",
        "federation.num_new_clients=4",
        "personalization.steps=5",
        "model.conv_channels=[8,16]",
        "model.dense_units=[32]",
        "logger=[]",
        f"dataset.dir={mnist_dir}",
    ]
    sizes = {}
    for dtype in ("bfloat16", "float32"):
        root = tmp_path / dtype
        summary = train(
            compose([*args, f"method.kept_dtype={dtype}", f"output.root={root}"]), show_progress=False
        )
        folder = root / "rmnist-shards" / "server_models" / "seed0"
        assert (
            summary["training_clients"]["accuracy"] > 0.4
        )  # their own start models, as they are (chance 0.1)
        assert summary["accuracy"] > summary["curve"][0]  # new clients adapt from the global model
        sent = torch.load(folder / "checkpoint.ckpt", weights_only=True)["federation"]["sent"]
        assert len(sent) >= 10 and {t.dtype for m in sent.values() for t in m.values()} == {
            getattr(torch, dtype)
        }
        sizes[dtype] = sum(t.numel() * t.element_size() for m in sent.values() for t in m.values())
        sizes[dtype + " clients"] = sorted(sent)
    assert sizes["bfloat16 clients"] == sizes["float32 clients"]
    assert sizes["bfloat16"] * 2 == sizes["float32"]
