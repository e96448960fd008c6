"""The contract kit: base test classes a plugin subclasses in a few lines, plus helpers to run
reference engines as real processes and to build tiny models offline.

    from weightsync.testing import TransportContract

    class TestMyTransport(TransportContract):
        def make_transport(self, tmp_path):
            return MyTransport(MyTransport.Options())
"""

from .contracts import AdapterContract, EncodingContract, ExporterContract, TransportContract
from .engines import EngineProcess, free_port
from .sample import sample_state_dict, write_weights_only_model

__all__ = ["AdapterContract", "EncodingContract", "EngineProcess", "ExporterContract",
           "TransportContract", "free_port", "sample_state_dict", "write_weights_only_model"]
