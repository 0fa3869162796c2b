"""Drop-in shims that expose railyard under other transfer engines' Python APIs.

- :mod:`railyard.compat.mooncake`: ``TransferEngine``, Mooncake's
  ``mooncake.engine.TransferEngine`` (as used by vLLM's and SGLang's connectors).
- :mod:`railyard.compat.mooncake_store`: ``MooncakeDistributedStore`` on railyard's store.
- :mod:`railyard.compat.sglang`: a storage backend for SGLang's HiCache.
- :mod:`railyard.compat.nixl`: NVIDIA NIXL's agent API (``nixl._api``/``nixl._bindings``,
  with :func:`railyard.compat.nixl.install` for code that imports ``nixl``), as vLLM's
  NixlConnector and SGLang's NIXL connector call it.
"""
