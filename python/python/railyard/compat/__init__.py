"""Drop-in shims that expose railyard under other transfer engines' Python APIs.

- :mod:`railyard.compat.mooncake`: ``TransferEngine``, Mooncake's
  ``mooncake.engine.TransferEngine`` (as used by vLLM's and SGLang's connectors).
"""
