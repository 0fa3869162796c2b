"""railyard.compat.sglang driven as SGLang's HiCache drives a dynamic storage backend: built
by the factory's call, given a host pool (a stand-in with SGLang's get_page_buffer_meta),
then pages written, counted, read and cleared — against a master and segment servers."""

from __future__ import annotations

import abc
import hashlib
import importlib
import subprocess
import sys
import time
import types
from types import SimpleNamespace

import numpy as np
import pytest

from railyard.compat.mooncake_store import MooncakeDistributedStore

PAGE = 4  # tokens per page
LAYERS = 2
HEAD_BYTES = 64  # heads x head dim x item size, per token and layer


class Tensor:
    """What a backend uses of a torch tensor: data_ptr, numel, element_size."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def numel(self) -> int:
        return self.array.size

    def element_size(self) -> int:
        return self.array.itemsize


class MHAPool:
    """SGLang's MHA host pool, page_first layout: kv_buffer (2, size, layers, head bytes);
    a page's K is one contiguous block, its V another."""

    def __init__(self, pages: int) -> None:
        self.page_size = PAGE
        self.size = pages * PAGE
        self.layout = "page_first"
        self.buffer = np.zeros((2, self.size, LAYERS, HEAD_BYTES), dtype=np.uint8)
        self.kv_buffer = Tensor(self.buffer)

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        indices = list(indices)
        assert len(indices) % self.page_size == 0
        base = self.buffer.ctypes.data
        token = LAYERS * HEAD_BYTES
        v_offset = self.size * token
        ptrs, sizes = [], []
        for first in indices[:: self.page_size]:
            k = base + first * token
            ptrs += [k, k + v_offset]
            sizes += [token * self.page_size] * 2
        return ptrs, sizes

    def page(self, first_slot: int) -> np.ndarray:
        return self.buffer[:, first_slot : first_slot + PAGE]


class MLAPool(MHAPool):
    """SGLang's MLA host pool, page_first: one latent block per page, no V."""

    def __init__(self, pages: int) -> None:
        super().__init__(pages)
        self.buffer = np.zeros((self.size, LAYERS, HEAD_BYTES), dtype=np.uint8)
        self.kv_buffer = Tensor(self.buffer)

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        indices = list(indices)
        token = LAYERS * HEAD_BYTES
        base = self.buffer.ctypes.data
        firsts = indices[:: self.page_size]
        return [base + f * token for f in firsts], [token * self.page_size] * len(firsts)

    def page(self, first_slot: int) -> np.ndarray:
        return self.buffer[first_slot : first_slot + PAGE]


def page_hashes(count: int, seed: str) -> list[str]:
    hashes, last = [], seed
    for i in range(count):
        last = hashlib.sha256(f"{last}/{i}".encode()).hexdigest()
        hashes.append(last)
    return hashes


def storage_config(
    cluster, *, mla: bool = False, tp_rank: int = 0, model: str = "org/stand-in", **extra
):
    return SimpleNamespace(
        tp_rank=tp_rank,
        tp_size=2,
        pp_rank=0,
        pp_size=1,
        is_mla_model=mla,
        model_name=model,
        enable_storage_metrics=True,
        extra_config={
            "backend_name": "railyard",
            "module_path": "railyard.compat.sglang",
            "class_name": "RailyardHiCacheStorage",
            "interface_v1": 1,
            "master_server_address": cluster.addr,
            "global_segment_size": "32mb",
            "protocol": "tcp",
            **extra,
        },
    )


def create_backend(config):
    """What SGLang's StorageBackendFactory does for a dynamic backend."""
    extra = config.extra_config
    module = importlib.import_module(extra["module_path"])
    backend_class = getattr(module, extra["class_name"])
    hicache = sys.modules.get("sglang.srt.mem_cache.hicache_storage")
    if hicache is not None:
        assert issubclass(backend_class, hicache.HiCacheStorage)
    return backend_class(config, {})


def slots(first_page: int, pages: int) -> np.ndarray:
    return np.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=np.int64)


def test_pages_written_counted_read_and_cleared_as_sglang_keys_them(store_cluster):
    backend = create_backend(storage_config(store_cluster, tp_rank=1))
    pool = MHAPool(pages=16)
    backend.register_mem_pool_host(pool)
    keys = page_hashes(6, "prompt-a")
    rng = np.random.default_rng(5)
    pool.buffer[:, : 6 * PAGE] = rng.integers(0, 255, pool.buffer[:, : 6 * PAGE].shape)
    written = pool.buffer[:, : 6 * PAGE].copy()
    assert backend.batch_set_v1(keys, slots(0, 6)) == [True] * 6

    # SGLang's keys (after its model prefix), readable by any Mooncake-API client.
    other = MooncakeDistributedStore()
    assert other.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", store_cluster.addr) == 0
    tagged = f"org-stand-in_{keys[0]}"
    assert other.batch_is_exist([f"{tagged}_1_k", f"{tagged}_1_v", f"{tagged}_0_k"]) == [1, 1, 0]
    assert other.get(f"org-stand-in_{keys[2]}_1_v") == pool.page(2 * PAGE)[1].tobytes()

    # Leading hits only: a missing page in the middle stops the count.
    assert backend.batch_exists(keys) == 6
    assert backend.batch_exists(keys[:3] + ["not-stored"] + keys[3:]) == 3
    assert backend.batch_exists([]) == 0
    assert backend.exists(f"{tagged}_1_k") and not backend.exists(keys[0])

    # Read back into other pages of the pool.
    pool.buffer[:, 6 * PAGE :] = 0
    assert backend.batch_get_v1(keys, slots(8, 6)) == [True] * 6
    assert np.array_equal(pool.buffer[:, 8 * PAGE : 14 * PAGE], written)
    assert backend.batch_get_v1(["never-stored"] + keys[:1], slots(14, 2)) == [False, True]

    # Written again: already held, nothing put, still a success.
    assert backend.batch_set_v1(keys[:2], slots(0, 2)) == [True, True]
    stats = backend.get_stats()
    assert stats.prefetch_pgs == [6, 1] and stats.backup_pgs == [6]
    assert len(stats.prefetch_bandwidth) == 2 and all(bw > 0 for bw in stats.backup_bandwidth)
    assert backend.get_stats().prefetch_pgs == []

    # A page read back shorter than its buffer is a miss, never a partial page.
    short = f"org-stand-in_{keys[5]}_1_v"
    other.remove(short, True)
    assert other.put(short, b"x" * 16) == 0
    assert backend.batch_get_v1(keys[5:], slots(14, 1)) == [False]

    time.sleep(1.2)  # the reads' leases (1 s at this master) end: clear skips leased pages
    backend.clear()
    assert backend.batch_exists(keys) == 0
    other.close()
    backend.close()


def test_mla_keys_and_the_generic_interface(store_cluster):
    backend = create_backend(storage_config(store_cluster, mla=True))
    pool = MLAPool(pages=8)
    backend.register_mem_pool_host(pool)
    keys = page_hashes(3, "prompt-mla")
    pool.buffer[: 3 * PAGE] = 7
    assert backend.batch_set_v1(keys, slots(0, 3)) == [True] * 3
    assert backend.exists(f"org-stand-in_{keys[0]}__k")
    assert backend.batch_exists(keys) == 3
    assert backend.batch_get_v1(keys, slots(4, 3)) == [True] * 3
    assert (pool.buffer[4 * PAGE : 7 * PAGE] == 7).all()
    time.sleep(1.2)  # leases of the reads end
    backend.clear()
    backend.close()


class FlatPage(Tensor):
    """A page as SGLang's copying interface hands it over: a flat CPU tensor."""

    def is_contiguous(self) -> bool:
        return self.array.flags.c_contiguous


def test_the_copying_interface_as_sglang_calls_it_without_interface_v1(store_cluster):
    config = storage_config(store_cluster)
    del config.extra_config["interface_v1"]
    backend = create_backend(config)
    keys = page_hashes(3, "prompt-copy")
    pages = [FlatPage(np.full(512, i + 1, dtype=np.uint16)) for i in range(3)]
    assert backend.batch_set(keys, pages)
    assert backend.batch_exists(keys + ["absent"]) == 3
    assert backend.batch_set(keys[:1], pages[:1])  # held already: nothing to write
    dummies = [FlatPage(np.zeros(512, dtype=np.uint16)) for _ in range(4)]
    got = backend.batch_get(keys + ["absent"], dummies)
    assert got[:3] == dummies[:3] and got[3] is None
    assert all((d.array == i + 1).all() for i, d in enumerate(dummies[:3]))
    wrong_size = [FlatPage(np.zeros(10, dtype=np.uint16))]
    assert backend.batch_get(keys[:1], wrong_size) == [None]
    assert not backend.batch_set([])
    assert backend.set("raw-key", b"payload") and backend.get("raw-key") == b"payload"
    assert backend.get("absent") is None
    backend.clear()
    backend.close()


def test_two_models_on_one_store_never_read_each_others_pages(store_cluster):
    first = create_backend(storage_config(store_cluster, model="org/model-a"))
    second = create_backend(storage_config(store_cluster, model="org/model-b"))
    pools = [MHAPool(pages=4), MHAPool(pages=4)]
    first.register_mem_pool_host(pools[0])
    second.register_mem_pool_host(pools[1])
    keys = page_hashes(2, "same-prompt")  # the same tokens, so the same page hashes
    pools[0].buffer[:, : 2 * PAGE] = 1
    assert first.batch_set_v1(keys, slots(0, 2)) == [True, True]
    assert second.batch_exists(keys) == 0
    assert second.batch_get_v1(keys, slots(0, 2)) == [False, False]
    assert (pools[1].buffer == 0).all()
    first.clear()
    first.close()
    second.close()


def test_pages_stay_readable_while_a_segment_server_is_killed(store_cluster):
    extra = [store_cluster.add_server("32MiB"), store_cluster.add_server("32MiB")]
    try:
        backend = create_backend(storage_config(store_cluster, replica_num=2))
        pool = MHAPool(pages=8)
        backend.register_mem_pool_host(pool)
        keys = page_hashes(4, "prompt-kill")
        pool.buffer[:, : 4 * PAGE] = 3
        assert backend.batch_set_v1(keys, slots(0, 4)) == [True] * 4
        extra[0].kill()
        assert backend.batch_get_v1(keys, slots(4, 4)) == [True] * 4
        assert (pool.buffer[:, 4 * PAGE : 8 * PAGE] == 3).all()
        backend.clear()
        backend.close()
    finally:
        for server in extra:
            server.kill()
        store_cluster.servers = [s for s in store_cluster.servers if s not in extra]


def test_bad_configuration_is_named():
    with pytest.raises(ValueError, match="master"):
        create_backend(SimpleNamespace(tp_rank=0, tp_size=1, extra_config={"module_path": "railyard.compat.sglang", "class_name": "RailyardHiCacheStorage"}))


def test_the_backend_subclasses_sglangs_hicache_storage_when_sglang_is_there(monkeypatch):
    class HiCacheStorage(abc.ABC):
        """SGLang's five abstract methods."""

        @abc.abstractmethod
        def get(self, key, target_location=None, target_sizes=None): ...

        @abc.abstractmethod
        def batch_get(self, keys, target_locations=None, target_sizes=None): ...

        @abc.abstractmethod
        def set(self, key, value=None, target_location=None, target_sizes=None): ...

        @abc.abstractmethod
        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None): ...

        @abc.abstractmethod
        def exists(self, key): ...

    names = ["sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.hicache_storage"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].HiCacheStorage = HiCacheStorage
    module = importlib.import_module("railyard.compat.sglang")
    monkeypatch.delitem(module.__dict__, "RailyardHiCacheStorage", raising=False)
    backend_class = module.RailyardHiCacheStorage
    assert issubclass(backend_class, HiCacheStorage)
    assert issubclass(backend_class, module.HiCacheBackend)
    assert not getattr(backend_class, "__abstractmethods__", None)
    monkeypatch.delitem(module.__dict__, "RailyardHiCacheStorage", raising=False)


def test_importing_the_backend_imports_neither_sglang_nor_torch():
    code = (
        "import sys, railyard.compat.sglang as m\n"
        "assert 'sglang' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
        "assert m.RailyardHiCacheStorage is m.HiCacheBackend or 'sglang' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
