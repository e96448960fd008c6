"""The engine side of a sync, for engines that run weightsync's own receiving code: every bucket
is staged and checked (names, shapes, dtypes, digests) and nothing is applied until commit.
`stores`: what an engine exposes; `staging`: receiving one payload; `session`: the round."""

from weightsync.receive.session import ReceiveSession
from weightsync.receive.staging import (BodyReader, build_encoding, build_receiver, check_digest,
                                        decode_checked, payload_nbytes, read_exact, read_staged,
                                        round_digests, stage_digest, stage_from)
from weightsync.receive.stores import DictStore, ModuleStore, WeightStore, check_tensor

__all__ = ["BodyReader", "DictStore", "ModuleStore", "ReceiveSession", "WeightStore",
           "build_encoding", "build_receiver", "check_digest", "check_tensor", "decode_checked",
           "payload_nbytes", "read_exact", "read_staged", "round_digests",
           "stage_digest", "stage_from"]
