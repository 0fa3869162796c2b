"""Mooncake Transfer Engine's Python API on top of railyard.

``TransferEngine`` here has the method names, arguments and integer return codes of
``mooncake.engine.TransferEngine`` (Mooncake's pybind11 binding,
``mooncake-integration/transfer_engine/transfer_engine_py.cpp``) for the calls that
vLLM's and SGLang's Mooncake connectors make, so a connector written for Mooncake runs on
railyard by changing one import::

    # from mooncake.engine import TransferEngine
    from railyard.compat.mooncake import TransferEngine

    engine = TransferEngine()
    assert engine.initialize(local_ip, "P2PHANDSHAKE", "rdma", "") == 0
    session_id = f"{local_ip}:{engine.get_rpc_port()}"
    assert engine.batch_register_memory(ptrs, lengths) == 0
    ret = engine.batch_transfer_sync_write(peer_session, src_ptrs, dst_ptrs, lengths)

Each call maps onto one :class:`railyard.Engine` call. Errors never raise: like Mooncake,
they are logged (logger ``railyard.compat.mooncake``) and returned as integer codes.

Return codes
    * Sync transfers, registration, ``initialize``, ``get_batch_transfer_status``,
      ``free_managed_buffer``: ``0`` success, ``-1`` failure.
    * ``transfer_submit_write``: a batch id ``> 0``, or ``-1`` when it could not be
      submitted. ``batch_transfer_async_*``: a batch id, or ``0`` (Mooncake's sentinel).
      Polling id ``0`` or ``-1`` returns ``-1``.
    * ``transfer_check_status``: ``1`` done, ``0`` still pending, ``-1`` failed (or an
      unknown id), ``-2`` timed out (the engine failed a request at its deadline).
    * ``send_probe``: ``0`` reachable, ``-1`` not.
    * ``allocate_managed_buffer``: an address, ``0`` on failure.

Only what the engine resolved is reported
    A transfer's result (``1``, ``-1``, ``-2``, or a sync call's ``0``/``-1``) is reported
    only once the railyard engine has resolved every request of it: done, failed, or failed
    by the engine at its deadline (``Timeout``), which for work already posted comes after
    the fabric flushed it. Until then ``transfer_check_status`` returns ``0``, however late,
    and the batch id stays valid; ``get_batch_transfer_status`` and the sync calls wait. So
    whatever code a call returns, no request it reports on reads or writes the caller's
    buffers any more: they may be reused at once. A batch id is forgotten once its result
    was reported (as Mooncake frees it), never before.

Timeouts
    The engine's deadline of a transfer is ``MC_TRANSFER_TIMEOUT`` seconds (default 30, at
    least 5, read when the ``TransferEngine`` is constructed) plus one second per GiB
    moved, as Mooncake's budget. The shim keeps no clock of its own: a timeout is the
    engine's, reported once the engine resolved the request (shortly after the deadline).

``initialize(local_hostname, metadata_server, protocol, device_name)``
    * ``local_hostname``: ``"host"`` or ``"host:port"``; the engine listens on ``host``
      when it is an IPv4 address of this host (``127.0.0.1``: loopback only), on every
      interface for a name, and advertises ``host``. The port is used only with
      ``MC_LEGACY_RPC_PORT_BINDING`` set (as in Mooncake); otherwise a free port is
      chosen, which ``get_rpc_port()`` returns. The session id peers use is
      ``f"{host}:{get_rpc_port()}"``.
    * ``metadata_server``: ``"P2PHANDSHAKE"`` selects railyard's ``p2p`` directory;
      ``"etcd://host:port"`` or a bare ``"host:port"`` (Mooncake's default metadata type
      is etcd) selects the etcd directory at that address. ``http://`` and ``redis://``
      metadata servers are not supported (``-1``).
    * ``protocol``: ``"tcp"`` selects the TCP fabric; ``"rdma"`` (and ``"efa"``) select
      verbs when this host has an RDMA device and the engine can open it, else railyard's
      ``auto`` fabric (soft fabric between processes on one host, TCP across hosts)
      with a ``RuntimeWarning`` once per process. Device protocols (``nvlink``,
      ``nvlink_intra``, ``hip``, ``musa``, ``ascend``, ``cxi``, ...) are refused with
      ``-1``: only host memory is supported.
    * ``device_name`` (an RDMA device filter in Mooncake) is ignored.

Differences from Mooncake
    * ``transfer_sync`` / ``batch_transfer_sync`` take ``opcode`` as
      ``TransferEngine.TransferOpcode.Read``/``Write`` (also plain ints 0/1, Mooncake's
      own enum values, or ``"read"``/``"write"``); ``opcode`` defaults to ``Write``.
    * Notifications (``notify=TransferNotify(name, msg)``) are sent after the batch
      completes, as a railyard notification whose payload carries ``name`` and ``msg``.
      ``get_notifies()`` drains them as a list of ``TransferNotify(name, msg)`` (``msg``
      a ``str``; bytes that are not UTF-8 come back as surrogate escapes). A
      notification sent by a plain :class:`railyard.Engine` shows with ``name`` set to
      the sending engine's name and its bytes as ``msg``.
    * ``register_memory(..., location)``: a device location (``"cuda:0"``, ``"npu:1"``,
      ...) is refused with ``-1``; registering the same range twice succeeds.
    * ``allocate_managed_buffer`` returns railyard engine memory (one allocation per
      call, huge pages when available) instead of slabs carved from a 2 GiB pool.
    * ``transport_hint`` is accepted and ignored.
    * ``write_bytes_to_buffer`` / ``read_bytes_from_buffer`` copy within this process,
      as in Mooncake.
    * ``get_batch_transfer_status`` waits until the engine resolved every batch it names
      (Mooncake returns ``-1`` at the first failure or at its own timeout, and frees the
      other batches while they may still be in flight); then every batch it names is
      forgotten, and it returns ``0`` if all of them were done.
    * ``unregister_memory`` / ``batch_unregister_memory`` / ``free_managed_buffer`` return
      ``-1`` when a peer or poller was still inside a range when the engine's wait ended
      (railyard's ``Busy``): the range stays withdrawn and must not be unmapped yet;
      calling again with its address waits again, and ``0`` means it is free.

    * ``register_memory`` of a range registered already counts (as Mooncake's TENT
      backend): it stays registered until unregistered as many times.
    * ``transfer_submit_write`` returns ``-1`` when nothing could be submitted (the check
      Mooncake's documentation shows, ``if batch_id < 0``); ``batch_transfer_async_*``
      return ``0``, as Mooncake documents for them.
    * ``write_bytes_to_buffer`` returns ``-1`` (copying nothing) for a length longer than
      the bytes given, a negative length or a null address, where Mooncake copies
      unchecked.
    * ``get_first_buffer_address(segment_name)``: the first buffer registered or allocated
      (in that order) of this engine's own segment (its session id, engine name or
      ``local_hostname``), or of a peer's ``host:port``; ``0`` when unknown or empty.
    * ``get_local_topology(device_name=None)``: Mooncake's JSON, one ``"cpu:N"`` entry per
      NUMA node with the RDMA devices on it and the others. ``get_engine()`` returns the
      :class:`railyard.Engine`. ``warmup_efa_segment`` returns ``0``. The ``SUPPORT_*``
      flags are all ``False``.

Not supported (raise :class:`NotSupportedError`, an ``AttributeError`` too, so ``hasattr``
feature checks see them missing):
    ``transfer_write_on_cuda``, ``transfer_read_on_cuda``,
    ``batch_transfer_write_on_cuda``, ``batch_transfer_read_on_cuda`` (CUDA streams),
    ``get_engine_ptr`` (no C++ engine), and Mooncake's shared-segment and RPC-interface
    classes.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import itertools
import json
import logging
import os
import socket
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import Batch, Engine

__all__ = ["NotSupportedError", "TransferEngine", "TransferNotify", "TransferOpcode"]

logger = logging.getLogger(__name__)

P2PHANDSHAKE = "P2PHANDSHAKE"
"""Mooncake's metadata server for peer-to-peer handshakes (railyard's ``p2p``)."""

_DEFAULT_TIMEOUT_S = 30
_MIN_TIMEOUT_S = 5
_NS_PER_GIB = float(1 << 30)

_RDMA_PROTOCOLS = frozenset({"rdma", "efa", "erdma"})
_DEVICE_PROTOCOLS = frozenset(
    {"nvlink", "nvlink_intra", "hip", "musa", "ascend", "xgmi", "cxi", "barex", "ubshmem"}
)
_DEVICE_LOCATION_PREFIXES = ("cuda", "gpu", "npu", "musa", "hip", "xpu", "mlu")

# A shim-to-shim notification: magic, then the UTF-8 name, NUL, then the message.
_NOTIFY_MAGIC = b"\x00rymc1\x00"

_rdma_warning_lock = threading.Lock()
_rdma_warned = False


class TransferOpcode(enum.IntEnum):
    """Direction of ``transfer_sync`` / ``batch_transfer_sync`` (Mooncake's values)."""

    Read = 0
    Write = 1


# Mooncake exports the enum values at module level too (``py::enum_::export_values``).
Read = TransferOpcode.Read
Write = TransferOpcode.Write


@dataclass
class TransferNotify:
    """A notification: ``name`` (chosen by the sender) and ``msg``, as in Mooncake."""

    name: str = ""
    msg: str = ""


def _transfer_timeout_s() -> float:
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    if raw is None:
        return float(_DEFAULT_TIMEOUT_S)
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0  # atoi() semantics: garbage reads as 0, then clamps to the minimum
    return float(max(_MIN_TIMEOUT_S, value))


def _split_host_port(hostname: str) -> tuple[str, int | None]:
    """``"host"``, ``"host:port"``, ``"[v6]:port"`` or Ascend's ``"host:port:npu_x"``."""
    hostname = hostname.strip()
    if hostname.startswith("["):
        host, _, rest = hostname[1:].partition("]")
        port = rest.lstrip(":").split(":", 1)[0]
        return host, int(port) if port.isdigit() else None
    parts = hostname.split(":")
    if len(parts) == 1:
        return hostname, None
    if len(parts) > 3 or (len(parts) == 3 and not parts[2].startswith("npu")):
        return hostname, None  # a bare IPv6 address (two colons or more, no brackets)
    return parts[0], int(parts[1]) if parts[1].isdigit() else None


def _map_directory(metadata_server: str, metadata_type: str = "etcd") -> str:
    """Mooncake's connection string rules (``parseConnectionString``/``buildConnString``)."""
    server = (metadata_server or "").strip()
    if server == P2PHANDSHAKE:
        return "p2p"
    if "://" not in server:
        if not server:
            raise ValueError("empty metadata server (use 'P2PHANDSHAKE' for peer-to-peer)")
        server = f"{metadata_type or 'etcd'}://{server}"
    scheme = server.split("://", 1)[0].lower()
    if scheme != "etcd":
        raise ValueError(
            f"metadata server {metadata_server!r}: only 'P2PHANDSHAKE' and etcd "
            "are supported by railyard"
        )
    return server


def _listen_ip(host: str) -> str:
    """Where the engine listens: the IPv4 address ``host`` is, when it is a literal one of
    this host's (``127.0.0.1`` stays on loopback); every interface for a name (a host name
    may resolve to a loopback address in /etc/hosts while peers reach it elsewhere) or an
    address this host does not have (a NAT's outside address: it is still advertised)."""
    try:
        ip = str(ipaddress.IPv4Address(host))
    except ValueError:
        return "0.0.0.0"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
        return ip
    except OSError:
        logger.info("%s is not an address of this host: listening on every interface", host)
        return "0.0.0.0"


def _has_rdma_device() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def _warn_rdma_fallback(protocol: str, why: str) -> None:
    global _rdma_warned
    with _rdma_warning_lock:
        if _rdma_warned:
            return
        _rdma_warned = True
    message = (
        f"railyard.compat.mooncake: protocol {protocol!r} asked for RDMA but {why}; "
        "using railyard's 'auto' fabric (soft fabric on one host, TCP across hosts)"
    )
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _opcode_is_write(opcode: Any) -> bool:
    if isinstance(opcode, str):
        name = opcode.strip().lower()
        if name in ("write", "w"):
            return True
        if name in ("read", "r"):
            return False
        raise ValueError(f"unknown opcode {opcode!r}")
    value = int(opcode)  # TransferOpcode, Mooncake's arithmetic enum, or 0/1
    if value == TransferOpcode.Write:
        return True
    if value == TransferOpcode.Read:
        return False
    raise ValueError(f"unknown opcode {opcode!r}")


def _encode_notify(notify: Any) -> bytes:
    name = getattr(notify, "name", "") or ""
    msg = getattr(notify, "msg", "") or ""
    msg_bytes = (
        msg if isinstance(msg, (bytes, bytearray)) else str(msg).encode("utf-8", "surrogateescape")
    )
    return _NOTIFY_MAGIC + str(name).encode("utf-8", "surrogateescape") + b"\x00" + bytes(msg_bytes)


def _decode_notify(sender: str, payload: bytes) -> TransferNotify:
    if payload.startswith(_NOTIFY_MAGIC):
        name, sep, msg = payload[len(_NOTIFY_MAGIC) :].partition(b"\x00")
        if sep:
            return TransferNotify(
                name.decode("utf-8", "surrogateescape"), msg.decode("utf-8", "surrogateescape")
            )
    return TransferNotify(sender, bytes(payload).decode("utf-8", "surrogateescape"))


def _deadline_s(timeout_s: float, lengths: Sequence[int]) -> float:
    """Mooncake's budget: the timeout plus one second per GiB."""
    try:
        total = sum(int(n) for n in lengths)
    except (TypeError, ValueError):
        total = 0
    return timeout_s + max(total, 0) / _NS_PER_GIB


# How long one wait of ``get_batch_transfer_status`` for a batch past its deadline lasts at
# most before it looks again (it wakes at once when the batch resolves).
_RESOLVE_STEP_S = 1.0


class _Pending:
    """A submitted batch, kept until its result was reported (never before the engine
    resolved it)."""

    __slots__ = ("batch", "session")

    def __init__(self, batch: Batch | None, session: str) -> None:
        self.batch = batch
        self.session = session


class TransferEngine:
    """Mooncake's ``TransferEngine`` on railyard. See the module docstring."""

    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        self._engine: Engine | None = None
        self._host: str | None = None
        self._hostname: str | None = None
        self._timeout_s = _transfer_timeout_s()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        # Ranges this shim registered or allocated, in that order (get_first_buffer_address
        # of this engine's own segment): address -> [length, registrations]. A managed
        # buffer counts once.
        self._buffers: dict[int, list[int]] = {}

    # -- set-up ---------------------------------------------------------------------------

    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> int:
        """Start the engine; ``0`` on success, ``-1`` on failure."""
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "etcd")

    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int:
        """``initialize`` with an explicit metadata type for a bare metadata server."""
        try:
            directory = _map_directory(metadata_server, metadata_type)
            host, port = _split_host_port(local_hostname or "")
            if not os.environ.get("MC_LEGACY_RPC_PORT_BINDING"):
                port = None
            proto = (protocol or "").strip().lower()
            if proto in _DEVICE_PROTOCOLS:
                raise ValueError(
                    f"protocol {protocol!r} moves device memory; railyard supports host "
                    "memory only (use 'rdma' or 'tcp')"
                )
            if device_name:
                logger.debug("device_name %r ignored: railyard picks its devices", device_name)
            kwargs: dict[str, Any] = {
                "listen": f"{_listen_ip(host)}:{port or 0}",
                "advertise_host": host or None,
                "directory": directory,
                "timeout_s": self._timeout_s,
            }
            if self._engine is not None:
                logger.warning("initialize called twice: closing the previous engine")
                self.close()
            self._engine = self._open_engine(proto, protocol, kwargs)
            self._host = host or self._engine.session_id.rsplit(":", 1)[0]
            self._hostname = local_hostname
            logger.info(
                "railyard engine %s at %s (protocol %s, directory %s)",
                self._engine.name,
                self._engine.session_id,
                protocol,
                directory,
            )
            return 0
        except Exception as err:  # Mooncake reports initialisation failures as -1
            logger.error("railyard TransferEngine initialization failed: %s", err)
            return -1

    @staticmethod
    def _open_engine(proto: str, protocol: str, kwargs: dict[str, Any]) -> Engine:
        if proto == "tcp":
            return Engine(fabric="tcp", **kwargs)
        if proto in _RDMA_PROTOCOLS:
            if _has_rdma_device():
                try:
                    return Engine(fabric="verbs", **kwargs)
                except Exception as err:
                    _warn_rdma_fallback(protocol, f"the verbs fabric failed to start ({err})")
            else:
                _warn_rdma_fallback(protocol, "this host has no RDMA device")
            return Engine(fabric="auto", **kwargs)
        if proto in ("", "auto"):
            return Engine(fabric="auto", **kwargs)
        raise ValueError(f"unknown protocol {protocol!r} (railyard supports 'rdma' and 'tcp')")

    @property
    def engine(self) -> Engine:
        """The underlying :class:`railyard.Engine` (after ``initialize``)."""
        return self._require()

    def get_rpc_port(self) -> int:
        """The port peers reach this engine at (``-1`` before ``initialize``)."""
        try:
            return int(self._require().session_id.rsplit(":", 1)[1])
        except Exception as err:
            logger.error("get_rpc_port: %s", err)
            return -1

    def get_session_id(self) -> str:
        """``"host:port"`` for this engine (not in Mooncake; connectors build it themselves)."""
        return f"{self._host}:{self.get_rpc_port()}"

    def close(self) -> None:
        """Stop the engine (Mooncake does this in its destructor)."""
        with self._lock:
            engine, self._engine = self._engine, None
            self._pending.clear()
            # Registrations belong to the engine that goes: a new one starts with none.
            self._buffers.clear()
        if engine is not None:
            engine.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require(self) -> Engine:
        engine = self._engine
        if engine is None:
            raise RuntimeError("TransferEngine is not initialized (call initialize first)")
        return engine

    # -- memory ---------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Register ``[buffer_addr, buffer_addr + capacity)``; ``0`` or ``-1``."""
        return self.batch_register_memory([buffer_addr], [capacity], location)

    def unregister_memory(self, buffer_addr: int) -> int:
        """Deregister the range starting at ``buffer_addr``; ``0`` or ``-1``.

        ``-1`` after railyard's ``Busy`` (a peer was still inside the range): the range is
        withdrawn but still in use; call again to wait again.
        """
        return self.batch_unregister_memory([buffer_addr])

    def batch_register_memory(
        self, buffer_addresses: Sequence[int], capacities: Sequence[int], location: str = "*"
    ) -> int:
        """Register several ranges; ``0`` or ``-1``. Registering a range again counts: it
        stays registered until unregistered as many times."""
        try:
            if _is_device_location(location):
                raise ValueError(
                    f"location {location!r} is device memory; railyard registers host memory only"
                )
            addrs, lens = list(buffer_addresses), list(capacities)
            if len(addrs) != len(lens):
                raise ValueError(f"{len(addrs)} buffer addresses but {len(lens)} capacities")
            with self._lock:
                again = [self._buffers.get(a, [None])[0] == n for a, n in zip(addrs, lens)]
                new = [(a, n) for (a, n), known in zip(zip(addrs, lens), again) if not known]
                if new:
                    self._require().register([a for a, _ in new], [n for _, n in new])
                for addr, length in zip(addrs, lens):
                    self._buffers.setdefault(addr, [length, 0])[1] += 1
            return 0
        except Exception as err:
            logger.error("memory registration failed: %s", err)
            return -1

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        """Deregister several ranges by start address; ``0`` or ``-1``. A range registered
        several times is deregistered by its last unregistration.

        ``-1`` if an address is unknown (then none is deregistered), or if railyard refused
        a range as ``Busy`` (still in use: it stays withdrawn, and unregistering its address
        again waits again; the other ranges are deregistered).
        """
        try:
            addrs = list(buffer_addresses)
            with self._lock:
                last = [a for a in addrs if self._buffers.get(a, [0, 0])[1] <= 1]
                if last:
                    self._require().deregister(last)
                for addr in addrs:
                    entry = self._buffers.get(addr)
                    if entry is not None:
                        entry[1] -= 1
                        if entry[1] <= 0:
                            del self._buffers[addr]
            return 0
        except Exception as err:
            logger.error("memory deregistration failed: %s", err)
            return -1

    def allocate_managed_buffer(self, length: int) -> int:
        """Registered engine memory of ``length`` bytes; its address, or ``0``."""
        try:
            addr = int(self._require().alloc(int(length)))
            with self._lock:
                self._buffers[addr] = [int(length), 1]
            return addr
        except Exception as err:
            logger.error("allocate_managed_buffer(%s) failed: %s", length, err)
            return 0

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Free what ``allocate_managed_buffer`` returned; ``0`` or ``-1``.

        ``-1`` after railyard's ``Busy`` (a peer was still inside the buffer): it stays
        allocated, and freeing it again waits again.
        """
        try:
            self._require().free(int(buffer_addr))
            with self._lock:
                self._buffers.pop(int(buffer_addr), None)
            return 0
        except Exception as err:
            logger.error("free_managed_buffer(%#x) failed: %s", buffer_addr, err)
            return -1

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        """Copy ``length`` bytes of ``src_ptr`` (bytes-like, or ``str`` as UTF-8) to local
        memory at ``dest_address``; ``0``, or ``-1`` (nothing copied) for a null address, a
        negative length or one longer than ``src_ptr``."""
        try:
            data = src_ptr.encode() if isinstance(src_ptr, str) else memoryview(src_ptr).tobytes()
            if isinstance(length, bool) or not isinstance(length, int) or length < 0:
                raise ValueError(f"length {length!r} is not a byte count")
            if length > len(data):
                raise ValueError(f"length {length} exceeds the {len(data)} bytes given")
            if not isinstance(dest_address, int) or dest_address <= 0:
                raise ValueError(f"dest_address {dest_address!r} is not an address")
            ctypes.memmove(dest_address, data, length)
            return 0
        except Exception as err:
            logger.error("write_bytes_to_buffer: %s", err)
            return -1

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes of local memory at ``source_address``."""
        return ctypes.string_at(int(source_address), int(length))

    # -- synchronous transfers ------------------------------------------------------------

    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Write ``length`` bytes from ``buffer`` to the peer's ``peer_buffer_address``."""
        return self._sync(target_hostname, [buffer], [peer_buffer_address], [length], True, None)

    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Read ``length`` bytes from the peer's ``peer_buffer_address`` into ``buffer``."""
        return self._sync(target_hostname, [buffer], [peer_buffer_address], [length], False, None)

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Write every ``(buffers[i], peer_buffer_addresses[i], lengths[i])``; ``0``/``-1``."""
        return self._sync(target_hostname, buffers, peer_buffer_addresses, lengths, True, None)

    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Read every ``(buffers[i], peer_buffer_addresses[i], lengths[i])``; ``0``/``-1``."""
        return self._sync(target_hostname, buffers, peer_buffer_addresses, lengths, False, None)

    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: Any = TransferOpcode.Write,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        """One transfer in the direction ``opcode``, then ``notify`` if given."""
        try:
            write = _opcode_is_write(opcode)
        except Exception as err:
            logger.error("transfer_sync: %s", err)
            return -1
        return self._sync(target_hostname, [buffer], [peer_buffer_address], [length], write, notify)

    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: Any = TransferOpcode.Write,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        """A batch in the direction ``opcode``, then ``notify`` if given; ``0``/``-1``."""
        try:
            write = _opcode_is_write(opcode)
        except Exception as err:
            logger.error("batch_transfer_sync: %s", err)
            return -1
        return self._sync(target_hostname, buffers, peer_buffer_addresses, lengths, write, notify)

    def _sync(
        self,
        session: str,
        buffers: Sequence[int],
        peers: Sequence[int],
        lengths: Sequence[int],
        write: bool,
        notify: TransferNotify | None,
    ) -> int:
        # ``Engine.write``/``read`` return or raise only once the engine resolved every
        # request (a timeout is the engine's), so the buffers are free whatever this returns.
        try:
            engine = self._require()
            local, remote, lens = _as_lists(buffers, peers, lengths)
            if not lens:
                return 0
            timeout_s = _deadline_s(self._timeout_s, lens)
            payload = _encode_notify(notify) if notify is not None else None
            if write:
                engine.write(session, local, remote, lens, notify=payload, timeout_s=timeout_s)
            else:
                engine.read(session, local, remote, lens, timeout_s=timeout_s)
                if payload is not None:
                    engine.notify(session, payload)
            return 0
        except Exception as err:
            logger.error(
                "%s of %d range(s) with %s failed: %s",
                "write" if write else "read",
                _count(lengths),
                session,
                err,
            )
            return -1

    # -- asynchronous transfers -----------------------------------------------------------

    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Submit one write; a batch id for ``transfer_check_status``, or ``-1`` (as
        Mooncake's documented ``if batch_id < 0`` check expects)."""
        batch_id = self._submit(target_hostname, [buffer], [peer_buffer_address], [length], True)
        return batch_id if batch_id > 0 else -1

    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Submit a batch of writes; a batch id, or ``0``."""
        return self._submit(target_hostname, buffers, peer_buffer_addresses, lengths, True)

    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        transport_hint: str = "",
    ) -> int:
        """Submit a batch of reads; a batch id, or ``0``."""
        return self._submit(target_hostname, buffers, peer_buffer_addresses, lengths, False)

    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: Sequence[int],
        peer_buffer_addresses: Sequence[int],
        lengths: Sequence[int],
        opcode: Any = TransferOpcode.Write,
        transport_hint: str = "",
    ) -> int:
        """Submit a batch in the direction ``opcode``; a batch id, or ``0``."""
        try:
            write = _opcode_is_write(opcode)
        except Exception as err:
            logger.error("batch_transfer_async: %s", err)
            return 0
        return self._submit(target_hostname, buffers, peer_buffer_addresses, lengths, write)

    def _submit(
        self,
        session: str,
        buffers: Sequence[int],
        peers: Sequence[int],
        lengths: Sequence[int],
        write: bool,
    ) -> int:
        try:
            engine = self._require()
            local, remote, lens = _as_lists(buffers, peers, lengths)
            timeout_s = _deadline_s(self._timeout_s, lens)
            batch = (
                engine.submit(
                    session, "write" if write else "read", local, remote, lens, timeout_s=timeout_s
                )
                if lens
                else None
            )
        except Exception as err:
            logger.error(
                "submitting %s of %d range(s) to %s failed: %s",
                "write" if write else "read",
                _count(lengths),
                session,
                err,
            )
            return 0
        with self._lock:
            batch_id = next(self._ids)
            self._pending[batch_id] = _Pending(batch, session)
        return batch_id

    def transfer_check_status(self, batch_id: int) -> int:
        """``1`` done, ``0`` pending, ``-1`` failed or unknown id, ``-2`` timed out.

        Reports only what the engine resolved: ``0`` until every request of the batch has
        resolved, however long past its deadline (the engine fails posted work at the
        deadline once the fabric flushed it). ``-2`` when the engine failed a request at its
        deadline (``Timeout``), ``-1`` for any other failure. The id is forgotten once a
        result other than ``0`` was returned.
        """
        with self._lock:
            pending = self._pending.get(batch_id)
        if pending is None:
            if batch_id != 0:
                logger.error("transfer_check_status: unknown batch id %s", batch_id)
            return -1
        state = self._poll(pending)
        if state == "PROC":
            return 0
        if not self._forget(batch_id, pending):
            # Another thread reported this batch meanwhile: for this caller it is unknown now.
            logger.error("transfer_check_status: unknown batch id %s", batch_id)
            return -1
        if state == "DONE":
            return 1
        self._log_failures(batch_id, pending)
        return -2 if self._timed_out(pending) else -1

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Wait until the engine resolved every batch: ``0`` if all were done, else ``-1``.

        ``-1`` also for an unknown id (after waiting for the known ones). Every batch named
        is forgotten on return, and none is before the engine resolved it: a batch past its
        deadline is waited for until the engine fails it (its ``Timeout``).
        """
        ids = list(batch_ids)
        with self._lock:
            named = [(batch_id, self._pending.get(batch_id)) for batch_id in ids]
        ok = True
        for batch_id, pending in named:
            if pending is None:
                logger.error("get_batch_transfer_status: unknown batch id %s", batch_id)
                ok = False
                continue
            state = self._resolve(pending)
            if state != "DONE":
                self._log_failures(batch_id, pending)
                ok = False
        # Mooncake frees every batch of the call; here all of them have resolved.
        for batch_id, pending in named:
            if pending is not None:
                self._forget(batch_id, pending)
        return 0 if ok else -1

    @staticmethod
    def _poll(pending: _Pending) -> str:
        """``"DONE"``, ``"ERR"`` (every request resolved, some failed) or ``"PROC"``."""
        if pending.batch is None:
            return "DONE"
        try:
            return pending.batch.poll()
        except Exception as err:  # not resolved as far as anyone knows: still pending
            logger.error("polling a batch to %s failed: %s", pending.session, err)
            return "PROC"

    @staticmethod
    def _resolve(pending: _Pending) -> str:
        """Waits until the engine resolved every request of the batch: ``"DONE"``/``"ERR"``."""
        batch = pending.batch
        if batch is None:
            return "DONE"
        state = batch.wait()  # until the batch's deadline and a grace, or resolved
        while state == "PROC":  # the engine resolves it once the flush is back
            state = batch.wait(_RESOLVE_STEP_S)
        return state

    @staticmethod
    def _timed_out(pending: _Pending) -> bool:
        try:
            return pending.batch is not None and pending.batch.timed_out()
        except Exception:
            return False

    def _forget(self, batch_id: int, pending: _Pending) -> bool:
        """Drops ``batch_id`` if it still names ``pending``; whether it did."""
        with self._lock:
            if self._pending.get(batch_id) is not pending:
                return False
            del self._pending[batch_id]
            return True

    @staticmethod
    def _log_failures(batch_id: int, pending: _Pending) -> None:
        try:
            failures = pending.batch.failures() if pending.batch is not None else []
        except Exception:
            failures = []
        logger.error("batch %s to %s failed: %s", batch_id, pending.session, failures[:8])

    # -- notifications and probes ---------------------------------------------------------

    def get_notifies(self) -> list[TransferNotify]:
        """Drain received notifications as ``TransferNotify(name, msg)`` objects."""
        try:
            received = self._require().get_notifs()
        except Exception as err:
            logger.error("Failed to get notifies: %s", err)
            return []
        return [
            _decode_notify(sender, payload)
            for sender, payloads in received.items()
            for payload in payloads
        ]

    def send_probe(self, peer_server_name: str) -> int:
        """``0`` if the peer answers (reopening its connection), else ``-1`` (an unknown,
        malformed or unreachable peer too)."""
        try:
            return 0 if self._require().probe(peer_server_name) else -1
        except Exception as err:
            logger.error("probe of %s failed: %s", peer_server_name, err)
            return -1

    # -- segments and topology ------------------------------------------------------------

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The address of the first buffer (in registration order) of segment
        ``segment_name``: this engine's own (its session id ``host:port``, its engine name,
        or the ``local_hostname`` it was initialized with), or a peer's ``host:port`` (asked
        for its buffers); ``0`` when the segment is unknown or has no buffer."""
        try:
            engine = self._require()
            own = {engine.session_id, engine.name, self.get_session_id(), self._hostname}
            if segment_name in own:
                with self._lock:
                    return next(iter(self._buffers), 0)
            buffers = engine.peer_buffers(segment_name)
            return int(buffers[0][0]) if buffers else 0
        except Exception as err:
            logger.error("get_first_buffer_address(%r): %s", segment_name, err)
            return 0

    def get_local_topology(self, device_name: str | None = None) -> str:
        """This host's topology as Mooncake's JSON: for each NUMA node ``"cpu:N"``, the RDMA
        devices on that node and the others (``device_name``: a comma-separated filter)."""
        return local_topology(device_name)

    def get_engine(self) -> Engine:
        """The :class:`railyard.Engine` this shim runs on (Mooncake returns its inner
        engine)."""
        return self._require()

    def warmup_efa_segment(self, segment_name: str) -> int:
        """``0``: nothing to warm up (as Mooncake answers on builds without EFA); railyard
        opens peers on first use."""
        return 0

    def __getattr__(self, name: str) -> Any:
        alternative = _UNSUPPORTED.get(name)
        if alternative is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise NotSupportedError(f"TransferEngine.{name} is not supported by railyard; {alternative}")


class NotSupportedError(NotImplementedError, AttributeError):
    """A Mooncake method railyard does not provide (an ``AttributeError`` too, so
    ``hasattr`` feature checks see it missing)."""


_CUDA = "railyard moves host memory only: stage through registered host memory"
_UNSUPPORTED: dict[str, str] = {
    "transfer_write_on_cuda": _CUDA,
    "transfer_read_on_cuda": _CUDA,
    "batch_transfer_write_on_cuda": _CUDA,
    "batch_transfer_read_on_cuda": _CUDA,
    "get_engine_ptr": "use get_engine() (a railyard.Engine, not a C++ pointer)",
}

# Mooncake's build flags (``mooncake.engine.SUPPORT_*``): this engine moves host memory.
SUPPORT_CUDA = False
SUPPORT_HIP = False
SUPPORT_MUSA = False
SUPPORT_EFA = False
SUPPORT_MNNVL = False
SUPPORT_INTRA_NVLINK = False


def local_topology(device_name: str | None = None) -> str:
    """Mooncake's topology JSON for this host, from sysfs: ``{"cpu:N": [[devices on node
    N], [other devices]]}``."""
    wanted = {d.strip() for d in (device_name or "").split(",") if d.strip()}
    devices: dict[str, int] = {}
    try:
        names = sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        names = []
    for name in names:
        if wanted and name not in wanted:
            continue
        try:
            with open(f"/sys/class/infiniband/{name}/device/numa_node") as node:
                devices[name] = int(node.read().strip())
        except (OSError, ValueError):
            devices[name] = -1
    try:
        nodes = sorted(
            int(entry[4:])
            for entry in os.listdir("/sys/devices/system/node")
            if entry.startswith("node") and entry[4:].isdigit()
        )
    except OSError:
        nodes = [0]
    topology = {}
    for node in nodes or [0]:
        near = [name for name, at in devices.items() if at == node]
        far = [name for name, at in devices.items() if at != node]
        topology[f"cpu:{node}"] = [near, far]
    return json.dumps(topology, indent=3)


def _is_device_location(location: str | None) -> bool:
    if not location or location == "*":
        return False
    return location.strip().lower().startswith(_DEVICE_LOCATION_PREFIXES)


def _as_lists(
    buffers: Sequence[int], peers: Sequence[int], lengths: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    local, remote, lens = (
        x.tolist() if hasattr(x, "tolist") else list(x) for x in (buffers, peers, lengths)
    )
    if not (len(local) == len(remote) == len(lens)):
        raise ValueError(
            f"buffers, peer_buffer_addresses and lengths have different sizes "
            f"({len(local)}, {len(remote)}, {len(lens)})"
        )
    return local, remote, lens


def _count(lengths: Any) -> int:
    try:
        return len(lengths)
    except TypeError:
        return 0
