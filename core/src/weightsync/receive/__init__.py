"""The engine side of a sync, for engines that run weightsync's own receiving code (the reference
engine, the vLLM backend, the disk agent). It stages every bucket, checks names, shapes, dtypes and
digests, and applies nothing until commit, so a failed sync leaves the engine at its old version.

`stores`: what an engine exposes (`WeightStore`) and the checks against it; `staging`: the steps of
receiving one payload; `session`: the round (`ReceiveSession`)."""

from weightsync.receive.session import ReceiveSession
from weightsync.receive.staging import (BodyReader, build_encoding, build_receiver, check_digest,
                                        decode_checked, payload_nbytes, read_exact, read_staged,
                                        round_digests, stage_digest, stage_from)
from weightsync.receive.stores import DictStore, ModuleStore, WeightStore, check_tensor

__all__ = ["BodyReader", "DictStore", "ModuleStore", "ReceiveSession", "WeightStore",
           "build_encoding", "build_receiver", "check_digest", "check_tensor", "decode_checked",
           "payload_nbytes", "read_exact", "read_staged", "round_digests",
           "stage_digest", "stage_from"]
