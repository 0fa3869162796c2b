"""What ``nixl._bindings`` holds, for :mod:`railyard.compat.nixl`: NIXL's constants and
enum values, its exceptions, ``nixlXferTelemetry``, the descriptor lists ``nixlXferDList``
and ``nixlRegDList``, the raw ``nixlAgent`` (here: the railyard engine an agent drives) and
the test helpers of ``nixl._utils``."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from ..._native import Engine

#: NIXL's name for the local side of ``prep_xfer_dlist`` (also ``"NIXL_INIT_AGENT"``).
NIXL_INIT_AGENT = ""
#: NIXL's default metadata listener port.
DEFAULT_COMM_PORT = 8888

#: The backend names an agent accepts (every one is railyard).
_PLUGINS = ["UCX", "UCCL", "LIBFABRIC", "MOONCAKE", "RAILYARD"]

DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG = 0, 1, 2, 3, 4
NIXL_READ, NIXL_WRITE = 0, 1
NIXL_THREAD_SYNC_NONE, NIXL_THREAD_SYNC_STRICT, NIXL_THREAD_SYNC_RW = 0, 1, 2
NIXL_THREAD_SYNC_DEFAULT = NIXL_THREAD_SYNC_NONE
NIXL_IN_PROG, NIXL_SUCCESS = 1, 0
NIXL_ERR_NOT_POSTED, NIXL_ERR_INVALID_PARAM, NIXL_ERR_BACKEND = -1, -2, -3
NIXL_ERR_NOT_FOUND, NIXL_ERR_MISMATCH, NIXL_ERR_NOT_ALLOWED = -4, -5, -6
NIXL_ERR_REPOST_ACTIVE, NIXL_ERR_UNKNOWN, NIXL_ERR_NOT_SUPPORTED = -7, -8, -9
NIXL_COST_ANALYTICAL_BACKEND = 0
HAVE_UCX_GPU_DEVICE_API = False

_MEM_NAMES = {DRAM_SEG: "DRAM_SEG", VRAM_SEG: "VRAM_SEG", BLK_SEG: "BLK_SEG",
              OBJ_SEG: "OBJ_SEG", FILE_SEG: "FILE_SEG"}


class nixlNotPostedError(Exception):
    """The transfer was never posted (NIXL_ERR_NOT_POSTED)."""


class nixlInvalidParamError(Exception):
    """A bad argument (NIXL_ERR_INVALID_PARAM)."""


class nixlBackendError(Exception):
    """The transfer backend failed (NIXL_ERR_BACKEND)."""


class nixlNotFoundError(Exception):
    """An unknown agent, or memory not registered (NIXL_ERR_NOT_FOUND)."""


class nixlMismatchError(Exception):
    """Metadata that cannot be read (NIXL_ERR_MISMATCH)."""


class nixlNotAllowedError(Exception):
    """Not allowed now (NIXL_ERR_NOT_ALLOWED)."""


class nixlRepostActiveError(Exception):
    """The handle's previous post is still in progress (NIXL_ERR_REPOST_ACTIVE)."""


class nixlUnknownError(Exception):
    """NIXL_ERR_UNKNOWN."""


class nixlNotSupportedError(Exception):
    """Not supported (NIXL_ERR_NOT_SUPPORTED)."""


class nixlRemoteDisconnectError(Exception):
    """The remote agent went away (NIXL_ERR_REMOTE_DISCONNECT)."""


class nixlCancelledError(Exception):
    """NIXL_ERR_CANCELED."""


class nixlNoTelemetryError(Exception):
    """Telemetry is off (``capture_telemetry`` / ``NIXL_TELEMETRY_ENABLE``)."""


class nixlMemTypeNotSupportedError(nixlInvalidParamError, nixlNotSupportedError):
    """A memory type railyard cannot move (it moves host memory, ``"DRAM"``, only)."""


_EXCEPTIONS = [
    nixlNotPostedError, nixlInvalidParamError, nixlBackendError, nixlNotFoundError,
    nixlMismatchError, nixlNotAllowedError, nixlRepostActiveError, nixlUnknownError,
    nixlNotSupportedError, nixlRemoteDisconnectError, nixlCancelledError,
    nixlNoTelemetryError, nixlMemTypeNotSupportedError,
]


class nixlXferTelemetry:
    """What one post of a transfer took: ``startTime`` (µs on a monotonic clock),
    ``postDuration`` and ``xferDuration`` (µs, from the post to when completion was seen),
    ``totalBytes`` and ``descCount`` (descriptors after merging). Read-only."""

    __slots__ = ("_start", "_post", "_xfer", "_bytes", "_count")

    def __init__(self, startTime: int = 0, postDuration: int = 0, xferDuration: int = 0,
                 totalBytes: int = 0, descCount: int = 0) -> None:
        self._start, self._post, self._xfer = int(startTime), int(postDuration), int(xferDuration)
        self._bytes, self._count = int(totalBytes), int(descCount)

    startTime = property(lambda self: self._start)
    postDuration = property(lambda self: self._post)
    xferDuration = property(lambda self: self._xfer)
    totalBytes = property(lambda self: self._bytes)
    descCount = property(lambda self: self._count)

    def __repr__(self) -> str:
        return (f"nixlXferTelemetry(startTime={self._start}, postDuration={self._post}, "
                f"xferDuration={self._xfer}, totalBytes={self._bytes}, "
                f"descCount={self._count})")


def _unsupported_mem(name: str) -> nixlMemTypeNotSupportedError:
    return nixlMemTypeNotSupportedError(
        f"railyard moves host memory only (\"DRAM\"); {name!r} is not supported: GPU memory "
        "(\"VRAM\"/\"cuda\") needs GPUDirect RDMA registration (nvidia-peermem or dma-buf), "
        "which railyard does not have, and storage types need a storage backend. Stage the "
        "blocks through registered host memory (a CPU KV cache) and use \"DRAM\"")


def _as_uint64(column: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(column, dtype=np.uint64))


class nixlXferDList:
    """A list of ``(addr, len, devId)`` descriptors of one memory type, as NIXL's
    ``nixlXferDList``: ``nixlXferDList(type, descs)`` with ``descs`` a list of 3-tuples or an
    N×3 ``uint64``/``int64`` array."""

    _arity = 3

    def __init__(self, type: int = DRAM_SEG, descs: Any = None, init_size: int = 0) -> None:
        # `init_size` (or an int in place of `descs`) only reserves room in NIXL: nothing to do.
        if isinstance(descs, int) and not isinstance(descs, bool):
            descs = None
        self._type = int(type)
        self._metas: list[bytes] = []
        if descs is None:
            self._addrs = np.zeros(0, np.uint64)
            self._lens = np.zeros(0, np.uint64)
            self._devs = np.zeros(0, np.uint64)
        elif isinstance(descs, np.ndarray):
            if descs.ndim != 2 or descs.shape[1] != 3 or descs.dtype not in (np.uint64, np.int64):
                raise ValueError("descs must be a Nx3 numpy array of uint64 or int64")
            if descs.dtype == np.int64 and len(descs) and (descs < 0).any():
                raise ValueError("descs must not hold negative addresses or lengths")
            table = descs.astype(np.uint64)
            self._addrs, self._lens, self._devs = (_as_uint64(table[:, i]) for i in range(3))
            self._metas = [b""] * len(table)
        else:
            rows = list(descs)
            for row in rows:
                if not isinstance(row, tuple):
                    raise TypeError(f"each descriptor must be a tuple, not {type_name(row)}")
                if len(row) != self._arity:
                    raise ValueError(
                        f"each descriptor must be a {self._arity}-tuple, not {len(row)} items")
            try:
                self._addrs = _as_uint64([row[0] for row in rows])
                self._lens = _as_uint64([row[1] for row in rows])
                self._devs = _as_uint64([row[2] for row in rows])
            except (OverflowError, ValueError, TypeError) as err:
                raise ValueError(f"descriptors must be non-negative integers: {err}") from None
            if self._arity == 4:
                self._metas = [r[3].encode() if isinstance(r[3], str) else bytes(r[3]) for r in rows]
            else:
                self._metas = [b""] * len(rows)

    def getType(self) -> int:
        return self._type

    def descCount(self) -> int:
        return len(self._addrs)

    def isEmpty(self) -> bool:
        return len(self._addrs) == 0

    def __getitem__(self, index: int) -> tuple:
        row = (int(self._addrs[index]), int(self._lens[index]), int(self._devs[index]))
        return row + (self._metas[index],) if self._arity == 4 else row

    def __setitem__(self, index: int, row: tuple) -> None:
        self._addrs[index], self._lens[index], self._devs[index] = row[0], row[1], row[2]
        if self._arity == 4:
            self._metas[index] = row[3].encode() if isinstance(row[3], str) else bytes(row[3])

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and self._type == other._type  # type: ignore[attr-defined]
                and [self[i] for i in range(self.descCount())]
                == [other[i] for i in range(other.descCount())])  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]

    def addDesc(self, row: tuple) -> None:
        if len(row) != self._arity:
            raise ValueError(f"a descriptor is a {self._arity}-tuple")
        self._addrs = np.append(self._addrs, np.uint64(row[0]))
        self._lens = np.append(self._lens, np.uint64(row[1]))
        self._devs = np.append(self._devs, np.uint64(row[2]))
        meta = row[3] if self._arity == 4 else b""
        self._metas.append(meta.encode() if isinstance(meta, str) else bytes(meta))

    append = addDesc

    def index(self, row: tuple) -> int:
        for i in range(self.descCount()):
            if self[i] == tuple(row):
                return i
        raise nixlNotFoundError("NIXL_ERR_NOT_FOUND")

    def remDesc(self, index: int) -> None:
        if not 0 <= index < self.descCount():
            raise IndexError(index)
        self._addrs = np.delete(self._addrs, index)
        self._lens = np.delete(self._lens, index)
        self._devs = np.delete(self._devs, index)
        del self._metas[index]

    def clear(self) -> None:
        self.__init__(self._type)  # type: ignore[misc]

    def print(self) -> None:
        print(repr(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_MEM_NAMES.get(self._type, self._type)}, {self.descCount()} descs)"

    # What railyard needs of it.
    def _ranges(self) -> tuple[np.ndarray, np.ndarray]:
        return self._addrs, self._lens


class nixlRegDList(nixlXferDList):
    """A list of ``(addr, len, devId, metaInfo)`` descriptors to register, as NIXL's
    ``nixlRegDList``."""

    _arity = 4

    def trim(self) -> nixlXferDList:
        trimmed = nixlXferDList(self._type)
        trimmed._addrs, trimmed._lens, trimmed._devs = (
            self._addrs.copy(), self._lens.copy(), self._devs.copy())
        trimmed._metas = [b""] * self.descCount()
        return trimmed


def type_name(value: Any) -> str:
    return type(value).__name__


class nixlAgentConfig:
    """The raw agent configuration (NIXL's ``nixlAgentConfig``), as ``nixl_agent`` fills it."""

    def __init__(self) -> None:
        self.useProgThread = True
        self.useListenThread = False
        self.listenPort = 0
        self.syncMode = NIXL_THREAD_SYNC_DEFAULT
        self.captureTelemetry = False
        self.pthrDelay = 0
        self.lthrDelay = 100000
        self.etcdWatchTimeout = 0


class nixlAgent:
    """The raw agent (NIXL's ``nixlAgent(name, config)``): here, the railyard engine an
    ``nixl_agent`` drives, listening on ``config.listenPort`` when ``useListenThread``."""

    def __init__(self, name: str, config: nixlAgentConfig) -> None:
        if not name:
            raise ValueError("Agent needs a non-empty name")
        busy = os.environ.get("RAILYARD_BUSY_POLL", "0") not in ("", "0")
        port = config.listenPort if config.useListenThread else 0
        self.engine = Engine(name, listen=f"0.0.0.0:{port}", busy_poll=busy,
                             fabric=os.environ.get("RAILYARD_FABRIC") or "auto",
                             timeout_s=getattr(config, "railyardTimeoutS", 30.0),
                             secret_file=os.environ.get("RAILYARD_SECRET_FILE") or None)

    def getAvailPlugins(self) -> list[str]:
        return list(_PLUGINS)


def _raw_agent(name: str, config: nixlAgentConfig) -> nixlAgent:
    """``nixl._bindings.nixlAgent`` as it is now (callers may wrap it), else this module's."""
    installed = sys.modules.get("nixl._bindings")
    if installed is not None and getattr(installed, "__railyard__", False):
        return installed.nixlAgent(name, config)
    return nixlAgent(name, config)


# nixl._utils: the test helpers NIXL's own tests and examples import.

def _libc() -> Any:
    import ctypes
    libc = ctypes.CDLL(None)
    libc.aligned_alloc.restype = ctypes.c_void_p
    libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def malloc_passthru(size: int) -> int:
    """``size`` bytes of host memory aligned to 4 KiB (NIXL's test helper): its address."""
    if size <= 0:
        raise ValueError(f"size must be positive, not {size}")
    address = _libc().aligned_alloc(4096, (size + 4095) // 4096 * 4096)
    if not address:
        raise MemoryError(f"cannot allocate {size} bytes")
    return int(address)


def free_passthru(address: int) -> None:
    """Frees what :func:`malloc_passthru` gave."""
    _libc().free(address)


def ba_buf(address: int, size: int) -> None:
    """Fills ``size`` bytes at ``address`` with 0xba (NIXL's test helper)."""
    import ctypes
    ctypes.memset(address, 0xBA, size)


def verify_transfer(first: int, second: int, size: int) -> None:
    """Asserts that ``size`` bytes at two addresses are equal (NIXL's test helper)."""
    import ctypes
    assert ctypes.string_at(first, size) == ctypes.string_at(second, size)
