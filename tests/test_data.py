import os

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from fedmeta.data.convert import LAYOUT
from fedmeta.data.sources import load_npz


def test_mnist_npz_is_read_as_it_is(mnist_dir):
    arrays = load_npz("mnist", mnist_dir, download=False)
    assert arrays["x"].shape == (70000, 28, 28) and arrays["x"].dtype == np.uint8
    assert (arrays["split"] == 0).sum() == 60000


def test_rmnist_has_ten_equal_rotation_groups(rmnist):
    assert len(rmnist) == 60000 and rmnist.x.shape[1:] == (1, 28, 28)
    assert torch.bincount(rmnist.groups).tolist() == [6000] * 10
    assert abs(rmnist.x.mean().item()) < 0.1  # normalized


def test_group_g_is_rotated_by_20g_degrees(rmnist):
    def mean_digit(group, label=1):
        return rmnist.x[(rmnist.groups == group) & (rmnist.y == label)].mean(0)

    upright = mean_digit(0)
    for group in (3, 9):
        rotated_back = TF.rotate(mean_digit(group), angle=-20.0 * group)
        other_angle = TF.rotate(mean_digit(group), angle=-20.0 * group + 90)
        match = torch.corrcoef(torch.stack([upright.flatten(), rotated_back.flatten()]))[0, 1]
        mismatch = torch.corrcoef(torch.stack([upright.flatten(), other_angle.flatten()]))[0, 1]
        assert match > 0.9 and mismatch < match - 0.3


def test_the_authors_rmnist_is_torchvisions_nearest_rotation_of_unscaled_pixels(mnist_dir):
    """The CAFeMe authors rotate with torchvision's default interpolation (nearest) on pixels in
    [0, 1] and do not standardize: dataset.options as their variant sets them."""
    from torchvision.transforms import functional as F_v1

    from fedmeta.data.datasets import build_rmnist

    theirs = build_rmnist(mnist_dir, seed=0, interpolation="nearest", standardize=False)
    arrays = load_npz("mnist", mnist_dir, download=False)
    images = torch.from_numpy(arrays["x"][arrays["split"] == 0]).float().div(255).unsqueeze(1)
    for group in (0, 4, 9):
        members = (theirs.groups == group).nonzero().flatten()[:50]
        expected = F_v1.rotate(images[members], 20.0 * group)  # torchvision's default interpolation
        assert torch.equal(theirs.x[members], expected)
    assert 0 <= theirs.x.min() and theirs.x.max() <= 1
    ours = build_rmnist(mnist_dir, seed=0)
    members = (ours.groups == 4).nonzero().flatten()[:50]
    assert not torch.allclose(
        ours.x[members] * 0.3081 + 0.1307, theirs.x[members], atol=1e-3
    )  # bilinear differs


# ---- hostile data: refused in one line that names the real cause, before a run folder exists ----
def train_folder(path, tmp_path, *overrides):
    """``fedmeta train`` on the folder data set ``path`` (grey 28×28), small enough to reach the model."""
    from fedmeta.cli import main

    return main(
        [
            "train",
            "dataset=folder",
            f"dataset.options.path={path}",
            "dataset.in_channels=1",
            "dataset.image_size=28",
            "method=fedavg_ft",
            "federation.num_clients=10",
            "federation.num_new_clients=2",
            "partition.min_samples=5",
            f"output.root={tmp_path / 'runs'}",
            *overrides,
        ]
    )


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("fedmeta: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture
def digits_npz(mnist_dir, tmp_path, monkeypatch):
    """A canonical file of 600 real digits, written with the arrays given (x, split)."""
    monkeypatch.setenv("FEDMETA_CACHE", str(tmp_path / "cache"))
    arrays = load_npz("mnist", mnist_dir, download=False)

    def write(name, **arrays_):
        path = tmp_path / f"{name}.npz"
        np.savez(path, **{"x": arrays["x"][:600], "y": arrays["y"][:600], **arrays_})
        return path

    return write


@pytest.mark.parametrize(
    "split,message",
    [
        (1, "has no training images (split 0), only 600 test"),
        (2, "has no training images (split 0), only 600 validation"),
        (7, "split values must be 0 (train), 1 (test) or 2 (validation), found [7]"),
    ],
)
def test_an_npz_whose_split_selects_no_training_image_is_one_line(
    digits_npz, tmp_path, capsys, split, message
):
    path = digits_npz("no_train", split=np.full(600, split, np.uint8))
    assert train_folder(path, tmp_path) == 2
    err = one_line_error(capsys)
    assert str(path) in err and message in err
    assert not (tmp_path / "runs").exists()


def test_a_training_split_of_one_class_is_one_line(digits_npz, tmp_path, capsys):
    y = np.repeat([0, 1], 300)
    path = digits_npz("one_class_train", y=y, split=(y == 1).astype(np.uint8))
    assert train_folder(path, tmp_path) == 2
    assert "its training split (split 0) holds one class only (label 0)" in one_line_error(capsys)


def image_folder(root, classes, images=6, value=None):
    """``root/<class>/<i>.png`` for each class: random 28×28 grey images, or all ``value``."""
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(images):
            pixels = np.full((28, 28), value) if value is not None else rng.integers(0, 256, (28, 28))
            Image.fromarray(pixels.astype(np.uint8)).save(root / name / f"{i}.png")
    return root


def test_a_folder_of_one_class_names_the_folder_not_its_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDMETA_CACHE", str(tmp_path / "cache"))
    folder = image_folder(tmp_path / "only_cats", ["cat"])
    assert train_folder(folder, tmp_path) == 2
    err = one_line_error(capsys)
    assert f"{folder}: a classification data set needs at least 2 classes, found 1 (cat)" in err
    assert "cache" not in err
    assert not list((tmp_path / "cache").rglob("*.npz"))  # nothing decoded is kept for the rerun


def test_a_folder_that_is_not_class_folders_is_refused_without_walking_it(tmp_path, monkeypatch, capsys):
    """``path=/`` must not walk the filesystem: the layout is checked folder by folder, and the
    first folder that does not fit stops it, after reading the names of two folders."""
    from fedmeta.config import CONFIG_DIR

    listed = []
    scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda path: listed.append(os.fspath(path)) or scandir(path))
    assert train_folder("/", tmp_path) == 2
    err = one_line_error(capsys)
    assert "/ is not an ImageFolder folder" in err and LAYOUT in err
    assert len([p for p in listed if not p.startswith(str(CONFIG_DIR))]) <= 3  # the configs are listed too

    deep = tmp_path / "deep"
    image_folder(deep / "animals", ["cat", "dog"])  # one level too deep: animals/cat/0.png
    assert train_folder(deep, tmp_path) == 2
    assert f"{deep / 'animals'} holds a folder (cat), not only images: {LAYOUT}" in one_line_error(capsys)


def test_class_folders_may_sit_in_train_test_and_valid_folders(tmp_path):
    from fedmeta.data.convert import image_tree

    for split in ("train", "test", "valid"):
        image_folder(tmp_path / "tree" / split, ["cat", "dog"], images=2)
    (tmp_path / "tree" / "README.md").write_text("not an image: passed over")
    arrays = image_tree(tmp_path / "tree")
    assert arrays["classes"].tolist() == ["cat", "dog"]
    assert arrays["split"].tolist() == [1] * 4 + [0] * 4 + [2] * 4  # test, train, valid: sorted


@pytest.mark.parametrize("source", ["npz", "folder"])
def test_constant_images_are_refused_before_training(digits_npz, tmp_path, capsys, source):
    if source == "npz":
        path = digits_npz("zeros", x=np.zeros((600, 28, 28), np.uint8))
    else:
        path = image_folder(tmp_path / "blank", ["a", "b"], images=30, value=255)
    assert train_folder(path, tmp_path) == 2
    err = one_line_error(capsys)
    assert f"{path}: the images are constant (every pixel {0 if source == 'npz' else 255}, std 0)" in err
    assert "learning rate" not in err and not (tmp_path / "runs").exists()


def test_a_constant_channel_is_centred_not_divided_by_zero():
    from fedmeta.data.datasets import standardize

    images = torch.rand(8, 3, 4, 4)
    images[:, 2] = 0.5  # blue always the same
    out = standardize(images, "test images")
    assert torch.isfinite(out).all() and (out[:, 2] == 0).all()
    assert torch.allclose(out[:, 0].std(), torch.tensor(1.0))


def test_an_image_size_beyond_memory_is_refused_before_any_image_is_decoded(digits_npz, tmp_path, capsys):
    path = digits_npz("digits")
    assert train_folder(path, tmp_path, "dataset.image_size=100000") == 2
    err = one_line_error(capsys)
    assert "dataset.image_size=100000:" in err and " GB, more than this machine's " in err


def test_a_folder_too_large_at_its_image_size_is_refused_before_it_is_decoded(tmp_path, monkeypatch, capsys):
    from fedmeta.data import memory

    monkeypatch.setenv("FEDMETA_CACHE", str(tmp_path / "cache"))
    folder = image_folder(tmp_path / "digits", ["a", "b"])
    monkeypatch.setattr(memory, "machine_bytes", lambda: 10_000)  # one image of 28×28 floats fits, 12 do not
    assert train_folder(folder, tmp_path) == 2
    assert "dataset.image_size=28: 12 images of 1×28×28 float32 would need 0.0 GB" in one_line_error(capsys)
    assert not list((tmp_path / "cache").rglob("*.npz"))
