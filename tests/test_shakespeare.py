"""Shakespeare's complete works in Project Gutenberg's 1994 layout (``dataset=shakespeare_complete``):
the plays and their (play, role) clients the parser finds in a small text written in that layout,
the samples built from them, and a download checked by parsing it, through a loopback mirror.
tinyshakespeare's ``dataset=shakespeare`` is tested in tests/test_model_kinds.py."""

from __future__ import annotations

import zipfile

import pytest
import torch

from fedmeta.cli import main
from fedmeta.data import load_dataset
from fedmeta.data.plays import MIN_PLAYS, MIN_ROLES, play_roles
from fedmeta.data.shakespeare import ALPHABET
from fedmeta.errors import FedmetaError

NOTICE = """<<THIS ELECTRONIC VERSION OF THE WORKS IS GIVEN
WITH PERMISSION.  COPIES MAY BE MADE FOR PERSONAL USE ONLY.>>"""
# A line of the sonnets and one of the poem read like a speech ("UNTIL the ink runs dry. And ..."):
# a work with a single role is no play
SONNETS = """1609

THE SONNETS

by William Shakespeare

                     1
  SO long as clocks keep time, the verse will stay.
  UNTIL the ink runs dry. And then, no more.

THE END
"""
LOST_KEY = """1600

THE TRAGEDY OF THE LOST KEY

by William Shakespeare

Dramatis Personae

  KEEPER, of the castle
  OLD PORTER

                            ACT I. SCENE 1.
                        The castle gate

  Enter KEEPER and OLD PORTER

  KEEPER. Who knocks so late upon the castle gate?
    The wind, perhaps,                              Exit PAGE
    or else a ghost come home.
  OLD PORTER.  [Aside]  A ghost that owes me money.
                                            [Yawns]
    I'll let him knock.
  PAGE. Sir!
  KEEPER. Then bar the door.                                Exeunt

"""
LOST_KEY_ACT_2 = """
ACT II. SCENE 1.
The hall

  Enter OLD PORTER

  OLD Porter. Still it knocks, and still I sleep.
      I do, I do.

THE END
"""
ERRORS = f"""1593

THE COMEDY OF ERRORS

by William Shakespeare

ACT I. SCENE 1.
A street

Enter FIRST TWIN and SECOND TWIN

FIRST TWIN. Brother, you wear my face
  and my cloak besides,
and my hat.
SECOND TWIN. Then one of us is lost.

Enter a MERCHANT

{NOTICE}

ACT II. SCENE 1.
FIRST TWIN. Not I.

THE END
"""
POEM = """1609

A LOVER'S COMPLAINT

by William Shakespeare

  FROM a high hill. A voice came down the vale.

End of this Etext
"""
WORKS = "\n".join(
    ["The Complete Works", NOTICE, SONNETS, NOTICE, LOST_KEY, NOTICE, LOST_KEY_ACT_2, ERRORS, POEM]
).replace("\n", "\r\n")  # the 1994 file's line ends
PLAY, COMEDY = "THE TRAGEDY OF THE LOST KEY", "THE COMEDY OF ERRORS"


def test_the_plays_and_their_roles_are_found_and_each_roles_speeches_joined_in_order():
    found = play_roles(WORKS)
    assert sorted(found) == [
        (COMEDY, "FIRST TWIN"),
        (COMEDY, "SECOND TWIN"),
        (PLAY, "KEEPER"),
        (PLAY, "OLD PORTER"),  # also written "OLD Porter": one role, as in LEAF
        (PLAY, "PAGE"),
    ]  # neither the sonnets, nor the poem, nor a heading ("ACT II") or entrance is a role
    assert found[PLAY, "KEEPER"] == (
        "Who knocks so late upon the castle gate? The wind, perhaps, or else a ghost come home. "
        "Then bar the door."
    )  # the exits set off to the right, the copyright notices and the stage directions left out
    assert found[PLAY, "OLD PORTER"] == (
        "A ghost that owes me money. I'll let him knock. Still it knocks, and still I sleep. I do, I do."
    )
    assert found[COMEDY, "FIRST TWIN"] == "Brother, you wear my face and my cloak besides, and my hat. Not I."
    assert (
        found[COMEDY, "SECOND TWIN"] == "Then one of us is lost."
    )  # a blank line ends a speech: the entrance after it is not his


def test_each_role_long_enough_is_a_client_and_every_sample_the_next_character(tmp_path):
    (tmp_path / "shakespeare_complete.txt").write_text(WORKS)
    options = {"sequence_length": 12, "min_chars": 20, "samples_per_role": 5}
    data = load_dataset("shakespeare_complete", tmp_path, 0, download=False, **options)
    assert data.num_classes == 80 and data.x.dtype == torch.uint8 and data.x.shape[1] == 12
    assert torch.bincount(data.groups).tolist() == [5, 5, 5, 5]  # PAGE's 4 characters: left out
    keeper = play_roles(WORKS)[PLAY, "KEEPER"]
    first = "".join(ALPHABET[i] for i in data.x[0])
    assert first == keeper[:12] and ALPHABET[data.y[0]] == keeper[12]
    assert ALPHABET[data.y[4]] == keeper[-1]  # the last window ends at the role's last character
    with pytest.raises(FedmetaError, match="fedmeta data download shakespeare_complete"):
        load_dataset("shakespeare_complete", tmp_path / "empty", 0, download=False)


def a_play(number: int, roles: int) -> str:
    speeches = "".join(f"  ROLE {chr(65 + r)}. Line {r} of play {number}.\n" for r in range(roles))
    return f"\nPLAY {number}\n\nby William Shakespeare\n\n{speeches}\n"


def serve_zip(folder, text: str) -> None:
    with zipfile.ZipFile(folder / "1994-01-100.zip", "w") as archive:
        archive.writestr("100.txt", text)


def test_a_download_is_taken_only_if_it_parses_into_the_complete_works(mirror, tmp_path, capsys):
    folder, url = mirror
    download = ["data", "download", "shakespeare_complete", "--mirror", url, "--dir"]
    serve_zip(folder, WORKS)
    assert main([*download, str(tmp_path / "few")]) == 2
    assert "parses into 2 plays and 5 (play, role) pairs" in capsys.readouterr().err
    assert list((tmp_path / "few").iterdir()) == []  # nothing left behind
    roles = -(-MIN_ROLES // MIN_PLAYS)  # enough a play for MIN_ROLES in all
    works = "".join(a_play(p, roles) for p in range(MIN_PLAYS))
    serve_zip(folder, works)
    assert main([*download, str(tmp_path / "all")]) == 0
    assert (tmp_path / "all" / "shakespeare_complete.txt").read_text() == works
