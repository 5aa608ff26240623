"""`Comm`: every collective and point-to-point call a plugin may make, with accounting.

Plugins never call torch.distributed themselves (docs/writing-plugins.md). Each call here

* counts the bytes this worker sends and receives, using the traffic of the algorithm the
  backends run (ring all-reduce: 2(n-1)/n of the buffer each way; ring all-gather: (n-1)
  times the local chunk; broadcast: the root sends one copy to each other member),
* counts the seconds the caller is blocked (a synchronous call's duration, or the time spent
  in `Handle.wait()` for a non-blocking one),
* applies the spec's network emulation: an operation never completes sooner than
  `messages * latency + bytes_sent / bandwidth` after it was issued, or, on a cluster of
  nodes and regions (cluster.py), than the messages it sends take on the links they cross;
  there it also splits the bytes sent by the link level they crossed.

Counters are per process and safe to update from background threads (asynchronous gossip).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dsgd_cli.comm import by_messages
from dsgd_cli.comm.cluster import LEVELS, Cluster
# Handles, and what a worker says when a collective hangs; Handle and CommTimeout are imported
# from here too.
from dsgd_cli.comm.handles import Handle
from dsgd_cli.comm.hangs import CollectiveCounts, CommTimeout, Entered
# The emulated link, in real time (`emulation.network.real_network`); imported from here too.
from dsgd_cli.emulation.network import NetworkModel


DEFAULT_TIMEOUT_S = 600.0  # the spec's `timeout` when it has none
# What an operation costs on a cluster: its real seconds, and its bytes sent per link level.
Cost = tuple[float, dict[str, int]]


@dataclass
class Traffic:
    """What this worker communicated since the counters were last taken."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    calls: int = 0
    # On a cluster: bytes_sent split by the link level they crossed (cluster.LEVELS).
    sent_by_level: dict[str, int] | None = None


@dataclass(frozen=True)
class Group:
    """A set of ranks that communicate together; `comm.world` is everyone."""

    ranks: tuple[int, ...]
    process_group: Any = None  # None means the default (world) group
    backend: str = "gloo"  # nccl moves CUDA tensors only

    @property
    def size(self) -> int:
        return len(self.ranks)


class SharedCounter:
    """An integer every worker can add to and read, kept in the rendezvous key-value store
    (a round trip to the store per call, no collective: workers need not be in step)."""

    def __init__(self, key: str):
        self._store = dist.distributed_c10d._get_default_store()
        self._key = f"dsgd/{key}"

    def add(self, amount: int) -> int:
        """Add `amount`; returns the new total."""
        return int(self._store.add(self._key, int(amount)))

    def value(self) -> int:
        return self.add(0)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def host_buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor of `tensor`'s shape and dtype, for a message gloo carries: page-
    locked when `tensor` is on a GPU, so that the copies to and from the device are DMA
    transfers (torch caches such buffers: they are not allocated anew each time)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype,
                       pin_memory=tensor.device.type == "cuda")


class Comm:
    """Communication for one worker. Built by the runtime; plugins get it as `ctx.comm`."""

    def __init__(self, rank: int, world_size: int, network: NetworkModel | None = None,
                 device: torch.device | str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S,
                 namespace: str = "", cluster: Cluster | None = None,
                 ring_max: int = by_messages.GLOO_RING_MAX):
        self.rank = rank
        # Groups of more members all-reduce by messages in real (by_messages.py).
        self.ring_max = ring_max
        # Experiments that share a launch keep their counters apart (see `counter`).
        self.namespace = namespace
        self._groups: list[Any] = []  # process groups made by new_group, for close()
        self.world_size = world_size
        self.network = network or NetworkModel()
        # Nodes, regions and their links, in real time: replaces `network` when set.
        self.cluster = cluster
        # Process groups give up on an operation after this long (gloo enforces it).
        self.timeout_s = timeout_s
        # Tensors for the world group and for groups of its backend live here: with NCCL the
        # worker's GPU. Groups made with backend="gloo" take CPU tensors wherever the world is.
        self.device = torch.device(device)
        self.world = Group(tuple(range(world_size)), None,
                           dist.get_backend() if dist.is_initialized() else "gloo")
        self._traffic = self._new_traffic()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._collectives = CollectiveCounts(rank, namespace)
        # Per group, when its last modeled collective ends (perf_counter): the backends run a
        # group's collectives one after the other (gloo's and NCCL's queue per communicator),
        # so one issued while another is on the wire starts, in the model, when it ends.
        self._group_busy_until: dict[str, float] = {}
        self._by_messages: dict[Any, int] = {}  # collectives by messages, per group
        # Operations with a modeled duration, and those whose real transfer overran it: their
        # recorded time is then the machine's, not the model's (see `comm_overrun`).
        self.modeled_operations = self.overran_operations = 0
        # The real seconds those overruns held the training loop past their modeled end.
        self.overrun_seconds = 0.0

    # -- accounting -------------------------------------------------------------------------

    def blocked_seconds(self) -> float:
        """The seconds counted as blocked in communication since `take_traffic` last ran."""
        with self._lock:
            return self._traffic.seconds

    def take_traffic(self) -> Traffic:
        """Return the counters accumulated so far and start new ones."""
        with self._lock:
            traffic, self._traffic = self._traffic, self._new_traffic()
        return traffic

    def _new_traffic(self) -> Traffic:
        return Traffic(sent_by_level=None if self.cluster is None else dict.fromkeys(LEVELS, 0))

    @contextmanager
    def _local_flag(self, name: str, value: bool):
        """Set a per-thread flag for the duration of a `with` block."""
        previous = getattr(self._local, name, True)
        setattr(self._local, name, value)
        try:
            yield
        finally:
            setattr(self._local, name, previous)

    def untracked(self):
        """Communication of the runtime itself (evaluation), kept out of the training metrics."""
        return self._local_flag("tracking", False)

    def _tracking(self) -> bool:
        return getattr(self._local, "tracking", True)

    def background(self):
        """Communication of a plugin's background thread: bytes are counted and the network
        is emulated as usual, but the time the thread spends blocked is not the training
        loop's, so it stays out of the `comm_seconds` metric."""
        return self._local_flag("count_seconds", False)

    def _counting_seconds(self) -> bool:
        return getattr(self._local, "count_seconds", True)

    @contextmanager
    def blocked(self):
        """Time the caller spends waiting for communication done elsewhere (by a plugin's
        background thread) counts as its communication time."""
        started = time.perf_counter()
        try:
            yield
        finally:
            if self._tracking() and self._counting_seconds():
                self._add(seconds=time.perf_counter() - started)

    def _note_modeled(self, overran: bool, added_s: float = 0.0) -> None:
        with self._lock:
            self.modeled_operations += 1
            self.overran_operations += overran
            self.overrun_seconds += added_s

    def _add(self, *, sent: int = 0, received: int = 0, seconds: float = 0.0, calls: int = 0,
             levels: dict[str, int] | None = None):
        with self._lock:
            if levels:
                for level, nbytes in levels.items():
                    self._traffic.sent_by_level[level] += nbytes
            self._traffic.bytes_sent += sent
            self._traffic.bytes_received += received
            self._traffic.seconds += seconds
            self._traffic.calls += calls

    def _issue(self, start: Callable[[], Any], *, sent: int, received: int, messages: int,
               async_op: bool, operation: str, result: Any = None,
               on_complete: Callable[[], Any] | None = None,
               collective: Group | None = None,
               on_cluster: Callable[[Cluster], Cost] | None = None) -> Any:
        """Run one operation: count it, emulate the network, block unless `async_op`.
        `collective`: the group of a collective (every member must enter it), counted.
        `on_cluster`: what the operation costs on the cluster, when there is one (an
        operation that sends nothing costs nothing)."""
        entered = None
        name = self._group_name(collective) if collective is not None else None
        if name is not None:
            entered = self._collectives.enter(name, collective.ranks)
        tracked = self._tracking()
        emulated_s, levels = 0.0, None
        if tracked and self.cluster is not None:
            if on_cluster is not None:
                emulated_s, levels = on_cluster(self.cluster)
            assert sum((levels or {}).values()) == sent, operation  # the ledger adds up
        elif tracked:
            emulated_s = self.network.duration(sent, messages)
        if tracked:
            self._add(sent=sent, received=received, calls=1, levels=levels)
        issued_at = time.perf_counter()
        if name is not None and emulated_s > 0:
            starts = max(issued_at, self._group_busy_until.get(name, 0.0))
            self._group_busy_until[name] = starts + emulated_s
            emulated_s += starts - issued_at  # the queue's wait, then its own transfer
        try:
            work = start()
        except RuntimeError as error:
            raise self._failure(operation, error, entered) from error
        works = list(work) if isinstance(work, (list, tuple)) else [work]  # several messages
        done_at = None
        if all(work is None for work in works):  # moved as it was issued (by_messages.py)
            done_at = time.perf_counter()
            if async_op and tracked and self._counting_seconds():
                self._add(seconds=done_at - issued_at)  # the caller was blocked meanwhile
        handle = Handle(self, works, issued_at, emulated_s, result, on_complete,
                        blocking=not async_op, operation=operation, entered=entered,
                        done_at=done_at)
        return handle if async_op else handle.wait()

    def _failure(self, operation: str, error: RuntimeError,
                 entered: Entered | None = None) -> RuntimeError:
        """The backend's error, saying which operation failed. gloo reports a timeout as
        "Timed out waiting Nms for recv operation", whatever the operation was, and once one
        operation timed out the connections it used fail at once ("pair closure"). A
        collective's timeout names the members that never entered it."""
        text = str(error)
        # gloo says "Connect timeout" when the peer never connected (it never reached the
        # collective that opens the pair): a timeout too, whose culprit is that peer.
        if "Timed out" in text or "Connect timeout" in text:
            behind = self._collectives.behind(*entered) if entered is not None else []
            late = f"; ranks behind: {', '.join(map(str, behind))}" if behind else ""
            return CommTimeout(f"{operation}: no progress for {self.timeout_s:g} s "
                               f"(the spec's timeout){late}", behind)
        if "timeout caused pair closure" in text:
            return RuntimeError(f"{operation}: connection closed after an earlier timeout")
        return RuntimeError(f"{operation}: {text}")

    def _group_name(self, group: Group) -> str | None:
        """The same name on every member: "world", or the group's place in the order the
        members made their groups (torch has them all make every group in the same order);
        None for a group not made by `new_group`."""
        if group.process_group is None:
            return "world"
        for index, process_group in enumerate(self._groups):
            if process_group is group.process_group:
                return f"group{index}"
        return None

    def _members(self, group: Group | None) -> str:
        ranks = (group or self.world).ranks
        if len(ranks) == self.world_size:
            return f"all {self.world_size} workers"
        return "ranks " + ", ".join(map(str, ranks))

    @staticmethod
    def _pg(group: Group | None):
        return None if group is None else group.process_group

    def _wire_device(self, group: Group | None) -> torch.device:
        """Where a message on `group` must be: the GPU for NCCL, host memory for gloo, whose
        sends, receives and reduce-scatters take CPU tensors (workers sharing a GPU compute
        on it and communicate over gloo; gloo stages its all-reduces, broadcasts and
        all-gathers of CUDA tensors through host memory itself)."""
        return self.device if (group or self.world).backend == "nccl" else torch.device("cpu")

    def on_wire(self, tensor: torch.Tensor, group: Group | None) -> torch.Tensor:
        """`tensor`, or its copy where messages on `group` must be (see `_wire_device`)."""
        device = self._wire_device(group)
        if tensor.device == device:
            return tensor
        if device.type == "cpu":
            wire = host_buffer_like(tensor)
            wire.copy_(tensor)  # waits for the copy: gloo reads the buffer next
            return wire
        return tensor.to(device)

    def _check(self, tensor: torch.Tensor, group: Group | None, operation: str) -> None:
        """NCCL fails obscurely, or hangs, on a CPU tensor: say which call was wrong."""
        if (group or self.world).backend == "nccl" and tensor.device.type != "cuda":
            raise ValueError(
                f"{operation}: a {tensor.device.type} tensor on an nccl group; make it on "
                "comm.device, or use a group made with backend='gloo'")

    def _size(self, group: Group | None) -> int:
        return self.world_size if group is None else group.size

    def _ring_cost(self, group: Group | None, sent: int,
                   seconds: Callable[[Cluster, tuple[int, ...]], float]) -> Callable[[Cluster], Cost]:
        """A ring collective's cost: `seconds(cluster, ranks)`, and everything this worker
        sends goes to its successor in the ring, over the link between them."""
        ranks = (group or self.world).ranks

        def cost(cluster: Cluster) -> Cost:
            successor = ranks[(ranks.index(self.rank) + 1) % len(ranks)]
            return seconds(cluster, ranks), {cluster.level(self.rank, successor): sent}
        return cost

    def _message_cost(self, destination: int, *sizes: int) -> Callable[[Cluster], Cost]:
        """Point-to-point messages of `sizes` bytes to `destination`, one after the other."""
        def cost(cluster: Cluster) -> Cost:
            seconds = sum(cluster.p2p_seconds(self.rank, destination, size) for size in sizes)
            return seconds, {cluster.level(self.rank, destination): sum(sizes)}
        return cost

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", group: Group | None = None,
                   async_op: bool = False, concurrent: int = 1):
        """Reduce `tensor` in place over the group. `op`: sum, avg, max, min.
        `concurrent`: on a cluster, how many all-reduces of this shape run at once on other
        ranks of the same nodes (a hierarchical all-reduce's slices): they share each node's
        link."""
        self._check(tensor, group, "all_reduce")
        reduce_ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
                      "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        if op not in reduce_ops:
            raise ValueError(f"all_reduce op must be one of {', '.join(reduce_ops)}, got {op!r}")
        n = self._size(group)
        traffic = 2 * (n - 1) * _nbytes(tensor) // n
        finish = None
        if op == "avg":  # gloo has no AVG: sum, then scale when the result is there
            def finish():
                tensor.div_(n)
                return tensor
        if by_messages.wanted(n, tensor, self.ring_max):  # a large group: by_messages.py
            start = self._all_reduce_by_messages(tensor, "sum" if op == "avg" else op, group)
        else:
            def start():
                return dist.all_reduce(tensor, reduce_ops[op], group=self._pg(group),
                                       async_op=True)
        return self._issue(
            start,
            sent=traffic, received=traffic, messages=2 * (n - 1), async_op=async_op,
            operation=f"all_reduce over {self._members(group)}", result=tensor,
            on_complete=finish, collective=group or self.world,
            on_cluster=self._ring_cost(group, traffic, lambda cluster, ranks: (
                cluster.ring_all_reduce_seconds(ranks, _nbytes(tensor), concurrent))))

    def reduce_scatter(self, tensor: torch.Tensor, group: Group | None = None,
                       async_op: bool = False):
        """Sum `tensor` over the group and give member i (in group order) its i-th of n equal
        chunks; `tensor.numel()` must be a multiple of the group's size. A ring: each member
        sends (n-1)/n of the tensor."""
        self._check(tensor, group, "reduce_scatter")
        n = self._size(group)
        if tensor.numel() % n:
            raise ValueError(f"reduce_scatter: {tensor.numel()} elements do not split into "
                             f"{n} equal chunks")
        wire = self.on_wire(tensor, group)  # gloo reduces CPU tensors only
        received = torch.empty(tensor.numel() // n, dtype=tensor.dtype, device=wire.device)
        traffic = (n - 1) * _nbytes(tensor) // n
        return self._issue(
            lambda: dist.reduce_scatter_tensor(received, wire, group=self._pg(group),
                                               async_op=True),
            sent=traffic, received=traffic, messages=n - 1, async_op=async_op,
            operation=f"reduce_scatter over {self._members(group)}",
            on_complete=lambda: received.to(tensor.device),
            collective=group or self.world,
            on_cluster=self._ring_cost(group, traffic, lambda cluster, ranks: (
                cluster.ring_reduce_scatter_seconds(ranks, _nbytes(tensor)))))

    def all_gather(self, tensor: torch.Tensor, group: Group | None = None,
                   async_op: bool = False):
        """Every member's `tensor` (same shape everywhere), as a list in group-rank order."""
        self._check(tensor, group, "all_gather")
        n = self._size(group)
        outputs = [torch.empty_like(tensor) for _ in range(n)]
        traffic = (n - 1) * _nbytes(tensor)
        return self._issue(
            lambda: dist.all_gather(outputs, tensor, group=self._pg(group), async_op=True),
            sent=traffic, received=traffic, messages=n - 1, async_op=async_op,
            operation=f"all_gather over {self._members(group)}", result=outputs,
            collective=group or self.world,
            on_cluster=self._ring_cost(group, traffic, lambda cluster, ranks: (
                cluster.ring_all_gather_seconds(ranks, _nbytes(tensor)))))

    def all_gather_uneven(self, tensor: torch.Tensor, group: Group | None = None) -> list[torch.Tensor]:
        """All-gather of 1-D tensors whose lengths differ between members (lengths go first)."""
        length = torch.tensor([tensor.numel()], dtype=torch.int64, device=tensor.device)
        lengths = [int(x) for x in self.all_gather(length, group=group)]
        padded = torch.zeros(max(lengths, default=0), dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.numel()] = tensor.reshape(-1)
        gathered = self.all_gather(padded, group=group)
        return [chunk[:size] for chunk, size in zip(gathered, lengths)]

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group | None = None,
                  async_op: bool = False):
        """Copy `tensor` from global rank `src` to every member, in place."""
        self._check(tensor, group, "broadcast")
        n = self._size(group)
        size = _nbytes(tensor)
        is_root = self.rank == src
        ranks = (group or self.world).ranks

        def on_cluster(cluster: Cluster) -> Cost:
            if not is_root:
                return 0.0, {}
            return (cluster.broadcast_seconds(src, ranks, size),
                    cluster.bytes_by_level([(src, rank, size) for rank in ranks if rank != src]))
        return self._issue(
            lambda: dist.broadcast(tensor, src, group=self._pg(group), async_op=True),
            sent=(n - 1) * size if is_root else 0, received=0 if is_root else size,
            messages=n - 1 if is_root else 0, async_op=async_op,
            operation=f"broadcast from rank {src} over {self._members(group)}", result=tensor,
            collective=group or self.world, on_cluster=on_cluster)

    def _all_reduce_by_messages(self, tensor: torch.Tensor, op: str,
                                group: Group | None) -> Callable[[], None]:
        """How to start an all-reduce of a large group (by_messages.py). It completes before
        `start()` returns: an `async_op` caller gets the result early, never late."""
        ranks = (group or self.world).ranks
        # Counted per group, not per member set: groups of the same members (a plugin's
        # own group of everyone beside the world) each have their own order of collectives.
        key = self._group_name(group or self.world) or ranks
        with self._lock:
            count = self._by_messages.get(key, 0)
            self._by_messages[key] = count + 1
        return lambda: by_messages.all_reduce(tensor, op, ranks, self.rank, self._pg(group),
                                              by_messages.tag(count))

    def barrier(self, group: Group | None = None) -> None:
        nccl = (group or self.world).backend == "nccl"
        marker = torch.zeros(1, device=self.device if nccl else "cpu")
        if by_messages.wanted(self._size(group), marker, self.ring_max):
            # gloo's barrier, like its ring, sends messages quadratic in the group's size
            start = self._all_reduce_by_messages(marker, "sum", group)
        else:
            def start():
                return dist.barrier(group=self._pg(group), async_op=True)
        self._issue(start,
                    sent=0, received=0, messages=0, async_op=False,
                    operation=f"barrier of {self._members(group)}", collective=group or self.world)

    def counter(self, name: str) -> SharedCounter:
        """A counter shared by all workers, starting at 0; the same `name` on every worker
        means the same counter."""
        return SharedCounter(f"{self.namespace}/{name}" if self.namespace else name)

    def new_group(self, ranks: Sequence[int], backend: str | None = None) -> Group:
        """A sub-group. Like torch.distributed, every rank must call this, in the same order.
        `backend` (e.g. "gloo" for CPU tensors next to an nccl world) defaults to the world's."""
        ranks = tuple(sorted(ranks))
        process_group = dist.new_group(list(ranks), backend=backend,
                                       timeout=timedelta(seconds=self.timeout_s))
        self._groups.append(process_group)
        return Group(ranks, process_group, backend or self.world.backend)

    def close(self) -> None:
        """Release the process groups made by `new_group` (their sockets and threads), once
        nothing uses them: the next experiment of a shared launch makes its own."""
        for process_group in self._groups:
            if process_group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
                dist.destroy_process_group(process_group)
        self._groups.clear()
        self._collectives.close()

    # -- point to point ---------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int, group: Group | None = None) -> None:
        self.isend(tensor, dst, group).wait()

    def send_within_process(self, tensor: torch.Tensor) -> None:
        """What `send` would cost, for a message whose receiver is a thread of this process
        (rank 0's coordinator beside its training loop): counts the bytes sent and received
        and blocks for the emulated transfer time, so that the local rank is not favoured."""
        size = _nbytes(tensor)
        # On a cluster: as from the worker slowest to reach from this one (with links per pair
        # of regions, the slowest pair; with one link per level, the highest level).
        farthest = max(range(self.world_size), key=lambda rank: (
            self.cluster.p2p_seconds(self.rank, rank, size),
            LEVELS.index(self.cluster.level(self.rank, rank)), rank)) if self.cluster else 0
        self._issue(lambda: None, sent=size, received=size, messages=1, async_op=False,
                    operation="send within this process",
                    on_cluster=self._message_cost(farthest, size))

    def recv(self, tensor: torch.Tensor, src: int | None = None,
             group: Group | None = None) -> torch.Tensor:
        return self.irecv(tensor, src, group).wait()

    def isend(self, tensor: torch.Tensor, dst: int, group: Group | None = None) -> Handle:
        """Send `tensor` to global rank `dst` (a member of `group`). With gloo, the send
        completes once the receiver has posted a matching receive."""
        self._check(tensor, group, "isend")
        wire = self.on_wire(tensor, group)
        return self._issue(lambda: dist.isend(wire, dst, group=self._pg(group)),
                           sent=_nbytes(tensor), received=0, messages=1, async_op=True,
                           operation=f"send to rank {dst}", result=tensor,
                           on_cluster=self._message_cost(dst, _nbytes(tensor)))

    def irecv(self, tensor: torch.Tensor, src: int | None = None, group: Group | None = None,
              length: Callable[[torch.Tensor], int] | None = None) -> Handle:
        """Receive into `tensor` from global rank `src`, or from any member of `group` when
        `src` is None (put the sender in the message if the receiver needs it). Messages
        between two ranks on one group arrive in the order they were sent.
        gloo also delivers a message shorter than `tensor` into its start: then `length`, read
        from the received message, says how many elements arrived (counted on `wait()`)."""
        self._check(tensor, group, "irecv")
        # The sender pays the emulated transfer time; the receiver waits for the data.
        source = f"rank {src}" if src is not None else f"any of {self._members(group)}"
        counted = length is not None and self._tracking()
        device = self._wire_device(group)
        if tensor.device == device:
            wire = tensor
        elif device.type == "cpu":
            wire = host_buffer_like(tensor)
        else:
            wire = torch.empty_like(tensor, device=device)

        def arrived():
            if wire is not tensor:
                tensor.copy_(wire)
            if counted:
                self._add(received=length(tensor) * tensor.element_size())
            return tensor
        return self._issue(lambda: dist.irecv(wire, src, group=self._pg(group)), sent=0,
                           received=0 if length is not None else _nbytes(tensor), messages=0,
                           async_op=True, operation=f"recv from {source}", result=tensor,
                           on_complete=arrived)

    # -- several tensors in one message (a compressor's payload) ------------------------------

    def isend_tensors(self, tensors: Sequence[torch.Tensor], dst: int, group: Group | None = None,
                      uniform: bool = True) -> Handle:
        """Send `tensors`, of any dtypes and shapes (a compressor's `Payload.tensors`: codes,
        indices, values, norms), to global rank `dst` as one message of their bytes, so they
        pay one latency and count exactly their bytes, as in an all-gather of payloads.
        The receiver (`irecv_tensors`) must know their dtypes and count and, with `uniform`,
        their shapes (a compressor whose payload is the same size on every worker).
        `uniform=False` (lengths that differ between workers, as dqsgd's): the byte length of
        each tensor travels first, one int64 each, counted like the lengths an all-gather of
        uneven payloads sends first; the receiver then gets the tensors 1-D."""
        for tensor in tensors:
            self._check(tensor, group, "isend_tensors")
        as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        device = self._wire_device(group)
        body = torch.cat(as_bytes) if as_bytes else torch.empty(0, dtype=torch.uint8)
        body = self.on_wire(body, group)
        pg = self._pg(group)
        if uniform:
            return self._issue(lambda: dist.isend(body, dst, group=pg), sent=_nbytes(body),
                               received=0, messages=1, async_op=True,
                               operation=f"send to rank {dst}", result=list(tensors),
                               on_cluster=self._message_cost(dst, _nbytes(body)))
        lengths = torch.tensor([b.numel() for b in as_bytes], dtype=torch.int64, device=device)
        return self._issue(lambda: [dist.isend(lengths, dst, group=pg),
                                    dist.isend(body, dst, group=pg)],
                           sent=_nbytes(lengths) + _nbytes(body), received=0, messages=2,
                           async_op=True, operation=f"send to rank {dst}", result=list(tensors),
                           on_cluster=self._message_cost(dst, _nbytes(lengths), _nbytes(body)))

    def irecv_tensors(self, like: Sequence[torch.Tensor], src: int, group: Group | None = None,
                      uniform: bool = True) -> Handle:
        """Receive what `isend_tensors(tensors, …, uniform)` sent from global rank `src`;
        `wait()` returns the tensors, with the dtypes of `like` (this worker's own payload of
        the same kind does), shaped like them when `uniform`, else 1-D, on `like`'s device."""
        for tensor in like:
            self._check(tensor, group, "irecv_tensors")
        device = self._wire_device(group)  # where the message arrives
        pg = self._pg(group)
        operation = f"recv from rank {src}"

        def split(body: torch.Tensor, sizes: list[int], shapes) -> list[torch.Tensor]:
            # A slice of a byte buffer may be misaligned for wider dtypes: copy before the view.
            return [chunk.clone().view(t.dtype).view(shape).to(t.device)
                    for chunk, t, shape in zip(body.split(sizes), like, shapes)]

        if uniform:
            sizes = [_nbytes(t) for t in like]
            body = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            return self._issue(lambda: dist.irecv(body, src, group=pg), sent=0,
                               received=_nbytes(body), messages=0, async_op=True,
                               operation=operation,
                               on_complete=lambda: split(body, sizes, [t.shape for t in like]))
        lengths = torch.empty(len(like), dtype=torch.int64, device=device)
        tracked = self._tracking()

        def receive_body() -> list[torch.Tensor]:
            # The lengths are here: post the body's receive and wait for it. The enclosing
            # handle's wait() counts the seconds; its bytes are counted here.
            sizes = lengths.tolist()
            body = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            try:
                dist.irecv(body, src, group=pg).wait()
            except RuntimeError as error:
                raise self._failure(operation, error) from error
            if tracked:
                self._add(received=_nbytes(body))
            return split(body, sizes, [(-1,)] * len(like))

        return self._issue(lambda: dist.irecv(lengths, src, group=pg), sent=0,
                           received=_nbytes(lengths), messages=0, async_op=True,
                           operation=operation, on_complete=receive_body)
