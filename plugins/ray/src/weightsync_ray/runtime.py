"""The few Ray calls every module here needs, with the errors said in weightsync's words: Ray is
imported only here and only when called, so a missing Ray is one clear message, and a dead or
silent actor is an error that names the actor, not a Ray traceback."""

from __future__ import annotations

import re
from typing import Any

from weightsync.errors import WeightSyncError

__all__ = ["ActorGone", "ActorRestarting", "RayMissing", "connect", "get", "node_ip",
           "reason", "require_ray", "restarted", "short"]


class RayMissing(WeightSyncError):
    """Ray is not installed where a Ray component was asked for."""


class ActorGone(WeightSyncError):
    """A Ray actor weightsync needs is dead, or did not answer in time."""


class ActorRestarting(ActorGone):
    """The actor died and Ray is restarting it: calls fail until it is back."""


def require_ray() -> Any:
    """The `ray` module, or a RayMissing that says how to install it."""
    try:
        import ray
    except ModuleNotFoundError as e:
        if e.name != "ray":
            raise
        raise RayMissing("weightsync's Ray components need Ray on this machine: "
                         "pip install weightsync-ray") from None
    return ray


def connect(address: str | None = None, namespace: str | None = None) -> Any:
    """Ray, connected: as it is inside a Ray actor or a driver that called `ray.init`, else
    `ray.init(address)` (None: RAY_ADDRESS, or a running local cluster, or a new one)."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, log_to_driver=True)
    return ray


def restarted(ctx: Any) -> bool:
    """Whether Ray restarted the current actor (read without Ray's deprecation warning)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(ctx.was_current_actor_reconstructed)


def node_ip() -> str:
    """This node's address as Ray knows it (what other nodes reach it at)."""
    return require_ray().util.get_node_ip_address()


def get(ref: Any, timeout: float, what: str) -> Any:
    """`ray.get(ref)` within `timeout`; the task's own exception is raised as itself, a dead
    actor or a timeout as ActorGone naming `what`."""
    ray = require_ray()
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None
        raise
    except ray.exceptions.GetTimeoutError:
        raise ActorGone(f"{what} did not answer within {timeout:g}s") from None
    except ray.exceptions.ActorUnavailableError as e:
        raise ActorRestarting(f"{what} is restarting: {reason(e)}") from None
    except ray.exceptions.RayActorError as e:
        raise ActorGone(f"{what} is gone: {reason(e)}") from None


def reason(e: BaseException) -> str:
    """What a Ray error says, without its traceback. For an actor whose constructor raised, the
    constructor's exception and its whole message; otherwise the first line, and the last one
    when it differs."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    lines = text.splitlines()
    if getattr(e, "actor_init_failed", False):
        frame = next((i for i, ln in enumerate(lines) if ln.startswith('  File "')), None)
        if frame is not None:
            start = next((i for i in range(frame + 1, len(lines))
                          if lines[i] and not lines[i][0].isspace()), None)
            if start is not None:
                exc = "\n".join(lines[start:]).strip()
                return "its constructor raised " + re.sub(r"^(\w+\.)+(?=\w+: )", "", exc)
    kept = [ln.strip() for ln in lines if ln.strip() and not set(ln.strip()) <= set("^~ ")]
    if not kept:
        return type(e).__name__
    why = next((ln for ln in kept if "is dead because" in ln), None)
    if why is not None:                   # Ray's own account, without its list of guesses
        rest = why.split("is dead because", 1)[1].strip()
        return "dead because " + rest.split(". ")[0].rstrip(".")
    first, last = kept[0][:300], kept[-1][:600]
    return first if first == last else f"{first} ... {last}"


def short(text: str, limit: int = 200) -> str:
    """One sentence of an error: without torch's `[file.cc:N] ` prefix, cut at its first full
    stop once it runs past `limit`."""
    text = re.sub(r"^\[[^\]]*\] ", "", text.strip().splitlines()[0] if text.strip() else "")
    if len(text) > limit and ". " in text[:limit * 2]:
        text = text[:text.index(". ") + 1]
    return text
