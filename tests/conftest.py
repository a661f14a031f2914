"""Suite-wide option: `--cluster-secret` runs every cluster test with a fresh cluster secret.

It sets SPECBUS_SECRET_FILE for the whole session, so node processes (LocalCluster inherits
the environment) and in-process nodes and clients (nodes/secret.py reads the variable) all
run CURVE and authenticated gossip, with the test modules unchanged:
`pytest tests/nodes/test_cluster_lossless.py --cluster-secret`.
"""

from __future__ import annotations

import pytest


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
