import os
from pathlib import Path

import pytest
import torch

from fedmeta.data import load_dataset
from fedmeta.data.sources import data_dir

os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    """The real data folder: $FEDMETA_DATA (CI points it at ../shared/data), else ./data."""
    directory = data_dir()
    if not (directory / "mnist.npz").exists():
        directory = Path(__file__).resolve().parent.parent / "data"
    return directory


@pytest.fixture(scope="session")
def rmnist(mnist_dir):
    return load_dataset("rmnist", mnist_dir, seed=0)
