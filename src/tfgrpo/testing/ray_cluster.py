"""A Ray cluster of several nodes on this one machine, each node its own `ray start` process, as a user starts one
across machines: for the tests and benchmarks of `backend="ray"`.

    with LocalRayCluster(nodes=2) as cluster:       # a head and one worker node
        os.environ["RAY_ADDRESS"] = cluster.address
        ...                                         # a compile with backend="ray"
        cluster.kill(1)                             # end the worker node's processes by their ids (SIGKILL)

Leaving the block ends every process of the cluster (by their ids, never `ray stop`, which would stop any other
cluster of the machine too).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes() -> dict[int, str]:
    """Every process of the machine: pid -> its command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # ended meanwhile
                pass
    return found


def _children(pid: int) -> list[int]:
    """The process and every process below it (by parent id)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += [c for c, parent in parents.items() if parent == p]
    return found


class LocalRayCluster:
    """`nodes` Ray nodes on this machine (`cpus_per_node` CPUs each, a small object store): node 0 the head, the others
    workers joined to it. `env` is added to the environment the nodes (and so their task processes) run in. `auth`:
    the nodes' RAY_AUTH_MODE ("disabled", so that a token in the user's ~/.ray, with which `ray start` turns token
    authentication on, does not change the tests' cluster), or None: as a shell without RAY_AUTH_* starts it."""

    def __init__(self, nodes: int = 2, *, cpus_per_node: int = 1, env: dict | None = None,
                 auth: str | None = "disabled"):
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        self.nodes, self.cpus = nodes, cpus_per_node
        self.env = {**base, "RAY_USAGE_STATS_ENABLED": "0", **({"RAY_AUTH_MODE": auth} if auth else {}), **(env or {})}
        self.temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.port, self.manager_ports = free_port(), [free_port() for _ in range(nodes)]
        self.address = f"127.0.0.1:{self.port}"

    def _ray(self, *args: str) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        done = subprocess.run([ray, "start", *args, f"--num-cpus={self.cpus}", "--object-store-memory=100000000",
                               "--disable-usage-stats"], env=self.env, capture_output=True, text=True, timeout=180)
        if done.returncode:
            raise RuntimeError(f"ray start {' '.join(args)} failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")

    def __enter__(self) -> LocalRayCluster:
        try:
            self._ray("--head", f"--port={self.port}", f"--temp-dir={self.temp_dir}", "--include-dashboard=false",
                      f"--node-manager-port={self.manager_ports[0]}")
            for i in range(1, self.nodes):
                self._ray(f"--address={self.address}", f"--node-manager-port={self.manager_ports[i]}",
                          f"--dashboard-agent-listen-port={free_port()}")
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def raylet(self, node: int) -> int | None:
        """The process id of node `node`'s raylet (None when it has ended)."""
        flag = f"--node_manager_port={self.manager_ports[node]}"
        return next((pid for pid, cmd in _processes().items() if "raylet" in cmd.split(" ")[0] and flag in cmd), None)

    def node_id(self, node: int) -> str | None:
        """Ray's id of node `node`, read from its raylet's command line."""
        pid = self.raylet(node)
        cmd = _processes().get(pid, "") if pid else ""
        return next((a.split("=", 1)[1] for a in cmd.split() if a.startswith("--node_id=")), None)

    def kill(self, node: int) -> list[int]:
        """End worker node `node` as a machine failing would: SIGKILL to its raylet and every process below it, and to
        the node's other processes (those naming its id). Returns the process ids ended."""
        pid, ident = self.raylet(node), self.node_id(node)
        targets = set(_children(pid)) if pid else set()
        targets |= {p for p, cmd in _processes().items() if ident and ident in cmd}
        for p in targets:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return sorted(targets)

    def stop(self) -> None:
        """End every process of the cluster: those naming its folder or ports, and every process below them."""
        marks = [self.temp_dir, f":{self.port}", f"={self.port}", *(f"={p}" for p in self.manager_ports)]
        roots = [p for p, cmd in _processes().items() if p != os.getpid() and any(m in cmd for m in marks)]
        for p in {c for r in roots for c in _children(r)} - {os.getpid()}:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
