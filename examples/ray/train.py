"""weightsync on Ray, on one machine: a local cluster of three nodes (one for the trainer, two for
engines), a trainer of two Ray actors (FSDP2 over gloo) pushing every step into three engine
actors that register with a named fleet actor. At `--kill-at` one engine actor is killed; Ray
restarts it, it catches up from a peer, and the run ends with every engine bit-exact.

    python examples/ray/train.py [--transport collective|http] [--versions 6] [--kill-at 3]

Needs `pip install weightsync-ray` (and torch). One line per version."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

NODES = [{"resources": {"trainer": 2}},                   # head: the trainer's ranks
         {"resources": {"engine": 2}},                    # engine node a
         {"resources": {"engine": 1}}]                    # engine node b
FLEET, NAMESPACE = "policy-fleet", "weightsync-example"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", choices=["collective", "http"], default="collective")
    p.add_argument("--versions", type=int, default=6)
    p.add_argument("--kill-at", type=int, default=3, help="kill engine e1 after this version")
    args = p.parse_args()

    import ray

    from weightsync_ray import (EngineLaunch, RayTrainer, local_cluster, start_engine,
                                start_fleet, stop_actors, stop_fleet, wait_ready)
    from weightsync_ray.testing import POLICY, mismatches, write_initial_checkpoint

    work = Path(tempfile.mkdtemp(prefix="weightsync-ray-"))
    model = write_initial_checkpoint(work / "model")          # version 0, what engines start on
    config = {"fleet": {"kind": "ray", "options": {"name": FLEET, "namespace": NAMESPACE}},
              "transport": args.transport,
              "exporter": {"kind": "torch", "options": {"bucket_bytes": 16384}},
              "sync": {"progress": "off", "lease": 3, "deadline": 60, "failure_policy": "continue"}}
    print(f"starting a 3-node Ray cluster on this machine (logs in {work}) ...", flush=True)
    with local_cluster(NODES, log_to_driver=False):     # the actors' logs stay in Ray's
        fleet = start_fleet(FLEET, NAMESPACE, lease=3)
        engines = [start_engine(f"e{i}", EngineLaunch(model=str(model)), fleet=(FLEET, NAMESPACE),
                                resources={"engine": 1}, log_dir=str(work)) for i in range(3)]
        trainer = RayTrainer(2, config, resources={"trainer": 1}, **POLICY)
        try:
            trainer.start()
            infos = wait_ready(engines, timeout=300)
            print(f"trainer: 2 ranks on {trainer.master['address']}; engines: "
                  + ", ".join(f"{i['name']} {i['url']}" for i in infos), flush=True)
            for v in range(1, args.versions + 1):
                t0 = time.monotonic()
                report = trainer.train_and_push(v)
                ok = sorted(n for n, o in report.engines.items() if o.ok)
                failed = {n: o.stage for n, o in report.engines.items() if not o.ok}
                line = (f"v{v} over {args.transport}: {len(ok)}/{len(report.engines)} engines at "
                        f"v{v} ({' '.join(ok)}), {report.logical_bytes / 1024:.0f} KiB, "
                        f"{time.monotonic() - t0:.2f}s")
                if failed:
                    line += f"; failed: {failed}"
                if report.excluded:
                    line += f"; excluded: {sorted(report.excluded)}"
                if v == args.kill_at:
                    ray.kill(engines[1], no_restart=False)
                    line += "; killed e1 (Ray restarts it)"
                print(line, flush=True)
                if v == args.kill_at + 1:
                    back = wait_ready([engines[1]], timeout=300)[0]
                    member = next(m for m in ray.get(fleet.view.remote())["members"]
                                  if m["name"] == "e1")
                    print(f"   e1 is back at {back['url']}, at v{back['version']} (caught up "
                          f"from peer {member['via'] or '-'})", flush=True)
            weights = trainer.weights()
            bad = {i["name"]: mismatches(i["url"], weights) for i in wait_ready(engines, 60)}
            exact = all(not b for b in bad.values())
            print(f"every engine bit-exact with the trainer at v{args.versions}: {exact}",
                  flush=True)
            return 0 if exact else 1
        finally:
            trainer.shutdown()
            stop_actors(engines)
            stop_fleet(FLEET, NAMESPACE)


if __name__ == "__main__":
    raise SystemExit(main())
