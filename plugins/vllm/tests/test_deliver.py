"""`VllmAdapter.deliver` without vLLM: each message goes to the route vLLM takes it on (checked
against a recording HTTP server), and in the worker a message of any transport reaches the
round's receiving half (`StagedRound.deliver`). Live: test_live_message.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from weightsync.config import EngineSpec
from weightsync.encodings.raw import RawEncoding
from weightsync.errors import EngineError, PayloadError
from weightsync.interfaces import Announce, Message, Stages
from weightsync.transports.collective import JoinGroup, LeaveGroup
from weightsync.transports.http import FetchPayload
from weightsync.transports.http.sending import HttpReceiver, HttpTransport
from weightsync.wire.bucket import Bucket
from weightsync_vllm.adapter import VllmAdapter, VllmOptions
from weightsync_vllm.staging import CheckpointIndex, StagedRound


class Recorder(ThreadingHTTPServer):
    """Answers every POST like vLLM's routes, and /collective_rpc like two workers that kept
    the answer to the message sent with a reply id."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.fail: set[str] = set()
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: Recorder

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        path = self.path.split("?")[0]
        with self.server.lock:
            self.server.seen.append((path, body))
        if path in self.server.fail:
            out, status = {"detail": f"{path} failed"}, 500
        elif path == "/collective_rpc":
            reply = body["kwargs"].get("reply")
            out, status = {"results": [{"rank": 1, "reply": {"rank": 1, "id": reply}},
                                       {"rank": 0, "reply": {"rank": 0, "id": reply}}]}, 200
        else:
            out, status = {"message": "ok"}, 200
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    server = Recorder()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def adapter(recorder: Recorder) -> Iterator[VllmAdapter]:
    a = VllmAdapter(VllmOptions(token="tok"),
                    EngineSpec(url=f"http://127.0.0.1:{recorder.server_address[1]}", name="e"))
    a.round_id = "r1"
    try:
        yield a
    finally:
        a.close()


class Echo(Message):
    kind = "echo.file"


def test_each_message_goes_where_vllm_takes_it(recorder: Recorder, adapter: VllmAdapter) -> None:
    join = {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo"}
    assert adapter.deliver(Announce({"index": 0, "digest": "d"})) == {}
    assert adapter.deliver(JoinGroup(join)) == {}
    assert adapter.deliver(LeaveGroup(join)) == {}
    assert adapter.deliver(FetchPayload({"header": {"index": 1}, "fetch": {"url": "u"}})) == {}
    got = adapter.deliver(Echo({"path": "/x"}))
    assert got["rank"] == 0                       # the lowest rank's answer
    reply = got["id"]
    assert recorder.seen == [
        ("/update_weights", {"update_info": {"header": {"index": 0, "digest": "d"},
                                             "round": "r1", "token": "tok"}}),
        ("/init_weight_transfer_engine", {"init_info": {"join": join, "token": "tok"}}),
        ("/init_weight_transfer_engine", {"init_info": {"leave": join, "token": "tok"}}),
        ("/update_weights", {"update_info": {"round": "r1", "header": {"index": 1},
                                             "fetch": {"url": "u"}, "token": "tok"}}),
        ("/update_weights", {"update_info": {"round": "r1", "reply": reply, "token": "tok",
                                             "message": {"kind": "echo.file",
                                                         "body": {"path": "/x"}}}}),
        ("/collective_rpc", {"method": "weightsync_state",
                             "kwargs": {"digests": False, "reply": reply}}),
    ]


def test_leaving_is_best_effort_and_a_refused_message_raises(recorder: Recorder,
                                                             adapter: VllmAdapter) -> None:
    recorder.fail = {"/init_weight_transfer_engine", "/update_weights"}
    assert adapter.deliver(LeaveGroup({"group_name": "g"})) == {}
    with pytest.raises(EngineError, match="/update_weights failed"):
        adapter.deliver(Echo({"path": "/x"}))
    assert [p for p, _ in recorder.seen] == ["/init_weight_transfer_engine", "/update_weights"]


def test_announces_leave_in_bucket_order(recorder: Recorder, adapter: VllmAdapter) -> None:
    """Bucket 1's announce waits for bucket 0's to return, whichever thread runs first."""
    t = threading.Thread(target=adapter.deliver, args=(Announce({"index": 1}),))
    t.start()
    t.join(0.3)
    assert t.is_alive() and recorder.seen == []
    adapter.deliver(Announce({"index": 0}))
    t.join(10)
    assert [b["update_info"]["header"]["index"] for _, b in recorder.seen] == [0, 1]


# -- in the worker --------------------------------------------------------------------------
class FileReceiver(HttpReceiver):
    """A receiving half with a message of its own: the body is in a file."""

    def deliver(self, kind: str, body: Mapping[str, Any], session: Stages) -> dict[str, Any]:
        if kind == Echo.kind:
            data = bytearray(Path(body["path"]).read_bytes())
            return {"digest": session.apply(body["header"], memoryview(data))}
        return super().deliver(kind, body, session)


def test_the_round_hands_any_message_to_its_receiving_half(tmp_path: Path) -> None:
    named = [("model.norm.weight", torch.ones(8)), ("lm_head.weight", torch.randn(16, 8))]
    (tmp_path / "m").mkdir()
    save_file(dict(named), str(tmp_path / "m" / "model.safetensors"))
    r = StagedRound(CheckpointIndex(tmp_path / "m"), RawEncoding(),
                    FileReceiver(HttpTransport.Options()), 1)
    new = [(n, t + 1) for n, t in named]
    p = RawEncoding().encode(Bucket(0, new, last=True))
    (tmp_path / "b0").write_bytes(p.body.numpy().tobytes())
    assert r.deliver(Echo.kind, {"header": p.header(), "path": str(tmp_path / "b0")}) == {"digest": p.digest}
    assert r.end() == {0: p.digest} and all(torch.equal(r.staged[n], t) for n, t in new)
    with pytest.raises(PayloadError, match="takes no message 'echo.nope'"):
        r.deliver("echo.nope", {})
