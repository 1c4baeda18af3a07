"""scripts/authors_code.py: what it hands the authors' code and what it reads back from it."""

import importlib.util
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.datasets import MNIST

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "authors_code.py"


@pytest.fixture(scope="module")
def authors_code():
    spec = importlib.util.spec_from_file_location("authors_code", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_their_mnist_loader_reads_our_mnist_exactly(authors_code, mnist_dir, tmp_path):
    """Their RotatedMNIST calls torchvision's MNIST(root='./data/rmnist', download=True): the files
    written must be found (no download) and hold the same images and labels in the same order."""
    authors_code.write_mnist(mnist_dir / "mnist.npz", tmp_path / "rmnist" / "MNIST" / "raw")
    ours = np.load(mnist_dir / "mnist.npz")
    for train, split in ((True, 0), (False, 1)):
        theirs = MNIST(root=tmp_path / "rmnist", train=train, download=False)
        chosen = ours["split"] == split
        assert torch.equal(theirs.data, torch.from_numpy(ours["x"][chosen]))
        assert torch.equal(theirs.targets, torch.from_numpy(ours["y"][chosen]))
    assert len(MNIST(root=tmp_path / "rmnist", train=True).data) == 60000


def test_scores_reads_curves_and_single_numbers(authors_code, tmp_path):
    """A fine-tuned method saves the mean accuracy after each personalization step, an unpersonalized
    one a single number; a method whose stage never ran is absent, not zero."""
    with open(tmp_path / "acc_ditto.pkl", "wb") as file:
        pickle.dump(np.array([0.1, 0.5, 0.9012]), file)
    with open(tmp_path / "acc_fedavg.pkl", "wb") as file:
        pickle.dump(np.float64(0.4375), file)
    scores = authors_code.scores(tmp_path)
    assert scores["ditto"]["final"] == 90.12 and scores["ditto"]["step0"] == 10.0
    assert scores["fedavg"]["final"] == scores["fedavg"]["step0"] == 43.75
    assert set(scores) == {"ditto", "fedavg"}
