"""The messages of transport `collective`: join the group, take a broadcast, leave the group.
`Broadcast` is an `Announce` of its own kind, so an adapter that translates broadcasts (SGLang,
LMDeploy) accepts them without accepting every out-of-band announce."""

from __future__ import annotations

from weightsync.interfaces.messages import Announce, Message

__all__ = ["Broadcast", "JoinGroup", "LeaveGroup"]


class Broadcast(Announce):
    """A payload rank 0 broadcasts on the group: `body` is its header, whose "transport" names
    the group, layout, byte count and `seq` (the order the engine must receive them in)."""

    kind = "collective.broadcast"


class JoinGroup(Message):
    """Blocking: join the trainer's group. `body` is SGLang's init body: master_address,
    master_port, rank_offset, world_size, group_name, backend."""

    kind = "collective.join"


class LeaveGroup(Message):
    """Best effort: destroy the group named in `body` (the join body it was built with)."""

    kind = "collective.leave"
