import pytest

from bus.loop import IOLoop
from bus.sockets import SocketFactory


@pytest.fixture
def loop():
    lp = IOLoop(name="test-io").start()
    yield lp
    lp.stop()


@pytest.fixture
def factory():
    return SocketFactory()
