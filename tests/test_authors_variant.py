"""variant=authors reproduces the authors' code on each point that changes a number; the paper
variant's outer optimizer is an explicit choice. One test per behaviour."""

import logging

import pytest
import torch
from omegaconf import OmegaConf
from test_models import tiny_cafeme

from fedmeta.config import compose
from fedmeta.data import ImageDataset, build_federation
from fedmeta.data.federation import PERSONALIZE_STREAM_PURPOSE
from fedmeta.evaluation import draw_personalization, personalize
from fedmeta.functional import grad_and_value


def tiny_client(side=8):
    """50 images: 35 to personalize on (5 batches of 6 an epoch, 5 left over), 15 held out."""
    g = torch.Generator().manual_seed(0)
    data = ImageDataset(
        x=torch.randn(100, 1, side, side, generator=g, dtype=torch.float64),
        y=torch.randint(0, 3, (100,), generator=g),
        num_classes=3,
    )
    return build_federation(data, {"name": "iid"}, 2, 1, 0.3, seed=0).train_clients[0]


def rows(batch):
    return {tuple(row.flatten().tolist()) for row in batch.x}


def test_stream_reads_consecutive_drop_last_batches_and_reshuffles_every_epoch():
    client = tiny_client()
    pers = rows(client.batch("pers", None))
    assert len(pers) == 35
    first, second = client.stream("pers", 6, 0, 5), client.stream("pers", 6, 5, 5)
    assert all(len(b.x) == 6 for b in first + second)
    seen = [rows(b) for b in first]
    assert (
        len(set().union(*seen)) == 30 and set().union(*seen) <= pers
    )  # consecutive, non-overlapping, drop_last
    assert [rows(b) for b in second] != seen  # the next epoch is shuffled afresh
    again = client.stream("pers", 6, 0, 3) + client.stream("pers", 6, 3, 5)  # resumable from a count
    assert all(torch.equal(a.x, b.x) for a, b in zip(again, first + second))


def test_stream_fixed_reads_the_same_batches_in_the_same_order_every_epoch():
    """FedLab's SubsetSampler shuffles once, at construction: every epoch repeats the first."""
    client = tiny_client()
    first, second = (
        client.stream("pers", 6, 0, 5, reshuffle=False),
        client.stream("pers", 6, 5, 5, reshuffle=False),
    )
    assert all(torch.equal(a.x, b.x) for a, b in zip(first, second))
    assert len(set().union(*(rows(b) for b in first))) == 30  # still a shuffled drop_last pass
    assert [rows(b) for b in first] == [
        rows(b) for b in client.stream("pers", 6, 0, 5)
    ]  # epoch 0 as the reshuffled one
    assert not all(torch.equal(a.x, b.x) for a, b in zip(second, client.stream("pers", 6, 5, 5)))


def test_authors_cafeme_reads_its_rounds_from_one_iterator_over_the_80_percent():
    algorithm, client = tiny_cafeme(batches="stream", eval_batch_size=12), tiny_client()
    held_out = rows(client.batch("held_out", None))
    data = algorithm.draw(client, 1)
    expected = client.stream("pers", 6, 0, 4)  # 2 inner steps, then an outer batch of 2 loader batches
    assert all(torch.equal(a.x, b.x) for a, b in zip(data["inner"], expected[:2]))
    assert torch.equal(data["outer"].x, torch.cat([b.x for b in expected[2:]]))
    assert (
        not (rows(data["outer"]) | set().union(*map(rows, data["inner"]))) & held_out
    )  # the 20 % is never trained on
    algorithm.aggregate([algorithm.run_client(client, 1)])
    assert algorithm.client_states[client.id]["batches_read"] == 4
    later = algorithm.draw(client, 7)  # the next visit continues where the last stopped, whatever the round
    assert torch.equal(later["inner"][0].x, client.stream("pers", 6, 4, 1)[0].x)


def test_paper_variant_says_once_when_the_outer_batch_is_smaller_than_configured(caplog):
    algorithm, client = tiny_cafeme(eval_batch_size=100), tiny_client()
    with caplog.at_level(logging.INFO, logger="fedmeta"):
        data = [algorithm.draw(client, r) for r in (1, 2)]
    assert len(data[0]["outer"].x) == len(client.indices("held_out")) == 15
    notices = [r for r in caplog.records if "outer batch" in r.message]
    assert len(notices) == 1 and "method.eval_batch_size=100" in notices[0].message
    assert ": 15)" in notices[0].message and notices[0].levelno == logging.INFO  # nothing to act on: a note


@pytest.mark.parametrize("optimizer", ["sgd", "adam_fresh"])
def test_outer_optimizer_sgd_is_line_8_and_a_fresh_adam_is_sign_sgd(optimizer):
    algorithm, client = tiny_cafeme(outer_optimizer=optimizer), tiny_client()
    params, data = algorithm.global_params(), algorithm.draw(client, 1)
    grads, _ = grad_and_value(algorithm.meta_loss)(params, data)
    new = algorithm.local_update(params, algorithm.client_state(client.id, params), data).params
    beta = algorithm.cfg.outer_lr
    for k in params:
        expected = grads[k] if optimizer == "sgd" else grads[k] / (grads[k].abs() + 1e-8)  # Adam's first step
        torch.testing.assert_close(new[k], params[k] - beta * expected, rtol=1e-9, atol=1e-12)
    if optimizer == "adam_fresh":
        moved = torch.cat(
            [(new[k] - params[k]).abs().flatten() for k in params if grads[k].abs().min() > 1e-6]
        )
        assert torch.allclose(moved, torch.full_like(moved, beta), rtol=1e-3)  # every weight moves by ≈ β


def personalization_cfg(**options):
    return OmegaConf.create(
        {
            **dict(
                steps=3,
                lr=0.1,
                decay=0.8,
                decay_every=5,
                batch_size=6,
                batches="independent",
                held_out_batch_size=None,
            ),
            **options,
        }
    )


def test_held_out_in_loader_batches_scores_each_batch_with_its_own_context_and_averages():
    algorithm, client = (
        tiny_cafeme(use_labels=False),
        tiny_client(),
    )  # transductive: ζ from the batch classified
    cfg = personalization_cfg(held_out_batch_size=4)
    data = draw_personalization(algorithm, client, cfg)
    batches = data["held_out"]
    assert [len(b.x) for b in batches] == [4, 4, 4, 3]  # 15 images in order, the last batch smaller
    params = algorithm.global_params()
    _, curve, _ = personalize(algorithm, params, data, cfg)
    with torch.no_grad():
        per_batch = [
            (algorithm(params, b.x, algorithm.prediction_context(b, None)).argmax(1) == b.y).double().mean()
            for b in batches
        ]
    assert curve[0].item() == pytest.approx(torch.stack(per_batch).mean().item(), abs=1e-6)


def test_authors_personalization_steps_read_a_persistent_iterator():
    algorithm, client = tiny_cafeme(), tiny_client()
    data = draw_personalization(algorithm, client, personalization_cfg(batches="stream", steps=6))
    expected = client.stream(
        "pers", 6, 0, 6, PERSONALIZE_STREAM_PURPOSE
    )  # 5 a pass: the 6th starts a new epoch
    assert all(torch.equal(a.x, b.x) for a, b in zip(data["steps"], expected)) and len(data["steps"]) == 6
    assert torch.equal(data["context"].x, expected[0].x)


@pytest.mark.parametrize("dataset,batch", [("rmnist", 30), ("cifar10", 50)])
def test_authors_variant_config_names_each_behaviour(dataset, batch):
    cfg = compose([f"dataset={dataset}", "method=cafeme", "variant=authors"])
    assert (cfg.method.outer_optimizer, cfg.method.batches, cfg.method.context, cfg.method.first_order) == (
        "adam_kept",
        "stream_fixed",
        "transductive",
        True,
    )
    assert cfg.personalization.batches == "stream_fixed" and cfg.personalization.held_out_batch_size == batch
    # the authors' data pipeline, for the data set and partition it applies to
    options = cfg.dataset.get("options", {})
    assert (options.get("interpolation"), options.get("standardize")) == (
        ("nearest", False) if dataset == "rmnist" else (None, None)
    )
    assert compose(
        [f"dataset={dataset}", "partition=dirichlet", "method=cafeme", "variant=authors"]
    ).partition.balance
    assert not compose([f"dataset={dataset}", "partition=dirichlet", "method=cafeme"]).partition.balance
    assert cfg.method.eval_batch_size == 6 * batch
    one_pass = compose(
        [f"dataset={dataset}", "method=cafeme", "variant=authors", "personalization.held_out_batch_size=null"]
    )
    assert one_pass.personalization.held_out_batch_size is None  # null (one pass) can be asked back
    paper = compose([f"dataset={dataset}", "method=cafeme"])
    assert (
        paper.method.outer_optimizer,
        paper.method.batches,
        paper.personalization.held_out_batch_size,
    ) == ("adam_fresh", "independent", None)


# ---- the baselines as the authors' code ran them ---------------------------------------------
def baseline(method, *overrides):
    from fedmeta.algorithms import build_algorithm

    cfg = compose(
        [
            f"method={method}",
            "variant=authors",
            "model.conv_channels=[4,8]",
            "model.dense_units=[16]",
            "method.batch_size=6",
            *overrides,
        ]
    )
    torch.manual_seed(0)
    return build_algorithm(cfg, 3).double()


def test_authors_fedavg_trains_on_the_80_percent_in_drop_last_epochs_and_averages_uniformly():
    fedavg, client = baseline("fedavg_ft", "method.local_epochs=2"), tiny_client(28)
    data = fedavg.draw(client, 1)
    assert [len(b.x) for b in data["epochs"]] == [6] * 10  # 35 images: 5 full batches an epoch, twice
    assert not set().union(*map(rows, data["epochs"])) & rows(client.batch("held_out", None))
    assert fedavg.update_weight(client) == 1.0
    assert (
        compose(["method=fedavg_ft", "variant=authors"]).personalization.held_out_batch_size == 30
    )  # RMNIST's loader batch


@pytest.mark.parametrize("method", ["fedavg", "ifca", "fedrep"])
def test_authors_baselines_read_their_data_in_one_order_fixed_at_the_start(method):
    """Their training loaders are FedLab's SubsetSampler too: every epoch of every round repeats the
    order of the client's persistent iterator; the paper variants reshuffle."""
    client = tiny_client(28)
    extra = ["method.head_batches=0", "method.body_batches=0"] if method == "fedrep" else []
    authors, paper = baseline(method, *extra), baseline(method, "variant=paper", *extra)
    key = "head" if method == "fedrep" else "epochs"
    order = client.stream("pers", 6, 0, 5, reshuffle=False)
    first, later = authors.draw(client, 1)[key], authors.draw(client, 7)[key]
    assert len(first) == len(later) > 5 and all(torch.equal(a.x, b.x) for a, b in zip(first, later))
    assert all(torch.equal(a.x, b.x) for a, b in zip(first, order))  # the iterator's order
    per_epoch = len(first) // (authors.cfg.get("local_epochs") or authors.cfg.head_epochs)
    assert all(torch.equal(a.x, b.x) for a, b in zip(first, first[per_epoch:]))  # every epoch alike
    reshuffled = paper.draw(client, 1)[key], paper.draw(client, 7)[key]
    assert not all(torch.equal(a.x, b.x) for a, b in zip(*reshuffled))


def test_authors_ditto_trains_w_with_a_kept_adam_after_the_personal_models_batches():
    ditto, client = baseline("ditto"), tiny_client(28)
    assert ditto.cfg.lam == 0.0  # new clients fine-tune without the proximal term
    first = ditto.draw(client, 1)["epochs"]
    expected = client.stream("pers", 6, 5, 5, reshuffle=False)  # batches 0–4 went to the personal model
    assert all(torch.equal(a.x, b.x) for a, b in zip(first, expected)) and len(first) == 5
    ditto.aggregate([ditto.run_client(client, 1)])
    kept = ditto.client_states[client.id]
    assert kept["batches_read"] == 10 and int(kept["adam"]["step"]) == 5
    ditto.aggregate([ditto.run_client(client, 2)])
    assert int(ditto.client_states[client.id]["adam"]["step"]) == 10  # the same Adam, continued


def test_authors_fedrep_averages_the_head_and_keeps_two_adams():
    fedrep, client = baseline("fedrep"), tiny_client(28)
    before = {n: p.clone() for n, p in fedrep.global_params().items()}
    data = fedrep.draw(client, 1)
    assert (len(data["head"]), len(data["body"])) == (5, 1)
    fedrep.aggregate([fedrep.run_client(client, 1)])
    after, kept = fedrep.global_params(), fedrep.client_states[client.id]
    assert all(not torch.equal(before[n], after[n]) for n in fedrep.head_names)  # the head is averaged
    assert (int(kept["head_adam"]["step"]), int(kept["body_adam"]["step"]), kept["batches_read"]) == (5, 1, 6)
    assert not any(n in kept for n in fedrep.head_names)  # no private head: the averaged one is used
    # the head is their model's whole fc block: the dense layers with the classifier; the body the convolutions
    assert {n.split(".")[0] for n in fedrep.head_names} == {"dense", "head"}
    assert {n.split(".")[0] for n in fedrep.body_names} == {"features"}
    assert {n.split(".")[0] for n in baseline("fedrep", "variant=paper").head_names} == {"head"}
    assert fedrep.adapted_names(0) is None  # new clients fine-tune every layer from the first step


def test_authors_perfedavg_reads_four_batches_a_local_step_from_the_iterator():
    perfedavg, client = baseline("perfedavg"), tiny_client(28)
    data = perfedavg.draw(client, 1)
    read = client.stream("pers", 6, 0, 20, reshuffle=False)  # FedLab's loader: shuffled once
    assert len(data["steps"]) == 15  # five local steps of three batches, the fourth left unread
    assert torch.equal(data["steps"][3].x, read[4].x) and torch.equal(data["steps"][5].x, read[6].x)
    assert torch.equal(data["loss"].x, read[19].x)
    perfedavg.aggregate([perfedavg.run_client(client, 1)])
    assert perfedavg.client_states[client.id]["batches_read"] == 20 and perfedavg.update_weight(client) == 1.0


@pytest.mark.parametrize("dataset", ["rmnist", "femnist", "cifar10"])
def test_paper_text_variant_takes_the_texts_values_where_the_code_differs(dataset):
    """variant=paper_text: the text's 28×28 CNN (32, 32 filters; 576 units), batch 30 everywhere,
    5 inner steps, Algorithm 1's plain outer step; the model builds for the data set's images."""
    from fedmeta.algorithms import build_model

    code = compose([f"dataset={dataset}", "method=cafeme"])
    text = compose([f"dataset={dataset}", "method=cafeme", "variant=paper_text"])
    assert (text.method.batch_size, text.method.eval_batch_size, text.method.inner_steps) == (30, 180, 5)
    assert text.personalization.batch_size == 30 and text.method.outer_optimizer == "sgd"
    if code.dataset.image_size == 28:
        assert (list(text.model.conv_channels), list(text.model.dense_units)) == ([32, 32], [576])
        assert list(code.model.conv_channels) == [32, 64]
    else:
        assert text.model == code.model
    model = build_model(text, 10)
    x = torch.zeros(2, text.dataset.in_channels, text.dataset.image_size, text.dataset.image_size)
    assert model(x, x, torch.zeros(2, dtype=torch.long)).shape == (2, 10)
