"""HTTP to engines in one place: bearer keys, timeouts, errors naming the engine in its words."""

from __future__ import annotations

from typing import Any, Iterable

import requests

from weightsync.errors import EngineError, EngineUnavailable, EngineUnreachable

__all__ = ["Parts", "auth_headers", "call", "error_text", "forget_connections", "json_of",
           "session_for"]


class Parts:
    """Several byte buffers sent as one body with a Content-Length, without joining them."""

    def __init__(self, parts: Iterable[bytes | memoryview]) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts]

    def __len__(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __iter__(self):  # noqa: ANN204
        return iter(self.parts)


def session_for(engine: Any) -> requests.Session:
    """A session for one engine, with its TLS verification (`EngineSpec.verify`) on every call."""
    s = requests.Session()
    s.verify = getattr(engine, "verify", True)
    return s


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_text(resp: requests.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:2000] or resp.reason
    if isinstance(body, dict):
        for key in ("error", "message", "detail"):
            if body.get(key):
                return str(body[key])
    return str(body)[:2000]


def call(session: requests.Session, engine: str, method: str, url: str, *, timeout: float,
         ok: Iterable[int] = (200,), **kwargs: Any) -> requests.Response:
    """Send one request; raise EngineUnavailable when nobody answers, EngineError on a refusal."""
    kwargs.setdefault("verify", session.verify)   # requests lets $REQUESTS_CA_BUNDLE override a
    try:                                          # session's own verify: pass it per request
        resp = session.request(method, url, timeout=timeout, **kwargs)
    except requests.Timeout:
        raise EngineUnavailable(engine, f"{method} {url} got no answer within {timeout:g}s") from None
    except requests.ConnectionError as e:
        raise EngineUnreachable(engine, f"{method} {url} failed: {_why(e)}; is the engine "
                                        f"running at that address?") from None
    if resp.status_code not in ok:
        if resp.status_code >= 500:
            forget_connections(session)
        raise EngineError(engine, f"{method} {url} -> HTTP {resp.status_code}: {error_text(resp)}",
                          status=resp.status_code)
    return resp


def forget_connections(session: requests.Session) -> None:
    """Drop the session's idle keep-alive connections (uvicorn closes one just after a 5xx)."""
    for adapter in session.adapters.values():
        adapter.close()


def _why(e: requests.ConnectionError) -> str:
    """Refused or reset: the OS's words from deep in requests' chain of wrapped errors."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        x = todo.pop(0)
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno is not None and x.strerror:
            lost = isinstance(x, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError))
            return f"{'connection lost' if lost else 'cannot connect'} ({x.strerror})"
        todo += [a for a in (*x.args, getattr(x, "reason", None), x.__cause__, x.__context__)
                 if isinstance(a, BaseException)]
    return f"cannot connect ({type(e).__name__})"


def json_of(resp: requests.Response, engine: str) -> Any:
    if not resp.content:
        return None
    try:
        return resp.json()
    except ValueError:
        raise EngineError(engine, f"{resp.request.method} {resp.url} answered non-JSON: "
                                  f"{resp.text[:200]!r}") from None
