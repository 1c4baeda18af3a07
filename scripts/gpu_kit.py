"""What a GPU lease carries beside the tree: scripts/gpu_kit.py [SETTING ...] (make gpu-kit SETTINGS="...").

Writes .gpu/ afresh:
  wheels/       the packages the job imports that the card's image lacks (configs/gpu_image.txt), pinned
                to .venv's versions so the card runs what CI tests; Python 3.12, x86_64 or pure Python;
  data/         the files the named settings of configs/preset/paper.yaml read (none for RMNIST alone:
                data/mnist.npz travels with the tree);
  MANIFEST.txt  each file, its size and why it is there.
Prints the same table and the total carried (the tree that travels + the kit) against a lease's 64 MiB.
An unknown setting, a data file not found, or a total over 64 MiB is refused in one line, exit 2, and
then nothing is written. Downloads are cached in .cache/gpu-kit. The standard library and pip only, so
that it runs under python3 as well as under .venv's python.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT = ROOT / ".gpu"
CACHE = ROOT / ".cache" / "gpu-kit"
VENV_PYTHON = ROOT / os.environ.get("VENV", ".venv") / "bin" / "python"
LIMIT = 64 * 2**20  # a lease carries the tree and the carried paths, 64 MiB in all
# The card's interpreter: wheels for another Python or machine would not install there.
CARD = ["--python-version", "3.12", "--implementation", "cp"] + [
    f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
]
CARD_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux"} | {
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "os_name": "posix",
    "extra": "",
}

# What the job (fedmeta.cli train/table/bench with W&B disabled, and pytest tests/test_capture.py) imports,
# found with grep '^import|^from' and the imports inside functions (tests/test_gpu_kit.py checks the
# module-level ones): (package, why, carried even when the image lists it).
NEEDED = [
    ("omegaconf", "fedmeta.config imports it at module level: every fedmeta command", False),
    ("pyyaml", "omegaconf reads YAML with it; fedmeta.grid imports it at module level", False),
    ("tqdm", "fedmeta.loop and fedmeta.grid import it at module level", False),
    ("numpy", "fedmeta.data and fedmeta.checkpoint import it at module level", False),
    ("torch", "everything", False),
    ("torchvision", "fedmeta.data.datasets and fedmeta.data.download import it at module level", False),
    ("lightning-fabric", "Fabric: fedmeta.assemble, loop, rounds, runs, checkpoint", False),
    ("pytest", "pytest tests/test_capture.py; carried in case the image lacks it", True),
    ("pluggy", "pytest needs it; carried in case the image lacks it", True),
    ("iniconfig", "pytest needs it; carried in case the image lacks it", True),
    ("pygments", "pytest needs it; carried in case the image lacks it", True),
    ("packaging", "pytest needs it; carried in case the image lacks it", True),
]
# Imported only off the job's paths: named in the manifest so that nobody carries them to be safe.
# What a carried wheel requires (its Requires-Dist) and the image lacks is carried too.
NOT_NEEDED = [
    ("antlr4-python3-runtime", "omegaconf 2.4 has its own copy (omegaconf.vendor.antlr4); 2.3 required it"),
    ("learn2learn", "imported only for Meta-Dataset and downloads (fedmeta.data.convert.learn2learn_data)"),
    ("wandb", "imported only when W&B is on; the job sets WANDB_MODE=disabled"),
    ("submitit", "imported only by --executor local|slurm; the job's table runs the default process pool"),
    ("optuna", "fedmeta tune only"),
    ("hypothesis", "the property tests only: tests/test_capture.py, test_vectorize.py, conftest.py lack it"),
    ("flwr", "fedmeta flower only"),
]
DATA_FILES = {"rmnist": ["mnist.npz"], "cifar10": ["cifar10-jpeg.tar.gz"], "femnist": ["femnist.npz"]}


class Refusal(Exception):
    """Bad input or a kit that cannot be made: one line, exit 2."""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> dict[str, str | None]:
    """configs/gpu_image.txt: package → version (None where the version was not read)."""
    packages = {}
    for line in (ROOT / "configs" / "gpu_image.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[normalized(name)] = version or None
    if "pytorch-lightning" in packages:  # its wheel holds lightning_fabric too (its RECORD lists it)
        packages.setdefault("lightning-fabric", packages["pytorch-lightning"])
    return packages


def settings() -> dict[str, tuple[str, str]]:
    """The settings of configs/preset/paper.yaml → (their grid, their data set), read from their one-line
    entries without a YAML parser."""
    text = (ROOT / "configs" / "preset" / "paper.yaml").read_text().split("\nsettings:\n", 1)[1]
    found = {}
    for line in text.splitlines():
        entry = re.match(r"  ([\w-]+): \{grid: (\w+),.*\bdataset=(\w+)", line)
        if entry:
            found[entry[1]] = (entry[2], entry[3])
        elif line and not line.startswith((" ", "#")):
            break
    return found


def data_dirs() -> list[Path]:
    """Where the data files are looked for: $FEDMETA_DATA, ../shared/data, the tree's data/."""
    return [
        Path(d) for d in (os.environ.get("FEDMETA_DATA"), ROOT.parent / "shared" / "data", ROOT / "data") if d
    ]


def find_data(name: str) -> Path | None:
    return next((d / name for d in data_dirs() if (d / name).is_file()), None)


def meta_dataset_files() -> list[str]:
    """The Meta-Dataset sources of configs/dataset/meta_dataset.yaml that exist (the loader skips the rest)."""
    text = (ROOT / "configs" / "dataset" / "meta_dataset.yaml").read_text()
    sources = re.search(r"sources: \[(.*?)\]", text)[1].replace(" ", "").split(",")
    return [f"{s}.npz" for s in sources if find_data(f"{s}.npz")]


def setting_files(setting: str, dataset: str) -> dict[str, Path]:
    """The data files a setting reads → where they are here. Refuses a missing one."""
    names = meta_dataset_files() if dataset == "meta_dataset" else DATA_FILES[dataset]
    folders = " or ".join(map(str, data_dirs()))
    if not names:
        raise Refusal(f"{setting}: none of its data files is in {folders}")
    files = {name: find_data(name) for name in names}
    for name, source in files.items():
        if source is None:
            raise Refusal(
                f"{setting} needs {name}, not found in {folders}: set FEDMETA_DATA to the folder that "
                f"holds it, or run `fedmeta data download {dataset}`"
            )
    return files


def plan_data(chosen: dict[str, dict[str, Path]]) -> dict[str, tuple[Path, str]]:
    """.gpu/data's files, from each chosen setting's files: name → (source, why)."""
    plan = {}
    for setting, files in chosen.items():
        for name, source in files.items():
            if name != "mnist.npz":  # data/mnist.npz travels with the tree
                plan[name] = (source, (plan[name][1] + ", " if name in plan else "read by ") + setting)
    # data/mnist.npz is not copied: the job links it into .gpu/data, where FEDMETA_DATA points
    return plan


def venv_version(name: str) -> str:
    """The version .venv has (pip show), as CI tests it."""
    if not VENV_PYTHON.exists():
        raise Refusal(
            f"no {VENV_PYTHON.relative_to(ROOT)}: run `make install` first (the wheels take its versions)"
        )
    shown = subprocess.run([VENV_PYTHON, "-m", "pip", "show", name], capture_output=True, text=True).stdout
    version = re.search(r"^Version: (.+)$", shown, re.M)
    if version is None:
        raise Refusal(f".venv lacks {name}: run `make install` to bring it up to date")
    return version[1]


def cached_wheel(name: str, version: str) -> Path | None:
    for wheel in CACHE.glob("*.whl"):
        dist, wheel_version = wheel.name.split("-")[:2]
        if normalized(dist) == normalized(name) and wheel_version == version:
            return wheel
    return None


def fetch_wheel(name: str, version: str) -> Path:
    """The wheel of name==version for the card, from the cache or PyPI; built from the sdist where PyPI has
    no wheel (antlr4-python3-runtime 4.9.3), which works for pure-Python packages only."""
    spec, pip = f"{name}=={version}", [sys.executable, "-m", "pip"]
    if cached_wheel(name, version) is None:
        CACHE.mkdir(parents=True, exist_ok=True)
        download = [*pip, "download", "-q", "--no-deps", "--only-binary=:all:", *CARD, "-d", CACHE, spec]
        if subprocess.run(download, capture_output=True, check=False).returncode != 0:
            build = [*pip, "wheel", "-q", "--no-deps", "--no-binary=:all:", "-w", CACHE, spec]
            subprocess.run(build, capture_output=True, check=False)
    wheel = cached_wheel(name, version)
    if wheel is None:
        raise Refusal(f"no wheel of {spec}: neither downloaded nor built (is PyPI reachable?)")
    python, abi, platform = wheel.stem.split("-")[-3:]
    if not ("py3" in python or python == "cp312" or abi == "abi3") or not (
        platform == "any" or platform.endswith("x86_64")
    ):
        raise Refusal(f"{wheel.name} is not for the card (Python 3.12, x86_64): delete it from {CACHE}")
    return wheel


def requirements(wheel: Path) -> list[str]:
    """The packages a wheel requires on the card: its Requires-Dist whose markers hold there."""
    from pip._vendor.packaging.requirements import Requirement  # pip's copy: pip is here whenever this runs

    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    needs = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
    return [r.name for r in needs if r.marker is None or r.marker.evaluate(CARD_MARKERS)]


def tree_files() -> list[Path]:
    """The files that travel: tracked ones and the untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    paths = (ROOT / p for p in listed.decode().split("\0") if p)
    return [p for p in paths if os.path.lexists(p)]  # a tracked file deleted here does not travel


def size(n: int) -> str:
    return f"{n / 2**10:.0f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def refuse_oversize(chosen: dict[str, dict[str, Path]], data: dict, tree_bytes: int, wheel_bytes: int):
    """A setting whose own data cannot travel must run where the data is; several that fit alone, one at a time."""
    for setting, files in chosen.items():
        own = sum(source.stat().st_size for name, source in files.items() if name in data)
        if tree_bytes + wheel_bytes + own > LIMIT:
            grid = settings()[setting][0]
            command = "table --preset paper" if grid == "table" else "figures --preset paper --run"
            raise Refusal(
                f"{setting}: its data ({', '.join(files)}) comes to {size(own)}, more than a lease's "
                f"64 MiB can carry beside the tree ({size(tree_bytes)}): run it where the data is, on a cluster "
                f"with `fedmeta {command} --datasets {setting} --executor slurm`, or on a machine "
                "whose disk holds the data set"
            )
    total = tree_bytes + wheel_bytes + sum(source.stat().st_size for source, _ in data.values())
    if total > LIMIT:
        raise Refusal(
            f"{' '.join(chosen)} together come to {size(total)} with the tree, over a lease's 64 MiB: make one "
            f"kit per lease, e.g. make gpu-kit SETTINGS={next(iter(chosen))}"
        )


def make_kit(names: list[str]) -> None:
    known = settings()
    unknown = [s for s in names if s not in known]
    if unknown:
        raise Refusal(f"unknown setting {unknown[0]!r}: choose from {', '.join(known)}")
    files = {setting: setting_files(setting, known[setting][1]) for setting in dict.fromkeys(names)}
    data = plan_data(files)
    tree = tree_files()
    tree_bytes = sum(p.lstat().st_size for p in tree)
    refuse_oversize(files, data, tree_bytes, 0)  # before any download: Meta-Dataset never fits

    image = image_packages()
    todo = [(n, why) for n, why, anyway in NEEDED if anyway or normalized(n) not in image]
    in_image = [n for n, _, anyway in NEEDED if not anyway and normalized(n) in image]
    wheels, carried = {}, set()
    while todo:
        name, why = todo.pop(0)
        if normalized(name) in carried:
            continue
        carried.add(normalized(name))
        wheel = fetch_wheel(name, venv_version(name))
        wheels[wheel] = why
        todo += [(r, f"{name} requires it") for r in requirements(wheel) if normalized(r) not in image]
    refuse_oversize(files, data, tree_bytes, sum(w.stat().st_size for w in wheels))

    rows = [(f"wheels/{w.name}", w.stat().st_size, why) for w, why in sorted(wheels.items())]
    rows += [(f"data/{name}", source.stat().st_size, why) for name, (source, why) in sorted(data.items())]
    kit_bytes = sum(r[1] for r in rows)
    tree_label = f"tree ({len(tree)} files: git ls-files -co --exclude-standard)"
    width = max(len(label) for label in [tree_label, *(r[0] for r in rows)])
    table = [f"{path:<{width}}  {size(n):>9}  {why}" for path, n, why in rows]
    table += [
        f"{tree_label:<{width}}  {size(tree_bytes):>9}",
        f"{'kit (.gpu/)':<{width}}  {size(kit_bytes):>9}",
        f"{'total carried':<{width}}  {size(tree_bytes + kit_bytes):>9}  of 64 MiB",
    ]
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    manifest = [
        f"# .gpu/ for {' '.join(files)}, made {stamp} by scripts/gpu_kit.py: carry .gpu beside the tree.",
        "# The job installs each wheel whose module does not import, and sets FEDMETA_DATA=.gpu/data if it exists.",
        *table,
        "",
        f"Needed and already in the image (configs/gpu_image.txt), not carried: {', '.join(in_image)}",
        "Not needed by the job, not carried:",
        *(f"  {name}: {why}" for name, why in NOT_NEEDED if normalized(name) not in carried),
    ]

    # Built whole, then moved into place: a refusal or a failure leaves no half kit.
    staging = CACHE / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "wheels").mkdir(parents=True)
    for wheel in wheels:
        shutil.copy2(wheel, staging / "wheels" / wheel.name)
    if data:
        (staging / "data").mkdir()
    for name, (source, _) in data.items():  # copied: a write to the kit's file never reaches the user's data
        shutil.copy2(source, staging / "data" / name)
    (staging / "MANIFEST.txt").write_text("\n".join(manifest) + "\n")
    shutil.rmtree(KIT, ignore_errors=True)
    staging.rename(KIT)
    print("\n".join(table))
    print(f"wrote {KIT.relative_to(ROOT)}/ and {KIT.relative_to(ROOT)}/MANIFEST.txt")


def main() -> int:
    try:
        make_kit(sys.argv[1:] or ["rmnist-shards"])
    except Refusal as exc:
        print(f"gpu_kit: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
