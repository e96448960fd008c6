import pytest

from weightsync import PayloadError, load_components, make_plugin_manager
from weightsync_reference.contracts import TransportContract
from weightsync_echo.transport import EchoTransport


def test_plugin_is_installed():
    assert load_components(make_plugin_manager()).transports.get("echo") is EchoTransport


def test_receiver_refuses_paths(tmp_path):
    receiver = EchoTransport.receiver(EchoTransport.Options(directory=str(tmp_path)))
    with pytest.raises(PayloadError, match="plain name"):
        receiver.deliver("echo.file", {"file": "../secret", "header": {"nbytes": 0}}, None)


class TestEchoTransport(TransportContract):
    def make_transport(self, tmp_path):
        return EchoTransport(EchoTransport.Options(directory=str(tmp_path / "echo")))
