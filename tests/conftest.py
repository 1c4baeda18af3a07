import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import fedmeta.data
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
# (OpenMP threads spin against any other load) — here, and in every process a test starts (runs of
# a grid, a campaign or the bench, which would take a thread per core beside the other worker's).
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

_REAL_DATA = {data_dir().resolve(), (Path(__file__).resolve().parent.parent / "data").resolve()}
_loaded: dict = {}


def _load_real_data_once(name, directory, seed, download=True, **options):
    """The real data sets, read and transformed once per test process: a training run in a test
    reloads its data set (RMNIST: decode 70,000 images, rotate 60,000, ~2 s) on every call. Only the
    read-only real folders are kept, keyed by everything the result depends on (the cache folder
    too: a test that wants a fresh decode names a fresh one); folders a test writes pass through."""
    if Path(directory).resolve() not in _REAL_DATA:
        return _load_dataset(name, directory, seed, download, **options)
    key = (
        name,
        str(Path(directory).resolve()),
        seed,
        os.environ.get("FEDMETA_CACHE"),
        repr(sorted(options.items())),
    )
    if key not in _loaded:
        if len(_loaded) >= 3:  # RMNIST is 190 MB a seed, CIFAR-10 600 MB
            _loaded.pop(next(iter(_loaded)))
        _loaded[key] = _load_dataset(name, directory, seed, download, **options)
    return _loaded[key]


_load_dataset = fedmeta.data.load_dataset
fedmeta.data.load_dataset = _load_real_data_once  # what fedmeta.data.federation_of calls


@pytest.fixture(scope="session")
def mnist_dir() -> Path:
    """The real data folder: $FEDMETA_DATA (CI points it at ../shared/data), else ./data."""
    directory = data_dir()
    if not (directory / "mnist.npz").exists():
        directory = Path(__file__).resolve().parent.parent / "data"
    return directory.resolve()  # tests that change the working folder still find it


@pytest.fixture(scope="session")
def rmnist(mnist_dir):
    return fedmeta.data.load_dataset("rmnist", mnist_dir, seed=0)


def _tracked_files() -> list[str]:
    """The files of the checkout that git tracks (none outside a git checkout)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    return [name for name in listed.stdout.decode().split("\0") if name] if listed.returncode == 0 else []


def _states(names: list[str]) -> dict[str, tuple[int, int] | None]:
    """Each file → (size, mtime), None if it is gone."""
    states = {}
    for name in names:
        try:
            stat = os.lstat(os.path.join(ROOT, name))
            states[name] = (stat.st_size, stat.st_mtime_ns)
        except OSError:
            states[name] = None
    return states


ROOT = Path(__file__).resolve().parent.parent
_CHECKOUT = _states(_tracked_files())


@pytest.fixture(autouse=True)
def _checkout_untouched(request):
    """No test writes into the project's own files: a test that removes or changes one fails here,
    named, rather than by the failures of every later test that reads it."""
    yield
    now = _states(list(_CHECKOUT))
    changed = sorted(name for name, state in _CHECKOUT.items() if now[name] != state)
    if changed:
        _CHECKOUT.update(now)  # reported once, by the test that did it
        pytest.fail(f"{request.node.nodeid} changed the checkout's own files: {', '.join(changed[:5])}")


# The files that take longest go to the workers first (handed out last, one of them would run alone
# while the other worker idles), those that start processes of their own (Flower's, grids' and
# campaigns' runs, the bench's rows, killed and resumed runs) between those that train in-process,
# so that the two workers' processes seldom outnumber the cores. pytest-xdist keeps this order only
# with --no-loadscope-reorder (the Makefile's): by default it hands out the files with most tests first.
LONGEST_FIRST = [
    "test_flower.py",  # processes
    "test_vectorize.py",
    "test_training.py",
    "test_grid.py",  # processes
    "test_bench.py",  # processes
    "test_real_datasets.py",
    "test_campaign.py",  # processes
    "test_properties.py",
    "test_checkpoint.py",  # processes
    "test_lanes.py",
    "test_extending.py",  # processes
    "test_baselines.py",
    "test_distributed.py",  # processes
    "test_zoo_methods.py",
    "test_trust.py",  # processes
    "test_census.py",
]


# make test's quick tier holds one representative of each family of per-method repetitions; the
# others are marked slow here and run with the slow tests (make test-all, CI). A family's other
# members repeat the same code path on another method, which the full suite still holds.
QUICK_REPRESENTATIVES = {
    # vmapped on the recorded layout ≡ one client at a time: second order, a kept head (first order:
    # the bucketed test below; IFCA's model choice: make test-all)
    "test_vectorize.py::test_vectorized_rounds_and_evaluation_equal_sequential": {
        "cafeme-static",
        "fedrep-static",
    },
    # every lane its own: plain, a head per client, prototypes read in evaluation (second order: the
    # vectorize test's cafeme above)
    "test_lanes.py::test_every_lane_computes_what_it_computes_alone": {
        "fedavg",
        "fedrod",
        "fedproto",
    },
    "test_lanes.py::test_every_methods_kept_state_travels_to_a_flower_node_unchanged": {"fedala"},
    "test_vectorize.py::test_clients_bucketed_by_size_compute_what_one_at_a_time_computes": {
        "fedavg_ft-none"
    },
    "test_baselines.py::test_every_baseline_trains_end_to_end": {"fedavg_ft"},
    "test_figures.py::test_a_presets_figures_are_redrawn_from_its_committed_runs": {"tiny", "paper"},
    # the sections campaigns still rewrite; the finished grids' sections: make test-all
    "test_generated_pages.py::test_a_presets_section_of_the_tables_is_what_its_runs_give": {
        "paper",
        "published",
        "headline",
        "cpu_fair",
    },
    # a training client scored with its kept model: a head of its own, a mixture
    "test_protocol.py::test_a_training_client_is_scored_with_the_model_its_method_keeps_for_it": {
        "fedrep",
        "apfl",
    },
}
QUICK_SLOW_FIXTURES = {"test_zoo_methods.py": "trained"}  # each method's training: its learning tests


def _quick_representative(item) -> bool:
    function = f"{item.path.name}::{item.originalname}"
    if function in QUICK_REPRESENTATIVES:
        return item.callspec.id in QUICK_REPRESENTATIVES[function]
    return QUICK_SLOW_FIXTURES.get(item.path.name) not in item.fixturenames


@pytest.hookimpl(tryfirst=True)  # before -m "not slow" deselects
def pytest_collection_modifyitems(items):
    for item in items:
        if not _quick_representative(item):
            item.add_marker(pytest.mark.slow)

    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, and among the rest, the order stays


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    """An HTTP server on 127.0.0.1 serving a folder, a publisher's files in the download tests;
    yields (folder, base URL)."""
    import functools
    import http.server
    import threading

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    folder = tmp_path_factory.mktemp("mirror")
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
