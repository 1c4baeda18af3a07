"""Shakespeare next-character prediction, a client per speaking role, as LEAF builds it (Caldas et
al. 2018): a role's speeches joined into one text, every sample the 80 characters before a position
and the label the character at it, over LEAF's 80-character alphabet.

Two texts give the roles. ``dataset=shakespeare`` reads ``shakespeare.txt`` in the data folder:
karpathy/char-rnn's tinyshakespeare (1.1 MB, 40,000 lines of speeches from the plays, each headed by
its speaker's name; the repository's ``data/`` folder holds a copy), or any text in that layout. It
names speakers, not plays, so a name that speaks in several plays ("First Citizen") is one role.
``dataset=shakespeare_complete`` reads ``shakespeare_complete.txt``, the complete works LEAF parses
(Project Gutenberg's 1994 ``100.txt``), and makes a client of each play's role, as LEAF does.

LEAF keeps every position of a role's text; here a role gives at most ``samples_per_role`` windows,
evenly spaced over its text, so one long role does not outweigh the rest and an evaluation costs
what a CPU can afford. Train and test samples of a client come from the same text and their windows
can overlap, as in LEAF's per-sample split.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping
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
    return {name: one_line(parts) for name, parts in speeches.items()}


def one_line(parts: list[str]) -> str:
    """``parts`` joined by spaces, each run of spaces read as one."""
    return re.sub(r" {2,}", " ", " ".join(parts))


COMPLETE_WORKS_FILE = "shakespeare_complete.txt"
BYLINE = "by William Shakespeare"  # the line under each work's title in the complete works
NOTICE = re.compile(r"<<.*?>>", re.S)  # World Library's copyright notice, between the acts of each play
# The file sets THE COMEDY OF ERRORS two columns further left than the other plays: its speeches
# begin at the margin, where its act and scene headings ("ACT I. SCENE 1.") begin too
SHIFTED_LEFT = {"THE COMEDY OF ERRORS"}
HEADING = re.compile(r"(ACT|SCENE)\b")
DIRECTION_IN_LINE = re.compile(r"\[[^\]]*\]| {5,}\S.*$")  # "[Aside]", or "Exit" set off to the right
# What a download of the complete works must parse into to be taken, as no checksum is published for
# it: LEAF finds about 1,100 (play, role) clients in it; an HTML page, a truncated file or another
# edition's layout parses into far fewer
MIN_PLAYS, MIN_ROLES = 30, 500


def play_roles(text: str) -> dict[tuple[str, str], str]:
    """Each (play, role)'s speeches, in order, as one line of text, for every play of the complete
    works: every work with two speaking roles or more (the sonnets and poems have none)."""
    speeches: dict[tuple[str, str], list[str]] = {}
    for title, lines in works(text):
        for role, speech in play_speeches(lines, margin=0 if title in SHIFTED_LEFT else 2):
            speeches.setdefault((title, role), []).append(speech)
    roles_in_play = Counter(play for play, _ in speeches)
    return {key: one_line(parts) for key, parts in speeches.items() if roles_in_play[key[0]] >= 2}


def works(text: str) -> Iterator[tuple[str, list[str]]]:
    """(title, lines) of each work: its title is the last non-blank line above a BYLINE, its lines
    run to the next work's; the front matter before the first title and the notices are in none."""
    lines = NOTICE.sub("", text.replace("\r\n", "\n")).split("\n")
    starts = [i for i, line in enumerate(lines) if line.strip() == BYLINE]
    for start, end in zip(starts, [*starts[1:], len(lines)]):
        title = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
        yield title, lines[start + 1 : end]


def play_speeches(lines: list[str], margin: int) -> Iterator[tuple[str, str]]:
    """(role, speech) of each speech of a play, in order. A speech begins ``margin`` spaces in with
    its speaker's name, the first word in capitals, and a period (``  HAMLET. To be, or not to
    be``); its verse goes on over the lines 2 to 5 spaces further in (at the margin too, where the
    margin is 0, as LEAF reads THE COMEDY OF ERRORS); lines further in still are stage directions,
    skipped; any other line (blank, an entrance, a heading) ends it. Names are upper-cased, as LEAF
    does, so that one role written in two casings stays one role."""
    speaker = re.compile(rf" {{{margin}}}([A-Z]{{2,}}(?: [A-Za-z]+)*)\. (.*)")
    verse = re.compile(rf" {{{margin + 2 if margin else 0},{margin + 5}}}(\S.*)")
    direction = re.compile(rf" {{{margin + 6},}}\S")
    role, parts = None, []
    for line in [*lines, ""]:  # the blank line added ends the last speech
        start = speaker.fullmatch(line)
        if role and start is None and (more := verse.fullmatch(line)):
            parts.append(DIRECTION_IN_LINE.sub("", more[1]))
            continue
        if role and start is None and direction.match(line):
            continue
        if role and (speech := one_line(parts).strip()):
            yield role, speech
        begins = start is not None and not HEADING.match(start[1])
        role, parts = (start[1].upper(), [DIRECTION_IN_LINE.sub("", start[2])]) if begins else (None, [])


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


def check_complete_works(path: Path) -> None:
    """Refuse a file that does not parse into the complete works (MIN_PLAYS, MIN_ROLES): the check
    of a download that has no published checksum."""
    found = play_roles(read_text(path, "shakespeare_complete", download=False))
    plays = len({play for play, _ in found})
    if plays < MIN_PLAYS or len(found) < MIN_ROLES:
        raise FedmetaError(
            f"{path.name} parses into {plays} plays and {len(found)} (play, role) pairs, not the complete "
            f"works' {MIN_PLAYS} and {MIN_ROLES} or more: download it again, or check that the mirror "
            "serves Gutenberg's 1994-01-100.zip"
        )
