"""The base networks beside the data sets' CNN — the character LSTM (text) and ResNet-18 (batch or
group norm) — and the Shakespeare data set: the LSTM is nn.LSTM's computation, every model runs
every method vmapped as it runs one client at a time (float64; tests/test_lanes.py's contract),
and each learns."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_lanes import CLIENTS, NEW, SEEDS, SHORT, TINY, assert_same, method_file, run

from fedmeta.algorithms import ALGORITHMS, build_algorithm
from fedmeta.assemble import make_fabric
from fedmeta.cli import main
from fedmeta.config import compose
from fedmeta.data import ImageDataset, build_federation, load_dataset
from fedmeta.data.shakespeare import ALPHABET, build_shakespeare, encode, roles
from fedmeta.errors import FedmetaError
from fedmeta.models.lstm import CharLSTM, LSTMLayer
from fedmeta.models.resnet import ResNet18
from fedmeta.rounds import Federated, evaluate_on_ranks, federated_round

REPOSITORY_DATA = Path(__file__).resolve().parents[1] / "data"
MODELS = {
    "lstm": [
        "dataset=shakespeare",
        "model.embedding_dim=4",
        "model.lstm_units=[6,5]",
        "model.modulator.lstm_units=[4]",
        "model.modulator.before_mean=[5]",
        "model.modulator.after_mean=[5]",
    ],
    "resnet18-batch": [
        "model.kind=resnet18",
        "model.norm=batch",
        "model.kernel_size=3",
        "model.padding=1",
        "model.width=4",
    ],
    "resnet18-group": [
        "model.kind=resnet18",
        "model.norm=group",
        "model.kernel_size=3",
        "model.padding=1",
        "model.width=4",
    ],
}


def test_an_lstm_layer_computes_what_nn_lstm_computes():
    torch.manual_seed(0)
    layer, reference = LSTMLayer(5, 7).double(), torch.nn.LSTM(5, 7, batch_first=True).double()
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(reference, f"{name}_l0").copy_(getattr(layer, name))
    x = torch.randn(3, 11, 5, dtype=torch.float64, requires_grad=True)
    ours, theirs = layer(x), reference(x)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(out.square().sum(), x)[0] for out in (ours, theirs)))


def test_the_models_keep_the_base_networks_interface():
    """What the methods read: logits, the representation (``embedding``), a gate per hidden layer
    of the sizes ``hidden_sizes`` gives, and a classifier named ``head``."""
    text, images = torch.randint(0, 80, (4, 12), dtype=torch.uint8), torch.randn(4, 3, 9, 9)
    for model, x in ((CharLSTM(80, 80, 8, [16, 12]), text), (ResNet18(3, 10, "group"), images)):
        seen = []
        logits = model(
            x, gate=lambda i, a, seen=seen: seen.append((i, a.shape[1])) or a * 0.5, gate_flatten=True
        )
        assert [units for _, units in seen] == model.hidden_sizes(include_flatten=True)
        assert logits.shape == (4, model.head.out_features)
        assert model(x, embedding=True).shape == (4, model.head.in_features)


SPEECHES = "ROMEO:\nBut soft, what light\nthrough yonder window breaks?\n\nJULIET:\nAy me!  $\n\nROMEO:\nShe speaks.\n"


def test_roles_join_their_speeches_and_characters_outside_leafs_alphabet_read_as_spaces():
    assert roles(SPEECHES) == {
        "ROMEO": "But soft, what light through yonder window breaks? She speaks.",
        "JULIET": "Ay me! $",
    }
    assert "".join(ALPHABET[i] for i in encode("Ay me! $é")) == "Ay me!   "


def test_shakespeare_is_a_client_per_role_and_every_sample_the_next_character(tmp_path):
    (tmp_path / "shakespeare.txt").write_text(SPEECHES + "\nNURSE:\n" + "Lord, how she talks! " * 5)
    data = build_shakespeare(
        tmp_path, 0, download=False, sequence_length=10, min_chars=60, samples_per_role=7
    )
    assert data.num_classes == 80 and data.x.dtype == torch.uint8 and data.x.shape[1] == 10
    assert torch.bincount(data.groups).tolist() == [7, 7]  # ROMEO and NURSE; JULIET is too short
    text = roles(SPEECHES)["ROMEO"]
    first, last = ("".join(ALPHABET[i] for i in row) for row in (data.x[0], data.x[6]))
    assert first == text[:10] and ALPHABET[data.y[0]] == text[10]
    assert last == text[-11:-1] and ALPHABET[data.y[6]] == text[-1]  # evenly spaced, to the end
    with pytest.raises(FedmetaError, match="min_chars"):
        build_shakespeare(tmp_path, 0, download=False, sequence_length=10, min_chars=10_000)


def test_the_repositorys_tinyshakespeare_gives_141_roles_and_downloads_through_a_mirror(
    mirror,
    tmp_path,
    capsys,
):
    data = load_dataset("shakespeare", REPOSITORY_DATA, 0, download=False)
    assert len(data.groups.unique()) == 141 and len(data) == 140_882
    folder, url = mirror
    (folder / "input.txt").write_bytes((REPOSITORY_DATA / "shakespeare.txt").read_bytes())
    assert main(["data", "download", "shakespeare", "--dir", str(tmp_path), "--mirror", url]) == 0
    assert (tmp_path / "shakespeare.txt").read_bytes() == (REPOSITORY_DATA / "shakespeare.txt").read_bytes()
    (folder / "input.txt").write_text("ROMEO:\nnot the file\n")
    assert main(["data", "download", "shakespeare", "--dir", str(tmp_path / "b"), "--mirror", url]) == 2
    assert "does not match the publisher's MD5" in capsys.readouterr().err


@functools.cache
def text_data() -> ImageDataset:
    """Roles of uneven sizes (10 to 38 samples): padded batches and idle lanes are exercised."""
    data = build_shakespeare(REPOSITORY_DATA, 0, download=False, sequence_length=12, samples_per_role=40)
    keep = torch.cat([torch.nonzero(data.groups == g).flatten()[: 10 + 7 * (g % 5)] for g in range(40)])
    return ImageDataset(x=data.x[keep], y=data.y[keep], num_classes=80, groups=data.groups[keep])


def federations(model: str, rmnist) -> dict:
    if model == "lstm":
        data, partition = text_data(), {"name": "writers", "min_samples": 10}
    else:  # RMNIST at 9×9: ResNet-18's cost, shrunk for a test
        data = ImageDataset(x=F.avg_pool2d(rmnist.x[:800], 3), y=rmnist.y[:800], num_classes=10)
        partition = {"name": "dirichlet", "alpha": 0.1}
    built = {}
    for seed in SEEDS:
        federation = build_federation(data, partition, CLIENTS, NEW, 0.25, seed=seed, test_fraction=0.25)
        if model != "lstm":
            federation.x = federation.x.double()
        built[seed] = federation
    return built


def config(algorithm: str, model: str):
    name = method_file(algorithm)
    # test_lanes.py's tiny CNN widths: the ResNets' modulator reads images with them; text has none
    tiny = [s for s in TINY if model != "lstm" or not s.startswith(("model.conv", "model.dense"))]
    method = compose([f"method={name}", *tiny, *MODELS[model]]).method
    short = [f"{key}={value}" for key, value in SHORT.items() if key[7:] in method]
    return compose([f"method={name}", *tiny, *MODELS[model], *short, "dataset.image_size=9"])


# the quick tier: FedAvg-FT on each model and CAFeMe on text; every other pair is slow (CI runs them)
QUICK = {("fedavg_ft", m) for m in MODELS} | {("cafeme", "lstm")}
# Group norm holds the same parameters as batch norm's affine ones and no running statistics, so
# every method's ResNet lane runs with batch norm (the harder case for vmap); with group norm, the
# methods that treat norm layers or the activations apart: CAFeMe's gates, FedBN's refusal,
# pFedHN's generated weights
GROUP_NORM = {"fedavg_ft", "cafeme", "fedbn", "pfedhn"}


@pytest.mark.parametrize(
    "algorithm, model",
    [
        pytest.param(a, m, marks=() if (a, m) in QUICK else pytest.mark.slow)
        for m in MODELS
        for a in sorted(ALGORITHMS)
        if m != "resnet18-group" or a in GROUP_NORM
    ],
)
def test_every_method_runs_vmapped_on_every_model_as_one_client_at_a_time(algorithm, model, rmnist):
    """tests/test_lanes.py's contract on the other models: a seed's clients vmapped, and two seeds
    stacked, compute what one client at a time computes, in float64."""
    built, cfg = federations(model, rmnist), config(algorithm, model)
    if algorithm == "fedbn" and model in ("lstm", "resnet18-group"):  # no batch norm to keep per client
        with pytest.raises(
            FedmetaError, match="FedBN keeps each client's batch norms, and this model has none"
        ):
            run(algorithm, built, (0,), False, cfg)
        return
    alone = {seed: run(algorithm, built, (seed,), False, cfg)[0] for seed in SEEDS}
    assert alone[0]["losses"] != alone[1]["losses"]  # the seeds are different runs
    assert_same(run(algorithm, built, (0,), True, cfg)[0], alone[0], f"{model}: vmapped clients")
    for seed, stacked in zip(SEEDS, run(algorithm, built, SEEDS, True, cfg)):
        assert_same(stacked, alone[seed], f"{model}: seed {seed} stacked")


def trained(overrides: list[str], data: ImageDataset, partition: dict, rounds: int):
    cfg = compose(["method=fedavg", "wandb.mode=disabled", *overrides])
    fabric = make_fabric(cfg)
    fabric.seed_everything(0, verbose=False)
    federation = build_federation(data, partition, 12, 4, 0.25, seed=0)
    algorithm = build_algorithm(cfg, data.num_classes)
    losses = [federated_round(algorithm, federation, r, 4, seed=0).loss for r in range(1, rounds + 1)]
    result = evaluate_on_ranks(fabric, [Federated(algorithm, federation, 0)], cfg.personalization)[0]
    return losses, result.curves[:, 0].mean().item()


def test_the_lstm_learns_the_next_character():
    """Ten rounds of FedAvg: the loss falls well below a uniform guess's (ln 80 = 4.38) and new
    clients' accuracy is far above 1/80."""
    losses, accuracy = trained(
        ["dataset=shakespeare", "model.lstm_units=[48]", "method.local_epochs=1", "personalization.steps=0"],
        text_data(),
        {"name": "writers", "min_samples": 10},
        rounds=10,
    )
    assert losses[0] > 3.5 and losses[-1] < 0.8 * losses[0], losses
    assert accuracy > 0.12, accuracy


@pytest.mark.parametrize("norm", ["batch", pytest.param("group", marks=pytest.mark.slow)])
def test_resnet18_learns(norm, rmnist):
    """ResNet-18 (width 16) on RMNIST at 9×9, FedAvg at 0.01: the loss falls and new clients end
    far above chance (10 %; 45 % when written) after six rounds."""
    data = ImageDataset(x=F.avg_pool2d(rmnist.x[:1200], 3), y=rmnist.y[:1200], num_classes=10)
    losses, accuracy = trained(
        [
            "model.kind=resnet18",
            f"model.norm={norm}",
            "model.width=16",
            "dataset.image_size=9",
            "method.local_epochs=1",
            "method.local_lr=0.01",
            "personalization.steps=0",
        ],
        data,
        {"name": "iid"},
        rounds=6,
    )
    assert losses[-1] < 0.9 * losses[0] and accuracy > 0.3, (losses, accuracy)


def test_a_model_kind_or_norm_not_offered_is_one_line():
    for setting, words in (
        ("model.kind=vit", "model.kind must be one of cnn, resnet18, lstm"),
        ("model.norm=layer", "model.norm must be one of batch, group"),
    ):
        with pytest.raises(FedmetaError, match=words):
            compose([setting])
