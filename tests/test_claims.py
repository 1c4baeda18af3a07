"""The claims a results page writes beside its numbers hold, and the checker catches what it is for:
a wrong digit, a wrong statistic (the mean where the sentence says the sd, round 20 where it says
round 10), a number with no claim, an order that does not hold (fedmeta/claims.py)."""

from pathlib import Path

import pytest

from fedmeta import claims

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "results").glob("*.md"), *(ROOT / "docs").glob("*.md")])
# seeds 0-2, evaluated at rounds 10 and 20: 96.44 ± 0.49 at 20, 95.60 ± 0.77 at 10
CAFEME = "quick/rmnist-shards/cafeme"
FEDAVG_FT = "quick/rmnist-shards/fedavg_ft"  # 76.57 ± 6.67 at round 20


def _problems(prose: str) -> list[str]:
    return [p.message for p in claims.check(f"## A section\n\n{prose}\n")]


@pytest.mark.parametrize(
    "page", [p for p in PAGES if claims.CLAIM.search(p.read_text())], ids=lambda p: p.name
)
def test_every_claim_on_a_page_holds_and_every_number_of_its_section_is_claimed(page):
    problems = claims.check(page.read_text())
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(map(str, problems))


def test_the_notes_claim_every_number_in_every_section():
    """The hand-written results page is written wholly in claims: a number in any of its sections
    with no claim beside it fails, whether or not the section has claims elsewhere."""
    problems = claims.check((ROOT / "results" / "NOTES.md").read_text(), every_section=True)
    assert not problems, "results/NOTES.md:\n" + "\n".join(map(str, problems))


def test_a_true_sentence_passes():
    assert _problems(f"CAFeMe 96.44 ± 0.49 (n = 3) <!--= ms {CAFEME}; n {CAFEME} -->") == []
    assert (
        _problems(
            f"at round 10: 95.60 ± 0.77<!--= evaluated {CAFEME} 10; ms {CAFEME} @10 -->, "
            f"seed 0 96.7 %<!--= acc {CAFEME}/seed0 -->"
        )
        == []
    )
    assert (
        _problems(f"ahead by 19.9 points<!--= diff {CAFEME} {FEDAVG_FT}; above {CAFEME} {FEDAVG_FT} -->")
        == []
    )


def test_a_wrong_digit_fails():
    assert _problems(f"CAFeMe 96.45 ± 0.49<!--= ms {CAFEME} -->") == [f"96.45: ms {CAFEME} gives 96.4444"]
    assert _problems(f"ahead by 19.8 points<!--= diff {CAFEME} {FEDAVG_FT} -->") != []


def test_a_wrong_statistic_fails():
    # the sd where the sentence says the mean, and the reverse
    assert _problems(f"CAFeMe's sd 96.44<!--= sd {CAFEME} -->") != []
    assert _problems(f"CAFeMe's mean 0.49<!--= mean {CAFEME} -->") != []
    # round 20's mean claimed as round 10's
    assert _problems(f"at round 10: 96.44<!--= evaluated {CAFEME} 10; mean {CAFEME} @10 -->") == [
        f"96.44: mean {CAFEME} @10 gives 95.5972"
    ]
    # one seed's accuracy where the sentence claims the seeds' mean
    assert _problems(f"the mean 96.71<!--= mean {CAFEME} -->") != []


def test_a_number_with_no_claim_or_no_source_fails():
    assert "round 15 was not evaluated" in _problems(f"at round 15: 96.44<!--= evaluated {CAFEME} 15 -->")[0]
    assert _problems(f"CAFeMe 96.44<!--= mean {CAFEME} -->, FedAvg-FT 76.57.") == [
        "76.57: no claim says what it is"
    ]
    assert _problems(f"CAFeMe 96.44 and 0.49<!--= mean {CAFEME} -->")[0].startswith("2 numbers written")
    assert "no seed has run" in _problems("CAFeMe 96.44<!--= mean quick/rmnist-shards/nothing -->")[0]
    assert "only what the repository keeps" in _problems("x 1.00<!--= file ../../etc/passwd /(1)/ -->")[0]
    assert "not a kind of claim" in _problems("x 1.00<!--= guess 1.00 -->")[0]


def test_an_order_that_does_not_hold_fails():
    assert _problems(f"FedAvg-FT above CAFeMe<!--= above {FEDAVG_FT} {CAFEME} -->") == [
        f"above {FEDAVG_FT} {CAFEME}: does not hold"
    ]
    # 19.9 points apart against sds of 0.49 and 6.67: apart, not level
    assert _problems(f"level<!--= level {CAFEME} {FEDAVG_FT} -->") != []
    assert _problems(f"apart<!--= apart {CAFEME} {FEDAVG_FT} -->") == []


def test_numbers_in_code_and_names_are_not_results():
    claimed = f"CAFeMe 96.44<!--= mean {CAFEME} -->"  # a section with a claim is checked whole
    assert (
        _problems(f"{claimed}: `results/runs/quick/rmnist-shards/cafeme/seed0`, CIFAR-10, fp32, `lr=0.01`")
        == []
    )
    assert _problems(f"{claimed}: seed 0, seeds 0–4, seeds 0, 1 and 2, Algorithm 1, Table 2") == []
    assert _problems(f"{claimed}: seed 0, 20 rounds") == ["20: no claim says what it is"]


def test_a_section_without_claims_is_left_to_the_weaker_check():
    assert _problems("FedAvg-FT 76.57, 20 rounds.") == []
    assert claims.claimed_sections("## A\n\n1.00\n\n## B\n\nx 96.44<!--= mean quick/x -->\n") == [(4, 7)]


def test_braces_expand_one_claim_into_one_per_name():
    assert _problems("96.44 and 76.57<!--= mean quick/rmnist-shards/{cafeme,fedavg_ft} -->") == []


def test_code_blocks_hold_commands_not_results():
    fenced = "```bash\nfedmeta train federation.rounds=100\n\nfedmeta table --seeds 3\n```"
    indented = "    fedmeta train federation.rounds=100 seed=2"
    assert _problems(f"{fenced}\n\n{indented}\n\nCAFeMe 96.44<!--= mean {CAFEME} -->") == []
    assert _problems(f"fedmeta train federation.rounds=100\n\nCAFeMe 96.44<!--= mean {CAFEME} -->") != []


def test_a_paired_gap_is_taken_seed_by_seed_and_each_asks_every_seed():
    """A seed draws the same clients for every method: the gap seed by seed, not of the means' spreads."""
    gaps = [
        claims.evaluate(f"acc {CAFEME}/seed{s}")[0] - claims.evaluate(f"acc {FEDAVG_FT}/seed{s}")[0]
        for s in range(3)
    ]
    mean = sum(gaps) / 3
    sd = (sum((g - mean) ** 2 for g in gaps) / 2) ** 0.5
    assert claims.evaluate(f"paired {CAFEME} {FEDAVG_FT}") == pytest.approx([mean, sd])
    assert claims.evaluate(f"paired {CAFEME} {FEDAVG_FT} seeds=0,2")[0] == pytest.approx(
        (gaps[0] + gaps[2]) / 2
    )
    assert _problems(f"ahead on every seed<!--= each {CAFEME} {FEDAVG_FT} -->") == []
    assert _problems(f"behind on every seed<!--= each {FEDAVG_FT} {CAFEME} -->") == [
        f"each {FEDAVG_FT} {CAFEME}: does not hold"
    ]
    assert _problems(f"one seed is not every seed<!--= each {CAFEME} {FEDAVG_FT} seeds=1 -->") != []
    assert "no seed has run" in _problems(f"x 1.00 ± 1.00<!--= paired {CAFEME} {FEDAVG_FT} seeds=7 -->")[0]


def test_tc_claims_the_training_clients_and_tcw_their_sample_weighted_accuracy():
    """A run scored both ways: ``tc`` reads its training clients (mean over clients), ``tcw`` the
    sample-weighted number, each as the run recorded it; the new-client number is not theirs; tc-gap
    is the one less the other run by run."""
    import json

    group = "protocols/rmnist-dirichlet/fedrep"
    summaries = [
        json.loads((ROOT / "results/runs" / group / f"seed{s}/summary.json").read_text()) for s in range(3)
    ]
    mean_tc = sum(100 * s["training_clients"]["accuracy"] for s in summaries) / 3
    weighted = [100 * s["training_clients"]["weighted_accuracy"] for s in summaries]
    assert claims.evaluate(f"mean {group} tc") == pytest.approx([mean_tc])
    assert claims.evaluate(f"acc {group}/seed1 tcw") == pytest.approx([weighted[1]])
    assert claims.evaluate(f"mean {group} tc") != claims.evaluate(f"mean {group} tcw")
    assert claims.evaluate(f"mean {group} tc") != claims.evaluate(f"mean {group}")
    gaps = [100 * (s["training_clients"]["accuracy"] - s["accuracy"]) for s in summaries]
    assert claims.evaluate(f"tc-gap {group}") == pytest.approx(
        [sum(gaps) / 3, (sum((g - sum(gaps) / 3) ** 2 for g in gaps) / 2) ** 0.5]
    )
    assert "no k=" in _problems(f"x 1.00<!--= acc {group}/seed0 tc k=3 -->")[0]
    assert "not scored" in _problems(f"x 1.00<!--= acc {CAFEME}/seed0 tc -->")[0]


# --- any page: a bounded check, linear in the page, whose every failure is one line -----------------


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    """The command line's exit code (argparse's exits too), its stdout and its stderr."""
    try:
        code = claims.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _page(tmp_path: Path, prose: str) -> str:
    page = tmp_path / "page.md"
    page.write_text(f"## A section\n\n{prose}\n")
    return str(page)


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """A repository of its own (claims.ROOT): a group of two seeds, one of another group with a NaN
    accuracy, kept files a hostile page claims, and links out of it."""
    root = tmp_path / "repo"
    for group, accuracies in {"g": ["0.9", "0.8"], "nan": ["NaN", "0.5"]}.items():
        for seed, accuracy in enumerate(accuracies):
            run = root / "results/runs" / group / f"seed{seed}"
            run.mkdir(parents=True)
            (run / "summary.json").write_text(f'{{"accuracy": {accuracy}, "accuracy_std": 0.1, "rounds": 2}}')
    (root / "results/x.json").write_text('{"a": {"b": {"c": 1.5}, "flag": true, "list": [1, 2]}}')
    (root / "results/deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with open(root / "results/big.txt", "wb") as f:  # 2 GB, sparse: nothing written
        f.truncate(2 * 2**30)
    outside = tmp_path / "outside/seed0"
    outside.mkdir(parents=True)
    (outside / "summary.json").write_text('{"accuracy": 0.5, "rounds": 2}')
    (root / "results/probe").mkdir()
    (root / "results/probe/link_etc").symlink_to("/etc")
    (root / "results/runs/linked").symlink_to(outside.parent)
    (root / "results/runs/g2").mkdir()
    (root / "results/runs/g2/seed0").symlink_to(outside)
    monkeypatch.setattr(claims, "ROOT", root)
    return root


def test_the_command_line_needs_a_page_and_explains_itself(capsys):
    code, out, err = _main(capsys)
    assert code == 2 and out == "" and "usage:" in err and "PAGE" in err
    code, out, err = _main(capsys, "--help")
    assert code == 0 and out.startswith("usage:") and err == ""


@pytest.mark.parametrize(
    "name, reason",
    [
        ("missing", "no such file"),
        ("folder", "a folder, not a file"),
        ("latin-1", "not UTF-8 text (byte 0xe9 at offset 8)"),
        ("/dev/zero", "more than 8 MiB"),
        ("claims past 8 MiB", "more than 8 MiB"),
    ],
)
def test_a_page_that_cannot_be_read_is_one_line_on_stderr_and_exit_2(tmp_path, capsys, name, reason):
    """/dev/zero would be read whole (a MemoryError) and 50 MB of claims checked for minutes: a page is
    read no further than its bound."""
    page = tmp_path / "page.md"
    if name == "folder":
        page.mkdir()
    elif name == "latin-1":
        page.write_bytes("## A\ncaf\u00e9 1.00\n".encode("latin-1"))
    elif name == "claims past 8 MiB":
        claim = f"CAFeMe 96.44<!--= mean {CAFEME} -->\n"
        page.write_text("## A\n\n" + claim * (claims.PAGE_BYTES // len(claim) + 1))
    code, out, err = _main(capsys, name if name == "/dev/zero" else str(page))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and reason in err and "give a Markdown page" in err


def test_a_page_whose_claims_all_hold_says_so_in_one_line(tmp_path, capsys):
    page = _page(tmp_path, f"CAFeMe 96.44 ± 0.49 (n = 3)<!--= ms {CAFEME}; n {CAFEME} -->")
    assert _main(capsys, page) == (0, f"{page}: 3 numbers in 1 sections hold\n", "")


def test_a_number_that_differs_exits_1_and_a_claim_that_cannot_be_computed_2(tmp_path, capsys):
    page = _page(tmp_path, f"CAFeMe 96.45<!--= mean {CAFEME} -->")
    assert _main(capsys, page) == (1, f"{page}:3: 96.45: mean {CAFEME} gives 96.4444\n", "")
    page = _page(tmp_path, "CAFeMe 96.44<!--= mean quick/rmnist-shards/nothing -->")
    code, out, err = _main(capsys, page)
    assert (code, out) == (2, "") and err.count("\n") == 1 and "no seed has run" in err


def test_an_unclosed_claim_is_an_error_not_a_section_left_unchecked(tmp_path, capsys):
    """``<!--=`` with no ``-->`` matched no claim: its section was not checked, and the page passed."""
    for prose in (f"CAFeMe 1.00<!--= mean {CAFEME}", f"CAFeMe 1.00<!--= mean {CAFEME}\n\n-->"):
        code, out, err = _main(capsys, _page(tmp_path, prose))
        assert (code, out) == (2, "") and err.count("\n") == 1 and "a claim with no -->" in err


def test_braces_expand_a_claim_into_a_bounded_number_of_items():
    """24 ``{a,b}`` groups were 2^24 items, computed one by one: past the bound, one error instead."""
    assert len(claims._expand("n {a,b}" + "{c,d}" * 11, claims.EXPANSION)) == 4096
    problems = claims.check("## A\n\nx 1.00<!--= ms q/" + "{a,b}" * 24 + " -->\n")
    assert len(problems) == 1 and problems[0].broken
    assert f"expand the claim past {claims.EXPANSION} items" in problems[0].message


def test_the_check_is_linear_in_the_page():
    """Each number's line was counted from its paragraph's start, and an unclosed link target or
    comment searched again from each later start: quadratic, minutes for a few MB; now a second."""
    claimed = f"CAFeMe 96.44<!--= mean {CAFEME} -->"
    numbers = "\n".join(["1.5 and 2.5"] * 100_000)  # one paragraph: lines 4 to 100,003
    problems = claims.check(f"## A\n\n{claimed}\n{numbers}\n")
    assert len(problems) == 200_000 and problems[-1] == claims.Problem(
        100_003, "2.5: no claim says what it is"
    )
    # a link target with no end is no link: its numbers are written; an unclosed comment hides the rest
    assert len(claims.check(f"## A\n\n{claimed} " + "](1 " * 100_000 + "\n")) == 100_000
    assert claims.check(f"## A\n\n{claimed} " + "<!-- 1 " * 100_000 + "\n") == []


@pytest.mark.parametrize(
    "claim, message",
    [
        ("file results/probe/link_etc/passwd /(root)/", "results/probe/link_etc/passwd: leads out of the"),
        ("ms linked", "results/runs/linked: leads out of the repository"),
        ("acc g2/seed0", "results/runs/g2/seed0: leads out of the repository"),
        ("file results/big.txt /(1)/", "results/big.txt: more than 64 MiB"),
        ("file results/x.json /(/", "/(/: not a regular expression (missing ), unterminated subpattern"),
        ("reeval g/seed0 1", "g/seed0: no evaluations.jsonl: re-evaluate the run"),
        ("file results/deep.json 0", "results/deep.json: nested too deeply to read"),
        ("ms nan", "results/runs/nan/seed0/summary.json: accuracy is NaN, not a finite number"),
        ("file results/x.json a.flag", "results/x.json: a.flag is true, not a finite number"),
        ("file results/x.json a.b.nosuch", "results/x.json has no key 'nosuch' at a.b"),
        ("file results/x.json a.list.5", "results/x.json has no item '5' at a.list (a list of 2)"),
        ("ms", "too short: write ms G"),
        ("mean g @x", "@round is 'x', not a whole number"),
    ],
)
def test_a_claim_that_cannot_be_computed_is_one_line_saying_what_is_missing(kept, claim, message):
    """A link out of the repository, a 2 GB file, a bad regex, a run never re-evaluated, a JSON nested
    past the recursion limit, a NaN, a boolean, a missing key: each was a traceback, a bare KeyError's
    'nosuch', or a claim that held (a link to /etc, true as 1, a NaN the statistics passed)."""
    problems = claims.check(f"## A\n\nx 1.00<!--= {claim} -->\n")
    assert len(problems) == 1 and problems[0].broken, problems
    assert message in problems[0].message and "\n" not in problems[0].message
