"""The layer-wise stream's message (:class:`LayerReady`), its validation and how a loop
pass's saved layers become messages (:func:`layer_messages`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..._exceptions import RemoteProtocolError
from ._wire import (
    _MAX_EVENT_SLOT,
    _MAX_HANDLE,
    WIRE_VERSION,
    _bytes,
    _exact_keys,
    _int,
    _str,
)

__all__ = ["LayerReady", "layer_messages"]


@dataclass(frozen=True, slots=True)
class LayerReady:
    """Producer → consumer, tensor id ``f"{rid}#ipcL{lo}"`` (layer-wise streaming
    only): layers from ``lo`` on, in chunks. Each mark ``(hi, event, event_slot)``
    ends a chunk: the layers from where the chunk before it ended (``lo`` for the
    first) to ``hi - 1`` are written once IPC event ``event`` (slot ``event_slot``)
    fired. The producer sends one message per run of consecutive layers saved in one
    loop pass (:func:`layer_messages`: a forward that saves its 32 layers without
    yielding sends one message with 32 marks, not 32 messages); the messages of one
    request partition ``[0, num_layers)``, so the consumer asks for ``#ipcL0`` first
    and then for the message that starts where the last one ended."""

    rid: str
    lo: int
    marks: tuple[tuple[int, bytes, int], ...]

    @property
    def hi(self) -> int:
        """Where this message's layers end (exclusive)."""
        return self.marks[-1][0]

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": WIRE_VERSION,
            "rid": self.rid,
            "lo": self.lo,
            "marks": [list(mk) for mk in self.marks],
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any], num_layers: int) -> LayerReady:
        """Parse and check against the consumer's layer count (untrusted): at least one
        mark, at most one per layer, their ends strictly rising within ``num_layers``."""
        _exact_keys(d, "IPC layer message", ("v", "rid", "lo", "marks"))
        lo = _int(d, "lo", 0, num_layers - 1)
        raw = d.get("marks")
        if type(raw) is not list or not 0 < len(raw) <= num_layers - lo:
            raise RemoteProtocolError(
                f"IPC layer message: marks not a list of 1..{num_layers - lo} entries"
            )
        marks = []
        prev = lo
        for mk in raw:
            if type(mk) is not list or len(mk) != 3:
                raise RemoteProtocolError("IPC layer message: a mark is not [hi, event, slot]")
            f = dict(zip(("hi", "event", "event_slot"), mk))
            hi = _int(f, "hi", prev + 1, num_layers)
            marks.append(
                (hi, _bytes(f, "event", 1, _MAX_HANDLE), _int(f, "event_slot", 0, _MAX_EVENT_SLOT))
            )
            prev = hi
        return cls(rid=_str(d, "rid", 4096), lo=lo, marks=tuple(marks))


def layer_messages(rid: str, saved: Sequence[tuple[int, bytes, int]]) -> list[LayerReady]:
    """The :class:`LayerReady` messages announcing ``saved`` -- ``(layer, event,
    event_slot)`` of layers saved in one loop pass, each once, in any order: one
    message per run of consecutive layers, each layer its own mark (its own event, so
    the consumer still copies layer by layer as they become ready)."""
    out: list[LayerReady] = []
    run: list[tuple[int, bytes, int]] = []
    lo = nxt = -1
    for layer, event, slot in sorted(saved, key=lambda x: x[0]):
        if run and layer != nxt:
            out.append(LayerReady(rid, lo, tuple(run)))
            run = []
        if not run:
            lo = layer
        run.append((layer + 1, event, slot))
        nxt = layer + 1
    if run:
        out.append(LayerReady(rid, lo, tuple(run)))
    return out
