"""One URL for the whole fleet: an HTTP service that takes generation requests and spreads them
over the live members holding a fitting version (through a RolloutClient), so a trainer or an
agent framework talks to one opaque endpoint while engines join, die and fall behind.

  POST /generate   {"prompts": [[ids], ...] | "input_ids": [ids], "sampling": {...},
                    "min_version"?: v, "exact_version"?: v, "wait"?: s, "mixed"?: "retry"|"keep"}
                   -> {"samples": [{token_ids, logprobs, finish_reason, engine, version,
                       version_end, prompt_ids, prompt_index}, ...]}
                   503 {"error", "held": {member: version}} when no member could serve in time;
                   400 for bad parameters, one an engine cannot honour, or a request an engine
                   refused as malformed (its 4xx; the engine is not marked down); 413 for a
                   body over `MAX_BODY` or more than `max_tokens` tokens asked for (prompts x n x
                   max_new_tokens). A caller that hangs up has its generations cancelled on the
                   engines; a prompt whose engine stops answering moves to another (the
                   client's `stuck`)
  GET  /members    -> {"members": {name: version or why not}}
  GET  /health     -> {"status": "ok", "members": n}   (no key needed)

Every other route needs the router's key (`Authorization: Bearer`): a router runs without one
only when started `insecure` on purpose, and says so."""

from __future__ import annotations

import logging
import threading
from typing import Any, cast

from pydantic import ValidationError

from weightsync.errors import ConfigError
from weightsync.interfaces.sampling import Refused, SamplingParams, StaleEngines, Unsupported
from weightsync.net.caller import hung_up
from weightsync.net.server import MiB, HttpError, Routes, Server, make_server
from weightsync_rl.rollout.client import Cancelled, RolloutClient

log = logging.getLogger("weightsync_rl.router")
routes = Routes()
MAX_PROMPTS = 4096
MAX_BODY = 32 * MiB          # 4096 prompts of ~1k token ids as JSON, with room
MAX_TOKENS = 1 << 22         # tokens one request may ask for: prompts x n x max_new_tokens


def _ids(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not v or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise HttpError(400, f"{what} must be a non-empty list of integer token ids")
    return v


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise HttpError(400, f"{key} must be an integer, got {v!r}")
    return v


@routes.add("GET", "/health", auth=False, max_body=0)
def _health(h: Any, q: dict) -> Any:
    return {"status": "ok", "members": len(h.client.slots())}


@routes.add("GET", "/members", max_body=0)
def _members(h: Any, q: dict) -> Any:
    return {"members": h.client.held()}


@routes.add("POST", "/generate", max_body=MAX_BODY)
def _generate(h: Any, q: dict) -> Any:
    body = h.json_body()
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    if "prompts" in body:
        raw = body["prompts"]
        if not isinstance(raw, list) or not 0 < len(raw) <= MAX_PROMPTS:
            raise HttpError(400, f"prompts must be a list of 1..{MAX_PROMPTS} token-id lists")
        prompts = [_ids(p, f"prompts[{i}]") for i, p in enumerate(raw)]
    else:
        prompts = [_ids(body.get("input_ids"), "input_ids")]
    try:
        params = SamplingParams.model_validate(body.get("sampling") or {})
    except ValidationError as e:
        raise HttpError(400, "bad sampling parameters: " + "; ".join(
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())) from None
    wait = body.get("wait", 30.0)
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= 3600:
        raise HttpError(400, "wait must be a number of seconds in 0..3600")
    mixed = body.get("mixed", "retry")
    if mixed not in ("retry", "keep"):
        raise HttpError(400, "mixed must be 'retry' or 'keep'")
    asked = len(prompts) * params.n * params.max_new_tokens
    if asked > h.max_tokens:
        raise HttpError(413, f"this request asks for {asked} tokens ({len(prompts)} prompts x n "
                             f"{params.n} x max_new_tokens {params.max_new_tokens}); the router "
                             f"takes at most {h.max_tokens} per request: split it")
    cancel, done = threading.Event(), threading.Event()
    threading.Thread(target=_watch_caller, args=(h.connection, cancel, done), daemon=True,
                     name="ws-router-caller").start()
    try:
        samples = h.client.sample(prompts, params, min_version=_opt_int(body, "min_version"),
                                  exact_version=_opt_int(body, "exact_version"),
                                  wait=float(wait), mixed=mixed, cancel=cancel)
    except Cancelled:
        h.close_connection = True
        raise HttpError(499, "the caller hung up; its generations were cancelled") from None
    except StaleEngines as e:
        raise HttpError(503, str(e), held=e.held) from None
    except (Unsupported, Refused) as e:
        raise HttpError(400, str(e)) from None
    finally:
        done.set()
    return {"samples": [s.to_json() for s in samples]}


def _watch_caller(sock: Any, cancel: threading.Event, done: threading.Event) -> None:
    """Until the request is answered: a caller that hung up cancels its generations."""
    while not done.wait(0.2):
        if hung_up(sock):
            log.info("a caller hung up; its generations are cancelled")
            cancel.set()
            return


class RolloutRouter:
    """The router service around `client`, started on a thread (`start`) or in the foreground
    (`serve_forever`)."""

    def __init__(self, client: RolloutClient, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, *, insecure: bool = False,
                 max_tokens: int = MAX_TOKENS) -> None:
        if not api_key and not insecure:
            raise ConfigError("the router has no key: anyone who reaches it could generate on "
                              "every engine of the fleet. Give it one (`weightsync route "
                              "--api-key-file`, $WEIGHTSYNC_ROUTER_KEY, `api_key=`), or say "
                              "`--insecure` (`insecure=True`) for a test setup")
        if not api_key:
            log.warning("the router at %s:%s serves without a key (insecure): any caller that "
                        "reaches it generates on the fleet's engines", host, port)
        self.client = client
        self.server: Server = make_server(routes, host, port, api_key=api_key, name="router",
                                          state={"client": client, "max_tokens": max_tokens},
                                          max_connections=256)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        # typeshed allows a bytes address (AF_UNIX); a TCP server's is (host, port)
        host, port = cast("tuple[str, int]", self.server.server_address[:2])
        return f"http://{host}:{port}"

    def start(self) -> "RolloutRouter":
        self._thread = threading.Thread(target=self.server.serve_forever, name="ws-router",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()

    def __enter__(self) -> "RolloutRouter":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
