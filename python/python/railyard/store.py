"""railyard's KV-cache store from Python: :class:`Store` and :class:`ReplicateConfig`.

A store keeps objects (a ``str`` key and a value) as replicas in memory segments that
member processes contribute, placed by a master (``railyard master``) that holds only
metadata. Each :class:`Store` has its own engine: it may contribute a segment
(``segment_size``) and puts and gets values, zero-copy from and into buffers registered
with it::

    import numpy as np
    import railyard

    with railyard.Store("127.0.0.1:7500", segment_size=256 << 20) as store:
        store.put("greeting", b"hello")
        assert store.get("greeting") == b"hello"
        pages = np.zeros(1 << 20, dtype=np.uint8)
        store.register_buffer(pages)          # a buffer, or (address, size)
        store.put_from("page-0", pages)        # zero-copy, from registered memory
        n = store.get_into("page-0", pages)    # zero-copy, its size

Every data call releases the GIL. Single-key calls raise :class:`railyard.StoreError`
(:class:`railyard.ObjectNotFound` for a missing key) whose ``code`` is Mooncake Store's
code for the same failure; batch calls return one result per key, a ``StoreError``
instance in the place of a key that failed (never raised for one key). Bad arguments —
wrong types, negative sizes, a range outside every registered buffer — raise ``TypeError``
or ``ValueError`` before anything is sent.
"""

from __future__ import annotations

import ctypes
import numbers
import operator
import threading
from typing import Any

from . import _native

__all__ = ["ReplicateConfig", "Store"]


class ReplicateConfig:
    """How a value is written.

    * ``replica_num``: replicas, each on a different segment (and host when there are
      several).
    * ``best_effort``: with fewer segments able to take one, write as many replicas as fit
      (at least one); batch puts return how many were written.
    * ``with_soft_pin``: kept from eviction for 30 minutes while others are evicted first.
    * ``with_hard_pin``: never evicted (until removed).
    * ``preferred_segments``: segment names, or members' engine names (a Store's
      :attr:`Store.segment_name`), that get replicas first.
    """

    def __init__(
        self,
        replica_num: int = 1,
        *,
        best_effort: bool = False,
        with_soft_pin: bool = False,
        with_hard_pin: bool = False,
        preferred_segments: list[str] | None = None,
    ) -> None:
        self.replica_num = replica_num
        self.best_effort = best_effort
        self.with_soft_pin = with_soft_pin
        self.with_hard_pin = with_hard_pin
        if isinstance(preferred_segments, str):
            raise TypeError("preferred_segments is a list of names, not one str")
        self.preferred_segments = list(preferred_segments or [])

    def __repr__(self) -> str:
        return (
            f"ReplicateConfig(replica_num={self.replica_num}, best_effort={self.best_effort}, "
            f"with_soft_pin={self.with_soft_pin}, with_hard_pin={self.with_hard_pin}, "
            f"preferred_segments={self.preferred_segments})"
        )


def buffer_address(buffer: Any, size: int | None) -> tuple[int, int]:
    """``(address, size)`` of ``buffer``: an ``int`` address (with ``size``), a tensor
    (``data_ptr()``), or a C-contiguous object with the buffer protocol (``size`` defaults to
    its length in bytes and may only shorten it)."""
    if isinstance(buffer, bool):
        raise TypeError("a buffer must be an int address or a buffer, not bool")
    if isinstance(buffer, numbers.Integral):  # an int, or a NumPy integer
        if size is None:
            raise TypeError("an int address needs a size")
        return operator.index(buffer), size
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "element_size"):
        if hasattr(buffer, "is_contiguous") and not buffer.is_contiguous():
            raise ValueError("the tensor is not contiguous")
        whole = buffer.numel() * buffer.element_size()
        return buffer.data_ptr(), _within(whole, size)
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(
            f"a buffer must be an int address or support the buffer protocol, not "
            f"{type(buffer).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("the buffer is not C-contiguous")
    if view.readonly:
        # bytes and read-only views: never registered memory (registration takes writable
        # buffers only), and ctypes gives no address for them without a copy.
        raise ValueError(
            "the buffer is read-only: registered buffers are writable (put() copies bytes)"
        )
    whole = view.nbytes
    if whole == 0:
        raise ValueError("the buffer is empty")
    address = ctypes.addressof((ctypes.c_char * whole).from_buffer(view))
    return address, _within(whole, size)


def _pinned(buffer: Any) -> Any:
    """What keeps a registered buffer's memory where it is: a memoryview of it (a
    ``bytearray`` with one cannot be resized), or the tensor itself."""
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "element_size"):
        return buffer
    return memoryview(buffer)


def _addresses(buffers: Any, sizes: Any) -> tuple[list[int], list[int]]:
    """Each buffer (an address, or an object) and its size (``None``: the whole object)."""
    buffers = list(buffers)
    sizes = [None] * len(buffers) if sizes is None else list(sizes)
    if len(sizes) != len(buffers):
        raise ValueError(f"{len(buffers)} buffers and {len(sizes)} sizes")
    spans = [buffer_address(b, n) for b, n in zip(buffers, sizes)]
    return [address for address, _ in spans], [length for _, length in spans]


def _multi(all_buffers: Any, all_sizes: Any) -> tuple[list[list[int]], list[list[int]]]:
    all_buffers = list(all_buffers)
    all_sizes = [None] * len(all_buffers) if all_sizes is None else list(all_sizes)
    if len(all_sizes) != len(all_buffers):
        raise ValueError(f"{len(all_buffers)} buffer lists and {len(all_sizes)} size lists")
    spans = [_addresses(b, n) for b, n in zip(all_buffers, all_sizes)]
    return [a for a, _ in spans], [n for _, n in spans]


def _within(whole: int, size: int | None) -> int:
    if size is None:
        return whole
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise TypeError(f"size must be an int, not {type(size).__name__}")
    size = operator.index(size)
    if size < 0 or size > whole:
        raise ValueError(f"size {size} is outside the buffer's {whole} bytes")
    return size


class Store(_native.Store):
    """A client of railyard's KV-cache store (see the module docs and ``_native.pyi``).

    ``Store(master, **options)`` sets it up at once; ``Store()`` waits for
    :meth:`setup`. Buffers may be given as ``int`` addresses (with a size) or as objects
    with the buffer protocol (NumPy arrays, ``bytearray``, ``memoryview``) or tensors
    (``data_ptr()``); a buffer registered by object is kept alive until unregistered.
    """

    def __init__(self, master: str | None = None, **options: Any) -> None:
        super().__init__()
        self._held: dict[int, list[Any]] = {}
        self._held_lock = threading.Lock()
        if master is not None:
            self.setup(master, **options)

    def register_buffer(self, buffer: Any, size: int | None = None) -> None:  # type: ignore[override]
        """Registers ``buffer`` (an address with ``size``, or a buffer object) for the
        zero-copy calls. Registering the same range again counts."""
        address, length = buffer_address(buffer, size)
        super().register_buffer(address, length)
        if not isinstance(buffer, numbers.Integral):
            with self._held_lock:
                self._held.setdefault(address, []).append(_pinned(buffer))

    def unregister_buffer(self, buffer: Any) -> None:  # type: ignore[override]
        """Unregisters a buffer registered with :meth:`register_buffer` (its address or the
        object)."""
        if isinstance(buffer, numbers.Integral):
            address = operator.index(buffer)
        else:
            address = buffer_address(buffer, None)[0]
        super().unregister_buffer(address)
        with self._held_lock:
            held = self._held.get(address)
            if held:
                held.pop()
                if not held:
                    del self._held[address]

    def put_from(self, key: str, buffer: Any, size: int | None = None, config: Any = None) -> None:  # type: ignore[override]
        """Stores ``size`` bytes of a registered buffer (an address, or the object) under
        ``key``, zero-copy."""
        address, length = buffer_address(buffer, size)
        super().put_from(key, address, length, config)

    def upsert_from(self, key: str, buffer: Any, size: int | None = None, config: Any = None) -> None:  # type: ignore[override]
        """:meth:`put_from`, replacing a complete object of that key."""
        address, length = buffer_address(buffer, size)
        super().upsert_from(key, address, length, config)

    def get_into(self, key: str, buffer: Any, size: int | None = None) -> int:  # type: ignore[override]
        """Reads ``key``'s value into a registered buffer (an address with ``size``, or the
        object), zero-copy: its size."""
        address, length = buffer_address(buffer, size)
        return super().get_into(key, address, length)

    def batch_put_from(  # type: ignore[override]
        self, keys: Any, buffers: Any, sizes: Any = None, config: Any = None
    ) -> list[Any]:
        """``put_from`` of each key (buffers as addresses with ``sizes``, or objects): the
        replicas written, or the key's ``StoreError``."""
        addresses, lengths = _addresses(buffers, sizes)
        return super().batch_put_from(keys, addresses, lengths, config)

    def batch_get_into(self, keys: Any, buffers: Any, sizes: Any = None) -> list[Any]:  # type: ignore[override]
        """``get_into`` of each key: its size, or its ``StoreError``."""
        addresses, lengths = _addresses(buffers, sizes)
        return super().batch_get_into(keys, addresses, lengths)

    def batch_put_from_multi_buffers(  # type: ignore[override]
        self, keys: Any, all_buffers: Any, all_sizes: Any = None, config: Any = None
    ) -> list[Any]:
        """Each key's value from its buffers, in order (scatter-gather)."""
        spans = _multi(all_buffers, all_sizes)
        return super().batch_put_from_multi_buffers(keys, *spans, config)

    def batch_get_into_multi_buffers(  # type: ignore[override]
        self, keys: Any, all_buffers: Any, all_sizes: Any = None
    ) -> list[Any]:
        """Each key's value into its buffers, in order: its size, or its ``StoreError``."""
        return super().batch_get_into_multi_buffers(keys, *_multi(all_buffers, all_sizes))

    def close(self) -> None:  # type: ignore[override]
        """Takes the segment back, disconnects and stops the engine (idempotent)."""
        try:
            super().close()
        finally:
            with self._held_lock:
                self._held.clear()

    def __exit__(self, *exc: object) -> None:  # type: ignore[override]
        self.close()
