"""An EAGLE-3 head served by a proposer node (issue 23's F3 data plane): the verifier sends the
hidden states of what it cached with every commit push, the proposer's head drafts from them.
A tiny random model and a random head in the published layout, over real sockets: the output
is the verifier's own whatever the head drafts, and the head really drafts."""

from __future__ import annotations

import pytest

from nodes.drafters.eagle.source import EagleDrafter
from nodes.engine.core import Engine
from nodes.proposer.role import ProposerRole
from nodes.verifier.proposer_client import DraftPolicy
from nodes.verifier.role import VerifierRole
from tests.engine.eagle_heads import head_config, head_tensors, write_head
from tests.nodes.conftest import BusHost
from tests.nodes.test_verifier_requests import PROMPT, FakeMembership, generate, refused


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("eagle_remote"), head_tensors(), head_config())


@pytest.fixture
def cluster(bus, host, tiny_backend, head_dir):
    host.membership = FakeMembership()
    verifier = VerifierRole(Engine(tiny_backend, None, max_draft=4),
                            policy=DraftPolicy(forced_s=60.0))
    verifier.attach(host)
    proposer_host = BusHost(*bus, node_id="eagle-1")
    drafter = EagleDrafter.load(head_dir, tiny_backend)
    proposer = ProposerRole(drafter, vocab_size=tiny_backend.vocab_size)
    proposer.attach(proposer_host)
    yield host, proposer, drafter, proposer_host.server.endpoint
    proposer.close()
    verifier.close()


def test_a_remote_head_drafts_from_the_verifiers_hidden_states(cluster):
    host, proposer, drafter, endpoint = cluster
    host.membership.add_proposer("eagle-1", endpoint, name="eagle", extras={
        "hidden_layers": list(drafter.hidden_layers), "hidden_size": drafter.hidden_size})
    plain = generate(host, prompt=PROMPT, max_tokens=24, speculate=False)
    forced = generate(host, prompt=PROMPT, max_tokens=24, proposers=["eagle"], draft="force")
    assert forced["stats"]["token_ids"] == plain["stats"]["token_ids"]
    link = forced["stats"]["proposers"]["eagle-1"]
    assert link["chunks"] >= 1 and link["bad_replies"] == 0 and link["errors"] == 0
    # a head drafts only once it holds the verifier's features of every committed position
    # (EagleState.draft_ahead): drafted tokens prove they came, aligned, over the wire
    assert proposer.stats.draft_tokens > 0
    assert link["drafted"] > 0


def test_a_proposer_wanting_hidden_states_the_verifier_lacks_is_left_out(cluster):
    host, proposer, drafter, endpoint = cluster
    host.membership.add_proposer("eagle-1", endpoint, name="eagle", extras={
        "hidden_layers": [0, 7], "hidden_size": drafter.hidden_size})  # the tiny model has 2
    err = refused(host, prompt=PROMPT, max_tokens=4, proposers=["eagle"], draft="force")
    assert err.code == "no_proposer"
    assert generate(host, prompt=PROMPT, max_tokens=4)["finish_reason"] in ("length", "eos")


def test_hidden_rows_beyond_the_cached_positions_are_refused(cluster):
    """A peer cannot grow a session's features past its tokens: rows for more positions than
    the verifier has cached are an out_of_sync error, and the proposer keeps serving."""
    import numpy as np

    from bus.streams import RemoteError
    from codec.sampling import SamplingParams
    from codec.structs import SessionExtend, SessionOpen

    host, proposer, drafter, endpoint = cluster
    width = len(drafter.hidden_layers) * drafter.hidden_size
    call = host.client.request(endpoint, SessionOpen(
        "s-rows", np.arange(1, 6, dtype=np.int32), 30.0, SamplingParams()).to_message(),
        timeout=30)
    rows = np.zeros(10 * width, dtype=np.float16)  # 10 rows; 5 positions cached after it
    push = SessionExtend("s-rows", np.array([7], np.int32), 6, None, width, rows)
    with pytest.raises(RemoteError) as err:
        host.client.request(endpoint, push.to_message(), timeout=30).result(30)
    assert err.value.code == "out_of_sync"
    fine = SessionExtend("s-rows", np.array([7], np.int32), 6, None, width, rows[: 5 * width])
    assert host.client.request(endpoint, fine.to_message(), timeout=30).result(30).type == "done"
    call.cancel()
