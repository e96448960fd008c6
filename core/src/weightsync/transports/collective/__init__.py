"""Transport `collective`: a torch.distributed broadcast from the trainer (rank 0) to every engine
rank. The group is SGLang's `init_custom_process_group` recipe, so SGLang and LMDeploy engines join
it through their own routes and weightsync's receivers the same way. One broadcast per bucket of
flattened bytes, cut by the engines' `Adapter.layout`; each engine's announce runs on its own
thread while rank 0 broadcasts.

A gloo broadcast to a dead peer fails at rank 0 at once, but the survivors wait for data that
never comes: so on a failure the engines whose health fails are dropped, the group is rebuilt
under a new name (a stale rank can never join it) and the broadcast repeated."""

from weightsync.transports.collective.layout import body_layout, split_payload
from weightsync.transports.collective.messages import Broadcast, JoinGroup, LeaveGroup
from weightsync.transports.collective.options import LAYOUTS, CollectiveOptions
from weightsync.transports.collective.receiving import CollectiveReceiver, _forget_groups
from weightsync.transports.collective.sending import CollectiveTransport

__all__ = ["LAYOUTS", "CollectiveOptions", "CollectiveReceiver", "CollectiveTransport",
           "Broadcast", "JoinGroup", "LeaveGroup", "_forget_groups", "body_layout", "split_payload"]
