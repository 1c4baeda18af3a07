"""``fedmeta data download`` against a real HTTP server on loopback that serves small files in
each publisher's own format (built from real MNIST digits), and generic ImageFolder sources."""

import gzip
import io
import pickle
import tarfile
import threading
import zipfile

import h5py
import numpy as np
import pytest
from PIL import Image

from fedmeta.cli import main
from fedmeta.data import build_federation, load_dataset
from fedmeta.data.sources import load_npz


@pytest.fixture(scope="module")
def digits(mnist_dir):
    arrays = load_npz("mnist", mnist_dir, download=False)
    return arrays["x"][:400], arrays["y"][:400]


def idx_gz(path, array, magic):
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def add_bytes(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def png(array):
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def download(name, mirror_url, target, *flags):
    return main(["data", "download", name, "--dir", str(target), "--mirror", mirror_url, *flags])


def test_mnist_idx_files_are_checked_then_converted_exactly(mirror, digits, tmp_path, capsys):
    folder, url = mirror
    x, y = digits
    for prefix, part in (("train", slice(0, 300)), ("t10k", slice(300, 400))):
        idx_gz(folder / f"{prefix}-images-idx3-ubyte.gz", x[part], 2051)
        idx_gz(folder / f"{prefix}-labels-idx1-ubyte.gz", y[part], 2049)

    # These are not the publisher's files: the MD5 check must refuse them and leave nothing behind.
    assert download("mnist", url, tmp_path) == 2
    assert "does not match the publisher's MD5" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []

    assert download("mnist", url, tmp_path, "--no-verify") == 0
    arrays = load_npz("mnist", tmp_path, download=False)
    np.testing.assert_array_equal(arrays["x"], x)
    np.testing.assert_array_equal(arrays["y"], y)
    assert arrays["split"].tolist() == [0] * 300 + [1] * 100
    assert len(load_dataset("rmnist", tmp_path, seed=0)) == 300  # usable as it is


def test_cifar_python_batches_are_converted(mirror, digits, tmp_path):
    folder, url = mirror
    x, y = digits
    rgb = np.pad(x[:120], ((0, 0), (2, 2), (2, 2)))[..., None].repeat(3, -1)
    rgb[..., 1] //= 2  # channels differ, so a wrong transpose shows
    rows = rgb.transpose(0, 3, 1, 2).reshape(120, 3072)
    with tarfile.open(folder / "cifar-10-python.tar.gz", "w:gz") as tar:
        for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
            batch = {b"data": rows[20 * i : 20 * (i + 1)], b"labels": y[20 * i : 20 * (i + 1)].tolist()}
            add_bytes(tar, f"cifar-10-batches-py/{name}", pickle.dumps(batch))
        add_bytes(
            tar,
            "cifar-10-batches-py/batches.meta",
            pickle.dumps({b"label_names": [str(i).encode() for i in range(10)]}),
        )

    assert download("cifar10", url, tmp_path, "--no-verify") == 0
    arrays = load_npz("cifar10", tmp_path, download=False)
    np.testing.assert_array_equal(arrays["x"], rgb)
    assert (arrays["split"] == 0).sum() == 100 and arrays["classes"].tolist() == [str(i) for i in range(10)]


def test_omniglot_zips_keep_alphabet_and_character_as_the_class(mirror, digits, tmp_path):
    folder, url = mirror
    x, _ = digits
    for archive, alphabets in (("images_background", ["Latin", "Greek"]), ("images_evaluation", ["Tengwar"])):
        with zipfile.ZipFile(folder / f"{archive}.zip", "w") as z:
            for a, alphabet in enumerate(alphabets):
                for c in range(3):  # character01… repeats across alphabets
                    for k in range(4):
                        z.writestr(
                            f"{archive}/{alphabet}/character0{c + 1}/{a}{c}{k}.png",
                            png(x[12 * a + 4 * c + k]),
                        )

    assert download("omniglot", url, tmp_path, "--no-verify") == 0
    arrays = load_npz("omniglot", tmp_path, download=False)
    assert arrays["x"].shape == (36, 28, 28) and len(arrays["classes"]) == 9
    assert (arrays["split"] == 1).sum() == 12 and "Greek/character01" in arrays["classes"]


def test_gtsrb_ppm_images_of_any_size_become_32_by_32(mirror, digits, tmp_path):
    folder, url = mirror
    x, _ = digits
    with zipfile.ZipFile(folder / "GTSRB-Training_fixed.zip", "w") as z:
        for k in range(6):
            buffer = io.BytesIO()
            Image.fromarray(x[k]).convert("RGB").resize((30 + 7 * k, 35)).save(buffer, format="PPM")
            z.writestr(f"GTSRB/Training/0000{k % 2}/{k:05d}.ppm", buffer.getvalue())
        z.writestr("GTSRB/Training/00000/GT-00000.csv", "Filename;ClassId\n")

    assert download("gtsrb32", url, tmp_path, "--no-verify") == 0
    arrays = load_npz("gtsrb32", tmp_path, download=False)
    assert arrays["x"].shape == (6, 32, 32, 3) and arrays["y"].tolist() == [
        0,
        1,
        0,
        1,
        0,
        1,
    ]  # folder 0000{k % 2}


def test_tff_femnist_keeps_writers_and_leaf_polarity(mirror, digits, tmp_path):
    folder, url = mirror
    x, y = digits
    paper = 1.0 - x / 255.0  # TFF's pixels: 1 = white paper, as in LEAF
    buffers = {}
    for split, part in (("train", slice(0, 30)), ("test", slice(30, 40))):
        buffers[split] = io.BytesIO()
        with h5py.File(buffers[split], "w") as h5:
            for w in range(2):
                group = h5.create_group(f"examples/f000{w}_00")
                group["pixels"] = paper[part][w::2].astype(np.float32)
                group["label"] = y[part][w::2].astype(np.int32)
    with tarfile.open(folder / "fed_emnist.tar.bz2", "w:bz2") as tar:
        for split, buffer in buffers.items():
            add_bytes(tar, f"fed_emnist_{split}.h5", buffer.getvalue())

    assert download("femnist", url, tmp_path) == 0  # no MD5 is published: nothing to verify
    assert load_npz("femnist", tmp_path, download=False)["writer_complete"].tolist() == [True, True]
    dataset = load_dataset("femnist", tmp_path, seed=0)
    assert dataset.groups.bincount().tolist() == [20, 20]  # every image of each writer
    ink = dataset.x[0, 0][x[0] > 128].mean() - dataset.x[0, 0][x[0] < 10].mean()
    assert ink > 1.0  # inverted back to MNIST's polarity: the ink is bright


@pytest.mark.slow  # seconds: out of the quick tier, which keeps to about 100 s
def test_image_folder_is_a_data_set_and_a_meta_dataset_source(digits, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMETA_CACHE", str(tmp_path / "cache"))
    x, y = digits
    tree = tmp_path / "my_digits"
    for i in range(300):
        (tree / "train" / f"class{y[i]}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(x[i]).save(tree / "train" / f"class{y[i]}" / f"{i}.png")
    dataset = load_dataset("folder", tmp_path, seed=0, path=str(tree), channels=1, image_size=28)
    assert len(dataset) == 300 and dataset.num_classes == 10 and dataset.x.shape[1:] == (1, 28, 28)
    federation = build_federation(
        dataset,
        {"name": "dirichlet", "alpha": 1.0, "min_samples": 5},
        num_clients=10,
        num_new_clients=2,
        held_out_fraction=0.2,
        seed=0,
    )
    assert len(federation.train_clients) == 8 and len(federation.new_clients) == 2

    # Through the CLI, with no code: a grey 28×28 folder trains the CNN sized for it.
    assert (
        main(
            [
                "train",
                "dataset=folder",
                f"dataset.options.path={tree}",
                "dataset.in_channels=1",
                "dataset.image_size=28",
                "method=fedavg_ft",
                "federation.num_clients=10",
                "federation.num_new_clients=2",
                "partition.min_samples=5",
                "federation.rounds=2",
                "personalization.steps=2",
                f"output.root={tmp_path / 'runs'}",
            ]
        )
        == 0
    )
    assert (tmp_path / "runs" / "folder-dirichlet" / "fedavg_ft" / "seed0" / "summary.json").exists()

    meta = load_dataset(
        "meta_dataset",
        tmp_path,
        seed=0,
        download=False,
        sources=[str(tree)],
        num_clients=4,
        classes_per_client=5,
        images_per_client=40,
    )
    assert meta.x.shape == (160, 3, 32, 32) and meta.y.max() == 4
    assert len(list((tmp_path / "cache" / "trees").iterdir())) == 2  # decoded once per shape asked for


def test_a_corrupt_archive_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDMETA_CACHE", str(tmp_path / "cache"))
    (tmp_path / "broken.zip").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    (tmp_path / "noise.tar").write_bytes(b"not an archive")
    for path in ("broken.zip", "noise.tar"):
        assert (
            main(
                [
                    "train",
                    "dataset=folder",
                    f"dataset.options.path={tmp_path / path}",
                    f"output.root={tmp_path}",
                ]
            )
            == 2
        )
        error = capsys.readouterr().err
        assert error.startswith("fedmeta: error:") and error.count("\n") == 1 and path in error
    assert not (tmp_path / "folder-dirichlet").exists()


@pytest.fixture
def silent_server():
    """A server that accepts connections and never says a word; yields its URL. After 60 s it hangs
    up on everyone, so a download without a timeout fails the test instead of hanging it."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    held, stop = [], threading.Event()

    def accept():
        deadline = threading.Timer(60, stop.set)
        deadline.start()
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                pass
        deadline.cancel()
        for connection in held:
            connection.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/"
    stop.set()
    thread.join()
    listener.close()


def test_a_mirror_that_never_answers_times_out_in_one_line(silent_server, tmp_path, monkeypatch, capsys):
    """A server that accepts the connection and then says nothing: the download shows what it waits
    for, gives up after its timeout and retries, ends in one line naming the URL and what to do, and
    leaves no temporary folder behind."""
    from fedmeta.data import download as downloads

    monkeypatch.setattr(downloads, "TIMEOUT_S", 0.5)
    monkeypatch.setattr(downloads, "ATTEMPTS", 2)
    (tmp_path / ".mnist-download-stale").mkdir()  # left by a killed download
    assert download("mnist", silent_server, tmp_path) == 2
    err = capsys.readouterr().err
    progress, _, error = err.rpartition("\r")  # the progress bar, then the line that replaces it
    assert "train-images-idx3-ubyte.gz: 0.00B" in progress and "try 2 of 2" in progress
    assert error == (
        f"fedmeta: error: downloading {silent_server}train-images-idx3-ubyte.gz failed: the server accepted "
        "the connection, then sent nothing for 0.5 s (2 tries): check the network, or pass --mirror URL "
        "of a server that answers\n"
    )
    assert list(tmp_path.iterdir()) == []  # neither the stale folder nor this download's


def test_a_download_shows_its_progress_and_checks_its_md5(mirror, tmp_path, capsys):
    import hashlib

    from fedmeta.data import download as downloads
    from fedmeta.errors import FedmetaError

    folder, url = mirror
    payload = bytes(range(256)) * 1000
    (folder / "blob.bin").write_bytes(payload)
    md5 = hashlib.md5(payload).hexdigest()
    assert downloads._fetch(f"{url}blob.bin", md5, tmp_path, None).read_bytes() == payload
    assert "blob.bin: 100%" in capsys.readouterr().err
    with pytest.raises(FedmetaError, match="does not match the publisher's MD5 0123"):
        downloads._fetch(f"{url}blob.bin", "0123", tmp_path, None)


def test_a_mirror_that_is_not_a_url_is_one_line(tmp_path, capsys):
    assert download("mnist", "not a url", tmp_path) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a URL" in err and list(tmp_path.iterdir()) == []


# ---- Meta-Dataset sources through learn2learn's own data set classes ---------------------------
def jpeg(array):
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG")
    return buffer.getvalue()


def tar_gz(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            add_bytes(tar, name, data)


def publisher_files(folder, digits):
    """Each publisher's file layout, as learn2learn downloads it, with one digit image per class."""
    import scipy.io
    from learn2learn.vision.datasets import cu_birds200, fgvc_aircraft

    x, _ = digits
    rgb = lambda i: np.repeat(x[i % len(x)][:, :, None], 3, axis=2)  # noqa: E731
    labels = io.BytesIO()
    scipy.io.savemat(labels, {"labels": np.arange(1, 103)[None]})
    (folder / "imagelabels.mat").write_bytes(labels.getvalue())
    tar_gz(folder / "102flowers.tgz", {f"jpg/image_{i + 1:05d}.jpg": jpeg(rgb(i)) for i in range(102)})
    variants = fgvc_aircraft.SPLITS["all"]
    members = {f"fgvc-aircraft-2013b/data/images/{1000 + i}.jpg": jpeg(rgb(i)) for i in range(len(variants))}
    members["fgvc-aircraft-2013b/data/images_variant_trainval.txt"] = b""
    for part in ("train", "val", "test"):
        members[f"fgvc-aircraft-2013b/data/images_variant_{part}.txt"] = "".join(
            f"{1000 + i} {v}\n"
            for i, v in enumerate(variants)
            if i % 3 == ("train", "val", "test").index(part)
        ).encode()
    tar_gz(folder / "fgvc-aircraft-2013b.tar.gz", members)
    birds = [c for split in ("train", "validation", "test") for c in cu_birds200.SPLITS[split]]
    tar_gz(
        folder / "CUB_200_2011.tgz",
        {f"CUB_200_2011/images/{c}/{c}_0001.jpg": jpeg(rgb(i)) for i, c in enumerate(birds)},
    )
    with zipfile.ZipFile(folder / "cifar100.zip", "w") as archive:
        for i, name in enumerate(["apple", "bear", "cloud", "dolphin", "maple", "rocket", "tulip"]):
            for j in range(2):
                archive.writestr(f"cifar100/data/{name}/{j}.png", png(rgb(i + j)))
        for part, names in (
            ("train", "apple\nbear\ncloud\n"),
            ("val", "dolphin\nmaple\n"),
            ("test", "rocket\ntulip\n"),
        ):
            archive.writestr(f"cifar100/splits/bertinetto/{part}.txt", names)
    for k, mode in enumerate(("train", "validation", "test")):
        images = np.stack([np.asarray(Image.fromarray(rgb(i)).resize((84, 84))) for i in range(6)])
        cache = {"image_data": images, "class_dict": {f"n0{k}{c}": [2 * c, 2 * c + 1] for c in range(3)}}
        (folder / f"mini-imagenet-cache-{mode}.pkl").write_bytes(pickle.dumps(cache))


@pytest.mark.parametrize(
    "name,images,classes",
    [
        ("vgg_flowers32", 102, 102),
        ("fgvc_aircraft32", 100, 100),
        ("cu_birds32", 200, 200),
        ("cifar_fs32", 14, 7),
        ("mini_imagenet32", 18, 9),
    ],
)
def test_learn2learn_sources_are_fetched_by_learn2learn_and_stored_canonically(
    name, images, classes, mirror, digits, tmp_path
):
    folder, url = mirror
    if not (folder / "102flowers.tgz").exists():
        publisher_files(folder, digits)
    assert download(name, url, tmp_path) == 0
    arrays = load_npz(name, tmp_path, download=False)
    assert arrays["x"].shape == (images, 32, 32, 3) and len(np.unique(arrays["y"])) == classes
    assert set(arrays["split"]) == {0, 1, 2}  # Meta-Dataset's train / test / validation classes
    assert not list(tmp_path.glob(".*download*"))  # learn2learn's working files are gone


def test_a_learn2learn_source_that_cannot_be_fetched_is_one_line(mirror, tmp_path, capsys):
    _, url = mirror
    assert (
        main(["data", "download", "cu_birds32", "--dir", str(tmp_path), "--mirror", url + "nothing-here/"])
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "fetching cu_birds32 through learn2learn's CUBirds200 failed" in err
        and len(err.strip().splitlines()) == 1
    )
    assert list(tmp_path.iterdir()) == []


def test_a_silent_mirror_is_named_while_fedmeta_waits_for_it(silent_server, tmp_path, monkeypatch, capsys):
    """Silence of more than a moment says what it waits for (a mirror that accepts and never
    answers printed nothing for 200 s)."""
    from fedmeta import waiting
    from fedmeta.data import download as downloads

    monkeypatch.setattr(waiting, "NOTICE_S", 0.3)
    monkeypatch.setattr(downloads, "TIMEOUT_S", 1.5)
    monkeypatch.setattr(downloads, "ATTEMPTS", 1)
    assert download("mnist", silent_server, tmp_path) == 2
    err = capsys.readouterr().err
    progress, _, error = err.rpartition("\r")  # the progress bar, then the line that replaces it
    assert "train-images-idx3-ubyte.gz: 0.00B" in progress
    assert "waiting for the server to answer (each try gives up after 1.5 s without a byte)" in progress
    assert error.startswith("fedmeta: error: downloading") and error.count("\n") == 1


def test_a_step_silent_past_its_notice_says_once_what_it_waits_for(monkeypatch, capsys):
    """W&B reaching its server (a run logging online without a network waited 221 s in silence)."""
    import time

    from fedmeta import waiting

    monkeypatch.setattr(waiting, "NOTICE_S", 0.1)
    with waiting.said_after("waiting for W&B to start the run online"):
        time.sleep(0.4)
    with waiting.said_after("never said: this step is quick"):
        pass
    time.sleep(0.2)
    assert capsys.readouterr().err == "fedmeta: waiting for W&B to start the run online\n"
