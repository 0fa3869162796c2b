"""A storage backend for SGLang's HiCache (its L3 tier) on railyard's KV-cache store.

SGLang loads it without a patch, as a dynamic backend::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "railyard",
            "module_path": "railyard.compat.sglang", "class_name": "RailyardHiCacheStorage",
            "interface_v1": 1, "master_server_address": "10.0.0.1:7500",
            "global_segment_size": "4gb"}'

``interface_v1: 1`` makes SGLang call the zero-copy ``batch_get_v1``/``batch_set_v1``
against the host pool's page buffers (as its built-in Mooncake backend does); use a
``page_first`` (the default) or ``page_first_direct`` host layout (MLA models also
``layer_first``). Without it SGLang calls ``batch_set(keys, pages)`` and
``batch_get(keys, pages)`` with flat page tensors, which this backend copies through the
store's bounce buffer.

The backend speaks to the store through
:class:`railyard.compat.mooncake_store.MooncakeDistributedStore`, with the same calls as
SGLang's Mooncake backend: a warm-up ``put``/``is_exist``/``get`` of a 4 KiB key,
``register_buffer`` for each host-pool buffer, ``batch_is_exist`` then ``batch_put_from``
of only the missing keys, ``batch_get_into``, and ``remove_all`` on ``clear``. Keys are
SGLang's: ``{page_hash}_{tp_rank}_k`` and ``_v`` for MHA models (``{page_hash}_{tp_rank}_
{pp_rank}_k`` with pipeline parallelism), ``{page_hash}__k`` for MLA models
(``{page_hash}_{pp_rank}_k``), after the prefix SGLang's Mooncake backend puts first —
``extra_backend_tag`` and the model name (``/`` as ``-``) joined by ``_``, then ``_`` — so
two models sharing a store never read each other's pages. Copied pages (without
``interface_v1``) of MHA models are one key each, ``…_kv``. Decode context parallelism
(``dcp_size`` > 1) and split heads are refused at construction.

Configuration (``extra_config``, else the environment)
    * ``master_server_address`` (``RAILYARD_STORE_MASTER``, ``MOONCAKE_MASTER``): the
      master, ``host:port`` or ``etcd://…``. Required.
    * ``local_hostname`` (the environment's ``MOONCAKE_LOCAL_HOSTNAME`` or
      ``LOCAL_HOSTNAME`` first, so one ``extra_config`` serves every node): this rank's
      host as peers reach it (default: the kernel's host name; a free port is added).
    * ``global_segment_size`` (``MOONCAKE_GLOBAL_SEGMENT_SIZE``, default ``"4gb"``): memory
      this server contributes, split evenly between its TP × PP ranks.
    * ``protocol`` (``MOONCAKE_PROTOCOL``, default ``"tcp"``), ``replica_num`` (default 1;
      more are written best effort), ``extra_backend_tag``.
    * ``get_stats()`` reports pages and bandwidth (as SGLang's ``StorageMetrics``) when
      ``enable_storage_metrics`` is on; nothing is recorded otherwise.

Importing this module imports neither SGLang nor torch: ``RailyardHiCacheStorage`` is
built on first access, as a subclass of SGLang's ``HiCacheStorage`` when SGLang is
importable (the factory checks ``issubclass``), else as the plain backend.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import socket
import time
import uuid
from types import SimpleNamespace
from typing import Any

from .mooncake_store import MooncakeDistributedStore, ReplicateConfig, parse_size

__all__ = ["HiCacheBackend", "RailyardHiCacheStorage"]

logger = logging.getLogger(__name__)

# SGLang's Mooncake backend's local buffer (SGLANG_MOONCAKE_LOCAL_BUFFER_SIZE).
_LOCAL_BUFFER_SIZE = 16 << 20
_WARMUP_TRIES = 10
_WARMUP_PAUSE_S = 1.0


def _setting(extra: dict, key: str, env: tuple[str, ...], default: Any = None) -> Any:
    """``extra_config[key]``, else the first variable of ``env`` that is set."""
    value = extra.get(key)
    if value not in (None, ""):
        return value
    return _from_env(env, default)


def _from_env(env: tuple[str, ...], default: Any = None) -> Any:
    for name in env:
        if os.environ.get(name):
            return os.environ[name]
    return default


class HiCacheBackend:
    """SGLang's ``HiCacheStorage`` interface on railyard's store (see the module docs).

    ``HiCacheBackend(storage_config, kwargs)`` is how SGLang's factory builds a dynamic
    backend; the host pool comes later through :meth:`register_mem_pool_host`.
    """

    def __init__(self, storage_config: Any = None, kwargs: Any = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        self.tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
        self.pp_rank = int(getattr(storage_config, "pp_rank", 0) or 0)
        self.pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        self.is_mla_model = bool(getattr(storage_config, "is_mla_model", False))
        self.zero_copy = bool(extra.get("interface_v1", 0))  # as SGLang reads it
        self.metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        if int(getattr(storage_config, "dcp_size", 1) or 1) > 1:
            raise NotImplementedError("railyard HiCache backend: dcp_size > 1 is not supported")
        if getattr(storage_config, "should_split_heads", False):
            raise NotImplementedError("railyard HiCache backend: split heads are not supported")
        master = _setting(
            extra, "master_server_address", ("RAILYARD_STORE_MASTER", "MOONCAKE_MASTER")
        )
        if not master:
            raise ValueError(
                "railyard HiCache backend: no master (extra_config master_server_address, or "
                "RAILYARD_STORE_MASTER)"
            )
        hostname = _from_env(("MOONCAKE_LOCAL_HOSTNAME", "LOCAL_HOSTNAME")) or extra.get(
            "local_hostname"
        ) or socket.gethostname()
        segment = _setting(
            extra, "global_segment_size", ("MOONCAKE_GLOBAL_SEGMENT_SIZE",), "4gb"
        )
        protocol = _setting(extra, "protocol", ("MOONCAKE_PROTOCOL",), "tcp")
        per_rank = parse_size(segment) // max(1, self.tp_size * self.pp_size)
        self.replica_num = int(extra.get("replica_num", 1))
        parts = []
        if extra.get("extra_backend_tag") is not None:
            parts.append(str(extra["extra_backend_tag"]))
        model = getattr(storage_config, "model_name", None)
        if model:
            parts.append("-".join(str(model).split("/")))
        self.key_prefix = "_".join(parts) + "_" if parts else ""
        self.store = MooncakeDistributedStore()
        ret = self.store.setup(
            str(hostname),
            "P2PHANDSHAKE",
            per_rank,
            _LOCAL_BUFFER_SIZE,
            str(protocol),
            "",
            str(master),
        )
        if ret != 0:
            raise RuntimeError(f"railyard HiCache backend: store setup failed ({ret})")
        if self.pp_size > 1:
            self.mha_suffix = f"{self.tp_rank}_{self.pp_rank}"
            self.mla_suffix = f"{self.pp_rank}"
        else:
            self.mha_suffix = f"{self.tp_rank}"
            self.mla_suffix = ""
        self.mem_pool_host: Any = None
        self._registered: list[int] = []
        self._stats = _empty_stats()
        self.warmup()

    # -- set-up ---------------------------------------------------------------------------

    def warmup(self) -> None:
        """A 4 KiB put, exist and get, as SGLang's Mooncake backend does at start."""
        key = "sglang_railyard_store_warmup_key" + uuid.uuid4().hex
        value = bytes(4 * 1024)
        for _ in range(_WARMUP_TRIES):
            if self.store.put(key, value) == 0:
                break
            time.sleep(_WARMUP_PAUSE_S)
        else:
            raise RuntimeError("railyard HiCache backend: the warm-up put failed")
        if self.store.is_exist(key) != 1 or self.store.get(key) != value:
            raise RuntimeError("railyard HiCache backend: the warm-up key did not read back")
        self.store.remove(key, True)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Registers the host pool's buffers with the store (zero-copy puts and gets)."""
        self.mem_pool_host = mem_pool_host
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            return
        buffers = (
            mem_pool_host.get_hybrid_pool_buffer()
            if hasattr(mem_pool_host, "get_hybrid_pool_buffer")
            else [mem_pool_host.kv_buffer]
        )
        for tensor in buffers:
            size = tensor.numel() * tensor.element_size()
            if size == 0:
                continue
            ret = self.store.register_buffer(tensor.data_ptr(), size)
            if ret != 0:
                raise RuntimeError(f"railyard HiCache backend: register_buffer failed ({ret})")
            self._registered.append(tensor.data_ptr())

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Hybrid models' extra pools: their buffers are registered too."""
        if getattr(host_pool, "kv_buffer", None) is not None and host_pool is not self.mem_pool_host:
            tensor = host_pool.kv_buffer
            ret = self.store.register_buffer(
                tensor.data_ptr(), tensor.numel() * tensor.element_size()
            )
            if ret == 0:
                self._registered.append(tensor.data_ptr())

    def on_host_pools_registered(self) -> None:
        """Called by SGLang once every pool is registered: nothing more to do."""

    # -- keys -----------------------------------------------------------------------------

    def _page_keys(self, keys: list[str], *, flat: bool) -> tuple[list[str], int]:
        """The store keys of each page, page by page, and how many one page has: K and V
        apart for the zero-copy interface, one flat page for the copying one (``flat``)."""
        if self.is_mla_model:
            return [f"{self.key_prefix}{key}_{self.mla_suffix}_k" for key in keys], 1
        if flat:
            return [f"{self.key_prefix}{key}_{self.mha_suffix}_kv" for key in keys], 1
        out = []
        for key in keys:
            out.append(f"{self.key_prefix}{key}_{self.mha_suffix}_k")
            out.append(f"{self.key_prefix}{key}_{self.mha_suffix}_v")
        return out, 2

    def _buffers(self, keys: list[str], host_indices: Any) -> tuple[list[str], list, list, int]:
        """Store keys, their buffers and sizes (one list each per key when the layout has
        several buffers per key), and keys per page."""
        if self.mem_pool_host is None:
            raise RuntimeError("railyard HiCache backend: register_mem_pool_host first")
        page_size = int(getattr(self.mem_pool_host, "page_size", 1) or 1)
        if len(host_indices) != len(keys) * page_size:
            raise ValueError(
                f"{len(keys)} pages but {len(host_indices)} host indices (page size {page_size})"
            )
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        store_keys, per_page = self._page_keys(keys, flat=False)
        ptrs, sizes = list(ptrs), list(sizes)
        if len(ptrs) == len(store_keys):
            return store_keys, ptrs, sizes, per_page
        if len(ptrs) % len(store_keys):
            raise RuntimeError(
                f"the host pool gave {len(ptrs)} buffers for {len(store_keys)} keys"
            )
        if not self.is_mla_model:
            raise RuntimeError(
                "a layer_first MHA host layout is not supported: use page_first "
                "(--hicache-mem-layout page_first)"
            )
        # MLA layer_first: each key's buffers are one per layer, scatter-gather.
        step = len(ptrs) // len(store_keys)
        grouped_ptrs = [ptrs[i * step : (i + 1) * step] for i in range(len(store_keys))]
        grouped_sizes = [sizes[i * step : (i + 1) * step] for i in range(len(store_keys))]
        return store_keys, grouped_ptrs, grouped_sizes, per_page

    @staticmethod
    def _per_page(results: list[int], per_page: int, expected: list[int] | None) -> list[bool]:
        """One bool per page: every key of it written (``0``), or read whole (``expected``
        bytes each)."""
        if expected is None:
            ok = [r == 0 for r in results]
        else:
            ok = [r == want for r, want in zip(results, expected)]
        return [all(ok[i : i + per_page]) for i in range(0, len(ok), per_page)]

    def _record(self, kind: str, pages: int, nbytes: int, started: float) -> None:
        if not self.metrics:
            return
        elapsed = max(time.monotonic() - started, 1e-9)
        self._stats[f"{kind}_pgs"].append(pages)
        self._stats[f"{kind}_bandwidth"].append(nbytes / elapsed / (1 << 30))

    def _config(self) -> ReplicateConfig | None:
        if self.replica_num <= 1:
            return None
        config = ReplicateConfig()
        config.replica_num = self.replica_num
        config.best_effort = True
        return config

    # -- zero-copy (interface_v1) ---------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Reads each page into the host pool: one bool per page."""
        if getattr(self.mem_pool_host, "kv_buffer", True) is None:
            return [True] * len(keys)
        if not keys:
            return []
        started = time.monotonic()
        store_keys, ptrs, sizes, per_page = self._buffers(keys, host_indices)
        if ptrs and isinstance(ptrs[0], list):
            results = self.store.batch_get_into_multi_buffers(store_keys, ptrs, sizes)
            expected = [sum(each) for each in sizes]
        else:
            results = self.store.batch_get_into(store_keys, ptrs, sizes)
            expected = list(sizes)
        pages = self._per_page(results, per_page, expected)
        self._record("prefetch", sum(pages), sum(expected), started)
        return pages

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Writes each page the store does not hold yet: one bool per page."""
        if getattr(self.mem_pool_host, "kv_buffer", True) is None:
            return [True] * len(keys)
        if not keys:
            return []
        started = time.monotonic()
        store_keys, ptrs, sizes, per_page = self._buffers(keys, host_indices)
        exists = self.store.batch_is_exist(store_keys)
        missing = [i for i, found in enumerate(exists) if found != 1]
        results = [0] * len(store_keys)
        if missing:
            put_keys = [store_keys[i] for i in missing]
            put_ptrs = [ptrs[i] for i in missing]
            put_sizes = [sizes[i] for i in missing]
            if isinstance(put_ptrs[0], list):
                written = self.store.batch_put_from_multi_buffers(
                    put_keys, put_ptrs, put_sizes, self._config()
                )
            else:
                written = self.store.batch_put_from(put_keys, put_ptrs, put_sizes, self._config())
            for index, code in zip(missing, written):
                results[index] = code
            nbytes = sum(sum(s) if isinstance(s, list) else s for s in put_sizes)
            self._record("backup", len(missing) // per_page, nbytes, started)
        return self._per_page(results, per_page, None)

    # -- existence ------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether the store holds ``key`` (a store key, as given)."""
        return self.store.is_exist(key) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many pages from the first one the store holds (every key of a page)."""
        if not keys:
            return 0
        store_keys, per_page = self._page_keys(list(keys), flat=not self.zero_copy)
        found = self.store.batch_is_exist(store_keys)
        for index, present in enumerate(found):
            if present != 1:
                return index // per_page
        return len(keys)

    # -- generic (copying) interface -------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """``key``'s value (a store key, as given): into ``target_location`` (a contiguous
        CPU tensor or buffer) which is returned, or as bytes; ``None`` on a miss."""
        value = self.store.get(key)
        if not value:
            return None
        if target_location is None:
            return value
        return target_location if _copy_into(target_location, value) else None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        """SGLang's copying read: each page's flat tensor filled from the store (the same
        object), ``None`` for a page it does not hold whole."""
        if not keys:
            return []
        store_keys, _ = self._page_keys(list(keys), flat=True)
        started = time.monotonic()
        values = self.store.get_batch(store_keys)
        out = []
        for index, value in enumerate(values):
            target = target_locations[index] if target_locations is not None else None
            if not value:
                out.append(None)
            elif target is None:
                out.append(value)
            else:
                out.append(target if _copy_into(target, value) else None)
        hits = sum(1 for page in out if page is not None)
        self._record("prefetch", hits, sum(len(v) for v in values), started)
        return out

    def set(
        self,
        key: str,
        value: Any = None,
        target_location: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Stores ``value`` (a contiguous CPU tensor or bytes-like) under ``key`` (a store key,
        as given), or ``target_sizes`` bytes at the registered address ``target_location``;
        a key already held counts as stored."""
        if self.exists(key):
            return True
        if target_location is not None:
            code = self.store.put_from(key, int(target_location), int(target_sizes), self._config())
            return code == 0
        if value is None:
            return False
        return self.store.put(key, _bytes(value), self._config()) == 0

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """SGLang's copying write: each page's flat tensor stored under its page key, pages
        the store holds already skipped; whether every page is stored."""
        if not keys or values is None or len(values) != len(keys):
            return False
        store_keys, _ = self._page_keys(list(keys), flat=True)
        started = time.monotonic()
        found = self.store.batch_is_exist(store_keys)
        missing = [i for i, present in enumerate(found) if present != 1]
        if not missing:
            return True
        data = [_bytes(values[i]) for i in missing]
        code = self.store.put_batch([store_keys[i] for i in missing], data, self._config())
        self._record("backup", len(missing), sum(len(d) for d in data), started)
        return code == 0

    # -- housekeeping ---------------------------------------------------------------------

    def clear(self) -> None:
        """Removes this deployment's pages (those under its key prefix; every object when
        it has none) that no reader holds a lease on, as SGLang's Mooncake backend does on
        ``flush_cache``."""
        if self.key_prefix:
            removed = self.store.remove_by_regex("^" + re.escape(self.key_prefix))
        else:
            removed = self.store.remove_all()
        logger.info("railyard HiCache backend: cleared %s objects", removed)

    def get_stats(self) -> Any:
        """Pages read and written, and their bandwidth in GiB/s, since the last call:
        SGLang's ``StorageMetrics`` (an object with the same four lists without SGLang)."""
        stats, self._stats = self._stats, _empty_stats()
        metrics = _storage_metrics()
        for name, values in stats.items():
            getattr(metrics, name).extend(values)
        return metrics

    def close(self) -> None:
        """Unregisters the host pool's buffers and closes the store."""
        for ptr in self._registered:
            self.store.unregister_buffer(ptr)
        self._registered.clear()
        self.store.close()


def _empty_stats() -> dict[str, list]:
    return {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}


def _storage_metrics() -> Any:
    """A fresh SGLang ``StorageMetrics`` (its module moved between releases), or an object
    with the same four lists when SGLang is not importable."""
    for module in ("sglang.srt.observability.metrics_collector", "sglang.srt.metrics.collector"):
        try:
            return __import__(module, fromlist=["StorageMetrics"]).StorageMetrics()
        except (ImportError, AttributeError):
            continue
    return SimpleNamespace(**_empty_stats())


def _tensor_span(value: Any) -> tuple[int, int]:
    """``(address, bytes)`` of a contiguous CPU tensor (any dtype, bf16 too)."""
    if hasattr(value, "is_contiguous") and not value.is_contiguous():
        raise ValueError("the page tensor is not contiguous")
    if getattr(getattr(value, "device", None), "type", "cpu") != "cpu":
        raise ValueError("the page tensor is not in host memory")
    return value.data_ptr(), value.numel() * value.element_size()


def _bytes(value: Any) -> bytes:
    """A page's bytes: a tensor's (without importing torch), or a buffer's."""
    if hasattr(value, "data_ptr") and hasattr(value, "element_size"):
        address, length = _tensor_span(value)
        return ctypes.string_at(address, length)
    return memoryview(value).tobytes()


def _copy_into(target: Any, value: bytes) -> bool:
    """Copies ``value`` into ``target`` (a tensor or a writable buffer) when it has
    exactly that many bytes."""
    if hasattr(target, "data_ptr") and hasattr(target, "element_size"):
        address, length = _tensor_span(target)
        if length != len(value):
            return False
        ctypes.memmove(address, value, length)
        return True
    view = memoryview(target).cast("B")
    if view.nbytes != len(value):
        return False
    view[:] = value
    return True


def _subclass_of_hicache_storage() -> type:
    """``RailyardHiCacheStorage``: :class:`HiCacheBackend` as a subclass of SGLang's
    ``HiCacheStorage`` (what SGLang's factory checks), or the plain backend without
    SGLang."""
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # type: ignore
    except ImportError:
        return HiCacheBackend
    return type(
        "RailyardHiCacheStorage",
        (HiCacheBackend, HiCacheStorage),
        {"__module__": __name__, "__doc__": HiCacheBackend.__doc__},
    )


def __getattr__(name: str) -> Any:
    if name == "RailyardHiCacheStorage":
        cls = _subclass_of_hicache_storage()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
