"""The wire form of a KV request: chunk and tensor names, the chunk plan, the request
header (JSON in a CPU uint8 tensor), a step batch's header and pull mode's ticket, and
the checks the consumer runs on each before it writes anything (see
:mod:`aiokv.kv.connector`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Container, Sequence
from typing import Any

import torch

from .._exceptions import LayoutMismatchError
from .layouts import KVLayout, check_compatible, layout_from_wire
from .ops import LayerChunker, StagingSlice

#: version of the request header (see the module docstring)
_HEADER_VERSION = 1
#: the packing order of gathered blocks (:mod:`aiokv.kv.ops`); bump when it changes
PACKING = "aiokv-kv-1"
#: version of pull mode's ticket (see :meth:`KVConnector.serve_request`)
_TICKET_VERSION = 1


def _pulled_offset(header_len: int) -> int:
    """Where the blocks start in a whole pulled request: after the u32 header length
    and the header, padded to a multiple of 16 bytes."""
    return -(-(4 + header_len) // 16) * 16


#: a request header is at most this many bytes (the consumer refuses larger ones)
MAX_HEADER_BYTES = 4096
#: a batch's header (one entry per request) is at most this many bytes
MAX_BATCH_HEADER_BYTES = 1 << 20


# -- names (both sides derive them)


def chunk_name(request_id: str, index: int) -> str:
    return f"{request_id}#kv{index}"


def layer_name(request_id: str, layer: int) -> str:
    return f"{request_id}#L{layer}"


def ticket_name(request_id: str) -> str:
    """Pull mode: the id of the request's ticket the producer publishes."""
    return f"{request_id}#pull"


def header_name(request_id: str) -> str:
    return f"{request_id}#kvh"


def batch_name(request_ids: Sequence[str]) -> str:
    """The id of a batch's first tensor (its header; on a CPU cache also its first
    chunk): named by the SET of its request ids, whatever their order."""
    ids = sorted(request_ids)
    digest = hashlib.blake2b("\0".join(ids).encode(), digest_size=8).hexdigest()
    return f"{ids[0]}#kvb{digest}"


def ipc_batch_name(entries: Sequence[tuple[str, int]]) -> str:
    """The plane request of (a part of) a step batch over the IPC plane: named by its
    requests AND their block counts, in packing order (sorted by request id). The
    plane's descriptor carries only the total block count, so two sides that disagree
    on which requests go or on how many blocks one of them has never pair up (and
    never write one request's blocks into another's)."""
    body = json.dumps([[rid, n] for rid, n in entries], separators=(",", ":"))
    digest = hashlib.blake2b(body.encode(), digest_size=8).hexdigest()
    return f"{entries[0][0]}#kvi{digest}"


def batch_chunk_name(base: str, index: int) -> str:
    """Chunk ``index`` of a batch, when it does not travel with the header."""
    return f"{base}#{index}"


def check_ticket(request_id: str, frm: str, raw: torch.Tensor, n: int) -> None:
    """A small pull ticket this side can read, for ``n`` blocks (else
    LayoutMismatchError, ``kv_size_mismatch``)."""
    if (
        raw.dtype != torch.int64
        or raw.dim() != 1
        or raw.numel() < 2
        or int(raw[0]) != _TICKET_VERSION
    ):
        raise LayoutMismatchError(
            f"request {request_id!r}: {frm} sent a ticket this side cannot read "
            f"({raw.dtype}, shape {tuple(raw.shape)})",
            code="kv_size_mismatch",
        )
    if int(raw[1]) != n:
        raise LayoutMismatchError(
            f"request {request_id!r}: {frm} holds {int(raw[1])} blocks, {n} were given here",
            code="kv_size_mismatch",
        )


class RequestCodec:
    """Plan, header and checks of a request, from this side's layout and ``chunk_bytes``
    (the connector's; see :class:`~aiokv.kv.KVConnector`)."""

    __slots__ = ("chunk_bytes", "device", "layout")

    def __init__(self, layout: KVLayout, chunk_bytes: int, device: torch.device) -> None:
        self.layout = layout
        self.chunk_bytes = chunk_bytes
        self.device = device

    def chunk_plan(self, n_blocks: int) -> list[StagingSlice]:
        """The chunks a request of ``n_blocks`` blocks travels in (same on both sides)."""
        if n_blocks == 0:
            return []
        return LayerChunker(self.layout, n_blocks).chunks(max_bytes=self.chunk_bytes)

    def header_bytes(self, n_blocks: int, mode: str) -> bytes:
        """The request header (see the module docstring): JSON."""
        body = {
            "v": _HEADER_VERSION,
            "packing": PACKING,
            "layout": self.layout.to_wire(),
            "mode": mode,
            "n_blocks": n_blocks,
            "chunk_bytes": self.chunk_bytes,
        }
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    def header(self, n_blocks: int, mode: str) -> torch.Tensor:
        """The request header as a CPU uint8 tensor."""
        return torch.frombuffer(bytearray(self.header_bytes(n_blocks, mode)), dtype=torch.uint8)

    def _read_header(
        self, data: bytes, what: str, bad: Callable[[str], LayoutMismatchError]
    ) -> dict[str, Any]:
        """The JSON object of a producer's header (a request's or a batch's), once its
        version, packing and layout match this side; ``bad(why)`` makes the error."""
        try:
            h = json.loads(data)
            if type(h) is not dict:
                raise ValueError("not an object")
            producer = layout_from_wire(h.get("layout"))
        except Exception as exc:  # untrusted bytes: whatever is wrong, it is a mismatch
            raise bad(f"unreadable {what} ({type(exc).__name__}: {exc})"[:300]) from None
        if h.get("v") != _HEADER_VERSION or h.get("packing") != PACKING:
            raise bad(
                f"the producer packs blocks as {h.get('packing')!r:.40} (header v{h.get('v')!r:.8}), "
                f"this side as {PACKING!r} (v{_HEADER_VERSION})"
            )
        check_compatible(producer, self.layout)
        return h

    def _check_chunk_plan(
        self, h: dict[str, Any], n_blocks: int, what: str, bad: Callable[..., LayoutMismatchError]
    ) -> None:
        """The producer's ``chunk_bytes`` (header ``h``) must split ``n_blocks`` blocks (0:
        no chunks, only the field's form is checked) into the chunks this side expects."""
        cb = h.get("chunk_bytes")
        if type(cb) is not int or cb <= 0:
            raise bad(f"bad chunk_bytes {cb!r:.20} in the header")
        if n_blocks and cb != self.chunk_bytes:
            mine = [s.layers for s in self.chunk_plan(n_blocks)]
            plan = LayerChunker(self.layout, n_blocks).chunks(max_bytes=cb)
            if [s.layers for s in plan] != mine:
                raise bad(
                    f"the producer's chunk_bytes {cb} splits the {what} into {len(plan)} "
                    f"chunks, this side's chunk_bytes {self.chunk_bytes} into {len(mine)}: "
                    "chunk_bytes must be equal on both sides",
                    "kv_size_mismatch",
                )

    def check_header(
        self, request_id: str, raw: torch.Tensor, n_blocks: int, layerwise: bool
    ) -> None:
        """Raise LayoutMismatchError unless the producer's header matches this side."""
        name = header_name(request_id)

        def bad(why: str, code: str = "layout_mismatch") -> LayoutMismatchError:
            return LayoutMismatchError(f"KV request {request_id!r}: {why}", code=code)

        if (
            raw.dtype != torch.uint8
            or raw.dim() != 1
            or raw.numel() > MAX_HEADER_BYTES
            or raw.device.type != "cpu"
        ):
            raise bad(f"{name!r} is not an aiokv KV request header")
        h = self._read_header(bytes(raw.tolist()), f"header {name!r}", bad)
        mode = "layers" if layerwise else "chunks"
        if h.get("mode") != mode:
            raise bad(
                f"the producer sent {h.get('mode')!r:.20} but the consumer expects {mode!r} "
                "(send_request pairs with recv_request(layerwise=False), save_layer with "
                "layerwise=True)",
                "kv_mode_mismatch",
            )
        theirs = h.get("n_blocks")
        if type(theirs) is not int or theirs != n_blocks:
            raise bad(
                f"the producer sent {theirs!r:.20} blocks, the consumer expects {n_blocks} "
                "blocks: the two sides disagree on the number of blocks of the request",
                "kv_size_mismatch",
            )
        self._check_chunk_plan(h, 0 if layerwise else n_blocks, "request", bad)

    def check_chunk(self, name: str, t: torch.Tensor, n_layers: int, n_blocks: int) -> torch.Tensor:
        """The chunk as a 1-D uint8 buffer on the cache device, or LayoutMismatchError."""
        row = n_blocks * self.layout.block_nbytes()
        want = n_layers * row
        got = t.numel() * t.element_size()
        shape = tuple(t.shape)
        ok = t.dtype == torch.uint8 and (shape == (n_layers, row) or shape == (want,))
        if not ok:
            raise LayoutMismatchError(
                f"KV chunk {name!r} has dtype {t.dtype} and shape {shape} ({got} bytes); "
                f"expected uint8 ({n_layers}, {row}) = {n_layers} layers x {n_blocks} blocks x "
                f"{self.layout.block_nbytes()} bytes ({want} bytes). The two sides disagree on "
                "the number of blocks of the request, on chunk_bytes, or on the KV layout",
                code="kv_size_mismatch",
            )
        if not t.is_contiguous():
            t = t.contiguous()
        t = t.reshape(-1)
        if t.device != self.device:
            t = t.to(self.device, non_blocking=True)
        elif t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
        return t

    # -- a step batch (see KVConnector.send_requests)

    def batch_prefix(self, entries: Sequence[tuple[str, int]], inline: bool) -> bytes:
        """A batch's header as it opens its first tensor: ``<u32 length>``, JSON (the
        requests it carries, in packing order, with their block counts; whether chunk 0
        follows it in the same tensor), zero padding to a multiple of 16 bytes."""
        body = {
            "v": _HEADER_VERSION,
            "packing": PACKING,
            "layout": self.layout.to_wire(),
            "mode": "batch",
            "chunk_bytes": self.chunk_bytes,
            "inline": inline,
            "requests": [[rid, n] for rid, n in entries],
        }
        header = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
        return (struct.pack("<I", len(header)) + header).ljust(_pulled_offset(len(header)), b"\0")

    def check_batch_header(
        self, name: str, raw: torch.Tensor, wanted: Container[str]
    ) -> tuple[list[tuple[str, int]], bool, int]:
        """``(entries, inline, offset)`` of a batch's first tensor: the requests it
        carries with their block counts (each one of ``wanted``, none twice), whether
        chunk 0 follows the header, and where. LayoutMismatchError unless the producer's
        layout and chunk plan match this side's."""

        def bad(why: str, code: str = "layout_mismatch") -> LayoutMismatchError:
            return LayoutMismatchError(f"KV batch {name!r}: {why}", code=code)

        if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.device.type != "cpu":
            raise bad("its first tensor is not an aiokv batch header")
        if raw.numel() < 4:
            raise bad("its first tensor is too short")
        (hlen,) = struct.unpack("<I", bytes(raw[:4].tolist()))
        off = _pulled_offset(hlen)
        if hlen > MAX_BATCH_HEADER_BYTES or off > raw.numel():
            raise bad(f"the header length {hlen} is out of range")
        h = self._read_header(bytes(raw[4 : 4 + hlen].tolist()), "header", bad)
        if h.get("mode") != "batch":
            raise bad(f"the producer sent {h.get('mode')!r:.20}, not a batch", "kv_mode_mismatch")
        inline = h.get("inline")
        reqs = h.get("requests")
        if type(inline) is not bool or type(reqs) is not list:
            raise bad("malformed header")
        entries: list[tuple[str, int]] = []
        seen: set[str] = set()
        for e in reqs:
            if (
                type(e) is not list
                or len(e) != 2
                or type(e[0]) is not str
                or type(e[1]) is not int
                or not 0 <= e[1] < 1 << 31
            ):
                raise bad(f"malformed request entry {e!r:.80}")
            if e[0] in seen or e[0] not in wanted:
                raise bad(
                    f"the producer's batch holds request {e[0]!r:.80} "
                    + ("twice" if e[0] in seen else "that this side did not ask for")
                )
            seen.add(e[0])
            entries.append((e[0], e[1]))
        total = sum(n for _, n in entries)
        self._check_chunk_plan(h, total, "batch", bad)
        if not (inline and total) and raw.numel() != off:
            raise bad(f"the header tensor holds {raw.numel() - off} bytes past the header")
        return entries, inline, off
