"""What a `weightsync bench` run concludes: issue 17's targets with the bound this machine
allows (`cpu_targets`), a verdict line per target, the printed table and the bar chart."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightsync_bench.measure import BARE_VERIFIED, DELTA_DENSITY, Row

if TYPE_CHECKING:
    from weightsync_bench.harness import Bench


def _target(value: float | None, target: float, higher: bool = True, **extra: Any) -> dict[str, Any]:
    met = None if value is None else (value >= target if higher else value <= target)
    return {"value": value, "target": target, "direction": ">=" if higher else "<=", "met": met, **extra}


class Bounds:
    """The least CPU a verified sync can spend on this machine, from rows of this run: the raw
    carry's measured core-seconds plus the cheapest verification of every byte on every end (one
    core: a hashing pass over memory, or the hash folded into a copy the end makes anyway, taking
    the cheaper), spread over every core. A target above `ratio` is out of reach here."""

    def __init__(self, by: dict[str, Row], cores: int) -> None:
        self.cores = max(1, cores)
        per = {k: (by[k].seconds / by[k].bytes) if k in by and by[k].bytes else None
               for k in ("memcpy (1 core)", "xxh3 + copy, one pass (1 core)", "xxh3 pass over memory (1 core)")}
        self.copy, self.fused, self.hash = per.values()
        self.ok = all(v is not None for v in per.values())

    def end(self) -> float:
        """core-seconds per byte to verify one end that must also place the bytes (recv into
        place + a hashing pass, or a copy that hashes as it goes)."""
        assert self.hash is not None and self.fused is not None     # called only when ok
        return min(self.hash, self.fused)

    def in_cache(self) -> float:
        """core-seconds per byte to hash bytes that just arrived in cache (fused minus copy)."""
        assert self.fused is not None and self.copy is not None     # called only when ok
        return max(0.0, self.fused - self.copy)

    def seconds(self, raw: Row, extra_cpu: float) -> float:
        return max(raw.seconds, (raw.detail.get("cpu_s", 0.0) + extra_cpu) / self.cores)


def cpu_targets(bench: Bench, by: dict[str, Row]) -> dict[str, Any]:
    """Issue 17's CPU targets, each with its value, whether it was met, and `bound`: the most
    any verified implementation could reach on this machine (`Bounds`)."""
    R = bench.receivers
    out: dict[str, Any] = {}
    bd = Bounds(by, os.cpu_count() or 1)
    note_b = ("bound: raw carry's core-seconds + the cheapest verification of every byte on "
              "every end, over all cores")
    per, coll = by.get("gloo broadcast per tensor (naive)"), by.get("collective")
    raw_r = by.get("gloo broadcast, 1 tensor (raw)")
    if per and coll:
        bound = None
        if raw_r and bd.ok:
            bound = round(per.seconds / bd.seconds(raw_r, (1 + R) * raw_r.bytes * bd.end()), 3)
        tcp = by.get("http floor (raw TCP)")
        out["collective_vs_per_tensor_llm"] = _target(
            round(per.seconds / coll.seconds, 3), 1.5,
            floor=round(per.seconds / raw_r.seconds, 3) if raw_r else None, bound=bound,
            link=round(per.seconds / tcp.seconds, 3) if tcp else None,
            note=f"per-tensor gloo broadcast s / collective push s, {R} receivers; floor: the same "
                 f"for one raw single-tensor gloo broadcast (unverified); link: for the model's "
                 f"bytes streamed to every receiver over plain loopback TCP at once (what any "
                 f"TCP collective must move); {note_b}")
    c1, raw_1 = by.get("collective (1 receiver)"), by.get("gloo broadcast, 1 tensor (raw, 1 receiver)")
    if c1 and raw_1:
        bound = round(raw_1.seconds / bd.seconds(raw_1, 2 * raw_1.bytes * bd.end()), 3) if bd.ok else None
        bare = by.get(BARE_VERIFIED)
        measured: dict[str, Any] = {} if bare is None else {
            "verified_floor": round(raw_1.seconds / bare.seconds, 3),
            "of_verified_floor": round(bare.seconds / c1.seconds, 3)}
        out["collective_1rx_vs_raw_gloo_1rx"] = _target(
            round(raw_1.seconds / c1.seconds, 3), 0.8, bound=bound, **measured,
            note=f"raw single-tensor broadcast s / collective push s; {note_b}; verified_floor: "
                 f"the same for the bare verified broadcast (bucket-sized broadcasts hashed on "
                 f"both ends while the next one moves, no copies, no framework: the most any "
                 f"verified push reached in this run); of_verified_floor: bare verified s / "
                 f"collective push s")
    cs, ps = by.get("collective (small tensors)"), by.get("gloo broadcast per tensor (small tensors)")
    if cs and ps:
        bound = None
        if raw_r and bd.ok:
            scale = cs.bytes / raw_r.bytes
            bound = round(ps.seconds / (scale * bd.seconds(raw_r, (1 + R) * raw_r.bytes * bd.end())), 3)
        out["collective_vs_per_tensor_small"] = _target(round(ps.seconds / cs.seconds, 3), 3.0, bound=bound)
    shm, shm_floor = by.get("shm"), by.get(f"shm floor ({R + 1} copies)")
    if shm and shm_floor:
        bound = None
        if bd.ok:
            assert bd.fused is not None
            need = max(shm_floor.seconds, (R + 1) * shm.bytes * bd.fused / bd.cores)
            bound = round(shm_floor.seconds / need, 3)
        out["shm_vs_floor"] = _target(round(shm_floor.seconds / shm.seconds, 3), 0.7, bound=bound,
                                      note=f"({R + 1} copies at memcpy speed) s / shm push s; bound: "
                                           f"the same copies, each hashing as it goes, over all cores")
    http, http_floor = by.get("http"), by.get("http floor (raw TCP)")
    if http and http_floor:
        bound = None
        if bd.ok:
            extra = http.bytes * (bd.end() + R * bd.in_cache())
            bound = round(http_floor.seconds / bd.seconds(http_floor, extra), 3)
        out["http_vs_floor"] = _target(round(http_floor.seconds / http.seconds, 3), 0.5, bound=bound,
                                       note="raw loopback TCP to every receiver s / http push s; bound: "
                                            "+ the sender's verification and each receiver hashing "
                                            "what it reads while it is in cache")
    cost = {}
    for t in ("collective", "shm", "http"):
        v, u = by.get(t), by.get(f"{t} (verify off)")
        if v and u:
            cost[t] = round(v.seconds / u.seconds - 1, 3)
    if cost:
        out["verification_cost"] = {"value": cost, "target": 0.10, "direction": "<=",
                                    "met": all(x <= 0.10 for x in cost.values()),
                                    "note": "verified push s / push with verify: false and no "
                                            "digest on either end, minus 1"}
    unit = max(bench.bucket, bench.largest)
    mem = {r.name: round(r.peak_extra_bytes / unit, 2) for r in by.values()
           if r.kind == "transport" and r.detail.get("device", "cpu") == "cpu"
           and r.detail.get("encoding") != "delta"}
    if mem:
        out["sender_peak_extra_in_buckets"] = {
            "value": mem, "target": 2.0, "direction": "<=", "met": all(x <= 2.02 for x in mem.values()),
            "bucket_unit_bytes": unit,
            "note": "unit = max(bucket_bytes, largest tensor), the largest payload a sync carries "
                    "without its safetensors header; met within 1 % (two payloads' headers and the "
                    "interpreter's own allocations); delta rows hold the last version (one model) "
                    "by design and are not counted"}
    for t in ("http", "shm"):
        d = by.get(f"delta {DELTA_DENSITY:.0%} over {t}")
        if d:
            out[f"delta_{t}"] = {"value": {"wire_vs_raw": d.detail.get("wire_vs_raw"),
                                           "seconds_vs_raw": d.detail.get("seconds_vs_raw"),
                                           "density": d.detail.get("density")},
                                 "target": None, "met": None}
    out.update(bench.extra_targets)          # what plugin rows concluded (`register_bench_rows`)
    for t in ("collective", "shm"):
        m, d = by.get(f"{t} (MoE)"), by.get(t)
        if m and d:
            out[f"{t}_moe_vs_dense_gbps"] = {"value": round(m.gbps / d.gbps, 3), "target": None, "met": None}
    return out


def verdicts(targets: dict[str, Any]) -> list[str]:
    """One line per target: met or missed, and what bounds it."""
    out = []
    for k, v in targets.items():
        if v.get("met") is None and v.get("target") is None:
            continue
        val = v["value"]
        shown = ", ".join(f"{n} {x}" for n, x in val.items()) if isinstance(val, dict) else f"{val}"
        line = f"{'MET   ' if v.get('met') else 'MISSED'} {k}: {shown} (target {v['direction']} {v['target']})"
        if v.get("floor") is not None:
            line += f"; the unverified floor reaches {v['floor']}"
        if v.get("link") is not None:
            line += f", raw TCP to every receiver {v['link']}"
        if v.get("bound") is not None:
            line += f"; the most a verified push can reach on this machine: {v['bound']}"
        if v.get("verified_floor") is not None:
            line += (f"; measured: a bare verified broadcast reaches {v['verified_floor']} and "
                     f"this push {v['of_verified_floor']} of it")
        out.append(line)
    return out


def table(result: dict[str, Any]) -> str:
    head = (f"{'method':<46} {'recv':>4} {'seconds':>8} {'cpu s':>6} {'GB/s':>6} {'x memcpy':>8} "
            f"{'x floor':>7} {'pause s (% push)':>17} {'sender peak extra':>17}")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        own = r.get("ratio_to_floor")
        pw = r.get("pause_window_s")
        pause = f"{pw:.3f} ({r['pause_pct_of_push']:4.1f}%)" if pw is not None else ""
        lines.append(f"{r['name']:<46} {r['receivers']:>4} {r['seconds']:>8.3f} "
                     f"{r['detail'].get('cpu_s', 0):>6.2f} {r['gbps']:>6.2f} "
                     f"{r['ratio_to_memcpy']:>8.3f} {f'{own:.3f}' if own is not None else '':>7} {pause:>17} "
                     f"{r['peak_extra_bytes'] / 2**20:>13.1f} MiB")
    lines.append("")
    for k, v in result["targets"].items():
        val = v["value"]
        shown = ", ".join(f"{n}={x}" for n, x in val.items()) if isinstance(val, dict) else f"{val}"
        tgt = f" (target {v['direction']} {v['target']})" if v.get("target") is not None else ""
        lines.append(f"{k}: {shown}{tgt}")
    if result.get("verdicts"):
        lines += ["", "verdicts:"] + [f"  {x}" for x in result["verdicts"]]
    return "\n".join(lines)


def bar_chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    colors = {"floor": "#555555", "reference": "#999999", "baseline": "#d98c3f", "transport": "#3f7fd9"}
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(rows) + 1.5))
    names = [f"{r['name']} ({r['receivers']} rx)" for r in rows]
    vals = [r["gbps"] for r in rows]
    ax.barh(names, vals, color=[colors[r["kind"]] for r in rows])
    for i, (v, r) in enumerate(zip(vals, rows)):
        own = r.get("ratio_to_floor")
        label = f" {v:.2f}" + (f"  ({own:.2f}x floor)" if own is not None and r["kind"] != "floor" else "")
        ax.text(v, i, label, va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (model bytes / end-to-end seconds; higher is better)")
    ax.set_title(f"weightsync bench: {result['size_bytes'] / 2**30:.2f} GiB bf16, "
                 f"{result['receivers']} receivers, {result['cores']} cores")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

