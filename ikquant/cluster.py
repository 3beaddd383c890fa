"""Ray clusters for the commands that spread work over machines (`ikquant --ray`, `ikrun sweep --ray`).

`--ray local` or `local:N` starts a private Ray on 127.0.0.1 for this command (N workers, default one per core);
anything else is the address of a running cluster (`auto`, `HOST:PORT`, `ray://HOST:10001`), whose workers must
have iktools installed and read the model at the same path. Ray is an optional extra: without it, `--ray` says
how to install it. An address that does not answer is refused within seconds (Ray itself retries for minutes).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ikquant.errors import ClusterError

INSTALL_HINT = "pip install 'iktools[ray]'"
#: how long a cluster address may take to accept a connection before it is called unreachable
CONNECT_TIMEOUT_S = 5.0


def ray_module() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise ClusterError(f"--ray needs Ray, an optional extra: {INSTALL_HINT}") from None
    return ray


def parse_address(address: str) -> tuple[str, int | None]:
    """("local", N or None) for a private local cluster, else (address, None)."""
    m = re.fullmatch(r"local(?::(\d+))?", address.strip())
    if m:
        n = int(m.group(1)) if m.group(1) else None
        if n is not None and n < 1:
            raise ClusterError(f"--ray {address}: a local cluster needs at least one worker")
        return "local", n
    if not address.strip():
        raise ClusterError("--ray needs an address: local, local:N, auto, HOST:PORT or ray://HOST:PORT")
    return address.strip(), None


def _check_reachable(address: str) -> None:
    m = re.fullmatch(r"(?:ray://)?\[?([^\]/]+?)\]?:(\d+)", address)
    if m is None:
        return  # `auto` and other forms Ray resolves itself, quickly
    host, port = m.group(1), int(m.group(2))
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ClusterError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc})") from None


@dataclass(frozen=True)
class Cluster:
    """A connected Ray and how many workers of `threads` CPUs each to run on it."""

    ray: ModuleType
    address: str
    workers: int
    threads: int


#: every worker process of a command's job keeps the memory it frees, as the command-line tools do (heap.py: a
#: layer's buffers reuse the last layer's pages; without it the workers faulted fresh ones in every layer)
WORKER_ENV = {"worker_process_setup_hook": "ikquant.heap.retain_freed_memory"}


@contextmanager
def open_cluster(address: str, threads: int = 1) -> Iterator[Cluster]:
    """Connect to (or start) the cluster for one command; disconnects (and stops a local one) on exit."""
    ray = ray_module()
    where, n_local = parse_address(address)
    threads = max(1, threads)
    try:
        if where == "local":
            n = n_local or max(1, (os.cpu_count() or 1) // threads)
            ray.init(address="local", num_cpus=n * threads, include_dashboard=False, log_to_driver=False,
                     _node_ip_address="127.0.0.1", configure_logging=False, runtime_env=WORKER_ENV)
        else:
            _check_reachable(where)
            ray.init(address=where, log_to_driver=False, configure_logging=False, runtime_env=WORKER_ENV)
            n = max(1, int(ray.cluster_resources().get("CPU", 1)) // threads)
    except ConnectionError as exc:
        raise ClusterError(f"--ray {address}: {exc}") from None
    except ValueError as exc:
        if "ray[client]" not in str(exc):
            raise
        raise ClusterError(f"--ray {address}: ray:// addresses need Ray's client: {INSTALL_HINT}") from None
    try:
        yield Cluster(ray, address, n, threads)
    finally:
        ray.shutdown()


def ordered_map(cluster: Cluster, fn: Callable[..., Any], calls: Iterable[tuple[Any, ...]],
                window: int | None = None) -> Iterator[Any]:
    """fn(*args) for every args of `calls`, run as Ray tasks with at most `window` in flight, results in order.

    A task whose worker dies is rerun by Ray (up to its retry limit), so no result is lost or repeated."""
    remote = cluster.ray.remote(num_cpus=cluster.threads, max_retries=3)(fn)
    window = window or 2 * cluster.workers
    pending: list[Any] = []
    for args in calls:
        pending.append(remote.remote(*args))
        if len(pending) >= window:
            yield cluster.ray.get(pending.pop(0))
    while pending:
        yield cluster.ray.get(pending.pop(0))
