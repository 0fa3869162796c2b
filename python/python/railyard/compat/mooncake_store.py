"""Mooncake Store's Python API on railyard's KV-cache store.

``MooncakeDistributedStore`` here has the method names, argument names and order, defaults
and integer return codes of ``mooncake.store.MooncakeDistributedStore`` (Mooncake's
pybind11 binding, ``mooncake-integration/store/store_py.cpp``), so a caller written for
Mooncake Store — SGLang's HiCache backend, vLLM's ``MooncakeStoreConnector``, LMCache's
Mooncake connector — runs on railyard by changing one import::

    # from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    from railyard.compat.mooncake_store import MooncakeDistributedStore, ReplicateConfig

    store = MooncakeDistributedStore()
    ret = store.setup("localhost:12345", "P2PHANDSHAKE", 512 << 20, 16 << 20, "tcp", "",
                      "127.0.0.1:7500")   # a `railyard master` there
    assert ret == 0
    store.put("key", b"value")
    assert store.get("key") == b"value"

Like Mooncake, no call raises for a failure of the store: ints are ``0`` or a negative
error code (the module's constants), ``get`` returns ``b""`` on a miss. Wrong argument
types and values answer ``INVALID_PARAMS`` (-600) before anything is sent. Errors are
logged on logger ``railyard.compat.mooncake_store``.

Return conventions (as Mooncake's)
    * ``setup``, ``register_buffer``, ``unregister_buffer``, ``put``, ``put_from``,
      ``put_parts``, ``upsert*``, ``remove``: ``0`` or a negative code. A ``put`` of a key
      that exists returns ``0`` and keeps the stored value; ``upsert`` replaces it.
    * ``put_batch`` / ``upsert_batch``: one int, ``0`` or the first key's error.
    * ``get`` / ``get_batch``: the value, ``b""`` for a miss or a failure (``get_batch`` of
      no keys, or before ``setup``: ``[b""]``).
    * ``get_into``, ``get_size``: bytes, or a negative code (``-704`` not found, ``-600``
      when the buffer is smaller than the value).
    * ``batch_*``: a list, one int per key (bytes read, ``0`` for a put, or a negative
      code); ``batch_is_exist``: ``1``/``0``/negative per key; a length mismatch answers
      ``-600`` for every key.
    * ``is_exist``: ``1``, ``0``, or a negative code.
    * ``remove``: ``-704`` for a missing key, ``-706`` while a reader holds a lease on it
      (a read grants one for the master's lease TTL), unless ``force``.
    * ``remove_all`` / ``remove_by_regex``: how many were removed (leased objects are
      skipped unless ``force``).
    * ``health_check``: ``0`` healthy, ``1`` not set up, ``2`` master unreachable.
    * ``close``: ``0``, idempotent; ``setup`` may follow. Objects in the segment this store
      contributed go with it; its objects in other segments stay readable.

Codes that mean the same as Mooncake's: ``-200`` no space (store pressure), ``-600``
invalid parameters, ``-703`` being written, ``-704`` not found, ``-706`` has a lease,
``-707`` lease expired, ``-712`` a replica's segment went away, ``-800`` transfer failed,
``-900`` master unreachable.

``setup``
    * ``local_hostname``: ``"host"`` or ``"host:port"``: this store's name (what
      ``preferred_segments`` and ``get_hostname()`` say) and where its engine listens; with
      no port a free one in 12300–14300 is taken, as Mooncake does.
    * ``metadata_server``: every form Mooncake accepts (``"P2PHANDSHAKE"``,
      ``"http://host:port/metadata"``, ``"etcd://host:port"``, ``"redis://…"``,
      ``"host:port"``) is accepted and ignored: railyard's master is the store's directory
      (a one-time note says so for anything but ``P2PHANDSHAKE``).
    * ``global_segment_size``: bytes this store contributes (``0``: none, a pure client).
    * ``local_buffer_size``: bytes of the bounce buffer for ``put``/``get`` of plain bytes.
      ``0`` sets up a zero-copy client: as in Mooncake, the copying calls (``put``,
      ``put_parts``, ``put_batch``, ``upsert``, ``get``, ``get_batch``, ``get_buffer``)
      then answer ``-600`` / ``b""``, and ``put_from``/``get_into`` and their forms work.
    * ``protocol``: ``"tcp"`` (TCP fabric), ``"rdma"``/``"efa"`` (verbs when this host has an
      RDMA device, else railyard's ``auto`` fabric with a ``RuntimeWarning``).
    * ``rdma_devices`` and ``engine`` are ignored (each store has its own railyard engine).
    * ``master_server_addr``: ``"host:port"`` of ``railyard master``, or ``"etcd://…"`` to
      find the leading master of a failover group.
    * ``setup(config_dict)``: the same as a dict (sizes as ints or ``"4GB"``-style strings,
      binary units ``B``/``K``/``KB``/``M``/``MB``/``G``/``GB``/``T``/``TB``; defaults as
      Mooncake's).
    * Environment: ``RAILYARD_SECRET_FILE`` (the cluster secret), ``RAILYARD_BUSY_POLL=1``
      (busy-polling pollers; the default parks idle pollers, as several stores often share
      a process), ``MC_STORE_CLIENT_MIN_PORT``/``MC_STORE_CLIENT_MAX_PORT``.

Limits
    Keys are 1 to 256 bytes of UTF-8 (Mooncake accepts longer): a longer key answers
    ``-600``, before anything is sent.

Not supported (answer ``NOT_SUPPORTED``, -1012, or raise :class:`NotSupportedError`, an
``AttributeError`` so ``hasattr`` feature checks see them missing)
    CXL, NVMe-oF and device-memory protocols (``protocol="cxl"``, ``"nvmeof"``,
    ``"nvlink"``, ...; -1012 from ``setup``), SSD offload (``enable_ssd_offload=True``), NOF/DFS replicas (``nof_replica_num``,
    ``dfs_replica_num``), ``setup_dummy`` (IPC to a standalone client), tenants other than
    ``"default"``, ``prefer_alloc_in_same_node`` on ``put``/``put_from``/``batch_put_from``
    and the upserts (``-600``, as Mooncake answers), every tensor method (``*tensor*``), and
    the session, range, task, segment-file and replica-descriptor methods (see
    ``_UNSUPPORTED``). Device (GPU) memory cannot be registered: ``register_buffer`` of it
    answers ``-600``; stage KV pages through registered host memory.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import operator
import os
import random
import re
import threading
from collections.abc import Sequence
from typing import Any

from .. import _native
from .mooncake import (
    _DEVICE_PROTOCOLS,
    _RDMA_PROTOCOLS,
    _has_rdma_device,
    _split_host_port,
    _warn_rdma_fallback,
)

__all__ = [
    "BufferHandle",
    "MooncakeDistributedStore",
    "NotSupportedError",
    "ReplicateConfig",
    "SoftPinAction",
]

logger = logging.getLogger(__name__)

# -- error codes (Mooncake's ErrorCode, mooncake-store/include/types.h) --------------------
OK = 0
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
SHARD_INDEX_OUT_OF_RANGE = -100
SEGMENT_NOT_FOUND = -101
SEGMENT_ALREADY_EXISTS = -102
CLIENT_NOT_FOUND = -103
NO_AVAILABLE_HANDLE = -200
INVALID_VERSION = -300
INVALID_KEY = -400
WRITE_FAIL = -500
INVALID_PARAMS = -600
ILLEGAL_CLIENT = -601
INVALID_WRITE = -700
INVALID_READ = -701
INVALID_REPLICA = -702
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
OBJECT_HAS_REPLICATION_TASK = -708
OBJECT_NO_REPLICATION_TASK = -709
REPLICA_NOT_FOUND = -710
REPLICA_ALREADY_EXISTS = -711
REPLICA_IS_GONE = -712
REPLICA_NOT_IN_LOCAL_MEMORY = -713
OBJECT_REPLICA_BUSY = -714
TRANSFER_FAIL = -800
CHECKSUM_MISMATCH = -801
RPC_FAIL = -900
RPC_TIMEOUT = -901
NOT_SUPPORTED = -1012

# health_check's answers.
HC_HEALTHY = 0
HC_NOT_INITIALIZED = 1
HC_MASTER_UNREACHABLE = 2

_MIB = 1 << 20
# The engine's bounce buffer when local_buffer_size is 0: the smallest one (the copying
# calls are refused then, as Mooncake refuses them without a local buffer).
_NO_STAGING = 4096
# Mooncake's port range and tries for a local_hostname without a port.
_CLIENT_MIN_PORT = 12300
_CLIENT_MAX_PORT = 14300
_SETUP_RETRIES = 20
# Mooncake's transports railyard does not have (device-memory ones are _DEVICE_PROTOCOLS).
_UNSUPPORTED_PROTOCOLS = frozenset({"cxl", "nvmeof", "nvmeof_generic", "ubshmem"})
# Mooncake's default soft-pin TTL (DEFAULT_KV_SOFT_PIN_TTL_MS).
_SOFT_PIN_TTL_MS = 30 * 60 * 1000


class SoftPinAction(enum.IntEnum):
    """What a write does to the object's soft pin (Mooncake's values)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    """What an object holds (Mooncake's values; railyard stores it nowhere)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class NotSupportedError(NotImplementedError, AttributeError):
    """A Mooncake Store method railyard does not provide (an ``AttributeError`` too, so
    ``hasattr`` sees it missing)."""


class ReplicateConfig:
    """Mooncake's ``ReplicateConfig``: built empty, fields set as attributes.

    ``with_soft_pin`` (Mooncake's older spelling) reads and sets
    ``soft_pin_action == SoftPinAction.ENABLE``. ``best_effort`` (railyard's, ``True`` here
    as Mooncake's allocator behaves): with fewer segments able to take a replica than
    ``replica_num``, write as many as they can take (at least one); ``False`` refuses.
    """

    def __init__(self) -> None:
        self.replica_num: int = 1
        self.nof_replica_num: int = 0
        self.dfs_replica_num: int = 0
        self.soft_pin_action: SoftPinAction = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms: int | None = None
        self.with_hard_pin: bool = False
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.preferred_segment: str = ""
        self.prefer_alloc_in_same_node: bool = False
        self.data_type: ObjectDataType = ObjectDataType.UNKNOWN
        self.group_ids: list[str] | None = None
        # Mooncake's allocator writes as many replicas as segments can take (at least one).
        self.best_effort: bool = True

    @property
    def soft_pin_ttl_ms(self) -> int | None:
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: int | None) -> None:
        # As Mooncake's binding (an optional uint64): a negative or too large value is a
        # TypeError.
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64
        ):
            raise TypeError(f"soft_pin_ttl_ms must be None or an int in [0, 2**64), not {value!r}")
        self._soft_pin_ttl_ms = value

    @property
    def with_soft_pin(self) -> bool:
        return self.soft_pin_action == SoftPinAction.ENABLE

    @with_soft_pin.setter
    def with_soft_pin(self, value: bool) -> None:
        self.soft_pin_action = SoftPinAction.ENABLE if value else SoftPinAction.PRESERVE

    def __str__(self) -> str:
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, nof_replica_num: "
            f"{self.nof_replica_num}, dfs_replica_num: {self.dfs_replica_num}, "
            f"soft_pin_action: {int(self.soft_pin_action)}, with_hard_pin: "
            f"{self.with_hard_pin}, preferred_segments: {self.preferred_segments}, "
            f"prefer_alloc_in_same_node: {self.prefer_alloc_in_same_node} }}"
        )

    __repr__ = __str__


class BufferHandle(bytearray):
    """A value read by ``get_buffer``: its bytes (``memoryview(h)``, ``bytes(h)``,
    ``len(h)``), with Mooncake's ``ptr()`` and ``size()``."""

    def ptr(self) -> int:
        if not self:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        return len(self)


class _Refused(Exception):
    """An argument refused before anything was sent: answers ``code``."""

    def __init__(self, message: str, code: int = INVALID_PARAMS) -> None:
        super().__init__(message)
        self.code = code


def _code_of(error: BaseException) -> int:
    if isinstance(error, _native.StoreError):
        return int(getattr(error, "code", INTERNAL_ERROR))
    if isinstance(error, _Refused):
        return error.code
    if isinstance(error, (TypeError, ValueError, OverflowError)):
        return INVALID_PARAMS
    if isinstance(error, RuntimeError) and "not set up" in str(error):
        return INVALID_PARAMS
    return INTERNAL_ERROR


_notes_lock = threading.Lock()
_notes_given: set[str] = set()


def _note_once(topic: str, message: str) -> None:
    with _notes_lock:
        if topic in _notes_given:
            return
        _notes_given.add(topic)
    logger.warning("railyard.compat.mooncake_store: %s", message)


def parse_size(value: Any) -> int:
    """Mooncake's size strings: a number (fractions allowed) and a binary unit ``B``,
    ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB`` (any case); ``"infinite"`` is
    2**64-1; an int is bytes."""
    if isinstance(value, bool):
        raise ValueError(f"size {value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size {value} is negative")
        return value
    text = str(value).strip()
    if text.lower() == "infinite":
        return (1 << 64) - 1
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)", text)
    if not match:
        raise ValueError(f"size {value!r} is not a number with an optional unit")
    number = float(match.group(1))
    units = {"": 0, "B": 0, "K": 1, "KB": 1, "M": 2, "MB": 2, "G": 3, "GB": 3, "T": 4, "TB": 4}
    unit = match.group(2).upper()
    if unit not in units:
        raise ValueError(f"size {value!r}: unknown unit {match.group(2)!r}")
    return int(number * (1024 ** units[unit]))


def _parse_bool(value: Any, default: bool) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on", "enable"):
        return True
    if text in ("0", "false", "no", "off", "disable"):
        return False
    logger.warning("railyard.compat.mooncake_store: %r is not a boolean; using %s", value, default)
    return default


def _config(config: Any, *, same_node_refused: bool) -> Any:
    """Checks a ``ReplicateConfig`` for what railyard cannot do (``None``: the defaults,
    best effort as Mooncake's)."""
    if config is None:
        return ReplicateConfig()
    if getattr(config, "prefer_alloc_in_same_node", False) and same_node_refused:
        raise _Refused("prefer_alloc_in_same_node is not supported by this call (as Mooncake)")
    if getattr(config, "nof_replica_num", 0) or getattr(config, "dfs_replica_num", 0):
        raise _Refused("NOF and DFS replicas are not supported by railyard", NOT_SUPPORTED)
    ttl = getattr(config, "soft_pin_ttl_ms", None)
    action = getattr(config, "soft_pin_action", SoftPinAction.PRESERVE)
    if ttl is not None and int(action) != SoftPinAction.ENABLE:
        raise _Refused("soft_pin_ttl_ms needs soft_pin_action = SoftPinAction.ENABLE")
    if ttl is not None and ttl < 0:
        raise _Refused("soft_pin_ttl_ms is negative")
    return config


def _ints(values: Any, what: str) -> list[int]:
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be a list of ints")
    out = []
    for value in values:
        if isinstance(value, bool):
            raise TypeError(f"{what} must be ints, not bool")
        number = operator.index(value)  # an int or a NumPy integer; TypeError otherwise
        if number < 0:
            raise ValueError(f"{what} has a negative value {number}")
        out.append(number)
    return out


def _keys(keys: Any) -> list[str]:
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be a list of str")
    out = list(keys)
    for key in out:
        if not isinstance(key, str):
            raise TypeError(f"keys must be str, not {type(key).__name__}")
    return out


def _count_of(keys: Any) -> int:
    """How many keys a batch was given (for one code per key when it is refused)."""
    try:
        return len(keys)
    except TypeError:
        return 0


def _bytes_of(value: Any) -> bytes:
    """A buffer-protocol value as bytes (``str`` raises ``TypeError``, as Mooncake)."""
    if isinstance(value, str):
        raise TypeError("a value must be bytes-like, not str")
    if isinstance(value, bytes):
        return value
    return memoryview(value).tobytes()


def _per_key(results: Sequence[Any], ok: Any = None) -> list[int]:
    """A batch's results as Mooncake's ints: a ``StoreError`` instance as its code."""
    out = []
    for result in results:
        if isinstance(result, BaseException):
            code = _code_of(result)
            out.append(OK if code == OBJECT_ALREADY_EXISTS else code)
        elif ok is not None:
            out.append(ok)
        else:
            out.append(int(result))
    return out


class MooncakeDistributedStore:
    """Mooncake's ``MooncakeDistributedStore`` on railyard. See the module docstring."""

    def __init__(self) -> None:
        self._store: _native.Store | None = None
        self._hostname = ""
        # Whether setup gave a local buffer: without one, the copying calls (put, get and
        # their forms) answer INVALID_PARAMS / b"", as Mooncake's do.
        self._local_buffer = False
        self._lock = threading.RLock()

    # -- set-up ---------------------------------------------------------------------------

    def setup(
        self,
        local_hostname: Any = None,
        metadata_server: str | None = None,
        global_segment_size: int = 16 * _MIB,
        local_buffer_size: int = 16 * _MIB,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:50051",
        engine: Any = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = "default",
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
        *,
        config: dict | None = None,
    ) -> int:
        """Start this store's engine, connect to the master and contribute
        ``global_segment_size`` bytes; ``0`` or a negative code. Also ``setup(dict)`` and
        ``setup(config=dict)``."""
        if config is not None:
            return self._setup_from_dict(config)
        if isinstance(local_hostname, dict):
            return self._setup_from_dict(local_hostname)
        try:
            if metadata_server is None:
                raise TypeError("setup() needs metadata_server")
            if not isinstance(local_hostname, str) or not local_hostname.strip():
                raise _Refused("local_hostname is empty")
            if enable_ssd_offload:
                raise _Refused("SSD offload is not supported by railyard", NOT_SUPPORTED)
            if tenant_id not in ("", "default"):
                raise _Refused(f"tenant {tenant_id!r}: railyard has no tenants", NOT_SUPPORTED)
            segment = parse_size(global_segment_size)
            staging = parse_size(local_buffer_size)
            self._note_ignored(metadata_server, rdma_devices, engine, enable_client_http_server)
            fabric = self._fabric(str(protocol or "tcp"))
            with self._lock:
                if self._store is not None:
                    logger.info("setup called again: closing the previous store")
                    self.close()
                self._store, self._hostname = self._open(
                    local_hostname.strip(),
                    master_server_addr,
                    segment,
                    staging or _NO_STAGING,
                    fabric,
                    protocol,
                )
                self._local_buffer = staging > 0
            return OK
        except Exception as error:  # Mooncake reports set-up failures as codes
            logger.error("railyard MooncakeDistributedStore setup failed: %s", error)
            return _code_of(error)

    def _setup_from_dict(self, config: Any) -> int:
        try:
            if not isinstance(config, dict):
                raise _Refused("the config is a dict")
            values = {str(k): v for k, v in config.items()}
            hostname = str(values.get("local_hostname", "") or "")
            metadata = str(values.get("metadata_server", "") or "")
            if not hostname or not metadata:
                raise _Refused("local_hostname and metadata_server are required")
            segment = parse_size(values.get("global_segment_size", 16 * _MIB))
            staging = parse_size(values.get("local_buffer_size", 16 * _MIB))
            if 0 < segment < 1024 or 0 < staging < 1024 or staging > (1 << 40):
                raise _Refused("global_segment_size and local_buffer_size are 0 or >= 1 KiB")
            return self.setup(
                hostname,
                metadata,
                segment,
                staging,
                str(values.get("protocol", "tcp")),
                str(values.get("rdma_devices", "")),
                str(values.get("master_server_addr", "127.0.0.1:50051")),
                None,
                _parse_bool(values.get("enable_ssd_offload", False), False),
                str(values.get("ssd_offload_path", "")),
                str(values.get("tenant_id", "default")),
                _parse_bool(values.get("enable_client_http_server", False), False),
                int(values.get("client_http_port", 9300)),
            )
        except Exception as error:
            logger.error("railyard MooncakeDistributedStore setup failed: %s", error)
            return _code_of(error)

    @staticmethod
    def _note_ignored(metadata_server: str, rdma_devices: str, engine: Any, http: bool) -> None:
        if str(metadata_server).strip() != "P2PHANDSHAKE":
            _note_once(
                "metadata",
                f"metadata_server {metadata_server!r} is not used: railyard's master is the "
                "store's directory",
            )
        if rdma_devices and rdma_devices != "auto-discovery":
            _note_once("devices", f"rdma_devices {rdma_devices!r} is not used: railyard picks")
        if engine is not None:
            _note_once("engine", "engine is not used: each railyard store has its own engine")
        if http:
            _note_once("http", "the client HTTP server is not provided by railyard")

    @staticmethod
    def _fabric(protocol: str) -> str:
        proto = protocol.strip().lower()
        if proto == "tcp":
            return "tcp"
        if proto in _RDMA_PROTOCOLS:
            if _has_rdma_device():
                return "verbs"
            _warn_rdma_fallback(protocol, "this host has no RDMA device")
            return "auto"
        if proto in _DEVICE_PROTOCOLS or proto in _UNSUPPORTED_PROTOCOLS:
            raise _Refused(
                f"protocol {protocol!r} is not supported by railyard (host memory over "
                "'tcp' or 'rdma')",
                NOT_SUPPORTED,
            )
        if proto in ("", "auto"):
            return "auto"
        raise _Refused(f"unknown protocol {protocol!r} (railyard supports 'rdma' and 'tcp')")

    @staticmethod
    def _open(
        local_hostname: str,
        master: str,
        segment: int,
        staging: int,
        fabric: str,
        protocol: str,
    ) -> tuple[_native.Store, str]:
        host, port = _split_host_port(local_hostname)
        host = host or "localhost"
        if port is not None:
            ports = [port]
        else:
            low = int(os.environ.get("MC_STORE_CLIENT_MIN_PORT", _CLIENT_MIN_PORT))
            high = int(os.environ.get("MC_STORE_CLIENT_MAX_PORT", _CLIENT_MAX_PORT))
            ports = random.sample(range(low, high + 1), min(_SETUP_RETRIES, high - low + 1))
        busy_poll = os.environ.get("RAILYARD_BUSY_POLL", "0") not in ("", "0")
        last: Exception | None = None
        for candidate in ports:
            name = f"{host}:{candidate}"
            store = _native.Store()
            try:
                store.setup(
                    master,
                    name=name,
                    segment_size=segment,
                    staging_size=staging,
                    listen=f"0.0.0.0:{candidate}",
                    advertise_host=host,
                    fabric=fabric,
                    busy_poll=busy_poll,
                )
                return store, name
            except RuntimeError as error:
                # The engine did not start (its port is taken): the next port.
                last = error
                if fabric == "verbs":
                    _warn_rdma_fallback(protocol, f"the verbs fabric failed to start ({error})")
                    fabric = "auto"
        assert last is not None
        if port is not None:
            # Mooncake: the port named could not be used -> INVALID_PARAMS.
            raise _Refused(f"{local_hostname}: {last}")
        raise last

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Not supported: railyard has no standalone client to talk to over IPC."""
        logger.error("setup_dummy is not supported by railyard: use setup()")
        return NOT_SUPPORTED

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int) -> int:
        """``setup("localhost:12345", "127.0.0.1:2379", mount_segment_size, 1 GiB, protocol,
        device_name, "127.0.0.1:50051")``, as Mooncake; ``-600`` when set up already."""
        if self._store is not None:
            return INVALID_PARAMS
        return self.setup(
            "localhost:12345",
            "127.0.0.1:2379",
            mount_segment_size,
            1 << 30,
            protocol,
            device_name,
            "127.0.0.1:50051",
        )

    def close(self) -> int:
        """Take this store's segment back and stop its engine; ``0`` (idempotent)."""
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception as error:
                logger.warning("railyard MooncakeDistributedStore close: %s", error)
        return OK

    def health_check(self) -> int:
        """``0`` healthy, ``1`` not set up, ``2`` the master does not answer."""
        store = self._store
        if store is None:
            return HC_NOT_INITIALIZED
        try:
            return HC_HEALTHY if store.health_check() else HC_MASTER_UNREACHABLE
        except Exception:
            return HC_NOT_INITIALIZED

    def get_hostname(self) -> str:
        """``"host:port"``: this store's name."""
        return self._hostname if self._store is not None else ""

    def _require_local_buffer(self) -> _native.Store:
        store = self._require()
        if not self._local_buffer:
            raise _Refused("no local buffer (local_buffer_size 0): use the zero-copy calls")
        return store

    def _require(self) -> _native.Store:
        store = self._store
        if store is None:
            raise _Refused("the store is not set up (call setup first)")
        return store

    # -- buffers --------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``size`` bytes at ``buffer_ptr`` for the zero-copy calls; ``0`` or a
        negative code. Registering the same range again counts (unregister as often)."""
        try:
            if not buffer_ptr or not size:
                raise _Refused("buffer_ptr and size must not be 0")
            self._require().register_buffer(buffer_ptr, size)
            return OK
        except Exception as error:
            logger.error("register_buffer(%#x, %s): %s", buffer_ptr or 0, size, error)
            return _code_of(error)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Unregister the buffer at ``buffer_ptr``; ``0`` or a negative code."""
        try:
            self._require().unregister_buffer(buffer_ptr)
            return OK
        except Exception as error:
            logger.error("unregister_buffer(%s): %s", buffer_ptr, error)
            return _code_of(error)

    # -- writes ---------------------------------------------------------------------------

    def _put_result(self, call: str, key: Any, run: Any) -> int:
        try:
            run()
            return OK
        except Exception as error:
            code = _code_of(error)
            if code == OBJECT_ALREADY_EXISTS:
                return OK  # Mooncake: a put of an existing key succeeds and keeps the value
            logger.error("%s(%r): %s", call, key, error)
            return code

    def put(self, key: str, value: Any, config: Any = None) -> int:
        """Store ``value`` (bytes-like) under ``key``; ``0`` or a negative code."""

        def run() -> None:
            data = _bytes_of(value)
            cfg = _config(config, same_node_refused=True)
            if not data:
                raise _Refused("the value is empty")
            self._require_local_buffer().put(key, data, cfg)

        return self._put_result("put", key, run)

    def put_parts(self, key: str, *parts: Any, config: Any = None) -> int:
        """Store the concatenation of ``parts`` (1-D bytes-like each) under ``key``; no
        bytes at all store nothing and return ``0``, as Mooncake."""

        def run() -> None:
            views = []
            for part in parts:
                view = memoryview(part) if not isinstance(part, str) else None
                if view is None or view.ndim != 1 or view.itemsize != 1:
                    raise _Refused("parts must be 1-D bytes-like")
                views.append(view)
            if sum(view.nbytes for view in views) == 0:
                return
            cfg = _config(config, same_node_refused=True)
            self._require_local_buffer().put_parts(key, *[view.tobytes() for view in views], config=cfg)

        return self._put_result("put_parts", key, run)

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], config: Any = None) -> int:
        """``put`` of each key; ``0``, or the first key's error (others may be written)."""
        try:
            keys = _keys(keys)
            values = list(values)
            if len(keys) != len(values):
                raise _Refused(f"{len(keys)} keys and {len(values)} values")
            data = [_bytes_of(value) for value in values]
            cfg = _config(config, same_node_refused=True)
            results = self._require_local_buffer().batch_put(keys, data, cfg)
        except Exception as error:
            logger.error("put_batch: %s", error)
            return _code_of(error)
        return next((code for code in _per_key(results, ok=OK) if code != OK), OK)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int:
        """Store ``size`` registered bytes at ``buffer_ptr`` under ``key``, zero-copy."""
        if size == 0:
            return OK

        def run() -> None:
            cfg = _config(config, same_node_refused=True)
            self._require().put_from(key, buffer_ptr, size, cfg)

        return self._put_result("put_from", key, run)

    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: Any = None,
    ) -> int:
        """Store the metadata bytes, then the data bytes (both registered), under ``key``."""
        if size == 0:
            return OK

        def run() -> None:
            cfg = _config(config, same_node_refused=True)
            ptrs, sizes = [metadata_buffer_ptr, buffer_ptr], [metadata_size, size]
            if metadata_size == 0:
                ptrs, sizes = [buffer_ptr], [size]
            (result,) = self._require().batch_put_from_multi_buffers([key], [ptrs], [sizes], cfg)
            if isinstance(result, BaseException):
                raise result

        return self._put_result("put_from_with_metadata", key, run)

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: Any = None,
    ) -> list[int]:
        """``put_from`` of each key: one int per key, ``0`` or a negative code."""
        count = _count_of(keys)
        try:
            keys = _keys(keys)
            ptrs, lens = _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes")
            if not (len(keys) == len(ptrs) == len(lens)):
                raise _Refused("keys, buffer_ptrs and sizes differ in length")
            cfg = _config(config, same_node_refused=True)
            results = self._require().batch_put_from(keys, ptrs, lens, cfg)
        except Exception as error:
            logger.error("batch_put_from: %s", error)
            return [_code_of(error)] * count
        return _per_key(results, ok=OK)

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        config: Any = None,
    ) -> list[int]:
        """Store, for each key, the concatenation of its buffers: one int per key."""
        count = _count_of(keys)
        if self._store is None:
            return []
        try:
            keys = _keys(keys)
            ptrs = [_ints(p, "all_buffer_ptrs") for p in all_buffer_ptrs]
            lens = [_ints(s, "all_sizes") for s in all_sizes]
            if not (len(keys) == len(ptrs) == len(lens)):
                raise _Refused("keys, all_buffer_ptrs and all_sizes differ in length")
            cfg = _config(config, same_node_refused=False)
            results = self._require().batch_put_from_multi_buffers(keys, ptrs, lens, cfg)
        except Exception as error:
            logger.error("batch_put_from_multi_buffers: %s", error)
            return [_code_of(error)] * count
        return _per_key(results, ok=OK)

    def upsert(self, key: str, value: Any, config: Any = None) -> int:
        """Store ``value`` under ``key``, replacing an existing value."""
        try:
            data = _bytes_of(value)
            if not data:
                raise _Refused("the value is empty")
            self._require_local_buffer().upsert(key, data, _config(config, same_node_refused=True))
            return OK
        except Exception as error:
            logger.error("upsert(%r): %s", key, error)
            return _code_of(error)

    def upsert_parts(self, key: str, *parts: Any, config: Any = None) -> int:
        """``upsert`` of the concatenation of ``parts``."""
        try:
            data = b"".join(_bytes_of(part) for part in parts)
        except Exception as error:
            return _code_of(error)
        return self.upsert(key, data, config) if data else OK

    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any], config: Any = None) -> int:
        """``upsert`` of each key; ``0``, or the first key's error."""
        try:
            keys = _keys(keys)
            values = list(values)
            if len(keys) != len(values):
                raise _Refused(f"{len(keys)} keys and {len(values)} values")
        except Exception as error:
            return _code_of(error)
        codes = [self.upsert(key, value, config) for key, value in zip(keys, values)]
        return next((code for code in codes if code != OK), OK)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int:
        """``put_from``, replacing an existing value (size 0: nothing, ``0``)."""
        if size == 0:
            return OK
        try:
            self._require().upsert_from(
                key, buffer_ptr, size, _config(config, same_node_refused=True)
            )
            return OK
        except Exception as error:
            logger.error("upsert_from(%r): %s", key, error)
            return _code_of(error)

    def batch_upsert_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: Any = None,
    ) -> list[int]:
        """``upsert_from`` of each key: one int per key."""
        count = _count_of(keys)
        try:
            keys = _keys(keys)
            ptrs, lens = _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes")
            if not (len(keys) == len(ptrs) == len(lens)):
                raise _Refused("keys, buffer_ptrs and sizes differ in length")
            self._require()
        except Exception as error:
            return [_code_of(error)] * count
        return [self.upsert_from(k, p, n, config) for k, p, n in zip(keys, ptrs, lens)]

    # -- reads ----------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The value of ``key``; ``b""`` on a miss or a failure."""
        try:
            return self._require_local_buffer().get(key)
        except Exception as error:
            if _code_of(error) != OBJECT_NOT_FOUND:
                logger.error("get(%r): %s", key, error)
            return b""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """The value of each key, ``b""`` for a miss or a failure (no keys: ``[b""]``)."""
        try:
            keys = _keys(keys)
            if not keys or self._store is None:
                return [b""]
            results = self._require_local_buffer().batch_get(keys)
        except Exception as error:
            logger.error("get_batch: %s", error)
            return [b""] * max(1, len(keys) if isinstance(keys, list) else 1)
        return [b"" if isinstance(result, BaseException) else result for result in results]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value of ``key`` as a :class:`BufferHandle`; ``None`` on a miss or failure."""
        value = self.get(key)
        return BufferHandle(value) if value else None

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """``get_buffer`` of each key."""
        try:
            keys = _keys(keys)
        except TypeError:
            return []
        if not keys:
            return []
        values = self.get_batch(keys)
        return [BufferHandle(value) if value else None for value in values]

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read ``key``'s value into the registered buffer at ``buffer_ptr``: its size, or a
        negative code (``-704`` missing, ``-600`` buffer too small)."""
        try:
            return int(self._require().get_into(key, buffer_ptr, size))
        except Exception as error:
            code = _code_of(error)
            if code != OBJECT_NOT_FOUND:
                logger.error("get_into(%r): %s", key, error)
            return code

    def batch_get_into(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """``get_into`` of each key: bytes read, or a negative code, per key."""
        count = _count_of(keys)
        try:
            keys = _keys(keys)
            ptrs, lens = _ints(buffer_ptrs, "buffer_ptrs"), _ints(sizes, "sizes")
            if not (len(keys) == len(ptrs) == len(lens)):
                raise _Refused("keys, buffer_ptrs and sizes differ in length")
            if not keys:
                return []
            results = self._require().batch_get_into(keys, ptrs, lens)
        except Exception as error:
            logger.error("batch_get_into: %s", error)
            return [_code_of(error)] * count
        return _per_key(results)

    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Read each key's value into its buffers, in order: bytes read, or a negative
        code, per key. (Reads go to the nearest replica anyway.)"""
        count = _count_of(keys)
        try:
            keys = _keys(keys)
            ptrs = [_ints(p, "all_buffer_ptrs") for p in all_buffer_ptrs]
            lens = [_ints(s, "all_sizes") for s in all_sizes]
            if not (len(keys) == len(ptrs) == len(lens)):
                raise _Refused("keys, all_buffer_ptrs and all_sizes differ in length")
            if not keys:
                return []
            results = self._require().batch_get_into_multi_buffers(keys, ptrs, lens)
        except Exception as error:
            logger.error("batch_get_into_multi_buffers: %s", error)
            return [_code_of(error)] * count
        return _per_key(results)

    # -- metadata -------------------------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """``1`` when ``key`` names a complete object, ``0`` when not, else a negative
        code."""
        try:
            return 1 if self._require().is_exist(key) else 0
        except Exception as error:
            logger.error("is_exist(%r): %s", key, error)
            return _code_of(error)

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """``is_exist`` of each key."""
        count = _count_of(keys)
        try:
            keys = _keys(keys)
            if not keys:
                return []
            results = self._require().batch_is_exist(keys)
        except Exception as error:
            logger.error("batch_is_exist: %s", error)
            return [_code_of(error)] * count
        return [
            _code_of(result) if isinstance(result, BaseException) else int(bool(result))
            for result in results
        ]

    def get_size(self, key: str) -> int:
        """The size of ``key``'s value, or a negative code (``-704`` missing)."""
        try:
            return int(self._require().get_size(key))
        except Exception as error:
            return _code_of(error)

    def remove(self, key: str, force: bool = False) -> int:
        """Remove ``key``'s object; ``0``, ``-704`` missing, ``-706`` leased (without
        ``force``), ``-703`` being written."""
        try:
            self._require().remove(key, force)
            return OK
        except Exception as error:
            code = _code_of(error)
            if code not in (OBJECT_NOT_FOUND, OBJECT_HAS_LEASE):
                logger.error("remove(%r): %s", key, error)
            return code

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """``remove`` of each key: one int per key."""
        count = _count_of(keys)
        try:
            keys = _keys(keys)
            if not keys:
                return []
            results = self._require().batch_remove(keys, force)
        except Exception as error:
            logger.error("batch_remove: %s", error)
            return [_code_of(error)] * count
        return [_code_of(r) if isinstance(r, BaseException) else OK for r in results]

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove every object whose key the pattern matches (``re.search``): how many
        (leased ones are skipped unless ``force``); ``-600`` for a bad pattern."""
        try:
            pattern = re.compile(regex_pattern)
            store = self._require()
            keys = [key for key in store.keys() if pattern.search(key)]
            if not keys:
                return 0
            results = store.batch_remove(keys, force)
        except Exception as error:
            logger.error("remove_by_regex(%r): %s", regex_pattern, error)
            return INVALID_PARAMS if isinstance(error, re.error) else _code_of(error)
        return sum(1 for result in results if not isinstance(result, BaseException))

    def remove_all(self, force: bool = False) -> int:
        """Remove every object: how many (leased ones are skipped unless ``force``)."""
        try:
            return int(self._require().remove_all(force))
        except Exception as error:
            logger.error("remove_all: %s", error)
            return _code_of(error)

    def __getattr__(self, name: str) -> Any:
        alternative = _UNSUPPORTED.get(name) or (_TENSORS if "tensor" in name else None)
        if alternative is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise NotSupportedError(
            f"MooncakeDistributedStore.{name} is not supported by railyard; {alternative}"
        )


_TENSORS = "store the tensor's bytes with put_from/batch_put_from and read with get_into"
_UNSUPPORTED: dict[str, str] = {
    **{
        name: _TENSORS
        for name in (
            "get_tensor",
            "batch_get_tensor",
            "put_tensor",
            "batch_put_tensor",
            "pub_tensor",
            "batch_pub_tensor",
            "get_tensor_into",
            "batch_get_tensor_into",
            "put_tensor_from",
            "batch_put_tensor_from",
            "upsert_tensor",
            "upsert_tensor_from",
            "batch_upsert_tensor",
            "batch_upsert_tensor_from",
            "get_tensor_with_tp",
            "put_tensor_with_tp",
            "batch_get_tensor_with_tp",
            "batch_put_tensor_with_tp",
            "get_tensor_into_cuda",
            "batch_get_tensor_into_cuda",
        )
    },
    "get_into_ranges": "use batch_get_into_multi_buffers",
    "batch_get_session_start": "use batch_get_into (leases are taken per call)",
    "batch_get_into_multi_buffer_ranges": "use batch_get_into_multi_buffers",
    "batch_get_session_end": "use batch_get_into (leases are taken per call)",
    "batch_put_session_start": "use batch_put_from_multi_buffers",
    "batch_put_from_multi_buffer_ranges": "use batch_put_from_multi_buffers",
    "batch_put_session_end": "use batch_put_from_multi_buffers",
    "batch_put_session_revoke": "use batch_put_from_multi_buffers",
    "get_replica_desc": "use is_exist/get_size (replica placement is the master's)",
    "batch_get_replica_desc": "use batch_is_exist (replica placement is the master's)",
    "batch_replica_clear": "use batch_remove",
    "mount_segment": "contribute memory with setup(global_segment_size=...)",
    "unmount_segment": "close() takes the segment back",
    "allocate_and_mount_segment": "contribute memory with setup(global_segment_size=...)",
    "unmount_and_free_segment": "close() takes the segment back",
    "unmount_local_disk_segment": "railyard has no SSD offload",
    "alloc_from_mem_pool": "allocate with NumPy and register_buffer",
    "create_copy_task": "write more replicas with ReplicateConfig.replica_num",
    "create_move_task": "write with ReplicateConfig.preferred_segments",
    "query_task": "railyard has no replica tasks",
    "get_offload_rpc_read_count": "railyard has no SSD offload",
}

