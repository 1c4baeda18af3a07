"""The labelled image sets built in beside CIFAR-10 (cifar100, fmnist, emnist, svhn, usps,
tiny_imagenet, mini_imagenet): each publisher's files, made small here in the publisher's own
format and served from 127.0.0.1, go through ``fedmeta data download`` and come out of
``load_dataset`` with the shape, labels, classes, orientation and split they should have."""

import bz2
import gzip
import io
import pickle
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import scipy.io
import torch
from PIL import Image
from test_download import add_bytes

from fedmeta.cli import main
from fedmeta.config import compose
from fedmeta.data import load_dataset
from fedmeta.data.sources import data_dir, load_npz, missing_files
from fedmeta.errors import FedmetaError
from fedmeta.models import build_base_net

NAMES = ["cifar100", "fmnist", "emnist", "svhn", "usps", "tiny_imagenet", "mini_imagenet"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Converted files go to this test's folder, never to the user's cache."""
    monkeypatch.setenv("FEDMETA_CACHE", str(tmp_path / "cache"))


def download(name, url, target, *flags):
    return main(["data", "download", name, "--dir", str(target), "--mirror", url, *flags])


def idx_bytes(array):
    """An idx file of unsigned bytes, gzipped, as MNIST's publishers ship them."""
    magic = bytes([0, 0, 8, array.ndim])
    header = magic + b"".join(d.to_bytes(4, "big") for d in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


def labelled(n, classes, seed, shape):
    """n random uint8 images of ``shape`` and labels covering 0 and classes − 1."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    y[:2] = [0, classes - 1]
    return rng.integers(0, 256, (n, *shape), dtype=np.uint8), y


def check_training_split(dataset, train_labels, classes, shape):
    """The data set is the training part alone: its labels in order, standardized images of ``shape``."""
    assert dataset.x.shape == (len(train_labels), *shape) and dataset.x.dtype == torch.float32
    assert dataset.y.tolist() == list(train_labels) and dataset.num_classes == classes
    assert int(dataset.y.min()) >= 0 and int(dataset.y.max()) < classes
    assert dataset.x.mean(dim=(0, 2, 3)).abs().max() < 1e-4  # per channel
    assert (dataset.x.std(dim=(0, 2, 3)) - 1).abs().max() < 1e-3


def test_fashion_mnist_idx_files_are_checked_then_read(mirror, tmp_path, capsys):
    from torchvision.datasets import FashionMNIST

    folder, url = mirror
    (train_x, train_y), (test_x, test_y) = labelled(40, 10, 0, (28, 28)), labelled(15, 10, 1, (28, 28))
    for prefix, x, y in (("train", train_x, train_y), ("t10k", test_x, test_y)):
        (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(idx_bytes(x))
        (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(idx_bytes(y))

    assert download("fmnist", url, tmp_path) == 2  # not Zalando's files: their MD5 differs
    assert "does not match the publisher's MD5" in capsys.readouterr().err
    assert list(tmp_path.glob("*.npz")) == []
    assert download("fmnist", url, tmp_path, "--no-verify") == 0
    arrays = load_npz("fmnist", tmp_path, download=False)
    np.testing.assert_array_equal(arrays["x"], np.concatenate([train_x, test_x]))
    assert arrays["classes"].tolist() == FashionMNIST.classes and arrays["split"].sum() == 15
    check_training_split(load_dataset("fmnist", tmp_path, seed=0), train_y, 10, (1, 28, 28))


def upright_letter():
    """A 28×28 "L": a bar down the left side and a foot along the bottom — asymmetric under a
    transpose, which turns it into a bar along the top and a foot down the right."""
    image = np.zeros((28, 28), np.uint8)
    image[4:24, 6:9] = 255
    image[21:24, 6:22] = 255
    return image


def test_emnist_byclass_is_read_from_nists_zip_and_stood_upright(mirror, tmp_path):
    folder, url = mirror
    (train_x, train_y), (test_x, test_y) = labelled(30, 62, 2, (28, 28)), labelled(10, 62, 3, (28, 28))
    train_x[5] = upright_letter()
    with zipfile.ZipFile(folder / "gzip.zip", "w") as z:
        for part, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
            stored = x.transpose(0, 2, 1)  # NIST stores each image transposed
            z.writestr(f"gzip/emnist-byclass-{part}-images-idx3-ubyte.gz", idx_bytes(stored))
            z.writestr(f"gzip/emnist-byclass-{part}-labels-idx1-ubyte.gz", idx_bytes(y))
            z.writestr(f"gzip/emnist-digits-{part}-images-idx3-ubyte.gz", idx_bytes(stored[:3]))
            z.writestr(f"gzip/emnist-digits-{part}-labels-idx1-ubyte.gz", idx_bytes(y[:3] % 10))

    assert download("emnist", url, tmp_path, "--no-verify") == 0
    arrays = load_npz("emnist", tmp_path, download=False)
    np.testing.assert_array_equal(arrays["x"][5], upright_letter())  # the bar on the left, the foot below
    assert len(arrays["x"]) == 40 and arrays["classes"][[0, 10, 36, 61]].tolist() == ["0", "A", "a", "z"]
    dataset = load_dataset("emnist", tmp_path, seed=0)
    check_training_split(dataset, train_y, 62, (1, 28, 28))
    letter = dataset.x[5, 0]
    assert letter[4:20, 6:9].mean() > letter[4:20, 20:23].mean() + 1  # left side bright, right side dark
    assert letter[21:24, 10:20].mean() > letter[6:9, 10:20].mean() + 1  # the foot below, nothing on top


def test_svhn_mat_files_keep_their_colours_and_make_10_the_digit_0(mirror, tmp_path):
    folder, url = mirror
    parts = {"train": labelled(24, 10, 4, (32, 32, 3)), "test": labelled(8, 10, 5, (32, 32, 3))}
    for part, (x, y) in parts.items():
        stored_y = np.where(y == 0, 10, y).astype(np.uint8)[:, None]  # SVHN's labels are 1…10
        scipy.io.savemat(folder / f"{part}_32x32.mat", {"X": x.transpose(1, 2, 3, 0), "y": stored_y})

    assert download("svhn", url, tmp_path, "--no-verify") == 0
    arrays = load_npz("svhn", tmp_path, download=False)
    np.testing.assert_array_equal(arrays["x"], np.concatenate([parts["train"][0], parts["test"][0]]))
    assert (
        arrays["y"].min() == 0 and arrays["y"].max() == 9 and arrays["split"].tolist() == [0] * 24 + [1] * 8
    )
    check_training_split(load_dataset("svhn", tmp_path, seed=0), parts["train"][1], 10, (3, 32, 32))


def libsvm_lines(values, labels):
    """USPS in LIBSVM's text: ``label index:value …``, indices from 1, a pixel of value 0 left out."""
    lines = []
    for row, label in zip(values, labels):
        pixels = " ".join(f"{i + 1}:{v:.6f}" for i, v in enumerate(row) if v != 0)
        lines.append(f"{label + 1} {pixels}\n")
    return "".join(lines).encode()


def test_usps_libsvm_text_becomes_16_by_16_grey_digits(mirror, tmp_path):
    folder, url = mirror
    rng = np.random.default_rng(6)
    parts = {}
    for file, n in (("usps.bz2", 30), ("usps.t.bz2", 10)):
        values = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], (n, 256))
        labels = np.arange(n) % 10
        parts[file] = values, labels
        (folder / file).write_bytes(bz2.compress(libsvm_lines(values, labels)))

    assert download("usps", url, tmp_path, "--no-verify") == 0
    arrays = load_npz("usps", tmp_path, download=False)
    assert arrays["x"].shape == (40, 16, 16) and arrays["y"].tolist() == [i % 10 for i in range(30)] + list(
        range(10)
    )
    values = parts["usps.bz2"][0]
    expected = np.round((values + 1) / 2 * 255).astype(np.uint8).reshape(-1, 16, 16)
    np.testing.assert_array_equal(arrays["x"][:30], expected)  # −1 → 0, 0 (left out) → 128, 1 → 255
    check_training_split(load_dataset("usps", tmp_path, seed=0), parts["usps.bz2"][1], 10, (1, 16, 16))


def test_cifar100_python_batches_give_100_fine_classes(mirror, tmp_path):
    folder, url = mirror
    parts = {"train": labelled(30, 100, 7, (32, 32, 3)), "test": labelled(10, 100, 8, (32, 32, 3))}
    with tarfile.open(folder / "cifar-100-python.tar.gz", "w:gz") as tar:
        for part, (x, y) in parts.items():
            batch = {
                b"data": x.transpose(0, 3, 1, 2).reshape(len(x), 3072),  # rows of R, then G, then B planes
                b"fine_labels": y.tolist(),
                b"coarse_labels": (y // 5).tolist(),
            }
            add_bytes(tar, f"cifar-100-python/{part}", pickle.dumps(batch))
        meta = {b"fine_label_names": [f"class{i}".encode() for i in range(100)], b"coarse_label_names": []}
        add_bytes(tar, "cifar-100-python/meta", pickle.dumps(meta))

    assert download("cifar100", url, tmp_path, "--no-verify") == 0
    arrays = load_npz("cifar100", tmp_path, download=False)
    np.testing.assert_array_equal(arrays["x"], np.concatenate([parts["train"][0], parts["test"][0]]))
    assert len(arrays["classes"]) == 100 and arrays["classes"][99] == "class99"
    check_training_split(load_dataset("cifar100", tmp_path, seed=0), parts["train"][1], 100, (3, 32, 32))


def jpeg(array):
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


WNIDS = ["n09999999", "n01443537", "n02099601"]  # wnids.txt's order is not the class order: sorted is
COLOURS = {"n01443537": (230, 20, 20), "n02099601": (20, 230, 20), "n09999999": (20, 20, 230)}


def tiny_imagenet_zip(path):
    """cs231n's layout: train/<wnid>/images (and boxes), val/images with its annotations, test/images."""
    plain = lambda wnid: np.full((64, 64, 3), COLOURS[wnid], np.uint8)  # noqa: E731
    with zipfile.ZipFile(path, "w") as z:
        root = "tiny-imagenet-200"
        z.writestr(f"{root}/wnids.txt", "\n".join(WNIDS) + "\n")
        z.writestr(f"{root}/words.txt", "".join(f"{w}\tthing {w}\n" for w in WNIDS))
        for wnid in WNIDS:
            z.writestr(f"{root}/train/{wnid}/{wnid}_boxes.txt", "")
            for k in range(4):
                z.writestr(f"{root}/train/{wnid}/images/{wnid}_{k}.JPEG", jpeg(plain(wnid)))
        z.writestr(
            f"{root}/train/{WNIDS[0]}/images/{WNIDS[0]}_grey.JPEG", jpeg(np.full((64, 64), 90, np.uint8))
        )
        annotations = [(f"val_{i}.JPEG", WNIDS[i % 3]) for i in range(5)]
        for file, wnid in annotations:
            z.writestr(f"{root}/val/images/{file}", jpeg(plain(wnid)))
        z.writestr(
            f"{root}/val/val_annotations.txt", "".join(f"{f}\t{w}\t0\t0\t63\t63\n" for f, w in annotations)
        )
        z.writestr(f"{root}/test/images/test_0.JPEG", jpeg(plain(WNIDS[0])))


def test_tiny_imagenet_zip_gives_train_and_val_and_leaves_test_out(mirror, tmp_path):
    folder, url = mirror
    tiny_imagenet_zip(folder / "tiny-imagenet-200.zip")

    assert download("tiny_imagenet", url, tmp_path, "--no-verify") == 0
    arrays = load_npz("tiny_imagenet", tmp_path, download=False)
    assert arrays["x"].shape == (18, 64, 64, 3) and arrays["classes"].tolist() == sorted(WNIDS)
    assert (arrays["split"] == 0).sum() == 13 and (arrays["split"] == 1).sum() == 5  # test/ left out
    colour = arrays["x"].reshape(18, -1, 3).mean(axis=1)  # each image's mean R, G, B
    grey = np.ptp(colour, axis=1) < 5
    assert grey.sum() == 1 and abs(colour[grey][0, 0] - 90) <= 2  # a grey JPEG, made RGB
    expected = [np.argmax(COLOURS[arrays["classes"][label]]) for label in arrays["y"][~grey]]
    assert np.argmax(colour[~grey], axis=1).tolist() == expected  # each image in its own class
    dataset = load_dataset("tiny_imagenet", tmp_path, seed=0)
    assert dataset.x.shape == (13, 3, 64, 64) and dataset.num_classes == 3  # the file's classes
    assert load_dataset("tiny_imagenet", tmp_path, seed=0, num_classes=200).num_classes == 200  # the config's
    with pytest.raises(FedmetaError, match="beyond the 2 classes of dataset.options.num_classes"):
        load_dataset("tiny_imagenet", tmp_path, seed=0, num_classes=2)


def mini_imagenet_pickles(folder):
    """learn2learn's mini-ImageNet caches: one pickle per class split, 84×84 images, 3 classes each."""
    rng = np.random.default_rng(9)
    for k, mode in enumerate(("train", "validation", "test")):
        images = rng.integers(0, 256, (6, 84, 84, 3), dtype=np.uint8)
        cache = {"image_data": images, "class_dict": {f"n0{k}{c}": [2 * c, 2 * c + 1] for c in range(3)}}
        (folder / f"mini-imagenet-cache-{mode}.pkl").write_bytes(pickle.dumps(cache))


def test_mini_imagenet_by_its_name_fetches_the_learn2learn_source_and_uses_all_its_class_splits(
    mirror, tmp_path
):
    folder, url = mirror
    mini_imagenet_pickles(folder)
    assert download("mini_imagenet", url, tmp_path) == 0  # the data set's name fetches its file
    assert [p.name for p in tmp_path.glob("*.npz")] == ["mini_imagenet32.npz"]
    arrays = load_npz("mini_imagenet32", tmp_path, download=False)
    assert set(arrays["split"]) == {0, 1, 2}  # split by class, for meta-learning
    dataset = load_dataset("mini_imagenet", tmp_path, seed=0)
    assert dataset.x.shape == (18, 3, 32, 32) and sorted(set(dataset.y.tolist())) == list(range(9))


def test_mini_imagenet_with_a_split_by_image_trains_on_its_training_split(tmp_path):
    x, y = labelled(50, 5, 10, (32, 32, 3))
    split = np.repeat(np.array([0, 1], np.uint8), [40, 10])
    np.savez(tmp_path / "mini_imagenet32.npz", x=x, y=y, split=split)
    dataset = load_dataset("mini_imagenet", tmp_path, seed=0, num_classes=100)
    check_training_split(dataset, y[:40], 100, (3, 32, 32))


def test_a_missing_file_is_one_line_naming_it_and_the_download(tmp_path):
    with pytest.raises(FedmetaError, match=r"svhn.npz not found.*fedmeta data download svhn"):
        load_dataset("svhn", tmp_path, seed=0, download=False)
    cfg = compose(["dataset=mini_imagenet", f"dataset.dir={tmp_path}"])
    assert missing_files(cfg.dataset) == f"mini_imagenet32.npz not in {tmp_path}"


@pytest.mark.parametrize("name", NAMES)
def test_each_config_builds_a_model_for_its_images_and_splits_by_label(name):
    cfg = compose([f"dataset={name}"])
    assert cfg.dataset.name == name and cfg.partition.name in ("shards", "dirichlet")
    classes = cfg.dataset.options.num_classes
    size, channels = cfg.dataset.image_size, cfg.dataset.in_channels
    model = build_base_net(cfg.model, channels, size, classes)
    assert model.features.flat_dim >= 256  # the conv stack leaves images of 4×4 pixels or more
    assert model(torch.zeros(2, channels, size, size)).shape == (2, classes)


def test_usps_trains_with_its_own_model_through_the_cli(mirror, tmp_path):
    """The 16×16 CNN of usps.yaml, CAFeMe's modulator included, on the files a download made."""
    folder, url = mirror
    values = np.random.default_rng(11).uniform(-1, 1, (200, 256))
    (folder / "usps.bz2").write_bytes(bz2.compress(libsvm_lines(values, np.arange(200) % 10)))
    (folder / "usps.t.bz2").write_bytes(bz2.compress(libsvm_lines(values[:10], np.arange(10))))
    data = tmp_path / "data"
    assert download("usps", url, data, "--no-verify") == 0
    words = [
        "train",
        "dataset=usps",
        "method=cafeme",
        "partition=iid",
        f"dataset.dir={data}",
        "federation.num_clients=6",
        "federation.num_new_clients=2",
        "federation.clients_per_round=2",
        "federation.rounds=1",
        "personalization.steps=2",
        "logger=[]",
        f"output.root={tmp_path / 'runs'}",
    ]
    assert main(words) == 0
    assert (tmp_path / "runs" / "usps-iid" / "cafeme" / "seed0" / "summary.json").exists()


def real_mini_imagenet() -> Path:
    """The folder of the real mini_imagenet32.npz: the data folder (CI: FEDMETA_DATA=../shared/data),
    else the shared data beside the checkout; skipped where neither holds it."""
    for folder in (data_dir(), Path(__file__).resolve().parents[2] / "shared" / "data"):
        if (folder / "mini_imagenet32.npz").exists():
            return folder.resolve()
    pytest.skip("mini_imagenet32.npz is in neither the data folder nor ../shared/data")


def test_the_real_mini_imagenet32_file_is_100_classes_at_32_by_32():
    dataset = load_dataset("mini_imagenet", real_mini_imagenet(), seed=0, download=False, num_classes=100)
    assert dataset.x.shape[1:] == (3, 32, 32) and dataset.num_classes == 100
    assert len(dataset) >= 20000 and sorted(set(dataset.y.tolist())) == list(range(100))
    assert dataset.x.mean(dim=(0, 2, 3)).abs().max() < 1e-3


@pytest.mark.slow
def test_fedavg_runs_on_the_real_mini_imagenet32(tmp_path):
    words = [
        "train",
        "dataset=mini_imagenet",
        "method=fedavg",
        f"dataset.dir={real_mini_imagenet()}",
        "federation.num_clients=10",
        "federation.num_new_clients=2",
        "federation.clients_per_round=2",
        "federation.rounds=1",
        "personalization.steps=2",
        "model.conv_channels=[8,8,8]",
        "model.dense_units=[32,32]",
        "logger=[]",
        f"output.root={tmp_path}",
    ]
    assert main(words) == 0
    assert (tmp_path / "mini_imagenet-dirichlet" / "fedavg" / "seed0" / "summary.json").exists()
