"""A small simulation of a push through a fleet, from the per-hop costs the cluster bench measures:
it predicts push seconds and the trainer's egress for the star (today: the trainer sends every
member its own copy) and for pipelined shapes (a chain, a tree of degree d) at any N.

The push moves the model in pieces of `piece` bytes. Node 0 is the trainer, 1..N the members;
the trainer feeds `root` members, every member feeds up to `degree` others (star: root = N,
degree 0; chain: root 1, degree 1; tree: root 1, degree d). Per piece:
- the sender's link sends it to each of its children in turn at the link's rate (`link_Bps`, the
  rate one copy over one link reached: TCP and framing included); it arrives `hop_latency_s`
  after its last byte left (the loaded round trip: a full link's queue is part of every hop);
- the member stages and verifies it on one core (`stage_s_per_byte`), and only then forwards it
  (a member relays nothing it has not checked);
- the trainer packs each piece at the same per-byte cost before it sends it.
The carry ends when the last member has verified the last piece. A push also needs the CPU time
the trainer and each member spend on it (`trainer_cpu_s`, `member_cpu_s`, measured at N = 1). On
the emulated cluster every process shares this machine's `shared_cores`; on a real cluster
(`shared_cores` None: the predictions) each host has its own. How that CPU adds up depends on the
encoding: raw bytes are staged and hashed as they land (`overlapped`: the push is the larger of
the carry and the CPU bound), while a delta is applied once its bytes are in (every member
patches and hashes the whole model after its last piece: the push is the carry plus that tail,
which on shared cores is all members' tails over the cores). Then `fixed_s`: what a push costs
beyond all that (health, begin, end, digest checks, commit), calibrated as the measured N = 1
push minus the modelled N = 1 push. The trainer's egress is its children times the payload times
`egress_overhead` (tx bytes per payload byte at N = 1: headers, control calls). Ignored: a
per-piece framing.

    python model.py results.json          # the star check and the N = 64, 256 predictions
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

PREDICT_N = (64, 256)
PIECES = (64 * 2**10, 256 * 2**10, 2**20)


@dataclass(frozen=True)
class Costs:
    """Per-hop costs of one encoding on one cluster (all measured by the bench)."""

    payload_bytes: int          # bytes per member per push (the model, or a delta's wire bytes)
    link_Bps: float
    hop_latency_s: float
    stage_s_per_byte: float
    fixed_s: float = 0.0
    egress_overhead: float = 1.0
    trainer_cpu_s: float = 0.0
    member_cpu_s: float = 0.0
    shared_cores: int | None = None     # the emulation: every host on these cores
    overlapped: bool = True             # members' CPU runs while bytes arrive (raw), or after

    @classmethod
    def measured(cls, result: dict[str, Any], encoding: str = "raw", shape: str = "star",
                 piece: int = 2**20) -> Costs:
        """The costs from a bench result, `fixed_s` and `egress_overhead` from its N = 1 row."""
        link = result["link"]
        rows = sorted((r for r in result["rows"] if r["encoding"] == encoding and r["shape"] == shape),
                      key=lambda r: r["members"])
        one = rows[0]
        payload = result["model_bytes"] if encoding == "raw" else one["wire_bytes"]
        base = cls(payload, result["model_bytes"] / link["one_copy_s"],
                   link["rtt_loaded_s"] or link["rtt_idle_s"], result["stage_s_per_byte"],
                   trainer_cpu_s=one.get("trainer_cpu_s", 0.0),
                   member_cpu_s=one.get("members_cpu_s", 0.0) / one["members"],
                   shared_cores=result["cores"], overlapped=encoding == "raw")
        modelled, _ = simulate(base, one["members"], *SHAPES[shape](one["members"]), piece=piece)
        return replace(base, fixed_s=max(0.0, one["seconds"] - modelled),
                       egress_overhead=one["egress_bytes"] / (payload * one["members"]))


SHAPES = {                                   # name -> (members) -> (root, degree)
    "star": lambda n: (n, 0),
    "chain": lambda n: (1, 1),
    "tree": lambda n: (1, 2),
}


def tree_children(n: int, root: int, degree: int) -> list[list[int]]:
    """children[u] for the trainer (0) and members 1..n, filled breadth first."""
    children: list[list[int]] = [[] for _ in range(n + 1)]
    nxt = 1
    queue = [0]
    while queue and nxt <= n:
        u = queue.pop(0)
        for _ in range(root if u == 0 else degree):
            if nxt > n:
                break
            children[u].append(nxt)
            queue.append(nxt)
            nxt += 1
    if nxt <= n:
        raise ValueError(f"root {root} and degree {degree} cannot reach {n} members")
    return children


def simulate(c: Costs, n: int, root: int, degree: int, piece: int = 2**20) -> tuple[float, float]:
    """(push seconds, trainer egress bytes) for n members in the given shape."""
    sizes = [piece] * (c.payload_bytes // piece) + ([c.payload_bytes % piece] if c.payload_bytes % piece else [])
    children = tree_children(n, root, degree)
    ready: list[list[float]] = [[0.0] * len(sizes) for _ in range(n + 1)]
    t = 0.0
    for k, size in enumerate(sizes):                 # the trainer packs each piece
        t += size * c.stage_s_per_byte
        ready[0][k] = t
    order = [0]
    for u in order:                                  # breadth first: parents before children
        order.extend(children[u])
        link_free = 0.0
        arrive = {v: [0.0] * len(sizes) for v in children[u]}
        for k, size in enumerate(sizes):
            for v in children[u]:
                link_free = max(ready[u][k], link_free) + size / c.link_Bps
                arrive[v][k] = link_free + c.hop_latency_s
        for v in children[u]:
            cpu_free = 0.0
            for k, size in enumerate(sizes):
                cpu_free = max(arrive[v][k], cpu_free) + size * c.stage_s_per_byte
                ready[v][k] = cpu_free
    carry = max(ready[v][-1] for v in range(1, n + 1))
    egress = len(children[0]) * c.payload_bytes * c.egress_overhead
    if not c.overlapped:          # every member's tail after its last piece, on shared cores
        tail = max(c.member_cpu_s, n * c.member_cpu_s / c.shared_cores if c.shared_cores else 0.0)
        return carry + tail + c.fixed_s, egress
    # a copy a member forwards costs it about what the copy it receives does (one more pass
    # through the kernel's sockets); on shared cores that adds up over the whole tree
    forwarded = sum(len(children[v]) for v in range(1, n + 1))
    cpu = ((c.trainer_cpu_s + (n + forwarded) * c.member_cpu_s) / c.shared_cores
           if c.shared_cores else max(c.trainer_cpu_s, c.member_cpu_s * (1 + degree)))
    return max(carry, cpu) + c.fixed_s, egress


def calibration(result: dict[str, Any], encoding: str) -> str | None:
    """The shape whose N = 1 row calibrates the model (the star's, else any: at N = 1 every
    shape is one copy to one member)."""
    ones = {r["shape"] for r in result["rows"] if r["encoding"] == encoding and r["members"] == 1}
    return "star" if "star" in ones else (sorted(ones)[0] if ones else None)


def relay_check(result: dict[str, Any], emulated: Costs, encoding: str) -> list[dict[str, Any]]:
    """The model against the measured chain and tree rows (same costs, pieces and degree)."""
    out = []
    model = result["model_bytes"]
    piece = result.get("piece_bytes") or 256 * 2**10
    for r in sorted((r for r in result["rows"] if r["encoding"] == encoding
                     and r["shape"] in ("chain", "tree")),
                    key=lambda r: (r["shape"], r["members"])):
        degree = 1 if r["shape"] == "chain" else int(r.get("degree", 2))
        s, e = simulate(emulated, r["members"], 1, degree, piece)
        out.append({"members": r["members"], "shape": r["shape"],
                    "measured_s": round(r["seconds"], 3), "predicted_s": round(s, 3),
                    "error": round(s / r["seconds"] - 1, 3),
                    "measured_egress_x": round(r["egress_bytes"] / model, 3),
                    "predicted_egress_x": round(e / model, 3)})
    return out


def predict(result: dict[str, Any], encoding: str = "raw") -> dict[str, Any]:
    """The model checked against the measured rows, and predictions at PREDICT_N."""
    emulated = Costs.measured(result, encoding, calibration(result, encoding) or "star")
    c = replace(emulated, shared_cores=None)      # a real cluster: every host its own cores
    one = result["link"]["one_copy_s"]
    model = result["model_bytes"]
    check = []
    for r in sorted((r for r in result["rows"] if r["encoding"] == encoding and r["shape"] == "star"),
                    key=lambda r: r["members"]):
        s, e = simulate(emulated, r["members"], r["members"], 0)
        check.append({"members": r["members"], "measured_s": round(r["seconds"], 3),
                      "predicted_s": round(s, 3), "error": round(s / r["seconds"] - 1, 3),
                      "measured_egress_x": round(r["egress_bytes"] / model, 3),
                      "predicted_egress_x": round(e / model, 3)})
    shapes: list[tuple[str, int, int, int]] = [("star", -1, 0, 2**20)]
    shapes += [("chain", 1, 1, p) for p in PIECES]
    shapes += [(f"tree d={d}", 1, d, 256 * 2**10) for d in (2, 4)]
    out = []
    for n in PREDICT_N:
        for name, root, degree, piece in shapes:
            s, e = simulate(c, n, n if root < 0 else root, degree, piece)
            out.append({"members": n, "shape": name, "piece_bytes": piece if name != "star" else None,
                        "seconds": round(s, 3), "x_one_copy": round(s / one, 3),
                        "egress_x_model": round(e / model, 3)})
    return {"encoding": encoding, "costs": asdict(emulated), "star_check": check,
            "relay_check": relay_check(result, emulated, encoding), "predictions": out}


def table(pred: dict[str, Any]) -> str:
    lines = [f"model ({pred['encoding']}): star check",
             "| N | measured s | predicted s | error | egress x model (measured / predicted) |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['members']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
              f"{100 * r['error']:+.1f} % | {r['measured_egress_x']:.2f} / {r['predicted_egress_x']:.2f} |"
              for r in pred["star_check"]]
    if pred.get("relay_check"):
        lines += ["", f"model ({pred['encoding']}): chain and tree check",
                  "| N | shape | measured s | predicted s | error | egress x model (measured / predicted) |",
                  "|---:|---|---:|---:|---:|---:|"]
        lines += [f"| {r['members']} | {r['shape']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
                  f"{100 * r['error']:+.1f} % | {r['measured_egress_x']:.2f} / "
                  f"{r['predicted_egress_x']:.2f} |" for r in pred["relay_check"]]
    lines += ["", f"model ({pred['encoding']}): predictions",
              "| N | shape | piece | push s | x one copy | trainer egress x model |",
              "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['members']} | {r['shape']} | "
              f"{'' if r['piece_bytes'] is None else str(r['piece_bytes'] // 1024) + ' KiB'} | "
              f"{r['seconds']:.2f} | {r['x_one_copy']:.2f} | {r['egress_x_model']:.2f} |"
              for r in pred["predictions"]]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="the cluster bench's JSON")
    p.add_argument("--encoding", default="raw")
    args = p.parse_args()
    print(table(predict(json.loads(Path(args.results).read_text()), args.encoding)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
