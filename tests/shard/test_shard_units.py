"""Fast checks of the shard layout, rank assignment and configuration errors (no model)."""

from __future__ import annotations

import argparse

import pytest
import torch

from discovery.cards import Card
from nodes.shard.layout import ShardConfigError, split_layers
from nodes.shard.node_run import check_args
from nodes.shard.pipeline import COMPACT, Op
from nodes.shard.rendezvous import plan_from, shard_extras


def test_split_is_contiguous_and_covers_every_layer():
    for world in (1, 2, 3, 7, 30):
        parts = [split_layers(30, world, r) for r in range(world)]
        assert parts[0].start == 0 and parts[-1].end == 30
        assert all(a.end == b.start for a, b in zip(parts, parts[1:], strict=False))
        assert max(p.end - p.start for p in parts) - min(p.end - p.start for p in parts) <= 1
        assert parts[0].first and parts[-1].last


def test_more_shards_than_layers_is_refused():
    with pytest.raises(ShardConfigError, match="more than the model's 30 layers"):
        split_layers(30, 31, 0)


def card(node_id, group="g", of=2, model="m", tokenizer="t", port=5000, phase="forming"):
    sh = {**shard_extras(group, of, port, 30), "phase": phase}
    return Card(node_id=node_id, cluster="c", incarnation=1, version=1, roles=(),
                endpoints={"gossip": "tcp://10.0.0.1:2", "stream": f"tcp://10.0.0.{node_id[-1]}:1"},
                model=model, tokenizer=tokenizer, extras={"shard": sh})


def test_ranks_follow_sorted_node_ids_and_rank0_store():
    cards = [card("bbbbbbbbbbb2", port=7002), card("aaaaaaaaaaa1", port=7001),
             card("ccccccccccc3", group="other")]
    plan = plan_from(cards, "bbbbbbbbbbb2", "g", 2)
    assert plan.rank == 1 and plan.members == ("aaaaaaaaaaa1", "bbbbbbbbbbb2")
    assert (plan.store_host, plan.store_port) == ("10.0.0.1", 7001)
    assert plan_from(cards, "aaaaaaaaaaa1", "g", 2).rank == 0


def test_incomplete_group_waits():
    assert plan_from([card("aaaaaaaaaaa1")], "aaaaaaaaaaa1", "g", 2) is None
    # a member already serving is not forming any more
    assert plan_from([card("aaaaaaaaaaa1"), card("bbbbbbbbbbb2", phase="serving")],
                     "aaaaaaaaaaa1", "g", 2) is None


@pytest.mark.parametrize("other, match", [
    (dict(of=3), "--shards 3"),
    (dict(model="other"), "model"),
    (dict(tokenizer="other"), "tokenizer"),
])
def test_mismatched_members_are_refused(other, match):
    cards = [card("aaaaaaaaaaa1"), card("bbbbbbbbbbb2", **other)]
    with pytest.raises(ShardConfigError, match=match):
        plan_from(cards, "aaaaaaaaaaa1", "g", 2)


def test_a_third_claimant_of_two_slots_is_refused():
    cards = [card("aaaaaaaaaaa1"), card("bbbbbbbbbbb2"), card("ccccccccccc3")]
    with pytest.raises(ShardConfigError, match="3 processes claim its 2 slots"):
        plan_from(cards, "aaaaaaaaaaa1", "g", 2)


def args(**kw):
    base = dict(shards=2, shard_group="g", role=("verifier",), backend="", shard_timeout=10.0)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, match", [
    (dict(shards=1), "drop --shards"),
    (dict(shard_group=""), "--shard-group"),
    (dict(role=("verifier", "proposer")), "verifier alone"),
    (dict(backend="mlx"), "not supported on the mlx backend"),
])
def test_bad_flags_are_refused(kw, match):
    with pytest.raises(ShardConfigError, match=match):
        check_args(args(**kw))


def test_op_header_round_trips():
    op = Op(COMPACT, 7, 2, 40, 0, (3, 4), (0, 2))
    payload = torch.tensor(op.free + op.payload, dtype=torch.int64)
    assert Op.parse(op.header(), payload) == op
