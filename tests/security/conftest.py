import pytest

from bus.security import Security, write_secret_file


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory):
    return write_secret_file(tmp_path_factory.mktemp("secret") / "cluster.key")


@pytest.fixture(scope="session")
def other_secret_file(tmp_path_factory):
    return write_secret_file(tmp_path_factory.mktemp("secret") / "other.key")


@pytest.fixture(scope="session")
def keys(secret_file):
    return Security.from_file(secret_file)


@pytest.fixture(scope="session")
def wrong_keys(other_secret_file):
    return Security.from_file(other_secret_file)
