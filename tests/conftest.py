import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from fedmeta.data import load_dataset
from fedmeta.data.sources import data_dir

# W&B as a user has it (offline, unless $WANDB_MODE says otherwise), its own files (settings, cache,
# staged artifacts) in a temporary home rather than the user's
_wandb_home = tempfile.mkdtemp(prefix="fedmeta-tests-wandb-")
atexit.register(shutil.rmtree, _wandb_home, ignore_errors=True)
for _variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
    os.environ.setdefault(_variable, _wandb_home)
# Small batches: one thread is as fast as two on a quiet machine and far faster on a busy one
# (OpenMP threads spin against any other load).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    """The real data folder: $FEDMETA_DATA (CI points it at ../shared/data), else ./data."""
    directory = data_dir()
    if not (directory / "mnist.npz").exists():
        directory = Path(__file__).resolve().parent.parent / "data"
    return directory.resolve()  # tests that change the working folder still find it


@pytest.fixture(scope="session")
def rmnist(mnist_dir):
    return load_dataset("rmnist", mnist_dir, seed=0)
