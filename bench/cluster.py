"""A multi-node Ray cluster on one machine (Ray's own `ray.cluster_utils.Cluster`): a head and
worker nodes, each a raylet of its own with its own logical CPUs and a custom resource named for
it, so a placement (a deployment's `resources`, a placement group's strategy) can be pinned to a
node and checked. The driver connects to it; everything is shut down after.

Every node shares this machine's IP address: Serve needs `proxy_location: HeadOnly` on it (one
HTTP proxy per node would bind the same port three times).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from deployments.local import serve_environment

# name -> logical CPUs; the first is the head. Each node also gets the resource {name: 1}.
NODES = {"node_head": 2, "node_w1": 2, "node_w2": 2}


class Nodes(dict):
    """{node name: Ray node id} of a running cluster; worker nodes can be removed (not gracefully:
    its raylet and every process on it are killed, as when a machine is lost) and added."""

    def __init__(self, cluster) -> None:
        super().__init__()
        self.cluster, self._nodes = cluster, {}

    def add(self, name: str, cpus: float, wait: bool = True) -> str:
        node = self.cluster.add_node(num_cpus=cpus, resources={name: 1}, wait=False)
        self[name], self._nodes[name] = node.node_id, node
        if wait:
            self.cluster.wait_for_nodes()
        return node.node_id

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self._nodes.pop(name), allow_graceful=False)
        del self[name]


@contextlib.contextmanager
def local_cluster(nodes: dict[str, float] | None = None, wait_s: float = 120) -> Iterator[Nodes]:
    """Start the nodes, connect this process (a driver on the head node) and yield them
    ({node name: Ray node id}); Serve, if something started it, Ray and the nodes are shut down after."""
    serve_environment()
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    nodes = dict(nodes or NODES)
    if not nodes:
        raise ValueError("nodes: a cluster needs at least a head node")
    (head, head_cpus), *workers = nodes.items()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "resources": {head: 1}, "include_dashboard": False})
    try:
        ids = Nodes(cluster)
        ids[head] = cluster.head_node.node_id
        for name, cpus in workers:
            ids.add(name, cpus, wait=False)
        cluster.wait_for_nodes(timeout=wait_s)
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield ids
        finally:
            serve.shutdown()
            ray.shutdown()
    finally:
        cluster.shutdown()
