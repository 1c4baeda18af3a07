"""Who speaks what in Shakespeare's texts: each role's speeches read out of a text's layout.

Two layouts. tinyshakespeare's (karpathy/char-rnn): a speech is a block of lines under a ``NAME:``
line, so its roles are speaker names (``roles``). The complete works LEAF parses (Project
Gutenberg's 1994 ``100.txt``): works under their titles, speeches begun by an indented ``NAME.``,
so its roles are each play's (``play_roles``). Text only: fedmeta.data.shakespeare makes samples
of them, and a download of the complete works is checked with them (``check_complete_works``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from fedmeta.errors import FedmetaError

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


def check_complete_works(path: Path) -> None:
    """Refuse a file that does not parse into the complete works (MIN_PLAYS, MIN_ROLES): the check
    of a download that has no published checksum."""
    found = play_roles(path.read_bytes().decode("utf-8", errors="replace"))
    plays = len({play for play, _ in found})
    if plays < MIN_PLAYS or len(found) < MIN_ROLES:
        raise FedmetaError(
            f"{path.name} parses into {plays} plays and {len(found)} (play, role) pairs, not the complete "
            f"works' {MIN_PLAYS} and {MIN_ROLES} or more: download it again, or check that the mirror "
            "serves Gutenberg's 1994-01-100.zip"
        )
