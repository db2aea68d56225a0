"""The IPC plane's wire messages (docs/ipc.md, "Control interface"): msgpack maps in
small uint8 CPU tensors, each validated field by field -- types, ranges, sizes, exact
key sets -- before anything is allocated or mapped from it."""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ..._config import parse_address
from ..._exceptions import ConfigError, RemoteProtocolError
from ..layouts import KVLayout, layout_from_wire
from . import _doorbell

WIRE_VERSION = 1
#: the largest control message accepted (an offer of a few thousand layers fits)
MAX_MESSAGE_BYTES = 1 << 20
_MAX_HANDLE = 256
_MAX_STORAGES = 8192
_MAX_OFFSET = 1 << 52
_MAX_REASON = 256
_MAX_BLOCKS_PER_REQUEST = 1 << 22
_REFCOUNT_RE = re.compile(rb"^/torch_[0-9_]{1,64}$")
_PROBE_SEGMENTS = 2
_MAX_EVENT_SLOT = 1 << 20
#: abort words per block of them (the consumer's; a grant's slot names block and word)
ABORT_WORDS = 4096
#: the descriptor's plane for layer-wise streaming (save_layer / recv_request(layerwise=True))
LAYERS = "ipc-layers"
#: A whole request's descriptor as the doorbell ring carries it (docs/ipc.md,
#: "Doorbell"): magic, flags (bit 0: sent by the ring alone), the request id's length
#: in bytes, the block count, the event slot, the export's token, the lease, the event
#: handle's length; then the event handle, the request id (UTF-8) and the source block
#: ids (u32 each). Fixed offsets, no map: packed and checked in a few microseconds
#: (the msgpack map and its generic validation were the largest piece of the ring's
#: poll on an H200 host). The ring never carries an offer or a layer-wise
#: descriptor, and its producer's address is the mapping's (the ring is named only in
#: that producer's offer), so neither is in the record.
_RING = struct.Struct("<BBHIIQdH")
_RING_MAGIC = 0xA1  # (no msgpack map starts with it: an older producer's record is rejected)
_RING_SOLO = 1
#: flag of a pull record: the producer has mapped this consumer's export (push mode)
_RING_CAN_PUSH = 2
#: A pushed request's record: magic, flags (bit 0: solo), the request id's length, the
#: block count, the event slot, the consumer's export token, the grant's id, the lease,
#: the event handle's length; then the event handle and the request id. No block ids:
#: the producer wrote the blocks the consumer's grant named.
_PUSH_RING = struct.Struct("<BBHIIQQdH")
_PUSH_MAGIC = 0xA2
#: A grant as the consumer's grants ring carries it: magic, flags (none yet), the
#: request id's length, the block count, the grant id, the abort slot, the deadline;
#: then the request id and the destination block ids (u32 each).
_GRANT_RING = struct.Struct("<BBHIQQd")
_GRANT_MAGIC = 0xA3
#: A cancelled grant's revoke (consumer -> producer, grants ring) and the producer's
#: answer that it never used it (producer -> consumer, descriptor ring): magic, flags
#: (none), the request id's length, the grant id; then the request id.
_REVOKE_RING = struct.Struct("<BBHQ")
REVOKE = 0xA4
REVOKED = 0xA5
#: the descriptor's plane of a request the producer pushed (after the consumer's grant)
PUSH = "ipc-push"
#: grant ids and abort slots are below these
_MAX_GID = (1 << 63) - 1
_MAX_SLOT = 1 << 40


def encode_message(d: Mapping[str, Any]) -> torch.Tensor:
    """msgpack bytes of ``d`` as a uint8 CPU tensor (what the engine carries)."""
    b = msgpack.packb(d, use_bin_type=True)
    if len(b) > MAX_MESSAGE_BYTES:
        raise ConfigError(f"IPC control message of {len(b)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def decode_message(t: object) -> dict[str, Any]:
    """Decode a control message received from a peer (untrusted; a uint8 tensor or
    bytes): size-checked before decoding, no ext types, string keys only, version 1.
    Raises :class:`~aiokv.RemoteProtocolError`."""
    if isinstance(t, (bytes, bytearray)):  # a channel that carries bytes
        n = len(t)
        if n == 0 or n > MAX_MESSAGE_BYTES:
            raise RemoteProtocolError(f"IPC control message of {n} bytes")
        raw = bytes(t)
    else:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
            raise RemoteProtocolError("IPC control message must be a 1-D uint8 tensor or bytes")
        n = t.numel()
        if n == 0 or n > MAX_MESSAGE_BYTES:
            raise RemoteProtocolError(f"IPC control message of {n} bytes")
        raw = _tensor_bytes(t)
    try:
        d = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_no_ext,
        )
    except Exception as exc:
        raise RemoteProtocolError(f"IPC control message does not decode: {exc}") from None
    if not isinstance(d, dict):
        raise RemoteProtocolError("IPC control message is not a map")
    if d.get("v") != WIRE_VERSION:
        raise RemoteProtocolError(f"IPC control message version {d.get('v')!r:.32}")
    return d


def _ring_fields(le: int, n: int, slot: int, token: int, lease: float) -> None:
    """The range checks both ring records share."""
    if (
        not 1 <= le <= _MAX_HANDLE
        or n > _MAX_BLOCKS_PER_REQUEST
        or slot > _MAX_EVENT_SLOT
        or not 1 <= token < 1 << 63
        or not math.isfinite(lease)
    ):
        raise RemoteProtocolError("IPC ring record: a field out of range")


def _ring_rid(b: bytes, o: int, lr: int) -> str:
    try:
        rid = b[o : o + lr].decode()
    except UnicodeDecodeError:
        raise RemoteProtocolError("IPC ring record: request id not UTF-8") from None
    if len(rid) > 4096:
        raise RemoteProtocolError("IPC ring record: request id of over 4096 chars")
    return rid


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("ext types are not allowed")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    from ...transport.tcp import tensor_buffer

    if t.device.type != "cpu" or not t.is_contiguous():  # (the engine hands out CPU ones)
        t = t.detach().cpu().contiguous()
    return bytes(tensor_buffer(t))


def _int(d: Mapping[str, Any], k: str, lo: int, hi: int) -> int:
    v = d.get(k)
    if type(v) is not int or not lo <= v <= hi:
        raise RemoteProtocolError(f"IPC message field {k!r}: {v!r:.64} not an int in [{lo}, {hi}]")
    return v


def _bytes(d: Mapping[str, Any], k: str, lo: int, hi: int) -> bytes:
    v = d.get(k)
    if not isinstance(v, bytes) or not lo <= len(v) <= hi:
        raise RemoteProtocolError(f"IPC message field {k!r}: not {lo}..{hi} bytes")
    return v


def _str(d: Mapping[str, Any], k: str, hi: int) -> str:
    v = d.get(k)
    if not isinstance(v, str) or len(v) > hi:
        raise RemoteProtocolError(f"IPC message field {k!r}: not a string of <= {hi} chars")
    return v


def _float(d: Mapping[str, Any], k: str) -> float:
    v = d.get(k)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise RemoteProtocolError(f"IPC message field {k!r}: {v!r:.32} not a finite number")
    return float(v)


def _bell_fields(d: Mapping[str, Any], what: str) -> tuple[str, bytes]:
    """A doorbell ring's ``bell`` (name) and ``bell_key`` of an offer: both or neither."""
    if "bell" not in d and "bell_key" not in d:
        return "", b""
    bell = _str(d, "bell", 64)
    bell_key = _bytes(d, "bell_key", _doorbell.KEY_BYTES, _doorbell.KEY_BYTES)
    if not _doorbell.valid_name(bell):
        raise RemoteProtocolError(f"{what}: not a doorbell name")
    return bell, bell_key


def _exact_keys(d: Mapping[str, Any], what: str, keys: Sequence[str]) -> None:
    extra = set(d) - set(keys)
    if extra:
        raise RemoteProtocolError(f"{what}: unknown fields {sorted(extra)[:8]}")


@dataclass(frozen=True, slots=True)
class StorageExport:
    """One exported CUDA allocation region (what torch's ``_share_cuda_`` yields).

    ``handle`` names the allocation (a CUDA IPC memory handle), ``offset``/``size``
    the storage inside it; ``rc_handle``/``rc_offset`` torch's shared reference
    counter (keeps the producer's allocator from reusing the block while mapped).
    """

    handle: bytes
    size: int
    offset: int
    rc_handle: bytes
    rc_offset: int
    event: bytes

    def to_wire(self) -> dict[str, Any]:
        return {
            "handle": self.handle,
            "size": self.size,
            "offset": self.offset,
            "rc_handle": self.rc_handle,
            "rc_offset": self.rc_offset,
            "event": self.event,
        }

    @classmethod
    def from_wire(cls, d: object) -> StorageExport:
        if not isinstance(d, dict):
            raise RemoteProtocolError("IPC storage export must be a map")
        _exact_keys(
            d, "IPC storage export", ("handle", "size", "offset", "rc_handle", "rc_offset", "event")
        )
        rc = _bytes(d, "rc_handle", 0, _MAX_HANDLE)
        if rc and not _REFCOUNT_RE.match(rc):
            raise RemoteProtocolError("IPC storage export: unexpected reference-counter name")
        return cls(
            handle=_bytes(d, "handle", 1, _MAX_HANDLE),
            size=_int(d, "size", 1, _MAX_OFFSET),
            offset=_int(d, "offset", 0, _MAX_OFFSET),
            rc_handle=rc,
            rc_offset=_int(d, "rc_offset", 0, 1 << 31),
            event=_bytes(d, "event", 0, _MAX_HANDLE),
        )


@dataclass(frozen=True, slots=True)
class Offer:
    """The producer's export of its cache to one consumer (sent inline in descriptors
    until the consumer has used it).

    ``layers[l] = (storage index, byte offset)`` of layer ``l``; ``word`` the widest
    word its layer addresses allow; ``probe`` a buffer of ``2 * segment`` bytes filled
    with :func:`probe_pattern` ``(nonce)``; ``boot_id``/``mono`` say which host and
    clock the producer runs on.
    """

    token: int
    boot_id: str
    pid: int
    mono: float
    layout: dict[str, Any]
    storages: tuple[StorageExport, ...]
    layers: tuple[tuple[int, int], ...]
    word: int
    probe: StorageExport
    nonce: int
    bell: str = ""  # the doorbell ring's name (one per consumer), or none
    bell_key: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        bell = {"bell": self.bell, "bell_key": self.bell_key} if self.bell else {}
        return {
            **bell,
            "token": self.token,
            "boot_id": self.boot_id,
            "pid": self.pid,
            "mono": self.mono,
            "layout": self.layout,
            "storages": [s.to_wire() for s in self.storages],
            "layers": [list(x) for x in self.layers],
            "word": self.word,
            "probe": self.probe.to_wire(),
            "nonce": self.nonce,
        }

    @classmethod
    def from_wire(cls, d: object) -> tuple[Offer, KVLayout]:
        """Parse and check an offer; returns it with the producer's layout."""
        if not isinstance(d, dict):
            raise RemoteProtocolError("IPC offer must be a map")
        _exact_keys(
            d,
            "IPC offer",
            (
                "token",
                "boot_id",
                "pid",
                "mono",
                "layout",
                "storages",
                "layers",
                "word",
                "probe",
                "nonce",
                "bell",
                "bell_key",
            ),
        )
        bell, bell_key = _bell_fields(d, "IPC offer")
        try:
            layout = layout_from_wire(d.get("layout"))
        except ConfigError as exc:
            raise RemoteProtocolError(f"IPC offer: {exc}") from None
        sts = d.get("storages")
        if not isinstance(sts, list) or not 1 <= len(sts) <= _MAX_STORAGES:
            raise RemoteProtocolError("IPC offer: storages must be a non-empty list")
        storages = tuple(StorageExport.from_wire(s) for s in sts)
        lays = d.get("layers")
        if not isinstance(lays, list) or len(lays) != layout.num_layers:
            raise RemoteProtocolError(
                f"IPC offer: layers must list {layout.num_layers} (storage, offset) pairs"
            )
        word = _int(d, "word", 1, 8)
        if word not in (1, 2, 4, 8):
            raise RemoteProtocolError(f"IPC offer: word {word} is not 1, 2, 4 or 8")
        need = layout.layer_nbytes()
        layers: list[tuple[int, int]] = []
        for x in lays:
            if (
                not isinstance(x, list)
                or len(x) != 2
                or type(x[0]) is not int
                or type(x[1]) is not int
            ):
                raise RemoteProtocolError("IPC offer: a layer is not an [int, int] pair")
            si, off = x
            if not 0 <= si < len(storages) or off < 0 or off % word:
                raise RemoteProtocolError(f"IPC offer: layer ({si}, {off}) out of range")
            if off + need > storages[si].size:
                raise RemoteProtocolError(
                    f"IPC offer: layer at offset {off} (+{need} bytes) exceeds its storage "
                    f"of {storages[si].size} bytes"
                )
            layers.append((si, off))
        probe = StorageExport.from_wire(d.get("probe"))
        seg = layout.segment_numel() * layout.itemsize
        if probe.size < _PROBE_SEGMENTS * seg:
            raise RemoteProtocolError("IPC offer: probe smaller than two segments")
        offer = cls(
            token=_int(d, "token", 1, (1 << 63) - 1),
            boot_id=_str(d, "boot_id", 64),
            pid=_int(d, "pid", 0, 1 << 31),
            mono=_float(d, "mono"),
            layout=dict(d["layout"]),
            storages=storages,
            layers=tuple(layers),
            word=word,
            probe=probe,
            nonce=_int(d, "nonce", 0, (1 << 63) - 1),
            bell=bell,
            bell_key=bell_key,
        )
        return offer, layout


@dataclass(frozen=True, slots=True)
class Descriptor:
    """One request, producer → consumer, tensor id ``f"{rid}#ipc"``.

    ``plane`` ``"ipc"``: pull ``src`` (the producer's block ids) from export
    ``token`` (``offer`` inline until the consumer acknowledged it), after IPC event
    ``event`` (slot ``event_slot``) fires, before ``lease`` (producer's
    ``time.monotonic()`` deadline); reply to ``reply_to``. ``plane`` ``"chunks"``:
    the blocks come the ordinary way (the connector's chunk tensors).
    This is the one message a request needs; the coordinator's one-message control
    protocol can carry exactly these fields (docs/ipc.md).

    Push mode (docs/ipc.md, "Push"): ``plane`` :data:`PUSH` says the producer copied the
    request into the blocks of the consumer's grant ``gid`` (export ``token`` is then
    the consumer's) and IPC event ``event`` fires once that copy is over; no ``src``.
    ``can_push`` on a pull descriptor (whole or layer-wise): the producer has mapped
    and verified this consumer's export, so the consumer may grant it its next
    requests.
    """

    rid: str
    plane: str
    n: int
    reply_to: str = ""
    token: int = 0
    src: tuple[int, ...] = ()
    event: bytes = b""
    event_slot: int = 0
    lease: float = 0.0
    offer: Offer | None = None
    gid: int = 0
    can_push: bool = False

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"v": WIRE_VERSION, "rid": self.rid, "plane": self.plane, "n": self.n}
        if self.plane == PUSH:
            d.update(
                reply_to=self.reply_to,
                token=self.token,
                event=self.event,
                event_slot=self.event_slot,
                lease=self.lease,
                gid=self.gid,
            )
        elif self.plane in ("ipc", LAYERS):
            d.update(
                reply_to=self.reply_to,
                token=self.token,
                src=struct.pack(f"<{len(self.src)}I", *self.src),
                event=self.event,
                event_slot=self.event_slot,
                lease=self.lease,
                offer=self.offer.to_wire() if self.offer is not None else None,
            )
            if self.can_push:  # (only then: a producer without push mode sends what it did)
                d["push"] = True
        return d

    def to_ring(self, *, solo: bool) -> bytes:
        """The doorbell ring's record of this descriptor (whole request, no offer);
        ``solo``: the ring alone carries it (the engine's copy is only a late backup)."""
        rid = self.rid.encode()
        flags = _RING_SOLO if solo else 0
        if self.plane == PUSH:
            head = _PUSH_RING.pack(
                _PUSH_MAGIC,
                flags,
                len(rid),
                self.n,
                self.event_slot,
                self.token,
                self.gid,
                self.lease,
                len(self.event),
            )
            return b"".join((head, self.event, rid))
        assert self.plane == "ipc" and self.offer is None
        return b"".join(
            (
                _RING.pack(
                    _RING_MAGIC,
                    flags | (_RING_CAN_PUSH if self.can_push else 0),
                    len(rid),
                    self.n,
                    self.event_slot,
                    self.token,
                    self.lease,
                    len(self.event),
                ),
                self.event,
                rid,
                struct.pack(f"<{self.n}I", *self.src),
            )
        )

    @classmethod
    def from_ring(cls, b: bytes, reply_to: str) -> tuple[Descriptor, bool]:
        """A ring record (untrusted, as an engine message) as a descriptor replying to
        ``reply_to`` (the ring's producer), and whether it is ``solo``. The same field
        rules as :meth:`from_wire`; the sizes add up exactly. Raises
        :class:`~aiokv.RemoteProtocolError`."""
        if b[:1] == bytes((_PUSH_MAGIC,)):
            return cls._from_push_ring(b, reply_to)
        if len(b) < _RING.size:
            raise RemoteProtocolError(f"IPC ring record of {len(b)} bytes")
        magic, flags, lr, n, slot, token, lease, le = _RING.unpack_from(b)
        if magic != _RING_MAGIC or flags & ~(_RING_SOLO | _RING_CAN_PUSH):
            raise RemoteProtocolError("IPC ring record: not a descriptor record")
        _ring_fields(le, n, slot, token, lease)
        if len(b) != _RING.size + le + lr + 4 * n:
            raise RemoteProtocolError(
                f"IPC ring record of {len(b)} bytes for {lr} + {le} bytes and {n} blocks"
            )
        o = _RING.size + le
        desc = cls(
            rid=_ring_rid(b, o, lr),
            plane="ipc",
            n=n,
            reply_to=reply_to,
            token=token,
            src=struct.unpack_from(f"<{n}I", b, o + lr),
            event=b[_RING.size : o],
            event_slot=slot,
            lease=lease,
            can_push=bool(flags & _RING_CAN_PUSH),
        )
        return desc, bool(flags & _RING_SOLO)

    @classmethod
    def _from_push_ring(cls, b: bytes, reply_to: str) -> tuple[Descriptor, bool]:
        if len(b) < _PUSH_RING.size:
            raise RemoteProtocolError(f"IPC ring record of {len(b)} bytes")
        _magic, flags, lr, n, slot, token, gid, lease, le = _PUSH_RING.unpack_from(b)
        if flags & ~_RING_SOLO or not 1 <= gid <= _MAX_GID:
            raise RemoteProtocolError("IPC ring record: not a push record")
        _ring_fields(le, n, slot, token, lease)
        if len(b) != _PUSH_RING.size + le + lr:
            raise RemoteProtocolError(f"IPC push record of {len(b)} bytes for {lr} + {le} bytes")
        o = _PUSH_RING.size + le
        desc = cls(
            rid=_ring_rid(b, o, lr),
            plane=PUSH,
            n=n,
            reply_to=reply_to,
            token=token,
            event=b[_PUSH_RING.size : o],
            event_slot=slot,
            lease=lease,
            gid=gid,
        )
        return desc, bool(flags & _RING_SOLO)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> tuple[Descriptor, KVLayout | None]:
        plane = d.get("plane")
        rid = _str(d, "rid", 4096)
        n = _int(d, "n", 0, _MAX_BLOCKS_PER_REQUEST)
        if plane == "chunks":
            _exact_keys(d, "IPC descriptor", ("v", "rid", "plane", "n"))
            return cls(rid=rid, plane="chunks", n=n), None
        if plane not in ("ipc", LAYERS, PUSH):
            raise RemoteProtocolError(f"IPC descriptor: unknown plane {plane!r:.32}")
        common = ("v", "rid", "plane", "n", "reply_to", "token", "event", "event_slot", "lease")
        if plane == PUSH:
            _exact_keys(d, "IPC descriptor", (*common, "gid"))
        else:
            _exact_keys(d, "IPC descriptor", (*common, "src", "offer", "push"))
        reply_to = _str(d, "reply_to", 256)
        try:
            parse_address(reply_to)
        except ConfigError:
            raise RemoteProtocolError(f"IPC descriptor: bad reply_to {reply_to!r:.64}") from None
        if plane == PUSH:
            desc = cls(
                rid=rid,
                plane=PUSH,
                n=n,
                reply_to=reply_to,
                token=_int(d, "token", 1, (1 << 63) - 1),
                event=_bytes(d, "event", 1, _MAX_HANDLE),
                event_slot=_int(d, "event_slot", 0, _MAX_EVENT_SLOT),
                lease=_float(d, "lease"),
                gid=_int(d, "gid", 1, _MAX_GID),
            )
            return desc, None
        can_push = d.get("push", False)
        if can_push is not False and can_push is not True:
            raise RemoteProtocolError("IPC descriptor: push must be a boolean")
        src_b = _bytes(d, "src", 0, 4 * _MAX_BLOCKS_PER_REQUEST)
        if len(src_b) != 4 * n:
            raise RemoteProtocolError(
                f"IPC descriptor: {len(src_b)} bytes of block ids for {n} blocks"
            )
        src = struct.unpack(f"<{n}I", src_b)
        offer = None
        layout = None
        if d.get("offer") is not None:
            offer, layout = Offer.from_wire(d["offer"])
        token = _int(d, "token", 1, (1 << 63) - 1)
        if offer is not None and offer.token != token:
            raise RemoteProtocolError("IPC descriptor: token differs from its offer's")
        return (
            cls(
                rid=rid,
                plane=plane,
                n=n,
                reply_to=reply_to,
                token=token,
                src=src,
                # layer-wise: the events travel in the LayerReady messages, none here
                event=_bytes(d, "event", *((0, 0) if plane == LAYERS else (1, _MAX_HANDLE))),
                event_slot=_int(d, "event_slot", 0, 0 if plane == LAYERS else _MAX_EVENT_SLOT),
                lease=_float(d, "lease"),
                offer=offer,
                can_push=can_push and plane in ("ipc", LAYERS),
            ),
            layout,
        )


@dataclass(frozen=True, slots=True)
class Release:
    """Consumer → producer, tensor id ``f"{rid}#ipcrel"``: the copy is over.

    ``ok``: the blocks landed (the producer may free its blocks). ``fallback``: IPC
    did not work for this request and nothing was read; send it the ordinary way.
    Otherwise the request failed on the consumer and nothing reads the blocks any
    more either. ``reason``: for the log. ``push``: the consumer's export for push
    mode (sent once, with an ok release, by a consumer with ``IpcOptions(push=True)``).
    """

    rid: str
    ok: bool
    fallback: bool = False
    reason: str = ""
    push: PushOffer | None = None

    def to_wire(self) -> dict[str, Any]:
        d = {
            "v": WIRE_VERSION,
            "rid": self.rid,
            "ok": self.ok,
            "fallback": self.fallback,
            "reason": self.reason[:_MAX_REASON],
        }
        if self.push is not None:
            d["push"] = self.push.to_wire()
        return d

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Release:
        _exact_keys(d, "IPC release", ("v", "rid", "ok", "fallback", "reason", "push"))
        ok, fb = d.get("ok"), d.get("fallback")
        if not isinstance(ok, bool) or not isinstance(fb, bool) or (ok and fb):
            raise RemoteProtocolError("IPC release: ok/fallback must be booleans, not both true")
        push = None
        if "push" in d:
            if not ok:
                raise RemoteProtocolError("IPC release: a push offer only with an ok release")
            push = PushOffer.from_wire(d["push"])
        return cls(
            rid=_str(d, "rid", 4096),
            ok=ok,
            fallback=fb,
            reason=_str(d, "reason", _MAX_REASON),
            push=push,
        )


@dataclass(frozen=True, slots=True)
class PushOffer:
    """The consumer's export for push mode (docs/ipc.md, "Push mode"): its cache as an
    :class:`Offer` (``probe`` filled with :func:`probe_pattern` ``(nonce)``), a
    ``target`` of two segments the producer's verification zeroes, writes the probe
    into and reads back, and its first block of abort words."""

    offer: Offer
    target: StorageExport
    abort0: StorageExport
    bell: str = ""  # the grants' doorbell ring (consumer -> this producer), or none
    bell_key: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        bell = {"bell": self.bell, "bell_key": self.bell_key} if self.bell else {}
        return {
            **bell,
            "offer": self.offer.to_wire(),
            "target": self.target.to_wire(),
            "abort0": self.abort0.to_wire(),
        }

    @classmethod
    def from_wire(cls, d: object) -> PushOffer:
        if not isinstance(d, dict):
            raise RemoteProtocolError("IPC push offer must be a map")
        _exact_keys(d, "IPC push offer", ("offer", "target", "abort0", "bell", "bell_key"))
        bell, bell_key = _bell_fields(d, "IPC push offer")
        offer, layout = Offer.from_wire(d.get("offer"))
        if offer.bell:
            raise RemoteProtocolError("IPC push offer: no doorbell in this direction")
        target = StorageExport.from_wire(d.get("target"))
        if target.size < _PROBE_SEGMENTS * layout.segment_numel() * layout.itemsize:
            raise RemoteProtocolError("IPC push offer: target smaller than two segments")
        abort0 = StorageExport.from_wire(d.get("abort0"))
        if abort0.size < 4 * ABORT_WORDS:
            raise RemoteProtocolError("IPC push offer: abort block too small")
        return cls(offer, target, abort0, bell, bell_key)


@dataclass(frozen=True, slots=True)
class Grant:
    """Consumer → producer, tensor id ``f"{rid}#ipcgrant"`` (push mode): the consumer
    allocated blocks ``dst`` for request ``rid`` and lets the producer write them until
    ``until`` (``time.monotonic()`` of the host), with the kernel checking abort word
    ``slot`` (global number: word ``slot % ABORT_WORDS`` of block ``slot // ABORT_WORDS``;
    ``abort`` exports that block when the producer may not have it). ``gid`` names the
    grant (the producer's descriptor repeats it)."""

    rid: str
    gid: int
    dst: tuple[int, ...]
    slot: int
    until: float
    abort: StorageExport | None = None

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "v": WIRE_VERSION,
            "rid": self.rid,
            "gid": self.gid,
            "dst": struct.pack(f"<{len(self.dst)}I", *self.dst),
            "slot": self.slot,
            "until": self.until,
        }
        if self.abort is not None:
            d["abort"] = self.abort.to_wire()
        return d

    def to_ring(self) -> bytes:
        """The grants' doorbell record (no abort export: such a grant goes by the engine)."""
        assert self.abort is None
        rid = self.rid.encode()
        n = len(self.dst)
        head = _GRANT_RING.pack(_GRANT_MAGIC, 0, len(rid), n, self.gid, self.slot, self.until)
        return b"".join((head, rid, struct.pack(f"<{n}I", *self.dst)))

    @classmethod
    def from_ring(cls, b: bytes) -> Grant:
        """A grant ring record (untrusted): the field rules of :meth:`from_wire`, sizes
        that add up exactly. Raises :class:`~aiokv.RemoteProtocolError`."""
        if len(b) < _GRANT_RING.size:
            raise RemoteProtocolError(f"IPC grant record of {len(b)} bytes")
        magic, flags, lr, n, gid, slot, until = _GRANT_RING.unpack_from(b)
        if (
            magic != _GRANT_MAGIC
            or flags
            or not 1 <= n <= _MAX_BLOCKS_PER_REQUEST
            or not 1 <= gid <= _MAX_GID
            or slot >= _MAX_SLOT
            or not math.isfinite(until)
        ):
            raise RemoteProtocolError("IPC grant record: a field out of range")
        if len(b) != _GRANT_RING.size + lr + 4 * n:
            raise RemoteProtocolError(f"IPC grant record of {len(b)} bytes for {n} blocks")
        rid = _ring_rid(b, _GRANT_RING.size, lr)
        dst = struct.unpack_from(f"<{n}I", b, _GRANT_RING.size + lr)
        if len(set(dst)) != n:
            raise RemoteProtocolError("IPC grant: duplicate destination blocks")
        return cls(rid, gid, dst, slot, until)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Grant:
        """Parse and check (untrusted): the ids' range is the producer's to check
        against the consumer's layout."""
        _exact_keys(d, "IPC grant", ("v", "rid", "gid", "dst", "slot", "until", "abort"))
        dst_b = _bytes(d, "dst", 4, 4 * _MAX_BLOCKS_PER_REQUEST)
        if len(dst_b) % 4:
            raise RemoteProtocolError("IPC grant: block ids not a whole number of u32")
        dst = struct.unpack(f"<{len(dst_b) // 4}I", dst_b)
        if len(set(dst)) != len(dst):
            raise RemoteProtocolError("IPC grant: duplicate destination blocks")
        abort = None
        if "abort" in d:
            abort = StorageExport.from_wire(d["abort"])
            if abort.size < 4 * ABORT_WORDS:
                raise RemoteProtocolError("IPC grant: abort block too small")
        return cls(
            rid=_str(d, "rid", 4096),
            gid=_int(d, "gid", 1, _MAX_GID),
            dst=dst,
            slot=_int(d, "slot", 0, _MAX_SLOT - 1),
            until=_float(d, "until"),
            abort=abort,
        )


def revoke_record(magic: int, rid: str, gid: int) -> bytes:
    """A :data:`REVOKE` or :data:`REVOKED` ring record for grant ``gid`` of ``rid``."""
    r = rid.encode()
    return _REVOKE_RING.pack(magic, 0, len(r), gid) + r


def parse_revoke(b: bytes, magic: int) -> tuple[str, int]:
    """``(rid, gid)`` of a :data:`REVOKE` / :data:`REVOKED` record (untrusted). Raises
    :class:`~aiokv.RemoteProtocolError`."""
    if len(b) < _REVOKE_RING.size:
        raise RemoteProtocolError(f"IPC revoke record of {len(b)} bytes")
    m, flags, lr, gid = _REVOKE_RING.unpack_from(b)
    if m != magic or flags or not 1 <= gid <= _MAX_GID:
        raise RemoteProtocolError("IPC revoke record: a field out of range")
    if len(b) != _REVOKE_RING.size + lr:
        raise RemoteProtocolError(f"IPC revoke record of {len(b)} bytes for {lr}")
    return _ring_rid(b, _REVOKE_RING.size, lr), gid


def probe_pattern(nonce: int, nbytes: int, device: torch.device | str) -> torch.Tensor:
    """The verification pattern: ``nbytes`` pseudo-random bytes from ``nonce`` (same on
    every device: integer arithmetic only)."""
    i = torch.arange(nbytes, dtype=torch.int64, device=device)
    x = (i * 2654435761 + (nonce & 0xFFFFFFFF)) ^ (i >> 7) * 40503
    return ((x >> 3) & 0xFF).to(torch.uint8)
