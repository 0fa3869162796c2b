"""Type stubs for ``railyard._native``, the Rust extension module behind ``railyard``.

Addresses are Python ints: raw virtual addresses of host memory in this process, e.g.
``tensor.data_ptr()`` or ``numpy_array.ctypes.data``. Wherever a list of ints is accepted,
a 1-D NumPy array of ``uint64``/``int64`` is accepted too (read with its ``tolist()``:
the stable ABI this wheel is built for has no buffer protocol before Python 3.11).
"""

import os
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal, Protocol

__version__: str
METRICS_CONTENT_TYPE: str
"""The content type of :meth:`Engine.metrics_text` (the Prometheus text format)."""
MAX_NOTIFY: int
"""Most bytes one notification carries."""

class _IntBuffer(Protocol):
    """A 1-D buffer of 64-bit integers, e.g. ``numpy.ndarray`` of ``uint64``/``int64``."""

    def __buffer__(self, flags: int, /) -> memoryview: ...

_Addrs = Sequence[int] | _IntBuffer
"""A list of addresses or lengths: ``list[int]`` or a 1-D uint64/int64 array."""

_BatchState = Literal["DONE", "PROC", "ERR"]

class TransferError(Exception):
    """A transfer failed or could not be queued.

    ``str(err)`` names the failed range, the peer and the reason. When the failure is
    tied to one request of a batch, ``index``, ``local_addr``, ``remote_addr`` and
    ``length`` describe it; otherwise they are ``None``.
    """

    peer: str
    """The peer's session id (``"host:port"``)."""
    reason: str
    """Why it failed (peer unreachable, timeout, unregistered range, ...)."""
    index: int | None
    """Index of the failed request in the batch, if one request is to blame."""
    local_addr: int | None
    remote_addr: int | None
    length: int | None
    kind: str | None
    """What a refused :meth:`PreparedTransfer.post` was about (``"stale_list"``,
    ``"not_connected"``, ``"refused"``); ``None`` otherwise."""

class Batch:
    """An in-flight group of transfers returned by :meth:`Engine.submit`.

    The state is one of ``"DONE"`` (every request completed), ``"PROC"`` (some request
    not resolved yet) or ``"ERR"`` (every request resolved, at least one failed; see
    :meth:`failures`). Only ``"DONE"`` and ``"ERR"`` mean the local ranges are free: a
    request whose deadline passed stays ``"PROC"`` until the engine has failed it (its
    ``Timeout``), after the work posted for it was flushed.
    """

    def poll(self) -> _BatchState:
        """The batch's state now, without blocking."""
        ...

    def wait(self, timeout_s: float | None = None) -> _BatchState:
        """Block (GIL released) until the batch is done or failed, or ``timeout_s`` passed.

        ``timeout_s=None`` waits until the batch's deadline (and a short grace: the
        engine fails what is still in flight at the deadline); ``0`` only looks. Returns
        ``"PROC"`` if the wait ended with requests still in flight.
        """
        ...

    def timed_out(self) -> bool:
        """Whether the engine failed a request because the batch's deadline passed
        (``Timeout``); ``False`` while no request has failed that way yet."""
        ...

    def failures(self) -> list[tuple[int, str]]:
        """``(request index, reason)`` for each failed request; empty unless ``"ERR"``."""
        ...

class Engine:
    """A railyard transfer engine: one per process is the usual shape.

    Args:
        name: This engine's name; peers see it as the sender of notifications.
            ``None`` picks ``python-<host>-<pid>-<n>``, unique on the host.
        listen: ``"host:port"`` to listen on for peers (``port`` 0 picks a free one).
        advertise_host: The host peers should dial, when ``listen`` is a wildcard
            address such as ``0.0.0.0``. ``None`` lets the engine choose.
        fabric: ``"auto"`` (the best one available between the two peers: soft fabric
            on one host, verbs where an RDMA device is present, else TCP), ``"soft"``,
            ``"tcp"``, ``"verbs"`` or ``"ofi"`` (libfabric; ``"efa"`` is the same, and
            without ``ofi_provider`` runs the ``efa`` provider).
        directory: Where peers' descriptors are found: ``"p2p"`` (exchanged when a
            peer is first opened) or ``"etcd://host:port"``.
        timeout_s: Default deadline of a blocking call (``write``, ``read``,
            ``Batch.wait``).
        rails: Number of software rails (default: one per NUMA node, from the topology
            plan).
        busy_poll: Whether each rail's poller spins on its own core while idle (the
            default: lowest latency). ``False`` parks idle pollers, for shared or small
            machines and tests.
        ofi_provider: The libfabric provider of ``fabric="ofi"``, as ``fi_info -l`` names
            it (``"efa"``, ``"tcp;ofi_rxm"``); default ``"efa"`` when present.
        secret_file: A file holding the cluster's secret (at least 16 bytes; default:
            ``$RAILYARD_SECRET_FILE``). Peers must prove they hold the same before this
            engine answers anything, and it proves it to them; without one, peers are not
            authenticated (a warning says so). Control frames after the handshake are then
            authenticated, and encrypted too with ``RAILYARD_ENCRYPT_CONTROL=1`` (the CLI's
            ``--encrypt-control``), which needs a secret.

    Raises:
        ValueError: An argument is malformed (unknown fabric, bad ``listen``, a secret
            file that cannot be read or is too short).
        RuntimeError: The engine could not start (port in use, fabric unavailable).
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        listen: str = "0.0.0.0:0",
        advertise_host: str | None = None,
        fabric: Literal["auto", "soft", "tcp", "verbs", "ofi", "efa"] | str = "auto",
        directory: str = "p2p",
        timeout_s: float = 30.0,
        rails: int | None = None,
        busy_poll: bool = True,
        ofi_provider: str | None = None,
        secret_file: str | os.PathLike[str] | None = None,
    ) -> None: ...
    @property
    def session_id(self) -> str:
        """``"host:port"``: what peers pass as ``session_id`` to reach this engine."""
        ...

    @property
    def name(self) -> str:
        """This engine's name (the sender name on its notifications)."""
        ...

    @property
    def incarnation(self) -> str:
        """This engine's incarnation: a restarted process (or a new engine) is a new one."""
        ...

    @property
    def fabric(self) -> str:
        """The fabric in use: ``"soft"``, ``"tcp"``, ``"soft+tcp"``, ``"verbs"`` or ``"ofi"``."""
        ...

    def alloc(
        self,
        nbytes: int,
        *,
        peer_access: Literal["read_write", "read", "none"] = "read_write",
    ) -> int:
        """Allocate ``nbytes`` of engine memory, already registered; returns its address.

        Backed by huge pages when the system has them. Release it with :meth:`free`.
        ``peer_access`` says what peers may do to it: a decode engine's KV cache needs
        ``"read_write"``; a prefill engine's source buffers, which it only writes out of,
        ``"none"``.
        """
        ...

    def free(self, addr: int) -> None:
        """Free memory returned by :meth:`alloc`. Unknown address: ``ValueError``.

        The memory is forgotten only once its deregistration succeeded. If a poller or a
        peer process was still inside it when the engine's wait ended (a stopped peer,
        say), ``RuntimeError`` (the engine's ``Busy``) is raised: the memory is withdrawn
        but stays allocated and mapped, and calling ``free`` again waits for it again.
        """
        ...

    def register(
        self,
        addrs: int | _Addrs,
        lengths: int | _Addrs,
        *,
        peer_access: Literal["read_write", "read", "none"] = "read_write",
    ) -> None:
        """Register host memory ranges for transfers; ``peer_access`` says what peers may
        do to them (read and write by default).

        Registering the same ``(addr, length)`` again (with the same ``peer_access``) is a
        no-op; a range that overlaps a registered, different range is refused with
        ``ValueError``, and so is memory that looks like device (GPU) memory: only host
        memory is supported.
        """
        ...

    def deregister(self, addrs: int | _Addrs) -> None:
        """Deregister ranges by their start address. Unknown address: ``ValueError``
        (raised before any range is deregistered).

        When it returns, no peer reads or writes the ranges any more. Every range is tried
        and the first error raised. ``RuntimeError`` (the engine's ``Busy``): a poller or a
        peer process was still inside a range when the engine's wait ended; that range is
        withdrawn but still in use and must stay mapped, and deregistering its address
        again waits for it again.
        """
        ...

    def write(
        self,
        session_id: str,
        local_addrs: _Addrs,
        remote_addrs: _Addrs,
        lengths: _Addrs,
        *,
        notify: bytes | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Copy ``lengths[i]`` bytes from ``local_addrs[i]`` here to ``remote_addrs[i]`` on
        the peer ``session_id``, for every ``i``; block (GIL released) until all landed.

        It returns or raises only once the engine resolved every request: a request whose
        deadline passed is failed by the engine (its ``Timeout``) after the work already
        posted for it was flushed, so when the call ends no request touches the local
        ranges any more, whatever the outcome.

        ``notify``: a message delivered to the peer after every byte of the batch landed
        (it appears in the peer's :meth:`get_notifs` under this engine's name).

        Raises:
            ValueError: mismatched list lengths, negative lengths.
            TypeError: an address or length that is not an int.
            TransferError: an unregistered local or remote range (the whole batch is
                refused, nothing queued), an unreachable peer, a failed request, or a
                request the engine failed at the deadline (``timeout_s``, default the
                engine's).
        """
        ...

    def read(
        self,
        session_id: str,
        local_addrs: _Addrs,
        remote_addrs: _Addrs,
        lengths: _Addrs,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Copy ``lengths[i]`` bytes from ``remote_addrs[i]`` on the peer to
        ``local_addrs[i]`` here; block (GIL released) until all arrived.

        Like :meth:`write`, it returns or raises only once the engine resolved every
        request, and raises the same errors.
        """
        ...

    def submit(
        self,
        session_id: str,
        op: Literal["write", "read"],
        local_addrs: _Addrs,
        remote_addrs: _Addrs,
        lengths: _Addrs,
        *,
        notify: bytes | None = None,
        timeout_s: float | None = None,
    ) -> Batch:
        """Queue a batch of writes or reads without waiting; returns its :class:`Batch`.

        Argument errors (``ValueError``, ``TypeError``, unregistered ranges as
        ``TransferError``) raise here; failures in flight show in the batch.
        """
        ...

    def notify(self, session_id: str, data: bytes) -> None:
        """Send a small message to the peer (it appears in the peer's
        :meth:`get_notifs` under this engine's name). Raises ``TransferError`` if the
        peer cannot be reached."""
        ...

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Drain the notifications received so far: sender name -> messages in order."""
        ...

    def wait_notifs(self, timeout_s: float) -> dict[str, list[bytes]]:
        """Like :meth:`get_notifs`, but wait (GIL released) up to ``timeout_s`` for at
        least one; returns ``{}`` on timeout (``0``: just look) or when the engine is
        closed meanwhile."""
        ...

    def probe(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        """Whether the peer answers now: it is opened (again, if the process there was
        replaced) and asked for its descriptor, within ``timeout_s`` (default 2 s). Never
        raises for a dead peer; a malformed session id is ``ValueError``."""
        ...

    def peer_buffers(
        self, session_id: str, *, timeout_s: float | None = None
    ) -> list[tuple[int, int]]:
        """The buffers the engine at ``session_id`` lets peers reach, ``(addr, length)`` in
        the order it registered them (its descriptor, asked for again within ``timeout_s``,
        default 2 s). ``TransferError`` when the peer cannot be opened."""
        ...

    def peer_info(
        self, session_id: str, *, timeout_s: float | None = None
    ) -> tuple[str, list[tuple[int, int]]]:
        """``(name, buffers)`` of the engine at ``session_id``: its segment name and what
        :meth:`peer_buffers` gives. ``TransferError`` when the peer cannot be opened."""
        ...

    def reconnect(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        """Open the peer at ``session_id`` again when the one kept no longer answers (it
        died, or a new process took its address), then ask it for its descriptor: ``True``
        when it answered within ``timeout_s`` (default 2 s). Never raises for a dead peer."""
        ...

    def prepare_local(self, addrs: _Addrs, lengths: _Addrs) -> PreparedList:
        """Resolve this engine's ranges (each inside one registered region) once, for
        :meth:`prepare_transfer`. ``ValueError`` names the first range no region holds."""
        ...

    def prepare_remote(
        self, session_id: str, addrs: _Addrs, lengths: _Addrs, *, timeout_s: float | None = None
    ) -> PreparedList:
        """Resolve ranges of the peer at ``session_id`` (each inside one region it
        registered) once, for :meth:`prepare_transfer`. The list outlives reconnects; a
        region the peer deregisters or registers anew, or a revoke by the peer, makes posts
        of it fail (``TransferError`` with ``kind`` ``"stale_list"``): prepare it again.
        ``ValueError`` names the first range the peer does not hold; ``TransferError`` when
        the peer cannot be opened within ``timeout_s``."""
        ...

    def prepare_transfer(
        self,
        op: Literal["write", "read"],
        local: PreparedList,
        local_indices: _Addrs,
        remote: PreparedList,
        remote_indices: _Addrs,
        *,
        notify: bytes | None = None,
        merge: bool = True,
    ) -> PreparedTransfer:
        """Pair ``local[local_indices[i]]`` with ``remote[remote_indices[i]]`` (lists or 1-D
        integer arrays), checked now: a :class:`PreparedTransfer` to post as often as
        needed, with no per-descriptor lookup. ``notify`` reaches the peer after each
        post's last byte; ``merge=False`` keeps pairs contiguous on both sides apart.
        ``ValueError`` for an index out of range, pairs of different lengths, or index
        lists of different lengths."""
        ...

    def metrics_text(self) -> str:
        """This engine's Prometheus metrics in the text format (``METRICS_CONTENT_TYPE``),
        for the application's own ``/metrics`` endpoint; every metric is in docs/logs-and-metrics.md."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters of this engine (bytes and requests moved, failures, peers, ...)."""
        ...

    def close(self) -> None:
        """Stop the engine and release its memory and connections once the calls still
        running return (``wait_notifs`` returns at once; a transfer by its deadline).
        Idempotent; any other call afterwards raises ``RuntimeError``."""
        ...

    def __enter__(self) -> Engine: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Calls :meth:`close`."""
        ...

class PreparedList:
    """Ranges resolved once to registered regions and keys: this engine's
    (:meth:`Engine.prepare_local`) or a peer's (:meth:`Engine.prepare_remote`)."""

    is_local: bool
    session_id: str | None
    def __len__(self) -> int: ...

class PreparedTransfer:
    """Index pairs into a local and a remote :class:`PreparedList`, checked once
    (:meth:`Engine.prepare_transfer`)."""

    def post(
        self, *, notify: bytes | None = None, timeout_s: float | None = None
    ) -> PreparedBatch:
        """Start the pairs as one batch (pairs contiguous on both sides merged unless the
        transfer was made with ``merge=False``). ``notify`` replaces the notification for
        this post and the next ones. ``TransferError`` (``kind``: ``"stale_list"``,
        ``"not_connected"`` or ``"refused"``) when it cannot be posted: nothing is queued."""
        ...

    def __len__(self) -> int: ...

class PreparedBatch:
    """One post of a :class:`PreparedTransfer`: one request, done when every pair is."""

    pairs: int
    runs: int
    slices: int
    bytes: int
    def poll(self) -> _BatchState:
        """``"DONE"``, ``"ERR"`` or ``"PROC"``, without blocking."""
        ...

    def wait(self, timeout_s: float | None = None) -> _BatchState:
        """Block (GIL released) until it resolved or ``timeout_s`` passed (default: its
        deadline and a grace)."""
        ...

    def failure(self) -> tuple[str, str] | None:
        """``(reason, description)`` once it failed (reason as the metrics name it:
        ``"peer_unavailable"``, ``"timeout"``…), else ``None``."""
        ...

    def peer_lost(self) -> bool:
        """Whether it failed because the peer is gone or unreachable."""
        ...

class StoreError(Exception):
    """A store operation failed for a key: raised by single-key calls, returned in the
    key's place by batch calls."""

    key: str
    """The key (empty for calls about no key)."""
    code: int
    """Mooncake Store's code for the same failure: -704 not found, -705 exists, -706 has a
    lease, -703 being written, -200 no space, -600 invalid, -712 a replica's segment went
    away, -800 transfer failed, -900 master unreachable."""
    kind: str
    """The cause's name (``"NotFound"``, ``"HasLease"``, ``"NoSpace"``, ...)."""

class ObjectNotFound(StoreError):
    """No complete object has this key (code -704)."""

_Config = Any
"""A ``railyard.ReplicateConfig`` (or anything with its attributes), or ``None``."""

class Store:
    """A client of railyard's KV-cache store with its own engine (``railyard.Store`` adds
    buffer objects to the ``int`` addresses accepted here).

    Every data call releases the GIL. Addresses and sizes are non-negative ``int``; every
    ``(ptr, size)`` must lie inside a buffer registered with :meth:`register_buffer`
    (``ValueError`` otherwise, for the whole call, before anything is sent). Batch calls
    return one item per key: its result, or its :class:`StoreError` (not raised).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def setup(
        self,
        master: str,
        *,
        name: str | None = None,
        segment_size: int = 0,
        staging_size: int = 64 << 20,
        listen: str = "0.0.0.0:0",
        advertise_host: str | None = None,
        fabric: Literal["auto", "soft", "tcp", "verbs", "rdma", "ofi", "efa"] = "auto",
        rails: int | None = None,
        busy_poll: bool = True,
        timeout_s: float = 10.0,
        host: str | None = None,
        secret_file: str | os.PathLike[str] | None = None,
        close_grace_s: float = 1.0,
    ) -> None:
        """Start this store's engine (``name``, ``listen``, ``advertise_host``, ``fabric``,
        ``rails``, ``busy_poll``, ``secret_file`` as :class:`Engine`'s; the secret defaults
        to ``RAILYARD_SECRET_FILE``), connect it to the master at ``master`` (``host:port``,
        or ``etcd://host:port`` to find the leader of a failover group) and, when
        ``segment_size`` > 0, contribute that many bytes as a segment. ``staging_size``:
        the bounce buffer of :meth:`put`/:meth:`get`. ``timeout_s`` bounds each call.
        ``host``: the host replicas are spread by (default: the kernel's host name).
        ``RuntimeError`` when set up already or the engine does not start; ``StoreError``
        (-900) when the master cannot be reached."""
        ...

    def close(self) -> None:
        """Take the segment back (readers already pointed at it have ``close_grace_s``),
        disconnect and stop the engine. Idempotent; :meth:`setup` may follow. Objects on
        this store's segment go with it; those it wrote elsewhere stay. Never raises for the
        store: when the master cannot be told (it is gone), the store is closed anyway and a
        ``RuntimeWarning`` says so."""
        ...

    @property
    def is_setup(self) -> bool: ...
    @property
    def segment_name(self) -> str | None:
        """The name other clients prefer this store's segment by (``None`` without one)."""
        ...

    def register_buffer(self, ptr: int, size: int) -> None:
        """Register ``size`` bytes at ``ptr`` for the zero-copy calls; the same range again
        counts (unregister as often). Another size at a registered address: ``ValueError``."""
        ...

    def unregister_buffer(self, ptr: int) -> None:
        """Unregister the buffer at ``ptr`` (``ValueError`` when none is registered)."""
        ...

    def put(self, key: str, value: bytes, config: _Config = None) -> None:
        """Store ``value`` (anything with the buffer protocol; an ``int`` or a list is
        ``TypeError``) under a new ``key`` (``StoreError`` -705 when the key exists). Keys
        are 1 to 256 bytes of UTF-8."""
        ...

    def put_parts(self, key: str, *parts: bytes, config: _Config = None) -> None:
        """Store the concatenation of ``parts`` under a new ``key``."""
        ...

    def upsert(self, key: str, value: bytes, config: _Config = None) -> None:
        """Store ``value``, replacing a complete object of that key (readers see the old
        value until the new one is complete)."""
        ...

    def batch_put(
        self, keys: Sequence[str], values: Sequence[bytes], config: _Config = None
    ) -> list[None | StoreError]: ...
    def put_from(self, key: str, ptr: int, size: int, config: _Config = None) -> None:
        """Store ``size`` registered bytes at ``ptr`` under ``key``, zero-copy."""
        ...

    def upsert_from(self, key: str, ptr: int, size: int, config: _Config = None) -> None: ...
    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], config: _Config = None
    ) -> list[int | StoreError]:
        """``put_from`` of each key: the number of replicas written (fewer than asked only
        with ``best_effort``), or the key's error."""
        ...

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        config: _Config = None,
    ) -> list[None | StoreError]:
        """Store, for each key, the concatenation of its buffers (scatter-gather)."""
        ...

    def get(self, key: str) -> bytes:
        """The value of ``key`` (:class:`ObjectNotFound` when there is none)."""
        ...

    def batch_get(self, keys: Sequence[str]) -> list[bytes | StoreError]: ...
    def get_into(self, key: str, ptr: int, size: int) -> int:
        """Read ``key``'s value into the registered buffer at ``ptr``: its size
        (``StoreError`` -600 when it is larger than ``size``)."""
        ...

    def batch_get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int | StoreError]: ...
    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[str],
        all_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
    ) -> list[int | StoreError]:
        """Read each key's value into its buffers, in order: its size per key."""
        ...

    def get_size(self, key: str) -> int: ...
    def is_exist(self, key: str) -> bool: ...
    def batch_is_exist(self, keys: Sequence[str]) -> list[bool | StoreError]: ...
    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``'s object; one a reader holds a lease on (-706) only with
        ``force``."""
        ...

    def batch_remove(
        self, keys: Sequence[str], force: bool = False
    ) -> list[None | StoreError]: ...
    def remove_all(self, force: bool = False) -> int:
        """Remove every object (leased ones only with ``force``): how many."""
        ...

    def keys(self) -> list[str]:
        """Keys of complete objects, sorted."""
        ...

    def get_hostname(self) -> str:
        """``"host:port"`` where this store's engine is reached."""
        ...

    def health_check(self) -> bool:
        """Whether the master answers, from the connection's keepalive (no round trip): a
        dead master reads ``False`` at once, a stopped one within 1.5 s."""
        ...

    def master_stats(self) -> dict[str, Any]:
        """Objects, writes in progress, bytes, the leader's term, and each segment (name,
        capacity, reserved, suspected)."""
        ...

    def __enter__(self) -> Store: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Calls :meth:`close`."""
        ...
