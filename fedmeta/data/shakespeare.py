"""Shakespeare next-character prediction, a client per speaking role, as LEAF builds it (Caldas et
al. 2018): a role's speeches joined into one text, every sample the 80 characters before a position
and the label the character at it, over LEAF's 80-character alphabet.

Two texts give the roles. ``dataset=shakespeare`` reads ``shakespeare.txt`` in the data folder:
karpathy/char-rnn's tinyshakespeare (1.1 MB, 40,000 lines of speeches from the plays, each headed by
its speaker's name; the repository's ``data/`` folder holds a copy), or any text in that layout. It
names speakers, not plays, so a name that speaks in several plays ("First Citizen") is one role.
``dataset=shakespeare_complete`` reads ``shakespeare_complete.txt``, the complete works LEAF parses
(Project Gutenberg's 1994 ``100.txt``), and makes a client of each play's role, as LEAF does. Who
speaks what in each text is read by fedmeta.data.plays.

LEAF keeps every position of a role's text; here a role gives at most ``samples_per_role`` windows,
evenly spaced over its text, so one long role does not outweigh the rest and an evaluation costs
what a CPU can afford. Train and test samples of a client come from the same text and their windows
can overlap, as in LEAF's per-sample split.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from pathlib import Path

import numpy as np
import torch

from fedmeta.data.datasets import ImageDataset
from fedmeta.data.plays import COMPLETE_WORKS_FILE, play_roles, roles
from fedmeta.errors import FedmetaError

# LEAF's alphabet (models/utils/language_utils.py): a character outside it is read as a space
ALPHABET = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
TEXT_FILE = "shakespeare.txt"
REPOSITORY_COPY = Path(__file__).resolve().parents[2] / "data" / TEXT_FILE


def encode(text: str) -> np.ndarray:
    """Each character's index in ALPHABET (a space's where it is not in it), as uint8."""
    lookup = np.full(256, ALPHABET.index(" "), dtype=np.uint8)
    lookup[[ord(c) for c in ALPHABET]] = np.arange(len(ALPHABET), dtype=np.uint8)
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return lookup[np.minimum(points, 255)]  # 255 (ÿ) is not in the alphabet either


def windows(codes: np.ndarray, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``count`` (window, next character) pairs, evenly spaced over ``codes``."""
    starts = np.unique(np.linspace(0, len(codes) - length - 1, num=count).round().astype(np.int64))
    return codes[starts[:, None] + np.arange(length)], codes[starts + length]


def build_shakespeare(directory: Path, seed: int, download: bool = True, **options) -> ImageDataset:
    """tinyshakespeare's speakers (``roles``), sampled by ``build_from_roles``."""
    path = directory / TEXT_FILE
    return build_from_roles(roles(read_text(path, "shakespeare", download, REPOSITORY_COPY)), path, **options)


def build_shakespeare_complete(directory: Path, seed: int, download: bool = True, **options) -> ImageDataset:
    """The complete works' (play, role) pairs (``play_roles``), sampled by ``build_from_roles``."""
    path = directory / COMPLETE_WORKS_FILE
    return build_from_roles(play_roles(read_text(path, "shakespeare_complete", download)), path, **options)


def build_from_roles(
    texts: Mapping[Hashable, str],
    source: Path,
    sequence_length: int = 80,
    min_chars: int = 1000,
    samples_per_role: int = 1000,
) -> ImageDataset:
    """Every role of ``texts`` (role → its text, read from ``source``) with at least ``min_chars``
    characters, its samples grouped by role (the ``writers`` partition makes a client of each): x
    uint8 (N, ``sequence_length``) of alphabet indices, y the next character's index."""
    kept = [body for body in texts.values() if len(body) >= max(min_chars, sequence_length + 1)]
    if len(kept) < 2:
        raise FedmetaError(
            f"{source}: {len(kept)} speaking role(s) with {min_chars} characters or more: "
            "lower dataset.options.min_chars, or check that the text is in the layout docs/data.md describes"
        )
    xs, ys, groups = [], [], []
    for role, body in enumerate(kept):
        x, y = windows(encode(body), sequence_length, samples_per_role)
        xs.append(x)
        ys.append(y)
        groups.append(np.full(len(y), role))
    return ImageDataset(
        x=torch.from_numpy(np.concatenate(xs)),
        y=torch.from_numpy(np.concatenate(ys)).long(),
        num_classes=len(ALPHABET),
        groups=torch.from_numpy(np.concatenate(groups)).long(),
    )


def read_text(path: Path, name: str, download: bool, repository_copy: Path | None = None) -> str:
    """``path``, else ``repository_copy`` (a checkout's ``data/``, so that a data folder elsewhere,
    ``$FEDMETA_DATA``, needs no copy of it), else ``fedmeta data download NAME``'s file."""
    if not path.exists() and repository_copy is not None and repository_copy.exists():
        path = repository_copy
    if not path.exists():
        from fedmeta.data.download import download as fetch

        if not download:
            raise FedmetaError(
                f"{path} not found: put {path.name} there, or run `fedmeta data download {name}`"
            )
        fetch(name, path.parent)
    try:  # a byte that is not UTF-8 (a Latin-1 file) becomes U+FFFD, outside the alphabet: a space
        return path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise FedmetaError(f"{path} could not be read ({exc}): download it again") from None
