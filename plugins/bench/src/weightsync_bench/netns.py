"""An emulated cluster on one machine, made of Linux network namespaces: one namespace per host,
each with one link (a veth pair) into a bridge that lives in a namespace of its own, and every
link shaped with `tc` tbf in both directions. Benchmarks and tests use it to see what a push does
to a trainer's NIC (its link's byte counters, its link's rate) without a real cluster.

Nothing here touches the machine's own network: the bridge, both ends of every veth and every
address live inside namespaces this module made, and no namespace has a route out, so traffic only
reaches addresses inside them. The addresses come from 198.18.0.0/15 (RFC 2544's benchmarking
range, never used on a real network).

    with Cluster(["trainer", "e0", "e1"], rate="400mbit") as c:
        sink = c.popen("e0", ["python", "sink.py", c.addr("e0")])
        c.run("trainer", ["python", "send.py", c.addr("e0")])
        print(c.link_bytes("trainer").tx)

`Cluster` always cleans up (also on an exception, Ctrl-C or SIGTERM): it kills whatever still
runs in its namespaces and deletes them, which removes the veths and the bridge with them. Names
carry the creating process's pid, so parallel runs never clash, and a new cluster first sweeps
namespaces left by dead processes (a run killed with SIGKILL). It needs root and iproute2 (`ip`,
`tc`); without them `require()` raises `NetnsUnavailable` saying what is missing, and `probe()`
also finds a kernel or container that cannot make namespaces, veths or tbf.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

PREFIX = "wsns"                       # every namespace this module makes starts with it
_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)-")
_HOST = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_SEQ = itertools.count()
DEV = "eth0"                          # each host's link, inside its namespace


class NetnsUnavailable(RuntimeError):
    """This machine cannot build namespaces (not root, or `ip`/`tc` missing): callers skip."""


@dataclass(frozen=True)
class LinkBytes:
    """A link's byte counters (kernel totals since the link was made), seen from its host."""

    tx: int
    rx: int


@dataclass(frozen=True)
class Host:
    """One emulated host: its namespace, its address, and its link's two ends (the end in the
    host's namespace, `DEV`, and `port` in the bridge's namespace)."""

    name: str
    ns: str
    addr: str
    port: str


def require() -> None:
    """Raise NetnsUnavailable naming everything missing for `Cluster` (root, `ip`, `tc`)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces need CAP_SYS_ADMIN; run as root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` (iproute2) on PATH")
    if missing:
        raise NetnsUnavailable("an emulated cluster needs " + " and ".join(missing))


def probe() -> None:
    """`require()`, then build and remove a one-host cluster: raises NetnsUnavailable where root
    alone is not enough (a container without CAP_NET_ADMIN, a kernel without veth or tbf)."""
    require()
    with Cluster(["probe"]):
        pass


def rate_bytes(rate: str) -> int:
    """Bytes per second of a tc rate such as '400mbit' (kbit, mbit, gbit: powers of 1000)."""
    m = _RATE.match(rate.strip().lower())
    if not m:
        raise ValueError(f"link rate {rate!r} is not a number followed by kbit, mbit or gbit "
                         f"(for example '400mbit')")
    scale = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]
    return int(float(m.group(1)) * scale / 8)


def _sh(*cmd: str, check: bool = True) -> str:
    """Run an iproute2 command; a failure says which command and what it printed."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def namespaces(prefix: str = PREFIX) -> list[str]:
    """Named network namespaces (`ip netns list`) whose names start with `prefix`."""
    out = _sh("ip", "-j", "netns", "list", check=False).strip()
    names = [n["name"] for n in json.loads(out)] if out else []
    return sorted(n for n in names if n.startswith(prefix))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(ns: str, timeout: float = 5.0) -> None:
    """SIGTERM every process in namespace `ns` (never this one), SIGKILL what is left after
    `timeout` seconds: a namespace stays alive, veths and all, while a process holds it."""
    def pids() -> list[int]:
        out = _sh("ip", "netns", "pids", ns, check=False)
        return [p for p in map(int, out.split()) if p != os.getpid()]
    left = pids()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in left:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = pids()
        if not left:
            return


def delete(names: list[str]) -> None:
    """Kill what runs in each namespace, then delete them (host namespaces before bridges)."""
    for ns in names:
        _kill_inside(ns)
    for ns in sorted(names, key=lambda n: n.endswith("-br")):
        _sh("ip", "netns", "delete", ns, check=False)


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces that clusters of processes no longer alive left behind (a run
    killed with SIGKILL); those of live processes are never touched. Returns what it deleted."""
    stale = [n for n in namespaces(prefix) if (m := _NAME.match(n)) and not _alive(int(m.group(1)))]
    delete(stale)
    return stale


class Cluster:
    """Hosts in namespaces on one bridge, each link shaped to `rate` in both directions.

    `rate` is tc's rate (e.g. '400mbit'); `burst` (bytes) defaults to 4 ms of the rate, at least
    128 KiB (the largest segment a veth hands tbf is 64 KiB); `latency` bounds each tbf queue.
    """

    def __init__(self, hosts: list[str], rate: str = "400mbit", *, burst: int | None = None,
                 latency: str = "20ms", subnet: str = "198.18.0.0/24") -> None:
        if not hosts or len(set(hosts)) != len(hosts):
            raise ValueError(f"hosts must be distinct names, got {hosts!r}")
        bad = [h for h in hosts if not _HOST.match(h)]
        if bad:
            raise ValueError(f"host names {bad} must be 1-12 lowercase letters and digits, "
                             f"starting with a letter")
        net = ipaddress.ip_network(subnet)
        if not net.subnet_of(ipaddress.ip_network("198.18.0.0/15")):  # type: ignore[arg-type]
            raise ValueError(f"subnet {subnet} is outside 198.18.0.0/15, the benchmarking range")
        if len(hosts) > net.num_addresses - 2:
            raise ValueError(f"{len(hosts)} hosts do not fit in {subnet}")
        self.rate = rate
        self.rate_bytes = rate_bytes(rate)
        self.burst = burst or max(128 * 1024, self.rate_bytes // 250)
        self.latency = latency
        self.prefixlen = net.prefixlen
        self.tag = f"{PREFIX}{os.getpid()}x{next(_SEQ)}"
        self.bridge_ns = f"{self.tag}-br"
        self.hosts = {h: Host(h, f"{self.tag}-{h}", str(net.network_address + i + 1), f"p{i}")
                      for i, h in enumerate(hosts)}
        self._made: list[str] = []
        self._old_term: Any = None

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        require()
        sweep_stale()
        delete(namespaces(self.tag + "-"))   # a dead run's, whose pid this process reuses
        self._trap_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _trap_sigterm(self) -> None:
        """SIGTERM raises SystemExit while the cluster is up, so `with` cleans up on it too."""
        if threading.current_thread() is not threading.main_thread():
            return

        def on_term(signum: int, frame: FrameType | None) -> None:
            raise SystemExit(128 + signum)
        self._old_term = signal.signal(signal.SIGTERM, on_term)

    def close(self) -> None:
        """Kill what runs inside, delete every namespace (veths and the bridge go with them).
        Safe to call twice."""
        made, self._made = self._made, []
        try:
            delete(made)
        finally:
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)
                self._old_term = None

    def _ns(self, name: str) -> None:
        self._made.append(name)             # first: an interrupt right after `add` still cleans it
        try:
            _sh("ip", "netns", "add", name)
        except RuntimeError as e:
            raise NetnsUnavailable(f"cannot make a network namespace: {e}") from e
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        try:
            _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", self.rate,
                "burst", str(self.burst), "latency", self.latency)
        except RuntimeError as e:
            raise NetnsUnavailable(f"cannot shape a link with tc tbf: {e}") from e

    def _build(self) -> None:
        br = self.bridge_ns
        self._ns(br)
        _sh("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", br, "link", "set", "br0", "up")
        for h in self.hosts.values():
            self._ns(h.ns)
            _sh("ip", "-n", br, "link", "add", h.port, "type", "veth", "peer", "name", DEV,
                "netns", h.ns)
            _sh("ip", "-n", br, "link", "set", h.port, "master", "br0")
            _sh("ip", "-n", br, "link", "set", h.port, "up")
            _sh("ip", "-n", h.ns, "addr", "add", f"{h.addr}/{self.prefixlen}", "dev", DEV)
            _sh("ip", "-n", h.ns, "link", "set", DEV, "up")
            self._shape(h.ns, DEV)          # host -> bridge
            self._shape(br, h.port)         # bridge -> host

    # -- using it -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        """The namespaces this cluster made and still holds."""
        return list(self._made)

    def addr(self, host: str) -> str:
        return self._host(host).addr

    def _host(self, host: str) -> Host:
        if host not in self.hosts:
            raise KeyError(f"no host {host!r} in this cluster; hosts: {sorted(self.hosts)}")
        return self.hosts[host]

    def prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command inside `host`'s namespace."""
        return ["ip", "netns", "exec", self._host(host).ns]

    def run(self, host: str, cmd: list[str], check: bool = False,
            **kw: Any) -> subprocess.CompletedProcess:
        """`subprocess.run(cmd, **kw)` inside `host`'s namespace."""
        return subprocess.run(self.prefix(host) + list(cmd), check=check, **kw)

    def popen(self, host: str, cmd: list[str], **kw: Any) -> subprocess.Popen:
        """`subprocess.Popen(cmd)` inside `host`'s namespace (killed by `close` if still alive)."""
        return subprocess.Popen(self.prefix(host) + list(cmd), **kw)

    def link_bytes(self, host: str) -> LinkBytes:
        """Bytes `host` has sent (tx) and received (rx) on its link so far."""
        return link_bytes(self._host(host).ns)

    def qdiscs(self, host: str) -> dict[str, dict[str, Any]]:
        """The root qdisc on each end of `host`'s link, as `tc -j` reports it: 'host' (egress
        from the host) and 'bridge' (egress towards it)."""
        h = self._host(host)
        return {"host": _root_qdisc(h.ns, DEV), "bridge": _root_qdisc(self.bridge_ns, h.port)}

    def spec(self) -> dict[str, Any]:
        """What a process inside the cluster needs to find the others (JSON-able)."""
        return {"rate": self.rate, "rate_bytes": self.rate_bytes, "burst": self.burst,
                "latency": self.latency, "dev": DEV,
                "hosts": {n: {"ns": h.ns, "addr": h.addr} for n, h in self.hosts.items()}}


def link_bytes(ns: str, dev: str = DEV) -> LinkBytes:
    """A link's byte counters in namespace `ns` (works from any namespace, root or not)."""
    out = json.loads(_sh("ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev))
    stats = out[0]["stats64"]
    return LinkBytes(tx=int(stats["tx"]["bytes"]), rx=int(stats["rx"]["bytes"]))


def _root_qdisc(ns: str, dev: str) -> dict[str, Any]:
    out = json.loads(_sh("tc", "-n", ns, "-j", "qdisc", "show", "dev", dev))
    return next((q for q in out if q.get("root")), {})
