"""The trainer's side of the cluster bench. `bench.py` starts it inside the trainer's namespace
(`ip netns exec`), with a JSON spec naming the cluster's hosts; it starts a reference engine in
every engine host's namespace (listening on that host's address), measures, and writes JSON.

What it measures, all over the shaped links:
- one copy over one link: the model's bytes sent once with plain TCP to a sink on e0 (the floor);
- the link's round trip for one byte, idle and while a bulk copy fills the link (queueing);
- the stage cost per byte of one member: a one-core copy + xxh3 pass (what every stage does);
- the relay floor (`floor.py`): one copy passed down a chain of the first N member hosts by plain
  TCP forwarders, for every N: what the cluster itself costs a relay shape;
- per members N, shape and encoding: `WeightSync.push` end to end (best of `repeat` after one
  warm-up), the trainer's egress during each push (its link's tx counter delta), and the CPU
  seconds the trainer and the members spent on it (all of them share this machine's cores).

    python worker.py SPEC.json
"""

from __future__ import annotations

import copy
import json
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from weightsync import WeightSync
from weightsync_bench.measure import DELTA_DENSITY, cpu_seconds, perturbed
from weightsync_bench.model import model_bytes
from weightsync_reference.processes import start_all
from weightsync_bench.netns import link_bytes
from weightsync_reference.processes import EngineProcess

from floor import relay_floor

# A shape is the config fragment that makes a push take it: add one here when the transport can
# (for example a fan-out setting) and `--shape` accepts it. star: the trainer sends every engine
# its own copy over `http`, which is what exists today.
SHAPES: dict[str, dict[str, Any]] = {
    "star": {"transport": {"kind": "http"}},
    # members pass each bucket on in checked pieces (docs/transports.md, relay shapes)
    "chain": {"transport": {"kind": "http", "options": {"shape": "chain"}}},
    "tree": {"transport": {"kind": "http", "options": {"shape": "tree", "degree": 2}}},
    # weightsync-nixl: every engine READs each payload from the trainer's registered memory
    # (UCX over TCP on each host's shaped link; bench.py sets UCX_TLS and UCX_NET_DEVICES)
    "nixl": {"transport": {"kind": "nixl", "options": {"device": "cpu"}}},
}
ENCODINGS: dict[str, dict[str, Any] | None] = {
    "raw": None,
    # the disk_delta plugin's encoding over the same transport; every timed push carries a
    # version in which DELTA_DENSITY of the elements changed (as `weightsync bench` does)
    "delta": {"kind": "delta", "options": {"full_when_chain_exceeds": 0}},
}
PORT = 8100
SINK_PORT = 9600
# a sink on e0: each message is an 8-byte length and that many bytes; it answers one byte after
# each, so the sender's clock stops when every byte arrived
SINK = """
import socket, struct, sys, threading
def serve(c):
    buf = bytearray(1 << 20)
    while True:
        head = c.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return c.close()
        left = struct.unpack("!Q", head)[0]
        while left:
            got = c.recv_into(buf, min(left, len(buf)))
            if not got:
                return c.close()
            left -= got
        c.sendall(b"k")
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def log(msg: str) -> None:
    print(f"[trainer] {msg}", flush=True)


def in_ns(spec: dict[str, Any], host: str) -> list[str]:
    return ["ip", "netns", "exec", spec["cluster"]["hosts"][host]["ns"]]


def addr(spec: dict[str, Any], host: str) -> str:
    return spec["cluster"]["hosts"][host]["addr"]


def trainer_tx(spec: dict[str, Any]) -> int:
    return link_bytes(spec["cluster"]["hosts"]["trainer"]["ns"]).tx


# -- the link: one copy, round trips, stage cost ----------------------------------------------
def connect(host: str, port: int, timeout: float = 60.0) -> socket.socket:
    """A connection to a server that may still be starting (retried, bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((host, port), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def message(s: socket.socket, body: memoryview | bytes) -> float:
    """Seconds until the sink acknowledged all of `body`."""
    t0 = time.perf_counter()
    s.sendall(struct.pack("!Q", len(body)))
    s.sendall(body)
    if s.recv(1) != b"k":
        raise RuntimeError("the link sink closed before acknowledging")
    return time.perf_counter() - t0


def link_costs(spec: dict[str, Any], flat: torch.Tensor, repeat: int) -> dict[str, Any]:
    """The floor and the round trips, against a sink on e0."""
    sink = subprocess.Popen(in_ns(spec, "e0") + [sys.executable, "-c", SINK, addr(spec, "e0"),
                                                 str(SINK_PORT)])
    try:
        body = memoryview(flat.numpy())
        bulk = connect(addr(spec, "e0"), SINK_PORT)
        ping = connect(addr(spec, "e0"), SINK_PORT)
        idle = [message(ping, b"x") for _ in range(50)]
        tx0 = trainer_tx(spec)
        runs = [message(bulk, body) for _ in range(repeat + 1)][1:]     # first: warm-up
        tx = (trainer_tx(spec) - tx0) / (repeat + 1)
        loaded: list[float] = []
        t = threading.Thread(target=message, args=(bulk, body))
        base = trainer_tx(spec)
        t.start()
        while t.is_alive() and trainer_tx(spec) - base < 4 * 2**20:    # the queue fills first
            time.sleep(0.01)
        while t.is_alive() and len(loaded) < 50:
            loaded.append(message(ping, b"x"))
        t.join()
        bulk.close()
        ping.close()
    finally:
        sink.kill()
        sink.wait()
    return {"one_copy_s": min(runs), "one_copy_runs": runs, "one_copy_egress_bytes": int(tx),
            "rtt_idle_s": statistics.median(idle),
            "rtt_loaded_s": statistics.median(loaded) if loaded else None}


def stage_cost(sd: dict[str, torch.Tensor]) -> float:
    """Seconds per byte of one copy + xxh3 pass on one core (what a member's stage does)."""
    from weightsync.wire.bucket import tensor_header
    from weightsync.wire.digests import copy_digest, warm
    warm()
    dst = {k: torch.empty_like(t) for k, t in sd.items()}
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for k, t in sd.items():
            copy_digest(dst[k], t, tensor_header(k, t), source=True)
        best = min(best, time.perf_counter() - t0)
    return best / model_bytes(sd)


# -- pushes -------------------------------------------------------------------------------------
def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Pushes:
    """Every (members, shape, encoding) row, into the first `members` of the running engines."""

    def __init__(self, spec: dict[str, Any], sd: dict[str, torch.Tensor],
                 engines: list[EngineProcess]) -> None:
        self.spec, self.sd, self.engines = spec, sd, engines
        self.version = 0
        self.seed = 100

    def _next_version(self, engines: list[EngineProcess]) -> int:
        self.version = max(self.version + 1, *(e.health()["version"] + 1 for e in engines))
        return self.version

    def row(self, members: int, shape: str, encoding: str) -> dict[str, Any]:
        engines = self.engines[:members]
        cfg: dict[str, Any] = {"adapter": "reference", "engines": [e.spec() for e in engines],
                               "sync": {"progress": "off"}}
        if self.spec["bucket"]:
            cfg["exporter"] = {"kind": "torch", "options": {"bucket_bytes": self.spec["bucket"]}}
        if ENCODINGS[encoding] is not None:
            cfg["encoding"] = ENCODINGS[encoding]
        cfg = merged(cfg, SHAPES[shape])
        if shape in ("chain", "tree") and self.spec.get("piece_bytes"):
            cfg = merged(cfg, {"transport": {"options": {"piece_bytes": self.spec["piece_bytes"]}}})
        sync = WeightSync.from_config(cfg)
        model = self.sd
        runs: list[dict[str, Any]] = []
        try:
            self._push(sync, model, engines)                 # the full version deltas start from
            for i in range(self.spec["repeat"] + 1):          # the first: warm-up
                if encoding == "delta":
                    sync.encoding.settle()                   # the trainer's kept-version patch
                    self.seed += 1
                    model = perturbed(model, DELTA_DENSITY, self.seed)
                pids = [e.proc.pid for e in engines if e.proc is not None]
                tx0 = trainer_tx(self.spec)
                cpu0, mine0 = cpu_seconds(pids), cpu_seconds([])
                t0 = time.perf_counter()
                r = self._push(sync, model, engines)
                dt = time.perf_counter() - t0
                mine = cpu_seconds([]) - mine0
                egress = trainer_tx(self.spec) - tx0
                if i:
                    runs.append({"seconds": dt, "egress_bytes": egress, "wire_bytes": r.wire_bytes,
                                 "pause_window_s": round(r.pause_window, 4),
                                 "density": r.density, "trainer_cpu_s": round(mine, 4),
                                 "stages": {k: round(v, 4) for k, v in r.seconds.items()},
                                 "members_cpu_s": round(cpu_seconds(pids) - cpu0 - mine, 4)})
        finally:
            if encoding == "delta":
                sync.encoding.settle()
            sync.close()
        best = min(runs, key=lambda x: x["seconds"])
        log(f"N={members:<3} {shape:<6} {encoding:<6} push {best['seconds']:7.3f} s  egress "
            f"{best['egress_bytes'] / 2**20:9.1f} MiB  runs {[round(x['seconds'], 3) for x in runs]}")
        return {"members": members, "shape": shape, "encoding": encoding, **best,
                "runs": [x["seconds"] for x in runs], "egress_runs": [x["egress_bytes"] for x in runs]}

    def _push(self, sync: WeightSync, model: dict[str, torch.Tensor],
              engines: list[EngineProcess]) -> Any:
        r = sync.push(model, version=self._next_version(engines))
        if not (r.ok and r.verified):
            raise RuntimeError(f"cluster bench push failed: {r.summary()}")
        return r


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["workdir"])
    sd = load_file(str(work / "model" / "model.safetensors"))
    n = model_bytes(sd)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in sd.values()])
    log(f"link costs: one copy of {n / 2**20:.0f} MiB to e0 over a {spec['cluster']['rate']} link")
    result: dict[str, Any] = {"link": link_costs(spec, flat, spec["repeat"])}
    top = max(spec["members"])
    names = [f"e{i}" for i in range(top)]
    if any(s != "star" for s in spec["shapes"]):
        result["relay_floor"] = relay_floor(
            names, lambda h: addr(spec, h), lambda h: in_ns(spec, h), memoryview(flat.numpy()),
            spec["members"], spec.get("piece_bytes") or 256 << 10, spec["repeat"], connect)
    del flat
    result["stage_s_per_byte"] = stage_cost(sd)
    log(f"one copy {result['link']['one_copy_s']:.3f} s, rtt idle "
        f"{result['link']['rtt_idle_s'] * 1e3:.2f} ms, loaded "
        f"{(result['link']['rtt_loaded_s'] or 0) * 1e3:.2f} ms, stage "
        f"{result['stage_s_per_byte'] * 2**30:.3f} s/GiB")
    engines = [EngineProcess(work / "model", host=addr(spec, h), port=PORT, name=h,
                             log=work / f"engine-{h}.log",
                             program=in_ns(spec, h) + [sys.executable, "-m", "weightsync"])
               for h in names]
    log(f"starting {top} reference engines, one per host namespace")
    t0 = time.perf_counter()
    start_all(engines, timeout=900)
    log(f"engines up in {time.perf_counter() - t0:.1f} s")
    rows = []
    try:
        pushes = Pushes(spec, sd, engines)
        for members in spec["members"]:
            for shape in spec["shapes"]:
                for encoding in spec["encodings"]:
                    rows.append(pushes.row(members, shape, encoding))
    finally:
        for e in engines:
            e.stop()
    result.update({"model_bytes": n, "tensors": len(sd), "rows": rows})
    Path(spec["out"]).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
