"""HTTP routes of the reference engine (stdlib ThreadingHTTPServer: one thread per request).

  GET  /health                      {"status": "ok", "version": v, "paused": mode|null}  (no key needed)
  GET  /info                        version, model kind, tensors (name -> dtype, shape)
  GET  /weights?name=..             live tensors as safetensors bytes (read-back for checks)
  POST /generate                    {"input_ids": [...], "max_new_tokens": n} -> output_ids, finish_reason
  POST /pause                       {"mode": "abort"|"keep"}
  POST /resume
  POST /weightsync/begin            {"version": v, "transport": {...}, "encoding": {...}}
  POST /weightsync/payload          frame: u64 header length, JSON header, body (http transport)
  POST /weightsync/announce         JSON header of a body placed out of band (shm, collective)
  POST /weightsync/join             group info (collective); returns once joined
  POST /weightsync/end              -> {"digests": {index: digest}}
  POST /weightsync/commit           {"version": v}
  POST /weightsync/abort
  POST /weightsync/load_from_disk   {"path": DIR, "version": v}: reload every *.safetensors in DIR
"""

from __future__ import annotations

import hmac
import json
import logging
import signal
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse

from safetensors.torch import save

from ..errors import PayloadError, WeightSyncError
from ..wire import unframe
from .engine import Conflict, ReferenceEngine

log = logging.getLogger("weightsync.server")
Route = Callable[["Handler", dict[str, list[str]], Any], Any]


def _json_body(h: "Handler") -> Any:
    raw = h.read_body()
    if not raw:
        return {}
    try:
        return json.loads(bytes(raw))
    except ValueError as e:
        raise PayloadError(f"request body is not JSON: {e}") from None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    engine: ReferenceEngine
    api_key: str | None = None
    routes: dict[tuple[str, str], Route] = {}

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def read_body(self) -> memoryview:
        n = int(self.headers.get("Content-Length") or 0)
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.rfile.readinto(view[got:])
            if not k:
                raise PayloadError(f"request body ended after {got} of {n} bytes")
            got += k
        return view

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _dispatch(self, method: str) -> None:
        url = urlparse(self.path)
        route = self.routes.get((method, url.path))
        try:
            if route is None:
                self.read_body()
                self._send(404, json.dumps({"error": f"no route {method} {url.path}"}).encode())
                return
            if self.api_key and url.path != "/health":
                got = self.headers.get("Authorization", "")
                if not hmac.compare_digest(got, f"Bearer {self.api_key}"):
                    self.read_body()
                    self._send(401, json.dumps({"error": "missing or wrong API key: send "
                                                         "'Authorization: Bearer <key>'"}).encode())
                    return
            result = route(self, parse_qs(url.query), None)
            if isinstance(result, bytes):
                self._send(200, result, "application/octet-stream")
            else:
                self._send(200, json.dumps(result if result is not None else {"ok": True}).encode())
        except Conflict as e:
            self._send(409, json.dumps({"error": f"engine {self.engine.name}: {e}"}).encode())
        except (WeightSyncError, ValueError, KeyError, NotImplementedError) as e:
            self._send(400, json.dumps({"error": f"engine {self.engine.name}: {e}"}).encode())
        except Exception as e:  # the engine keeps serving; the caller gets the reason
            log.error("%s %s failed:\n%s", method, url.path, traceback.format_exc())
            self._send(500, json.dumps({"error": f"engine {self.engine.name}: {type(e).__name__}: {e}"}).encode())

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")


def route(method: str, path: str) -> Callable[[Route], Route]:
    def deco(fn: Route) -> Route:
        Handler.routes[(method, path)] = fn
        return fn
    return deco


@route("GET", "/health")
def _health(h: Handler, q: dict, _: Any) -> Any:
    return {"status": "ok", "version": h.engine.version, "paused": h.engine.paused}


@route("GET", "/info")
def _info(h: Handler, q: dict, _: Any) -> Any:
    return h.engine.info()


@route("GET", "/weights")
def _weights(h: Handler, q: dict, _: Any) -> Any:
    return save(h.engine.tensors(q.get("name", [])), metadata={"version": str(h.engine.version)})


@route("POST", "/generate")
def _generate(h: Handler, q: dict, _: Any) -> Any:
    body = _json_body(h)
    return h.engine.generate([int(i) for i in body.get("input_ids", [])],
                             int(body.get("max_new_tokens", 16)))


@route("POST", "/pause")
def _pause(h: Handler, q: dict, _: Any) -> Any:
    h.engine.pause(str(_json_body(h).get("mode", "abort")))
    return {"status": "paused"}


@route("POST", "/resume")
def _resume(h: Handler, q: dict, _: Any) -> Any:
    h.read_body()
    h.engine.resume()
    return {"status": "resumed"}


@route("POST", "/weightsync/begin")
def _begin(h: Handler, q: dict, _: Any) -> Any:
    body = _json_body(h)
    h.engine.begin(int(body["version"]), body)
    return {"status": "begun", "version": int(body["version"])}


@route("POST", "/weightsync/payload")
def _payload(h: Handler, q: dict, _: Any) -> Any:
    header, body = unframe(h.read_body())
    return {"digest": h.engine.apply(header, body)}


@route("POST", "/weightsync/announce")
def _announce(h: Handler, q: dict, _: Any) -> Any:
    return {"digest": h.engine.apply(_json_body(h), None)}


@route("POST", "/weightsync/join")
def _join(h: Handler, q: dict, _: Any) -> Any:
    h.engine.join(_json_body(h))
    return {"status": "joined"}


@route("POST", "/weightsync/end")
def _end(h: Handler, q: dict, _: Any) -> Any:
    h.read_body()
    return {"digests": {str(k): v for k, v in h.engine.end().items()}}


@route("POST", "/weightsync/commit")
def _commit(h: Handler, q: dict, _: Any) -> Any:
    h.engine.commit(int(_json_body(h)["version"]))
    return {"version": h.engine.version}


@route("POST", "/weightsync/abort")
def _abort(h: Handler, q: dict, _: Any) -> Any:
    h.read_body()
    h.engine.abort()
    return {"version": h.engine.version}


@route("POST", "/weightsync/load_from_disk")
def _load_from_disk(h: Handler, q: dict, _: Any) -> Any:
    body = _json_body(h)
    if "path" not in body or "version" not in body:
        raise PayloadError('load_from_disk needs {"path": DIR, "version": v}')
    return {"version": h.engine.load_from_disk(str(body["path"]), int(body["version"]))}


def make_server(engine: ReferenceEngine, host: str = "127.0.0.1", port: int = 0,
                api_key: str | None = None) -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"engine": engine, "api_key": api_key})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8100, api_key: str | None = None,
          name: str | None = None, device: str = "cpu") -> None:
    from ..plugins import load_components
    from .model import load_model

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = ReferenceEngine(load_model(model_dir, device), load_components(), name or f"{host}:{port}")
    server = make_server(engine, host, port, api_key)
    real_port = server.server_address[1]
    engine.name = name or f"{host}:{real_port}"
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"weightsync reference engine serving {model_dir} ({engine.model.kind}) "
          f"on http://{host}:{real_port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        sys.stdout.flush()
