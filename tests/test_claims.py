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
