"""The ``kv_transfer_params`` AiokvConnector writes and reads, and the metadata its
scheduler side hands its workers. Pure Python (no vLLM import).

A prefill (``kv_transfer_params={"do_remote_decode": true}``) answers with::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_engine_id": ..., "remote_request_id": <the prefill's request id>,
     "remote_block_ids": [...], "remote_host": ..., "remote_port": ...,
     "remote_num_tokens": <tokens whose KV it holds>, "tp_size": ...,
     "aiokv": 1, "aiokv_mode": "pull" | "push",
     "aiokv_addresses": ["host:port" of each tensor-parallel rank's engine],
     "aiokv_layerwise": <push: the prefill sent it layer by layer>,
     "aiokv_batch": [<wire id of each request of its step batch>],  # whole pushes only
     "aiokv_batch_index": <this request's place in aiokv_batch>}

which the decode request carries verbatim. The data itself travels under the key
``f"{remote_request_id}@{digest}"`` where ``digest`` is :func:`prompt_digest` of the
tokens: the decode computes it from ITS OWN prompt, so parameters that point at
another request (or a prompt that differs) find nothing and the decode recomputes;
it never loads KV computed for other tokens.

A prefill step that completes several prompts pushed whole (not layer-wise) to one
decode sends them as ONE step batch (``KVConnector.send_requests``), whose name is
the set of its requests' wire ids (:func:`batch_wire_id`: a hash of each key, so a
decode learns nothing of the other requests' ids or prompts). Each answer lists the
batch and the request's place in it; the decode receives the batch with one
``recv_requests`` once the batch's requests are there, and a request whose own key
does not hash to its place fails alone (it recomputes).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "MAX_BATCH",
    "PARAMS_VERSION",
    "DeclineSpec",
    "LoadSpec",
    "RemoteKV",
    "SendSpec",
    "batch_wire_id",
    "decline_name",
    "decode_address_of",
    "parse_remote",
    "prompt_digest",
    "transfer_key",
]

PARAMS_VERSION = 1
_MAX_ID = 256
_MAX_BLOCKS = 1 << 20
#: the most requests one step batch carries (a step schedules fewer)
MAX_BATCH = 1024
_WIRE_ID = re.compile(r"^kvb-[0-9a-f]{32}$")
_ADDR = re.compile(r"^[A-Za-z0-9._\-\[\]:]{1,255}:[0-9]{1,5}$")
# the decode address in a request id, as vLLM's P2P proxy and the aiokv router write it
_DECODE_IN_ID = re.compile(r"___decode_addr_([A-Za-z0-9._\-]{1,255}):([0-9]{1,5})")


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A short hash of token ids (what a request's KV was computed for)."""
    h = hashlib.sha256()
    h.update(struct.pack("<Q", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.hexdigest()[:32]


def transfer_key(request_id: str, token_ids: Sequence[int]) -> str:
    """The id a request's KV travels under (see the module docstring)."""
    return f"{request_id}@{prompt_digest(token_ids)}"


def decline_name(key: str) -> str:
    """The id of the ticket a pull prefill publishes beside its request's: a decode
    that will not load the request GETs it, and the prefill frees the blocks at once."""
    return f"{key}#decline"


def batch_wire_id(key: str) -> str:
    """The id request ``key`` travels under inside a step batch."""
    return "kvb-" + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def valid_address(a: object) -> bool:
    return isinstance(a, str) and bool(_ADDR.match(a)) and 0 < int(a.rsplit(":", 1)[1]) < 65536


def with_port_offset(address: str, rank: int) -> str:
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + rank}"


def decode_address_of(request_id: str, params: Mapping[str, Any] | None) -> str | None:
    """Where a prefill pushes: ``kv_transfer_params["aiokv_decode"]`` ("host:port",
    rank 0's engine), else the ``___decode_addr_HOST:PORT`` in the request id."""
    if params is not None:
        a = params.get("aiokv_decode")
        if valid_address(a):
            return str(a)
    m = _DECODE_IN_ID.search(request_id)
    if m is not None and 0 < int(m.group(2)) < 65536:
        return f"{m.group(1)}:{m.group(2)}"
    return None


@dataclass(frozen=True, slots=True)
class RemoteKV:
    """Validated ``kv_transfer_params`` of a decode request."""

    request_id: str
    addresses: tuple[str, ...]
    block_ids: tuple[int, ...]
    num_tokens: int
    mode: Literal["pull", "push"]
    layerwise: bool = False
    #: the wire ids of the step batch it travelled in, and its place there
    batch: tuple[str, ...] | None = None
    batch_index: int = 0


def parse_remote(
    params: object, *, prompt_len: int, block_size: int, tp_size: int
) -> tuple[RemoteKV | None, str | None]:
    """``(RemoteKV, None)`` when ``params`` ask to load an aiokv prefill's KV and are
    usable here; ``(None, None)`` when they do not ask; ``(None, why)`` when they ask
    but are not usable (the request then recomputes)."""
    if not isinstance(params, Mapping) or not params.get("do_remote_prefill"):
        return None, None
    if params.get("aiokv") != PARAMS_VERSION:
        return None, f"not the parameters of an aiokv prefill (aiokv={params.get('aiokv')!r:.20})"
    rid = params.get("remote_request_id")
    if not isinstance(rid, str) or not 0 < len(rid) <= _MAX_ID or "#" in rid or "@" in rid:
        return None, f"bad remote_request_id {rid!r:.80}"
    addrs = params.get("aiokv_addresses")
    if (
        not isinstance(addrs, list)
        or len(addrs) != tp_size
        or not all(valid_address(a) for a in addrs)
    ):
        return None, (
            f"aiokv_addresses must list {tp_size} 'host:port' (one per tensor-parallel "
            f"rank), got {addrs!r:.200}"
        )
    n = params.get("remote_num_tokens")
    if type(n) is not int or not 0 < n <= prompt_len:
        return None, f"remote_num_tokens {n!r:.20} is not in [1, {prompt_len}] (the prompt)"
    ids = params.get("remote_block_ids")
    want = -(-n // block_size)
    if (
        not isinstance(ids, list)
        or len(ids) != want
        or len(ids) > _MAX_BLOCKS
        or not all(type(i) is int and i >= 0 for i in ids)
    ):
        return None, f"remote_block_ids must be {want} block ids for {n} tokens"
    mode = params.get("aiokv_mode")
    if mode not in ("pull", "push"):
        return None, f"aiokv_mode {mode!r:.20} is not pull or push"
    layerwise = params.get("aiokv_layerwise", False)
    if not isinstance(layerwise, bool) or (layerwise and mode != "push"):
        return None, f"aiokv_layerwise {layerwise!r:.20} is not a bool, or not with push"
    batch = params.get("aiokv_batch")
    index = params.get("aiokv_batch_index", 0)
    if batch is not None and (
        not isinstance(batch, list)
        or not 1 < len(batch) <= MAX_BATCH
        or not all(isinstance(b, str) and _WIRE_ID.match(b) for b in batch)
        or len(set(batch)) != len(batch)
        or type(index) is not int
        or not 0 <= index < len(batch)
        or mode != "push"
        or layerwise
    ):
        return None, (
            f"aiokv_batch must list 2 to {MAX_BATCH} distinct wire ids of a whole push, "
            f"with aiokv_batch_index in it; got {batch!r:.80} at {index!r:.20}"
        )
    return (
        RemoteKV(
            rid,
            tuple(addrs),
            tuple(ids),
            n,
            mode,
            layerwise,
            tuple(batch) if batch is not None else None,
            index if batch is not None else 0,
        ),
        None,
    )


@dataclass(slots=True)
class SendSpec:
    """Worker, prefill side: hand request ``req_id``'s blocks to its decode."""

    req_id: str
    key: str
    block_ids: list[int]
    #: push: the decode's address (rank 0; rank r adds r to the port); None: pull
    push_to: str | None = None
    #: push layer by layer, as the forward saves each layer
    layerwise: bool = False
    #: a whole push sent in a step batch: the batch's wire ids, this one's place there
    batch: list[str] | None = None
    batch_index: int = 0


@dataclass(slots=True)
class LoadSpec:
    """Worker, decode side: write the prefill's KV of ``key`` into ``block_ids``.

    ``skip`` leading remote blocks are already in this cache (a local prefix-cache
    hit): the request still moves whole, and only the rest is written."""

    req_id: str
    key: str
    addresses: list[str]
    mode: Literal["pull", "push"]
    n_remote: int
    skip: int
    block_ids: list[int] = field(default_factory=list)
    #: the prefill pushed it layer by layer
    layerwise: bool = False
    #: the prefill pushed it in a step batch: the batch's wire ids, its place there
    batch: list[str] | None = None
    batch_index: int = 0


@dataclass(slots=True)
class DeclineSpec:
    """Worker, decode side: the pull prefill at ``addresses`` holds ``key`` for a
    request that will not load it (its own prefix cache serves the prompt, or vLLM
    computes it, or the request ended first): tell it to free the blocks."""

    req_id: str
    key: str
    addresses: list[str]
