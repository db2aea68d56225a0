"""Read deadlines for the router's client connections (slow clients).

uvicorn bounds an idle keep-alive connection (``timeout_keep_alive``) but
nothing else: a client that sends a request head one byte at a time, or a
body that never ends, holds its connection, its file descriptor and (for the
body) a handler forever, because every byte received cancels the keep-alive
timer and h11's size limit (``h11_max_incomplete_event_size``) only bounds
how large an unfinished head may grow, not how long it may take.

:func:`deadline_protocol` makes uvicorn's h11 protocol class with two
deadlines, checked by a timer on the event loop (no task per connection):

* ``header_timeout``: from the moment the connection opens, or the previous
  response ends, the next request head must be complete within this many
  seconds;
* ``body_timeout``: from the moment the head is complete, the whole body must
  be received within this many seconds.

A connection that misses a deadline is closed (a handler still reading the
body then sees the client disconnect); the close is logged at debug level.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["deadline_protocol"]

log = logging.getLogger("aiokv.serving.router")


class _DeadlineH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    body_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        #: what the armed deadline waits for: ("head", the cycle before it) or ("body", cycle)
        self._waiting: tuple[str, object] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def _track(self) -> None:
        """Arm the deadline of what the connection waits for now, once per phase."""
        if self.transport.is_closing():
            self._disarm()
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            phase: tuple[str, object] | None = ("head", cycle)
            timeout = self.header_timeout
        elif cycle.more_body:
            phase, timeout = ("body", cycle), self.body_timeout
        else:  # the request is in; the handler's own timeouts bound the response
            phase = None
        if phase == self._waiting:
            return
        self._disarm()
        self._waiting = phase
        if phase is not None:
            self._deadline = self.loop.call_later(timeout, self._expired, phase[0], timeout)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._waiting = None

    def _expired(self, what: str, timeout: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.debug(
            "closing the connection of %s: request %s not received in %gs", peer, what, timeout
        )
        self.transport.close()


def deadline_protocol(header_timeout: float, body_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with these read deadlines (pass it as ``http=``)."""
    if header_timeout <= 0 or body_timeout <= 0:
        raise ValueError("read deadlines must be positive")
    return type(
        "DeadlineH11Protocol",
        (_DeadlineH11Protocol,),
        {"header_timeout": float(header_timeout), "body_timeout": float(body_timeout)},
    )
