"""Transport `collective`: a torch.distributed broadcast from the trainer (rank 0) to every engine
rank, for disaggregated clusters. The group is SGLang's `init_custom_process_group` recipe (TCP
store + PrefixStore(group name) + a gloo or nccl group), so SGLang and LMDeploy engines join it
through their own HTTP routes and weightsync's receivers join it the same way.

Contract (fixed in COLLECTIVE_SPEC): one broadcast per bucket of flattened bytes, never one per
tensor; what is broadcast depends on the engines' `Adapter.layout` ("safetensors": the whole
body; "flat": its data section; "flat_per_dtype": one broadcast per run of one dtype). For every
broadcast each engine's `announce(header)` runs on its own thread while rank 0 broadcasts.

Why the failure handling looks the way it does: a gloo broadcast to a peer that died fails at
rank 0 at once, but the surviving ranks wait for data that never comes. So when a broadcast fails
the transport asks every engine for its health, drops the dead ones, rebuilds the group for the
survivors under a new group name (a stale rank can never join it) and broadcasts the same bytes
again. An engine that never joins makes the group creation time out after `timeout` seconds: the
engines that did not answer are dropped and the group is built once more without them.

The package: `options` (what users set), `receiving` (the engine's half: joining and receiving),
`group` (the trainer's group lifecycle: build, join failures, rebuild), `ahead` (the
announce-ahead state), `layout` (how a payload is cut into broadcasts) and `sending` (the
trainer's half: send buffers, announces, broadcasts and who broke one)."""

from weightsync.transports.collective.layout import body_layout, split_payload
from weightsync.transports.collective.messages import Broadcast, JoinGroup, LeaveGroup
from weightsync.transports.collective.options import LAYOUTS, CollectiveOptions
from weightsync.transports.collective.receiving import CollectiveReceiver, _forget_groups
from weightsync.transports.collective.sending import CollectiveTransport

__all__ = ["LAYOUTS", "CollectiveOptions", "CollectiveReceiver", "CollectiveTransport",
           "Broadcast", "JoinGroup", "LeaveGroup", "_forget_groups", "body_layout", "split_payload"]
