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

from ._ray import free_port, require_ray


@contextlib.contextmanager
def local_cluster(nodes: Sequence[dict[str, Any]], *, namespace: str | None = None,
                  object_store_bytes: int = 80 * 2**20, log_to_driver: bool = True
                  ) -> Iterator[Any]:
    """Start one node per entry of `nodes` (the first is the head; each entry's `resources`
    are its custom resources, `num_cpus` defaults to 0 so only resources place actors), connect
    this process to it, and yield the Cluster; everything is stopped on exit. `log_to_driver`:
    the actors' output is printed here too."""
    ray = require_ray()
    from ray.cluster_utils import Cluster
    if ray.is_initialized():
        raise RuntimeError("this process is already connected to a Ray cluster")
    tmp = tempfile.mkdtemp(prefix="wsray-", dir="/tmp")  # short: Ray's socket paths must fit
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR",)}
    os.environ["RAY_TMPDIR"] = tmp          # the address file and sessions go there too
    cluster = None
    try:
        head, *rest = [dict(n) for n in nodes]
        cluster = Cluster(initialize_head=True, connect=False, head_node_args=_node(head, True,
                                                                                  object_store_bytes))
        for node in rest:
            cluster.add_node(**_node(node, False, object_store_bytes))
        cluster.wait_for_nodes()
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
