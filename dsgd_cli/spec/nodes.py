"""Runs across machines: the spec's `launch:` section and `dsgd run --nnodes/--node-rank/
--rdzv-endpoint`.

Every machine runs the same `dsgd run SPEC` with its own node rank; each starts torchrun for
`workers / nnodes` local workers, and all meet through torchrun's c10d rendezvous at the
endpoint (on the machine of node rank 0, usually). One run is recorded once: node rank 0
creates it, follows its status and ends it; the other nodes add their workers' metrics to the
same run, so the database must be shared (PostgreSQL, or an SQLite file on a shared
filesystem). Each experiment is a launch of its own (no shared launches across machines), its
rendezvous id derived from the spec and the experiment, the same on every machine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from dsgd_cli.errors import SpecError

LAUNCH_KEYS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_timeout")
DEFAULT_RDZV_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class NodePlan:
    """This machine's part in a run over `nnodes` machines."""

    nnodes: int
    node_rank: int
    endpoint: str
    timeout: float = DEFAULT_RDZV_TIMEOUT_S  # seconds to wait for every node to join

    @property
    def records(self) -> bool:
        """Node rank 0 records the runs; the others add their workers' metrics."""
        return self.node_rank == 0

    def local_workers(self, workers: int) -> int:
        return workers // self.nnodes

    def rendezvous_id(self, spec_text: str, experiment: str) -> str:
        digest = hashlib.sha256(f"{spec_text}\0{experiment}".encode()).hexdigest()[:16]
        return f"dsgd-{digest}"


def parse_launch(raw: Any, overrides: dict[str, Any] | None = None) -> NodePlan | None:
    """The `launch:` section with the command line's values over it; None on one machine."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(f"expected a mapping with keys {', '.join(LAUNCH_KEYS)}", path="launch")
    for key in raw:
        if key not in LAUNCH_KEYS:
            raise SpecError(f"unknown key (expected one of {', '.join(LAUNCH_KEYS)})",
                            path=f"launch.{key}")
    merged = {**raw, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    nnodes = _integer(merged.get("nnodes", 1), "nnodes", low=1)
    if nnodes == 1:
        return None
    node_rank = _integer(merged.get("node_rank", 0), "node_rank", low=0)
    if node_rank >= nnodes:
        raise SpecError(f"expected a node rank below nnodes ({nnodes}), got {node_rank}",
                        path="launch.node_rank")
    endpoint = merged.get("rdzv_endpoint")
    if not isinstance(endpoint, str) or not _is_endpoint(endpoint):
        raise SpecError(f"expected HOST:PORT where the nodes meet, got {endpoint!r}",
                        path="launch.rdzv_endpoint")
    timeout = merged.get("rdzv_timeout", DEFAULT_RDZV_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e7:
        raise SpecError(f"expected seconds > 0, got {timeout!r}", path="launch.rdzv_timeout")
    return NodePlan(nnodes, node_rank, endpoint, float(timeout))


def local_workers(plan: NodePlan | None, workers: int) -> int:
    """How many of a run's `workers` run on this machine."""
    return workers if plan is None else plan.local_workers(workers)


def check_split(plan: NodePlan | None, workers: int, path: str) -> None:
    if plan is not None and workers % plan.nnodes:
        raise SpecError(f"{workers} workers cannot be split evenly over {plan.nnodes} nodes",
                        path=f"{path}.workers")


def _integer(value: Any, key: str, low: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or value > 2**16:
        raise SpecError(f"expected an integer between {low} and {2**16}, got {value!r}",
                        path=f"launch.{key}")
    return value


def _is_endpoint(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
