"""The contract kit: base test classes a plugin subclasses in a few lines, and the sample weights
they push. The contracts that need real receiving engines (transports, fleet sources) come with
the reference engine (`weightsync_reference.contracts`).

    from weightsync.testing import EncodingContract

    class TestMyEncoding(EncodingContract):
        def make_encoding(self):
            return MyEncoding(MyEncoding.Options())
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightsync.testing.sample import perturb, sample_state_dict, write_weights_only_model

if TYPE_CHECKING:
    from weightsync.testing.contracts import (AdapterContract, EncodingContract, ExporterContract,
                                              PeerSourceContract, ServingPeer)

_CONTRACTS = ("AdapterContract", "EncodingContract", "ExporterContract", "PeerSourceContract",
              "ServingPeer")


def __getattr__(name: str) -> Any:
    """Contracts load on first use: they need pytest (the `testing` extra); the samples do not."""
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


__all__ = ["AdapterContract", "EncodingContract", "ExporterContract", "PeerSourceContract",
           "ServingPeer", "perturb", "sample_state_dict", "write_weights_only_model"]
