import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from fedmeta.data import load_dataset
from fedmeta.data.sources import data_dir

# The user's own state is never read or written: their home (~/.config/fedmeta, where fedmeta tune
# writes tuned variants and a user's own methods live; W&B's settings; other tools' caches) and
# $FEDMETA_CONFIG_HOME are an empty temporary home for the whole suite and what it starts. W&B runs
# as a user has it (offline, unless $WANDB_MODE says otherwise), its files in that home.
_home = tempfile.mkdtemp(prefix="fedmeta-tests-home-")
atexit.register(shutil.rmtree, _home, ignore_errors=True)
os.environ["HOME"] = _home
os.environ["FEDMETA_CONFIG_HOME"] = os.path.join(_home, ".config", "fedmeta")
for _variable, _folder in (
    ("XDG_CONFIG_HOME", ".config"),
    ("XDG_CACHE_HOME", ".cache"),
    ("XDG_DATA_HOME", ".local/share"),
    ("MPLCONFIGDIR", ".config/matplotlib"),
    ("WANDB_CONFIG_DIR", "wandb"),
    ("WANDB_CACHE_DIR", "wandb"),
    ("WANDB_DATA_DIR", "wandb"),
):
    os.environ[_variable] = os.path.join(_home, _folder)
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
