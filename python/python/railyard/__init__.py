"""railyard: a zero-copy transfer engine for disaggregated LLM inference.

Move bytes between registered host memory of two processes (on one host or across a
network) by raw address, the way KV-cache connectors do::

    import numpy as np
    import railyard

    with railyard.Engine("prefill-0") as engine:
        buf = np.zeros(1 << 20, dtype=np.uint8)
        engine.register(buf.ctypes.data, buf.nbytes)
        # remote_addr: an address the peer registered, learnt out of band
        engine.write(peer_session_id, [buf.ctypes.data], [remote_addr], [buf.nbytes])

:class:`Engine` is the native API; :class:`Store` is a client of railyard's KV-cache store
(see :mod:`railyard.store`). :mod:`railyard.compat.mooncake` offers ``TransferEngine`` and
:mod:`railyard.compat.mooncake_store` ``MooncakeDistributedStore`` with Mooncake's method
names and integer return codes; :mod:`railyard.compat.sglang` is a storage backend for
SGLang's HiCache; :mod:`railyard.compat.nixl` is NVIDIA NIXL's agent API (``nixl_agent``,
prepared descriptor lists), as vLLM's NixlConnector calls it. :meth:`Engine.prepare_local`,
:meth:`Engine.prepare_remote` and :meth:`Engine.prepare_transfer` are the prepared lists
underneath: ranges resolved once, posted by index.
"""

from ._native import (
    MAX_NOTIFY,
    METRICS_CONTENT_TYPE,
    Batch,
    Engine,
    ObjectNotFound,
    PreparedBatch,
    PreparedList,
    PreparedTransfer,
    StoreError,
    TransferError,
    __version__,
)
from .store import ReplicateConfig, Store

__all__ = [
    "MAX_NOTIFY",
    "METRICS_CONTENT_TYPE",
    "Batch",
    "Engine",
    "ObjectNotFound",
    "PreparedBatch",
    "PreparedList",
    "PreparedTransfer",
    "ReplicateConfig",
    "Store",
    "StoreError",
    "TransferError",
    "__version__",
]
