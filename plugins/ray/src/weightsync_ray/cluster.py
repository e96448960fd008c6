"""A Ray cluster of several nodes on this machine (`ray.cluster_utils.Cluster`), for tests and
the example: each node a real raylet with its own resources, so placement by resources is
Ray's, as on a real cluster. It lives in a temporary directory and on ports of its own (never
/tmp/ray or Ray's default ports), so it does not meet other Ray clusters on the machine, and it
is shut down on exit, its own processes only."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any, Iterator, Sequence

from weightsync.net.server import free_port
from weightsync_ray.runtime import require_ray


@contextlib.contextmanager
def local_cluster(nodes: Sequence[dict[str, Any]], *, namespace: str | None = None,
                  object_store_bytes: int = 80 * 2**20, log_to_driver: bool = True,
                  start_timeout: float = 180.0) -> Iterator[Any]:
    """Start one node per entry of `nodes` (the first is the head; each entry's `resources`
    are its custom resources, `num_cpus` defaults to 0 so only resources place actors), connect
    this process to it, and yield the Cluster; everything is stopped on exit. `log_to_driver`:
    the actors' output is printed here too; `start_timeout`: seconds each node may take to
    join."""
    ray = require_ray()
    from ray.cluster_utils import Cluster
    if ray.is_initialized():
        raise RuntimeError("this process is already connected to a Ray cluster")
    tmp = tempfile.mkdtemp(prefix="wsray-", dir="/tmp")  # short: Ray's socket paths must fit
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR", "RAY_worker_niceness")}
    os.environ["RAY_TMPDIR"] = tmp          # the address file and sessions go there too
    # Ray starts its workers at nice 15: on a machine shared with the trainer (or anything else
    # busy) a new actor's imports then took 50-110 s instead of 2, and actors missed their
    # start-up deadlines. The nodes are this machine's engines and trainer ranks: nice 0.
    os.environ.setdefault("RAY_worker_niceness", "0")
    cluster = None
    try:
        cluster = Cluster(initialize_head=False, connect=False)
        for i, spec in enumerate(nodes):
            # each node is waited for in turn (the driver attaches to the first), for up to
            # start_timeout: Ray's own 30 s is too short for raylets starting on a busy machine
            node = cluster.add_node(wait=False, **_node(dict(spec), i == 0, object_store_bytes))
            cluster._wait_for_node(node, timeout=start_timeout)
        cluster.wait_for_nodes(timeout=start_timeout)
        ray.init(address=cluster.address, namespace=namespace, log_to_driver=log_to_driver)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)


def _node(spec: dict[str, Any], head: bool, object_store_bytes: int) -> dict[str, Any]:
    args: dict[str, Any] = {"num_cpus": 0, "object_store_memory": object_store_bytes,
                            "dashboard_agent_listen_port": free_port(),
                            "metrics_export_port": free_port(),
                            "runtime_env_agent_port": free_port()}
    if head:
        args.update(include_dashboard=False, gcs_server_port=free_port())
    args.update(spec)
    return args
