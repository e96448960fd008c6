"""The contract kit: base test classes a plugin subclasses in a few lines, plus helpers to run
reference engines as real processes and to build tiny models offline.

    from weightsync.testing import TransportContract

    class TestMyTransport(TransportContract):
        def make_transport(self, tmp_path):
            return MyTransport(MyTransport.Options())
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.testing.engines import EngineProcess, start_all

from weightsync.net.server import free_port
from weightsync.testing.sample import sample_state_dict, write_weights_only_model

if TYPE_CHECKING:
    from weightsync.testing.contracts import (AdapterContract, EncodingContract, ExporterContract,
                                              FleetContract, PeerSourceContract, ServingPeer,
                                              TransportContract)

_CONTRACTS = ("AdapterContract", "EncodingContract", "ExporterContract", "FleetContract",
              "PeerSourceContract", "ServingPeer", "TransportContract")


def __getattr__(name: str) -> Any:
    """The contract classes load on first use: they need pytest (the `testing` extra), while the
    engine helpers here also serve `weightsync demo` and `bench` on a plain install."""
    if name not in _CONTRACTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        from weightsync.testing import contracts
    except ModuleNotFoundError as e:
        if e.name != "pytest":
            raise
        raise ModuleNotFoundError(f"weightsync.testing.{name} needs pytest: pip install "
                                  f"'weightsync-core[testing]'", name="pytest") from e
    return getattr(contracts, name)


__all__ = ["AdapterContract", "EncodingContract", "EngineProcess", "ExporterContract",
           "FleetContract", "PeerSourceContract", "ServingPeer", "TransportContract", "free_port",
           "sample_state_dict", "start_all", "write_weights_only_model"]
