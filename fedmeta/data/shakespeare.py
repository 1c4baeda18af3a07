"""Shakespeare next-character prediction, a client per speaking role, as LEAF builds it (Caldas et
al. 2018): a role's speeches joined into one text, every sample the 80 characters before a position
and the label the character at it, over LEAF's 80-character alphabet.

The text is ``shakespeare.txt`` in the data folder: karpathy/char-rnn's tinyshakespeare (1.1 MB,
40,000 lines of speeches from the plays, each headed by its speaker's name; the repository's
``data/`` folder holds a copy), or any text in that layout. It names speakers, not plays, so a name
that speaks in several plays ("First Citizen") is one role here, where LEAF's complete works make a
client of each play's role. LEAF keeps every position of a role's text; here a role gives at most
``samples_per_role`` windows, evenly spaced over its text, so one long role does not outweigh the
rest and an evaluation costs what a CPU can afford. Train and test samples of a client come from the
same text and their windows can overlap, as in LEAF's per-sample split.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from fedmeta.data.datasets import ImageDataset
from fedmeta.errors import FedmetaError

# LEAF's alphabet (models/utils/language_utils.py): a character outside it is read as a space
ALPHABET = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
TEXT_FILE = "shakespeare.txt"
REPOSITORY_COPY = Path(__file__).resolve().parents[2] / "data" / TEXT_FILE
SPEAKER = re.compile(r"^([A-Za-z][A-Za-z ',.-]*):$")


def roles(text: str) -> dict[str, str]:
    """Each speaker's speeches, in order, as one line of text: a speech is a block of lines after a
    ``NAME:`` line, blocks apart by blank lines; line breaks and runs of spaces become one space."""
    speeches: dict[str, list[str]] = {}
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = block.strip("\n").split("\n")
        match = SPEAKER.match(lines[0].strip())
        if match and len(lines) > 1:
            speeches.setdefault(match.group(1), []).append(" ".join(lines[1:]))
    return {name: re.sub(r" {2,}", " ", " ".join(parts)) for name, parts in speeches.items()}


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


def build_shakespeare(
    directory: Path,
    seed: int,
    download: bool = True,
    sequence_length: int = 80,
    min_chars: int = 1000,
    samples_per_role: int = 1000,
) -> ImageDataset:
    """Every role with at least ``min_chars`` characters, its samples grouped by role (the
    ``writers`` partition makes a client of each): x uint8 (N, ``sequence_length``) of alphabet
    indices, y the next character's index."""
    text = read_text(directory, download)
    kept = {
        name: body for name, body in roles(text).items() if len(body) >= max(min_chars, sequence_length + 1)
    }
    if len(kept) < 2:
        raise FedmetaError(
            f"{directory / TEXT_FILE}: {len(kept)} speaking role(s) with {min_chars} characters or more: "
            "lower dataset.options.min_chars, or check that the text has NAME: lines before speeches"
        )
    xs, ys, groups = [], [], []
    for role, body in enumerate(kept.values()):
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


def read_text(directory: Path, download: bool) -> str:
    """The data folder's ``shakespeare.txt``, else the repository's own copy (a checkout's ``data/``,
    so that a data folder elsewhere, ``$FEDMETA_DATA``, needs no copy of it), else downloaded."""
    path = directory / TEXT_FILE
    if not path.exists() and REPOSITORY_COPY.exists():
        path = REPOSITORY_COPY
    if not path.exists():
        from fedmeta.data.download import download as fetch

        if not download:
            raise FedmetaError(
                f"{path} not found: put {TEXT_FILE} there, or run `fedmeta data download shakespeare`"
            )
        fetch("shakespeare", directory)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FedmetaError(f"{path} could not be read as UTF-8 text ({exc}): download it again") from None
