"""NVIDIA NIXL's Python agent API (``nixl._api`` / ``nixl._bindings``) on railyard.

vLLM's ``NixlConnector`` (the single-file connector and the split ``nixl/`` package),
SGLang's NIXL disaggregation connector and NVIDIA Dynamo move KV blocks through NIXL's
agent: register memory once, swap agent metadata through a side channel, prepare
descriptor lists once per peer, then post transfers as pairs of index arrays into those
lists. This module gives those callers the same names, argument orders, return values
and exceptions (NIXL 1.5)::

    from railyard.compat.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent("decode-0", nixl_agent_config(capture_telemetry=True))
    agent.register_memory(agent.get_reg_descs([(addr, size, 0, "")], "DRAM"))
    peer = agent.add_remote_agent(metadata_from_prefill)          # b"prefill-0"
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks, "DRAM"))
    remote = agent.prep_xfer_dlist(peer, agent.get_xfer_descs(remote_blocks, "DRAM"))
    handle = agent.make_prepped_xfer("READ", local, ids, remote, ids, notif_msg=b"req-7:1")
    agent.transfer(handle)
    while agent.check_xfer_state(handle) == "PROC": ...

Code that imports ``nixl._api`` and ``nixl._bindings`` itself runs unchanged after
:func:`install`, which makes those imports resolve to this module.

How it maps onto railyard:

* An agent is a :class:`railyard.Engine` named after the agent (its notifications arrive
  under that name). Every backend name (``"UCX"``, ``"LIBFABRIC"``…) is railyard: its
  fabric is chosen as the engine chooses it (verbs where there is RDMA, shared memory on
  one host, TCP across hosts).
* ``prep_xfer_dlist`` resolves the descriptors once (railyard's prepared lists); a transfer
  handle checks its index pairs once, and each ``transfer`` posts them with no
  per-descriptor lookup, merging pairs contiguous on both sides unless
  ``skip_desc_merge``. A handle's notification reaches the peer only after all of its
  descriptors completed.
* ``check_xfer_state`` answers ``"DONE"``, ``"PROC"`` or ``"ERR"``. A transfer that stalls
  becomes ``"ERR"`` by its deadline — ``xfer_timeout_s`` of :class:`nixl_agent_config`,
  else ``RAILYARD_NIXL_XFER_TIMEOUT_S``, else 30 s — and one whose peer died as soon as
  railyard sees it (about 1.5 s). A peer lost that way is dropped
  (``check_remote_metadata`` answers False) until its metadata is added again, as NIXL does.
* Metadata is opaque bytes (``get_agent_metadata``/``add_remote_agent``), as vLLM and SGLang
  swap it; ``send_local_metadata``/``fetch_remote_metadata``/``invalidate_local_metadata``
  go through railyard's own listener (``listen_port`` when ``enable_listen_thread``).

What differs from NIXL:

* Host memory only. ``"VRAM"`` (and ``"cuda"``) raise :class:`nixlMemTypeNotSupportedError`
  (an ``nixlInvalidParamError`` and an ``nixlNotSupportedError``), as do ``"FILE"``,
  ``"BLOCK"`` and ``"OBJ"``: railyard has no GPU-direct registration and no storage
  backends.
* Failures of a posted transfer answer ``"ERR"`` (NIXL raises ``nixlRemoteDisconnectError``
  and the like); misuse still raises (released handles, a post while one is in progress,
  a peer removed).
* ``release_xfer_handle`` of a transfer still in progress waits up to 1 s for it to end,
  then raises ``nixlRepostActiveError`` (railyard cannot cancel posted work; it resolves
  by its deadline): release it once ``check_xfer_state`` stops answering ``"PROC"``.
* A registration inside another of the same agent is counted against it (the memory stays
  registered until both are taken back); ranges that overlap only partly are refused
  (``nixlBackendError``): register the larger first.
* A notification, and the metadata ``send_local_metadata`` sends, carry at most
  ``railyard.MAX_NOTIFY`` bytes (1 MiB); more raises ``nixlInvalidParamError``.
* When a peer restarted or registered its memory anew, the metadata it hands out says so:
  adding it again makes the next ``prep_xfer_dlist`` (or ``send_notif``) reconnect and take
  its descriptor first.
* No etcd or TCPStore metadata exchange (``label=``), no memory views, no cost model
  (``estimate_xfer_cost`` answers ``(0, 0, "UNKNOWN")``), none of the raw
  ``nixl._bindings.nixlAgent`` methods (the agent API above is what callers use).

Environment: ``RAILYARD_BUSY_POLL=1`` gives every rail a busy-polling core (default: pollers
that park when idle); ``RAILYARD_FABRIC`` picks the fabric (``auto``, the default, ``tcp``,
``soft``, ``verbs``, ``ofi``); ``RAILYARD_SECRET_FILE`` the cluster secret;
``RAILYARD_NIXL_XFER_TIMEOUT_S`` the transfer deadline; ``NIXL_TELEMETRY_ENABLE`` as NIXL.
The agent is thread-safe: vLLM calls it from its worker and handshake threads at once.
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import types

from . import agent as _agent_module
from . import bindings as _bindings_module
from .agent import (
    DEFAULT_XFER_TIMEOUT_S,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)
from .bindings import (
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlMemTypeNotSupportedError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
    nixlXferDList,
    nixlXferTelemetry,
)

__all__ = [
    "DEFAULT_COMM_PORT",
    "DEFAULT_XFER_TIMEOUT_S",
    "NIXL_INIT_AGENT",
    "NIXL_VERSION",
    "install",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
    "nixlBackendError",
    "nixlCancelledError",
    "nixlInvalidParamError",
    "nixlMemTypeNotSupportedError",
    "nixlMismatchError",
    "nixlNoTelemetryError",
    "nixlNotAllowedError",
    "nixlNotFoundError",
    "nixlNotPostedError",
    "nixlNotSupportedError",
    "nixlRegDList",
    "nixlRemoteDisconnectError",
    "nixlRepostActiveError",
    "nixlUnknownError",
    "nixlXferDList",
    "nixlXferTelemetry",
]

#: The NIXL release whose Python API this package follows.
NIXL_VERSION = "1.5.1"

_API_NAMES = ["DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_thread_sync_t",
              "nixl_xfer_handle", "nixl_prepped_dlist_handle", "nixl_backend_handle"]
_BINDING_NAMES = (
    [e.__name__ for e in _bindings_module._EXCEPTIONS]
    + ["nixlXferTelemetry", "nixlXferDList", "nixlRegDList", "nixlAgent", "nixlAgentConfig",
       "NIXL_INIT_AGENT",
       "DEFAULT_COMM_PORT", "HAVE_UCX_GPU_DEVICE_API", "DRAM_SEG", "VRAM_SEG", "BLK_SEG",
       "OBJ_SEG", "FILE_SEG", "NIXL_READ", "NIXL_WRITE", "NIXL_THREAD_SYNC_NONE",
       "NIXL_THREAD_SYNC_STRICT", "NIXL_THREAD_SYNC_RW", "NIXL_THREAD_SYNC_DEFAULT",
       "NIXL_IN_PROG", "NIXL_SUCCESS", "NIXL_ERR_NOT_POSTED", "NIXL_ERR_INVALID_PARAM",
       "NIXL_ERR_BACKEND", "NIXL_ERR_NOT_FOUND", "NIXL_ERR_MISMATCH", "NIXL_ERR_NOT_ALLOWED",
       "NIXL_ERR_REPOST_ACTIVE", "NIXL_ERR_UNKNOWN", "NIXL_ERR_NOT_SUPPORTED",
       "NIXL_COST_ANALYTICAL_BACKEND"])


def _module(name: str, source: types.ModuleType, names: list[str],
            package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, f"railyard's stand-in for {name} (railyard.compat.nixl)")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []  # type: ignore[attr-defined]
    for attribute in names:
        setattr(module, attribute, getattr(source, attribute))
    return module


def install() -> types.ModuleType:
    """Makes ``import nixl``, ``nixl._api``, ``nixl._bindings``, ``nixl._utils`` (NIXL's
    test helpers) and ``nixl.logging`` resolve to this package in this process (replacing a
    real NIXL imported before), for code that cannot change its imports. Returns the
    ``nixl`` package. Idempotent."""
    package = _module("nixl", _agent_module, [], package=True)
    api = _module("nixl._api", _agent_module, _API_NAMES)
    bindings = _module("nixl._bindings", _bindings_module, _BINDING_NAMES)
    bindings.__railyard__ = True  # type: ignore[attr-defined]
    utils = _module("nixl._utils", _bindings_module,
                    ["malloc_passthru", "free_passthru", "ba_buf", "verify_transfer"])
    log = types.ModuleType("nixl.logging")
    log.__spec__ = importlib.machinery.ModuleSpec("nixl.logging", None)
    log.get_logger = lambda name: logging.getLogger("nixl." + name.lstrip("_"))  # type: ignore[attr-defined]
    package._api, package._bindings, package.logging = api, bindings, log  # type: ignore[attr-defined]
    package._utils = utils  # type: ignore[attr-defined]
    for module in (api, bindings):
        for attribute, value in vars(module).items():
            if not attribute.startswith("__"):
                setattr(package, attribute, value)
    package.__version__ = NIXL_VERSION  # type: ignore[attr-defined]
    sys.modules.update({"nixl": package, "nixl._api": api, "nixl._bindings": bindings,
                        "nixl._utils": utils, "nixl.logging": log})
    return package
