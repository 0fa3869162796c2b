"""What ``nixl._api`` holds, for :mod:`railyard.compat.nixl`: ``nixl_agent_config``,
``nixl_thread_sync_t``, the handle types and ``nixl_agent`` itself, with the thread that
applies metadata messages for agents that listen."""

from __future__ import annotations

import atexit
import enum
import json
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Iterable, Optional

import numpy as np

from ... import _native
from ..._native import Engine, PreparedBatch, PreparedList, PreparedTransfer, TransferError
from .bindings import (
    _MEM_NAMES,
    _PLUGINS,
    BLK_SEG,
    DEFAULT_COMM_PORT,
    DRAM_SEG,
    FILE_SEG,
    NIXL_INIT_AGENT,
    NIXL_READ,
    NIXL_THREAD_SYNC_DEFAULT,
    NIXL_THREAD_SYNC_NONE,
    NIXL_THREAD_SYNC_RW,
    NIXL_THREAD_SYNC_STRICT,
    NIXL_WRITE,
    OBJ_SEG,
    VRAM_SEG,
    _raw_agent,
    _unsupported_mem,
    nixlAgentConfig,
    nixlBackendError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlXferDList,
    nixlXferTelemetry,
    type_name,
)

logger = logging.getLogger("railyard.compat.nixl")

#: Default deadline of a posted transfer (seconds).
DEFAULT_XFER_TIMEOUT_S = 30.0

#: How long ``release_xfer_handle`` of a transfer still in flight waits for it to end.
RELEASE_WAIT_S = 1.0

#: Most bytes one notification (or metadata message) carries: railyard's control frame.
MAX_NOTIFY = _native.MAX_NOTIFY

class nixl_thread_sync_t(enum.Enum):
    """How NIXL serialises calls into one agent. railyard's agent is always thread-safe; the
    value is kept for callers that pass it."""

    NIXL_THREAD_SYNC_NONE = NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = NIXL_THREAD_SYNC_DEFAULT


nixl_backend_handle = int


class nixl_agent_config:
    """NIXL's agent configuration, in NIXL 1.1+'s positional order. What railyard uses:
    ``enable_listen_thread`` and ``listen_port`` (the engine listens there: 0 for any free
    port), ``capture_telemetry``, ``backends`` (each name maps to railyard). Kept but
    unused: ``enable_prog_thread``, ``num_threads`` and ``sync_mode``. railyard's own:
    ``xfer_timeout_s``, the deadline of each posted transfer."""

    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False,
                 listen_port: int = DEFAULT_COMM_PORT, capture_telemetry: bool = False,
                 num_threads: int = 0, backends: Optional[list[str]] = None,
                 sync_mode: Optional[nixl_thread_sync_t] = None, *,
                 xfer_timeout_s: Optional[float] = None) -> None:
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(
                f"sync_mode must be a nixl_thread_sync_t (got {type_name(sync_mode)!r})")
        if not isinstance(listen_port, int) or not 0 <= listen_port <= 65535:
            raise ValueError(f"listen_port must be a port number, not {listen_port!r}")
        if xfer_timeout_s is not None and not (0 < float(xfer_timeout_s) < 1e9):
            raise ValueError(f"xfer_timeout_s must be positive, not {xfer_timeout_s!r}")
        self.enable_pthread = bool(enable_prog_thread)
        self.enable_listen = bool(enable_listen_thread)
        self.port = listen_port
        self.capture_telemetry = bool(capture_telemetry)
        self.num_threads = num_threads
        self.backends = list(["UCX"] if backends is None else backends)
        self.sync_mode = sync_mode
        self.xfer_timeout_s = xfer_timeout_s



_MEM_TYPES = {"DRAM": DRAM_SEG, "VRAM": VRAM_SEG, "FILE": FILE_SEG, "BLOCK": BLK_SEG,
              "OBJ": OBJ_SEG, "cpu": DRAM_SEG, "cuda": VRAM_SEG}

#: Notifications the agents send each other about metadata, never shown to the caller.
_MD_LOAD = b"\x00RYNIXL\x00LOAD:"
_MD_INVALIDATE = b"\x00RYNIXL\x00INVL:"
_METADATA_MAGIC = b"RYNIXL1\n"


class _Remote:
    """A remote agent as this one knows it. ``stale``: its metadata was (re)loaded since the
    engine last looked at the process behind it, which may have restarted or registered its
    memory anew: the next call that reaches it reconnects and takes its descriptor first."""

    __slots__ = ("name", "session", "identity", "mems", "valid", "stale")

    def __init__(self, name: str, session: str, mems: list[tuple[int, int]],
                 identity: str = "") -> None:
        self.name, self.session, self.mems = name, session, mems
        # The engine's incarnation and the agent's registration generation.
        self.identity = identity
        self.valid = True
        self.stale = True

    def holds(self, addr: int, length: int) -> bool:
        return any(base <= addr and addr + length <= base + size for base, size in self.mems)


class nixl_prepped_dlist_handle:
    """A prepared descriptor list (``prep_xfer_dlist``): local, or of one remote agent."""

    __slots__ = ("_native", "_remote", "_count", "_released", "__weakref__")

    def __init__(self, native: PreparedList, remote: Optional[_Remote], count: int) -> None:
        self._native, self._remote, self._count = native, remote, count
        self._released = False

    def release(self) -> None:
        self._released = True

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        side = "local" if self._remote is None else f"of {self._remote.name}"
        return (f"nixl_prepped_dlist_handle({side}, {self._count} descs, "
                f"released={self._released})")


class nixl_xfer_handle:
    """A transfer (``make_prepped_xfer``/``initialize_xfer``), posted by ``transfer``."""

    __slots__ = ("_native", "_remote", "_owned", "_batch", "_started", "_post_us", "_done_at",
                 "_released", "__weakref__")

    def __init__(self, native: PreparedTransfer, remote: _Remote,
                 owned: tuple[nixl_prepped_dlist_handle, ...] = ()) -> None:
        self._native, self._remote, self._owned = native, remote, owned
        self._batch: Optional[PreparedBatch] = None
        self._started = 0
        self._post_us = 0
        self._done_at: Optional[int] = None
        self._released = False

    def release(self) -> None:
        self._released = True
        for dlist in self._owned:
            dlist.release()

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(to {self._remote.name}, released={self._released})"


def _name(agent: Any) -> str:
    if isinstance(agent, (bytes, bytearray)):
        try:
            return bytes(agent).decode()
        except UnicodeDecodeError:
            raise nixlNotFoundError(f"no agent is named {bytes(agent)!r}") from None
    if isinstance(agent, str):
        return agent
    raise TypeError(f"an agent name is str or bytes, not {type_name(agent)}")


def _message(notif: Any) -> bytes:
    if isinstance(notif, str):
        return notif.encode()
    if isinstance(notif, (bytes, bytearray, memoryview)):
        return bytes(notif)
    raise TypeError(f"a notification is bytes or str, not {type_name(notif)}")


def _micros() -> int:
    return time.monotonic_ns() // 1000


def _telemetry_on(conf: nixl_agent_config) -> bool:
    env = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if env is not None:
        return env.strip().lower() in ("y", "yes", "1", "true", "on")
    return conf.capture_telemetry


def _xfer_timeout(conf: nixl_agent_config) -> float:
    if conf.xfer_timeout_s is not None:
        return float(conf.xfer_timeout_s)
    env = os.environ.get("RAILYARD_NIXL_XFER_TIMEOUT_S")
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"RAILYARD_NIXL_XFER_TIMEOUT_S={env!r} is not a number") from None
        if value > 0:
            return value
    return DEFAULT_XFER_TIMEOUT_S


def _indices(value: Any, what: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise ValueError("indices numpy array must be 1D")
        if value.dtype.kind not in "iu":
            raise nixlInvalidParamError(f"{what} must be integers, not {value.dtype}")
        array = value.astype(np.int64, copy=False)
    else:
        try:
            array = np.asarray(list(value), dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise nixlInvalidParamError(f"{what} must be a list of ints or an integer array") from None
        if array.ndim != 1:
            raise ValueError("indices numpy array must be 1D")
    if len(array) and array.min() < 0:
        raise nixlInvalidParamError(f"{what} holds a negative index ({int(array.min())})")
    return array


def _strided(table: np.ndarray) -> nixlXferDList:
    """An N×5 table of ``(addr, len, devId, stride, count)`` rows, expanded row by row."""
    if table.dtype not in (np.uint64, np.int64):
        raise ValueError("strided descs must be a Nx5 numpy array of uint64 or int64")
    rows = table.astype(np.uint64)
    counts = rows[:, 4].astype(np.int64)
    total = int(counts.sum())
    starts = np.repeat(rows[:, 0], counts)
    strides = np.repeat(rows[:, 3], counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    step = (np.arange(total, dtype=np.int64) - first).astype(np.uint64)
    expanded = nixlXferDList(DRAM_SEG)
    expanded._addrs = starts + step * strides
    expanded._lens = np.repeat(rows[:, 1], counts)
    expanded._devs = np.repeat(rows[:, 2], counts)
    expanded._metas = [b""] * total
    return expanded


class nixl_agent:
    """A NIXL agent on railyard: see the module docs. ``nixl_agent(name, conf=None)``."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None,
                 instantiate_all: bool = False) -> None:
        name = _name(agent_name)
        if not name:
            raise ValueError("Agent needs a non-empty name")
        conf = nixl_conf if nixl_conf is not None else nixl_agent_config()
        if not isinstance(conf, nixl_agent_config):
            raise TypeError(f"nixl_conf must be a nixl_agent_config, not {type_name(conf)}")
        self.name = name
        self.plugin_list = list(_PLUGINS)
        self.nixl_mems = dict(_MEM_TYPES)
        self.nixl_ops = {"WRITE": NIXL_WRITE, "READ": NIXL_READ}
        self.notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, int] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self._telemetry = _telemetry_on(conf)
        self._timeout_s = _xfer_timeout(conf)
        self._lock = threading.RLock()
        self._remotes: dict[str, _Remote] = {}
        # Registered ranges of the engine (base -> [length, registrations inside]), and each
        # registration's range (-> the bases it counts against, one per registration).
        self._regions: dict[int, list[int]] = {}
        self._registrations: dict[tuple[int, int], list[int]] = {}
        # Held across a registration or deregistration and the engine's call.
        self._registering = threading.Lock()
        # Bumped by every registration and deregistration: metadata that carries a newer one
        # tells a peer to take this agent's descriptor again.
        self._generation = 0
        self._pending: dict[str, list[bytes]] = {}
        # Held while notifications are taken from the engine and filed.
        self._drain = threading.Lock()
        self._listener: Optional[threading.Thread] = None
        config = nixlAgentConfig()
        config.useProgThread = conf.enable_pthread
        config.useListenThread = conf.enable_listen
        config.listenPort = conf.port
        sync = conf.sync_mode or (nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if conf.enable_listen
                                  else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE)
        config.syncMode = sync.value
        config.captureTelemetry = self._telemetry
        config.railyardTimeoutS = min(self._timeout_s, 30.0)  # type: ignore[attr-defined]
        self.agent = _raw_agent(name, config)
        self._engine: Engine = self.agent.engine
        backends = self.plugin_list if instantiate_all and nixl_conf is None else conf.backends
        for backend in backends:
            if backend in self.plugin_list:
                self.create_backend(backend)
            else:
                logger.warning("no backend %r: railyard answers to %s", backend,
                               ", ".join(self.plugin_list))
        self._closed = threading.Event()
        if conf.enable_listen:
            self._listener = threading.Thread(
                target=_listen, args=(weakref.ref(self), self._closed),
                name=f"nixl-listen-{name}", daemon=True)
            with _LISTENERS_LOCK:
                _LISTENERS.add((self._closed, self._listener))
            self._listener.start()
        logger.info("NIXL agent %s on railyard at %s (%s)", name, self._engine.session_id,
                    self._engine.fabric)

    # --- lifetime (railyard's own) ------------------------------------------------------

    @property
    def session_id(self) -> str:
        """``host:port`` of this agent's railyard engine (its listener)."""
        return self._engine.session_id

    def close(self) -> None:
        """Stops the agent's listen thread and its engine (idempotent); NIXL agents end
        when collected."""
        self._closed.set()
        listener = self._listener
        if listener is not None and listener is not threading.current_thread():
            listener.join(timeout=LISTEN_WAIT_S * 10)
        self._engine.close()

    def __del__(self) -> None:
        closed = getattr(self, "_closed", None)
        if closed is not None:
            closed.set()

    # --- backends -----------------------------------------------------------------------

    def get_plugin_list(self) -> list[str]:
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        if backend not in self.plugin_list:
            logger.warning("%s is not a plugin of this agent", backend)
            return []
        return ["DRAM_SEG"]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        if backend not in self.plugin_list:
            logger.warning("%s is not a plugin of this agent", backend)
        return {}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        if backend not in self.backends:
            logger.warning("backend %s was not created", backend)
            return []
        return ["DRAM_SEG"]

    def get_backend_params(self, backend: str) -> dict[str, str]:
        if backend not in self.backends:
            logger.warning("backend %s was not created", backend)
            return {}
        return dict(self.backend_options[backend])

    def create_backend(self, backend: str, initParams: Optional[dict[str, str]] = None) -> None:
        with self._lock:
            if backend not in self.plugin_list:
                raise nixlNotFoundError(
                    f"no backend {backend!r}: railyard answers to {', '.join(self.plugin_list)}")
            if backend in self.backends:
                raise nixlInvalidParamError(f"backend {backend!r} was created already")
            self.backends[backend] = len(self.backends)
            self.backend_mems[backend] = ["DRAM_SEG"]
            self.backend_options[backend] = dict(initParams or {})

    # --- descriptor lists ---------------------------------------------------------------

    def _mem(self, mem_type: Any) -> int:
        segment = self.nixl_mems[mem_type]
        if segment != DRAM_SEG:
            raise _unsupported_mem(mem_type)
        return segment

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> Optional[nixlRegDList]:
        return self._descs(descs, mem_type, nixlRegDList)

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> Optional[nixlXferDList]:
        return self._descs(descs, mem_type, nixlXferDList)

    def _descs(self, descs: Any, mem_type: Optional[str], kind: type) -> Any:
        if isinstance(descs, nixlXferDList):
            if type(descs) is kind:
                if descs.getType() != DRAM_SEG:
                    raise _unsupported_mem(_MEM_NAMES.get(descs.getType(), "?"))
                return descs
            logger.error("a %s where a %s belongs", type_name(descs), kind.__name__)
            return None
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(descs, torch.Tensor):
            descs = [descs]
        if isinstance(descs, (list, tuple)) and descs and torch is not None \
                and all(isinstance(t, torch.Tensor) for t in descs):
            return self._tensor_descs(descs, kind)
        if mem_type is None:
            logger.error("a memory type (\"DRAM\") must be given with raw descriptors")
            return None
        segment = self._mem(mem_type)
        if isinstance(descs, np.ndarray):
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("descriptor arrays are N×3 (addr, len, devId), not %s", descs.shape)
                return None
            return kind(segment, descs)
        if isinstance(descs, (list, tuple)):
            if not descs:
                raise nixlInvalidParamError("no descriptors given")
            if not isinstance(descs[0], tuple) or len(descs[0]) != kind._arity:
                logger.error("%s takes %d-tuples", kind.__name__, kind._arity)
                return None
            return kind(segment, list(descs))
        logger.error("descriptors must be tuples, an N×3 array or tensors, not %s",
                     type_name(descs))
        return None

    def _tensor_descs(self, tensors: list, kind: type) -> Any:
        rows = []
        for tensor in tensors:
            if not tensor.is_contiguous():
                logger.error("a tensor that is not contiguous cannot be one descriptor")
                return None
            if tensor.get_device() != -1:
                raise _unsupported_mem("VRAM")
            size = tensor.numel() * tensor.element_size()
            rows.append((tensor.data_ptr(), size, 0) + (("",) if kind._arity == 4 else ()))
        return kind(DRAM_SEG, rows)

    def get_serialized_descs(self, descs: Any) -> bytes:
        import pickle
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized: bytes) -> Any:
        import pickle
        return pickle.loads(serialized)

    # --- memory -------------------------------------------------------------------------

    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None,
                        backends: Iterable[str] = ()) -> nixlRegDList:
        """Registers each range. A range inside one this agent registered already (a
        registration within a registration, as NIXL allows) is counted against it; ranges
        that overlap partly are refused (``nixlBackendError``): register the larger first."""
        descs = self.get_reg_descs(reg_list, mem_type)
        if descs is None:
            raise TypeError("register_memory takes a nixlRegDList, 4-tuples with a memory type, "
                            "an N×3 array with a memory type, or host tensors")
        addrs, lens = descs._ranges()
        ranges = sorted({(int(a), int(n)) for a, n in zip(addrs, lens)},
                        key=lambda r: (-r[1], r[0]))
        with self._registering:
            regions = dict(self._regions)
            fresh: list[tuple[int, int]] = []
            inside: dict[tuple[int, int], int] = {}
            for addr, size in ranges:
                container = next((base for base, (length, _) in regions.items()
                                  if base <= addr and addr + size <= base + length), None)
                if container is None:
                    container = next((base for base, length in fresh
                                      if base <= addr and addr + size <= base + length), None)
                if container is None:
                    fresh.append((addr, size))
                else:
                    inside[(addr, size)] = container
            if fresh:
                try:
                    self._engine.register([a for a, _ in fresh], [n for _, n in fresh])
                except (ValueError, RuntimeError) as err:
                    raise nixlBackendError(f"railyard cannot register the memory: {err}") from None
            with self._lock:
                self._generation += 1
                for addr, size in fresh:
                    self._regions[addr] = [size, 0]
                    inside[(addr, size)] = addr
                for a, n in zip(addrs.tolist(), lens.tolist()):
                    base = inside[(a, n)]
                    self._regions[base][1] += 1
                    self._registrations.setdefault((a, n), []).append(base)
        return descs

    def deregister_memory(self, dereg_list: nixlRegDList, backends: Iterable[str] = ()) -> None:
        """Takes each registration back; a registered range goes once nothing registered in
        it is left."""
        if not isinstance(dereg_list, nixlRegDList):
            raise TypeError(f"deregister_memory takes a nixlRegDList, not {type_name(dereg_list)}")
        addrs, lens = dereg_list._ranges()
        with self._registering:
            with self._lock:
                wanted = [(int(a), int(n)) for a, n in zip(addrs, lens)]
                counts: dict[tuple[int, int], int] = {}
                for key in wanted:
                    counts[key] = counts.get(key, 0) + 1
                for key, count in counts.items():
                    if len(self._registrations.get(key, [])) < count:
                        raise nixlNotFoundError(
                            f"{key[1]} bytes at {key[0]:#x} are not registered with this agent")
                self._generation += 1
                emptied = []
                for key in wanted:
                    base = self._registrations[key].pop()
                    if not self._registrations[key]:
                        del self._registrations[key]
                    self._regions[base][1] -= 1
                    if self._regions[base][1] == 0:
                        del self._regions[base]
                        emptied.append(base)
            if emptied:
                try:
                    self._engine.deregister(emptied)
                except (ValueError, RuntimeError) as err:
                    raise nixlBackendError(f"railyard cannot deregister the memory: {err}") from None

    def query_memory(self, reg_list: Any, backend: str, mem_type: Optional[str] = None) -> list:
        if backend not in self.backends:
            raise ValueError(f"backend {backend!r} was not created")
        descs = self.get_reg_descs(reg_list, mem_type)
        return [None] * (descs.descCount() if descs is not None else 0)

    # --- metadata -----------------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        with self._lock:
            mems = [[base, size, 0] for base, (size, _) in sorted(self._regions.items())]
            generation = self._generation
        body = {"name": self.name, "session": self._engine.session_id,
                "identity": f"{self._engine.incarnation}/{generation}", "mems": mems}
        return _METADATA_MAGIC + json.dumps(body).encode()

    def get_partial_agent_metadata(self, descs: Any, inc_conn_info: bool = False,
                                   backends: Iterable[str] = ()) -> bytes:
        return self.get_agent_metadata()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        name, session, identity, mems = self._parse(metadata)
        if name == self.name and session == self._engine.session_id:
            raise nixlInvalidParamError("this agent's own metadata")
        with self._lock:
            known = self._remotes.get(name)
            if known is not None and known.valid and known.session != session:
                raise nixlNotAllowedError(
                    f"agent {name} is known at {known.session}, not {session}: remove it first")
            if known is not None and known.valid:
                if (known.identity, known.mems) != (identity, mems):
                    # Restarted at its address, or its memory registered anew.
                    known.identity, known.mems, known.stale = identity, mems, True
            else:
                self._remotes[name] = _Remote(name, session, mems, identity)
        return name.encode()

    @staticmethod
    def _parse(metadata: Any) -> tuple[str, str, str, list[tuple[int, int]]]:
        if not isinstance(metadata, (bytes, bytearray, memoryview)):
            raise nixlMismatchError(f"metadata is bytes, not {type_name(metadata)}")
        raw = bytes(metadata)
        if not raw.startswith(_METADATA_MAGIC):
            raise nixlMismatchError("not metadata of a railyard NIXL agent")
        try:
            body = json.loads(raw[len(_METADATA_MAGIC):])
            name, session = str(body["name"]), str(body["session"])
            identity = str(body.get("identity", ""))
            mems = [(int(m[0]), int(m[1])) for m in body["mems"]]
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise nixlMismatchError(f"metadata that cannot be read: {err}") from None
        if not name or ":" not in session:
            raise nixlMismatchError("metadata without a name or an address")
        return name, session, identity, mems

    def remove_remote_agent(self, agent: Any) -> None:
        try:
            name = _name(agent)
        except (TypeError, nixlNotFoundError):
            return
        with self._lock:
            remote = self._remotes.pop(name, None)
            if remote is not None:
                remote.valid = False

    def make_connection(self, remote_agent: Any, backends: Iterable[str] = ()) -> None:
        remote = self._remote(remote_agent)
        if not self._fresh(remote, force=True):
            raise nixlBackendError(f"agent {remote.name} at {remote.session} does not answer")

    def _fresh(self, remote: _Remote, force: bool = False) -> bool:
        """Reconnects to a remote whose metadata was (re)loaded since the engine last looked
        (a restarted process at the same address, memory registered anew), and takes its
        descriptor: True when it answered. Cheap when nothing changed."""
        if not (remote.stale or force) or remote.name == self.name:
            return True
        answered = self._engine.reconnect(remote.session, timeout_s=min(self._timeout_s, 5.0))
        if answered:
            remote.stale = False
        return answered

    def check_remote_metadata(self, remote_name: Any, descs: Any = None) -> bool:
        try:
            name = _name(remote_name)
            self._pump()
        except Exception:  # never raises, as NIXL
            return False
        with self._lock:
            remote = self._remotes.get(name)
            if remote is None or not remote.valid:
                return False
        if descs is None:
            return True
        if not isinstance(descs, nixlXferDList):
            return False
        addrs, lens = descs._ranges()
        return all(remote.holds(int(a), int(n)) for a, n in zip(addrs, lens))

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self._send_to(ip_addr, port, _MD_LOAD + self.get_agent_metadata())

    def send_partial_agent_metadata(self, descs: Any, inc_conn_info: bool = False,
                                    backends: Iterable[str] = (), ip_addr: str = "",
                                    port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        if label and not ip_addr:
            raise nixlNotSupportedError("railyard has no central metadata store (label=)")
        self.send_local_metadata(ip_addr, port)

    def fetch_remote_metadata(self, remote_agent: Any = "", ip_addr: str = "",
                              port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        session = self._address(ip_addr, port, label)
        try:
            name, buffers = self._engine.peer_info(session)
        except TransferError as err:
            logger.warning("fetching metadata from %s failed: %s", session, err)
            return
        with self._lock:
            known = self._remotes.get(name)
            if known is None or not known.valid or known.session == session:
                self._remotes[name] = _Remote(name, session, list(buffers))

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self._send_to(ip_addr, port, _MD_INVALIDATE + self.name.encode())

    @staticmethod
    def _address(ip_addr: str, port: int, label: str = "") -> str:
        if not ip_addr:
            raise nixlInvalidParamError(
                "no peer address provided and no centralized store configured "
                "(railyard has no etcd/TCPStore metadata store)")
        return f"{ip_addr}:{int(port)}"

    def _send_to(self, ip_addr: str, port: int, message: bytes) -> None:
        session = self._address(ip_addr, port)
        if len(message) > MAX_NOTIFY:
            raise nixlInvalidParamError(
                f"the metadata is {len(message)} bytes; railyard carries at most {MAX_NOTIFY} "
                "in one message (register fewer, larger ranges)")
        try:
            self._engine.notify(session, message)
        except TransferError as err:
            # NIXL sends metadata from a worker thread and only logs failures.
            logger.warning("sending metadata to %s failed: %s", session, err)

    # --- preparing and making transfers -------------------------------------------------

    def _remote(self, agent: Any) -> _Remote:
        name = _name(agent)
        with self._lock:
            remote = self._remotes.get(name)
        if remote is None or not remote.valid:
            raise nixlNotFoundError(f"no remote agent {name!r}: add its metadata first")
        return remote

    def _xfer_list(self, xfer_list: Any, mem_type: Optional[str]) -> nixlXferDList:
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            self._mem(mem_type)
            return _strided(xfer_list)
        descs = self.get_xfer_descs(xfer_list, mem_type)
        if descs is None:
            raise TypeError("prep_xfer_dlist takes a nixlXferDList, 3-tuples or an N×3 array "
                            "with a memory type, or an N×5 strided array")
        return descs

    def prep_xfer_dlist(self, agent_name: Any, xfer_list: Any, mem_type: Optional[str] = None,
                        backends: Iterable[str] = ()) -> nixl_prepped_dlist_handle:
        name = _name(agent_name)
        descs = self._xfer_list(xfer_list, mem_type)
        addrs, lens = descs._ranges()
        if name in ("", "NIXL_INIT_AGENT"):
            try:
                native = self._engine.prepare_local(addrs, lens)
            except ValueError as err:
                raise nixlNotFoundError(f"local descriptors not registered: {err}") from None
            return nixl_prepped_dlist_handle(native, None, descs.descCount())
        if name == self.name:
            remote = _Remote(name, self._engine.session_id, [])
        else:
            remote = self._remote(name)
            self._fresh(remote)
        try:
            native = self._engine.prepare_remote(remote.session, addrs, lens)
        except ValueError as err:
            raise nixlNotFoundError(f"descriptors not registered by {name}: {err}") from None
        except TransferError as err:
            raise nixlRemoteDisconnectError(f"agent {name} cannot be reached: {err}") from None
        return nixl_prepped_dlist_handle(native, remote, descs.descCount())

    @staticmethod
    def _op(operation: Any) -> str:
        code = {"WRITE": NIXL_WRITE, "READ": NIXL_READ}[operation]
        return "read" if code == NIXL_READ else "write"

    @staticmethod
    def _usable(handle: Any, kind: type) -> Any:
        if not isinstance(handle, kind):
            raise nixlInvalidParamError(f"expected a {kind.__name__}, not {type_name(handle)}")
        if handle._released:
            raise nixlInvalidParamError(f"the {kind.__name__} was released")
        return handle

    def _current(self, remote: _Remote) -> None:
        with self._lock:
            current = self._remotes.get(remote.name)
        if remote.name != self.name and current is not remote:
            raise nixlNotFoundError(
                f"agent {remote.name} was removed or lost since this was prepared: add it "
                "again and prepare anew")

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle,
                          local_indices: Any, remote_xfer_side: nixl_prepped_dlist_handle,
                          remote_indices: Any, notif_msg: Any = b"",
                          backends: Iterable[str] = (), skip_desc_merge: bool = False
                          ) -> nixl_xfer_handle:
        op = self._op(operation)
        local = self._usable(local_xfer_side, nixl_prepped_dlist_handle)
        remote = self._usable(remote_xfer_side, nixl_prepped_dlist_handle)
        if local._remote is not None:
            raise nixlInvalidParamError("the local side is a remote agent's list")
        if remote._remote is None:
            raise nixlInvalidParamError("the remote side is a local list")
        self._current(remote._remote)
        lefts = _indices(local_indices, "local_indices")
        rights = _indices(remote_indices, "remote_indices")
        if len(lefts) != len(rights):
            raise nixlInvalidParamError(
                f"{len(lefts)} local indices but {len(rights)} remote indices")
        if len(lefts) == 0:
            raise nixlInvalidParamError("no descriptors to transfer")
        notify = _message(notif_msg)
        try:
            native = self._engine.prepare_transfer(op, local._native, lefts, remote._native,
                                                   rights, notify=notify or None,
                                                   merge=not skip_desc_merge)
        except ValueError as err:
            raise nixlInvalidParamError(str(err)) from None
        return nixl_xfer_handle(native, remote._remote)

    def initialize_xfer(self, operation: str, local_descs: Any, remote_descs: Any,
                        remote_agent: Any, notif_msg: Any = b"",
                        backends: Iterable[str] = ()) -> nixl_xfer_handle:
        self._op(operation)
        local = self.prep_xfer_dlist(NIXL_INIT_AGENT, local_descs)
        remote = self.prep_xfer_dlist(remote_agent, remote_descs)
        count = local._count
        if count != remote._count:
            raise nixlInvalidParamError(
                f"{count} local descriptors but {remote._count} remote ones")
        indices = np.arange(count, dtype=np.int64)
        # NIXL merges the descriptors of prepared lists only.
        handle = self.make_prepped_xfer(operation, local, indices, remote, indices, notif_msg,
                                        skip_desc_merge=True)
        handle._owned = (local, remote)
        return handle

    # --- posting and polling ------------------------------------------------------------

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Any = b"") -> str:
        handle = self._usable(handle, nixl_xfer_handle)
        self._current(handle._remote)
        notify = _message(notif_msg)
        with self._lock:
            if handle._batch is not None and handle._batch.poll() == "PROC":
                raise nixlRepostActiveError("the handle's previous post is still in progress")
            started = time.perf_counter_ns()
            handle._started = _micros()
            handle._done_at = None
            try:
                handle._batch = handle._native.post(notify=notify or None,
                                                    timeout_s=self._timeout_s)
            except ValueError as err:
                raise nixlInvalidParamError(str(err)) from None
            except TransferError as err:
                handle._batch = None
                if getattr(err, "kind", None) == "stale_list":
                    raise nixlNotFoundError(
                        f"the prepared lists are stale ({err}): prepare them again") from None
                logger.warning("transfer to %s could not be posted: %s", handle._remote.name, err)
                self._lose(handle._remote)
                handle._post_us = (time.perf_counter_ns() - started) // 1000
                return "ERR"
            handle._post_us = max(1, (time.perf_counter_ns() - started) // 1000)
        return self._state(handle)

    def _state(self, handle: nixl_xfer_handle) -> str:
        batch = handle._batch
        if batch is None:
            return "ERR"
        state = batch.poll()
        if state == "DONE" and handle._done_at is None:
            handle._done_at = _micros()
        elif state == "ERR" and batch.peer_lost():
            self._lose(handle._remote)
        return state

    def _lose(self, remote: _Remote) -> None:
        """NIXL drops a peer after a disconnect: it must be added again."""
        with self._lock:
            if self._remotes.get(remote.name) is remote:
                del self._remotes[remote.name]
            remote.valid = False

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        handle = self._usable(handle, nixl_xfer_handle)
        if handle._batch is None and handle._started == 0:
            raise nixlNotPostedError("the transfer was never posted")
        return self._state(handle)

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        handle = self._usable(handle, nixl_xfer_handle)
        if not self._telemetry:
            raise nixlNoTelemetryError(
                "telemetry is off: nixl_agent_config(capture_telemetry=True) or "
                "NIXL_TELEMETRY_ENABLE=y")
        if handle._started == 0:
            raise nixlNotPostedError("the transfer was never posted")
        state = self._state(handle)
        batch = handle._batch
        if state == "ERR" or batch is None:
            reason = batch.failure() if batch is not None else None
            raise nixlBackendError(f"the transfer failed: {reason[1] if reason else 'not posted'}")
        end = handle._done_at if handle._done_at is not None else _micros()
        return nixlXferTelemetry(
            startTime=handle._started, postDuration=handle._post_us,
            xferDuration=max(handle._post_us, end - handle._started),
            totalBytes=batch.bytes, descCount=batch.runs)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        if not isinstance(handle, nixl_xfer_handle):
            raise nixlInvalidParamError(f"expected a nixl_xfer_handle, not {type_name(handle)}")
        if handle._released:
            return
        if handle._batch is not None and handle._batch.wait(RELEASE_WAIT_S) == "PROC":
            raise nixlRepostActiveError(
                "the transfer is still in progress and railyard cannot cancel it: release it "
                "once check_xfer_state no longer answers \"PROC\" (by its deadline)")
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        if not isinstance(handle, nixl_prepped_dlist_handle):
            raise nixlInvalidParamError(
                f"expected a nixl_prepped_dlist_handle, not {type_name(handle)}")
        handle.release()

    def estimate_xfer_cost(self, handle: nixl_xfer_handle) -> tuple[int, int, str]:
        self._usable(handle, nixl_xfer_handle)
        return (0, 0, "UNKNOWN")

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        self._usable(handle, nixl_xfer_handle)
        return next(iter(self.backends), "RAILYARD")

    # --- notifications ------------------------------------------------------------------

    def send_notif(self, remote_agent_name: Any, notif_msg: Any,
                   backend: Optional[str] = None) -> None:
        remote = self._remote(remote_agent_name)
        message = _message(notif_msg)
        if len(message) > MAX_NOTIFY:
            raise nixlInvalidParamError(
                f"a notification of {len(message)} bytes; railyard carries at most {MAX_NOTIFY}")
        self._fresh(remote)
        try:
            self._engine.notify(remote.session, message)
        except (TransferError, ValueError) as err:
            raise nixlBackendError(f"notification to {remote.name} failed: {err}") from None

    def _pump(self) -> None:
        """Takes the engine's notifications now, unless the listen thread does (one drainer
        keeps each sender's messages in order)."""
        if self._listener is not None:
            return
        with self._drain:
            self._apply(self._engine.get_notifs())

    def _apply(self, received: dict[str, list[bytes]]) -> None:
        """Applies metadata messages and keeps the rest for ``get_new_notifs``, in order."""
        for sender, messages in received.items():
            for message in messages:
                if message.startswith(_MD_LOAD):
                    try:
                        self.add_remote_agent(message[len(_MD_LOAD):])
                    except Exception as err:  # a bad message from a peer is logged, not raised
                        logger.warning("metadata from %s not loaded: %s", sender, err)
                elif message.startswith(_MD_INVALIDATE):
                    # Only an agent itself takes its metadata back.
                    if message[len(_MD_INVALIDATE):] == sender.encode():
                        self.remove_remote_agent(sender)
                    else:
                        logger.warning("%s tried to invalidate another agent", sender)
                else:
                    with self._lock:
                        self._pending.setdefault(sender, []).append(message)

    def get_new_notifs(self, backends: Iterable[str] = ()) -> dict[str, list[bytes]]:
        self._pump()
        with self._lock:
            taken, self._pending = self._pending, {}
        return taken

    def update_notifs(self, backends: Iterable[str] = ()) -> dict[str, list[bytes]]:
        for sender, messages in self.get_new_notifs().items():
            self.notifs.setdefault(sender, []).extend(messages)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: Any, lookup_tag: bytes,
                               backends: Iterable[str] = (), tag_is_prefix: bool = True) -> bool:
        name = _name(remote_agent_name)
        self.update_notifs()
        messages = self.notifs.get(name, [])
        for i, message in enumerate(messages):
            if message.startswith(lookup_tag) if tag_is_prefix else lookup_tag in message:
                del messages[i]
                return True
        return False


#: How long the listen thread waits for notifications at a time (and so how soon it sees
#: that it should stop).
LISTEN_WAIT_S = 0.1

#: Listen threads that run, with the event that stops each. They are stopped and joined at
#: exit, so that none is inside the engine when the interpreter finalizes: a daemon thread
#: that comes back into Python then is ended mid-call, which aborts the process.
_LISTENERS: set[tuple[threading.Event, threading.Thread]] = set()
_LISTENERS_LOCK = threading.Lock()


def _stop_listeners() -> None:
    with _LISTENERS_LOCK:
        running = list(_LISTENERS)
        _LISTENERS.clear()
    for closed, _ in running:
        closed.set()
    for _, thread in running:
        thread.join(timeout=LISTEN_WAIT_S * 10)


atexit.register(_stop_listeners)


def _listen(agent_ref: "weakref.ref[nixl_agent]", closed: threading.Event) -> None:
    """The agent's listen thread: applies metadata messages as they come, as NIXL's does."""
    try:
        while not closed.is_set():
            agent = agent_ref()
            if agent is None:
                return
            try:
                received = agent._engine.wait_notifs(LISTEN_WAIT_S)
                with agent._drain:
                    agent._apply(received)
            except RuntimeError:  # the engine was closed
                return
            except Exception as err:
                logger.warning("the NIXL listen thread of %s: %s", agent.name, err)
            del agent
    finally:
        with _LISTENERS_LOCK:
            _LISTENERS.discard((closed, threading.current_thread()))