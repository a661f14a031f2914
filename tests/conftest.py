"""Fixtures and options shared by every test folder.

`model_cluster` is the one set of real model processes the cluster-level modules share (nodes,
monitor): starting SmolLM2 verifiers and model proposers is the slowest thing the suite does, so
it happens once per session, in parallel, instead of once per module. Modules add their own
short-lived nodes (proposers they kill, a doomed verifier) and stop them themselves; every
request that asserts speculation names its proposers, so the extra members never change another
module's verdict.

`--cluster-secret` runs every cluster test with a fresh cluster secret. It sets
SPECBUS_SECRET_FILE for the whole session, so node processes (LocalCluster inherits the
environment) and in-process nodes and clients (nodes/secret.py reads the variable) all run
CURVE and authenticated gossip, with the test modules unchanged:
`pytest tests/nodes/test_cluster_lossless.py --cluster-secret`.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite's node processes (LocalCluster inherits the environment) and CLI runs verify in the
# reference mode, --weights fp32, unless a test names other weights: their outputs are
# compared with Hugging Face generate and with in-process fp32 engines. The product's default
# (auto: a GGUF model's own blocks, the embedded model's Q4_1 file) has its own tests
# (tests/engine/test_quant_forward.py, tests/nodes/test_quant_cluster.py).
os.environ.setdefault("SPECBUS_WEIGHTS", "fp32")

# Both verifiers: one torch thread each (several model processes share two cores) and a short
# session lease so that the lease tests do not wait long.
VERIFIER_FLAGS = ("--role", "verifier", "--threads", "1", "--session-lease", "2")
SHARED_NODES = (
    ("v1", VERIFIER_FLAGS),
    ("v2", VERIFIER_FLAGS),
    ("ngram", ("--role", "proposer", "--drafter", "ngram")),
    ("int8", ("--role", "proposer", "--drafter", "int8", "--threads", "1")),
    ("mlx", ("--role", "proposer", "--backend", "mlx", "--drafter", "model:smollm2-135m")),
)


@pytest.fixture
def loop():
    """A started I/O loop (bus/loop.py) for one test, stopped after it."""
    from bus.loop import IOLoop

    lp = IOLoop(name="test-io").start()
    yield lp
    lp.stop()


@pytest.fixture
def factory():
    from bus.sockets import SocketFactory

    return SocketFactory()


@pytest.fixture(scope="module")
def tiny_backend(tmp_path_factory):
    """A torch backend of the tiny random Llama (tests/engine/conftest.py's `build_tiny`, seed 0)
    with the embedded model's tokenizer, one torch thread: for node, CLI and tool tests."""
    import torch

    from nodes import models
    from nodes.backends.torch_backend import TorchBackend
    from tests.engine.conftest import build_tiny

    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("tiny")
    build_tiny(folder, models.resolve(models.DEFAULT_MODEL).path, seed=0)
    return TorchBackend.load(str(folder), device="cpu")


def pytest_addoption(parser):
    parser.addoption("--cluster-secret", action="store_true",
                     help="run cluster tests with a cluster secret (CURVE + gossip MAC)")


@pytest.fixture(scope="session", autouse=True)
def _cluster_secret(request, tmp_path_factory):
    if not request.config.getoption("--cluster-secret"):
        yield None
        return
    from bus.security import write_secret_file

    path = write_secret_file(tmp_path_factory.mktemp("cluster-secret") / "cluster.key")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECBUS_SECRET_FILE", str(path))
    try:
        yield path
    finally:
        mp.undo()


@pytest.fixture(scope="session")
def model_cluster(tmp_path_factory, _cluster_secret):
    """v1, v2 (SmolLM2 verifiers) and ngram, int8, mlx proposers on loopback, seeded by v1."""
    from tools.local_cluster import LocalCluster

    c = LocalCluster(log_dir=tmp_path_factory.mktemp("cluster-logs"), mdns=False)
    try:
        (first, flags), *rest = SHARED_NODES
        c.start_node(first, *flags)
        started = [c.spawn(name, *flags) for name, flags in rest]  # load in parallel
        for node in started:
            node.wait_ready()
        yield c
    finally:
        c.stop()
