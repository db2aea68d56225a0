"""GET mode, both ends: publishing tensors for peers to fetch, and fetching them.

:class:`_GetMode` is a part the :class:`~aiokv.engine.engine.Engine` owns: the
producer's table of published tensors (``publish``, ``unpublish``, ``wait_fetched``,
and the claim the server side makes when a peer's GET arrives) and the consumer's
``get``, whose concurrent calls for one id share one GET. It holds the engine as a
:class:`~aiokv.engine.interfaces.GetModeOwner` (its configuration, loop and address,
its checks, its client sessions and ``recv``); the engine's public calls of the same
names hand over to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from aiokv._exceptions import (
    ConfigError,
    NotPublishedError,
    TransferAbortedError,
    TransferTimeoutError,
)
from aiokv._runtime.deadlines import _await_shielded, _Deadline, _retrieve
from aiokv.engine.interfaces import GetModeOwner
from aiokv.engine.staging import _prepare
from aiokv.protocol.messages import Get, GetReply

__all__: list[str] = []

log = logging.getLogger("aiokv")


@dataclass(slots=True, eq=False)
class _SharedGet:
    """One GET in flight and how many :meth:`Engine.get` calls wait for it."""

    task: asyncio.Task[torch.Tensor]
    waiters: int = 0


class _GetMode:
    """GET mode's state and calls (see the module); a part of the engine."""

    def __init__(self, owner: GetModeOwner) -> None:
        self._owner = owner
        self.config = owner.config
        self._published: dict[str, torch.Tensor] = {}
        # published for one GET only (``publish(once=True)``) until served or unpublished
        self._once: set[str] = set()
        # once-published tensors served and not yet waited for: the requester's address
        self._fetched: OrderedDict[str, str] = OrderedDict()
        self._fetch_waiters: dict[str, asyncio.Future[str]] = {}
        self._on_get: dict[str, Callable[[str], None]] = {}  # publish(on_get=...)
        # GETs in flight, by (producer, tensor id): concurrent gets of one id share one
        # GET (the producer sends the id once; a second copy would be a duplicate)
        self._getting: dict[tuple[str, str], _SharedGet] = {}

    def fail_waiters(self, exc: BaseException) -> None:
        """The engine closes: nobody can fetch any more."""
        for w in self._fetch_waiters.values():
            if not w.done():
                w.set_exception(exc)

    def publish(
        self,
        tensor_id: str,
        tensor: torch.Tensor,
        *,
        once: bool = False,
        on_get: Callable[[str], None] | None = None,
    ) -> None:
        """GET mode, producer side: see :meth:`Engine.publish`."""
        self._owner._check_open()
        _prepare([(tensor_id, tensor)], self.config.limits.max_id_length)
        if (
            tensor_id not in self._published
            and len(self._published) >= self.config.limits.max_published
        ):
            raise ConfigError(f"more than {self.config.limits.max_published} published tensors")
        self._published[tensor_id] = tensor
        self._fetched.pop(tensor_id, None)
        if on_get is not None:
            self._on_get[tensor_id] = on_get
        else:
            self._on_get.pop(tensor_id, None)
        if once:
            self._once.add(tensor_id)
        else:
            self._once.discard(tensor_id)

    def unpublish(self, tensor_id: str) -> bool:
        """See :meth:`Engine.unpublish`."""
        self._owner._check_loop()
        self._once.discard(tensor_id)
        self._fetched.pop(tensor_id, None)
        self._on_get.pop(tensor_id, None)
        fut = self._fetch_waiters.pop(tensor_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(NotPublishedError(f"{tensor_id!r} was unpublished"))
        return self._published.pop(tensor_id, None) is not None

    async def wait_fetched(self, tensor_id: str, *, timeout: float | None = None) -> str:
        """GET mode, producer side: see :meth:`Engine.wait_fetched`."""
        self._owner._check_open()
        address = self._fetched.pop(tensor_id, None)
        if address is not None:
            return address
        if tensor_id not in self._once:
            raise NotPublishedError(f"{tensor_id!r} is not published with once=True")
        if tensor_id in self._fetch_waiters:
            raise ConfigError(f"wait_fetched({tensor_id!r}) is already waiting")
        t = self._owner._timeout(timeout)
        fut: asyncio.Future[str] = self._owner._loop.create_future()
        fut.add_done_callback(_retrieve)
        self._fetch_waiters[tensor_id] = fut
        try:
            address = await _await_shielded(fut, t)
            return str(address)
        except TimeoutError:
            raise TransferTimeoutError(f"nobody fetched {tensor_id!r} within {t:.3g}s") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._fetched[tensor_id] = fut.result()  # served meanwhile: not lost
            raise
        finally:
            if self._fetch_waiters.get(tensor_id) is fut:
                del self._fetch_waiters[tensor_id]

    def claim_published(
        self, tensor_ids: Sequence[str], address: str
    ) -> list[tuple[str, torch.Tensor]]:
        """A GET of these (all published) for the session at ``address`` starts: a
        once-published one is that peer's from now on (it leaves the table, and
        :meth:`wait_fetched` learns the address at once, not a round trip later when the
        tensor has landed: a producer waiting to send that peer more starts now)."""
        items = [(t, self._published[t]) for t in tensor_ids]
        for t in tensor_ids:
            cb = self._on_get.get(t)
            if cb is not None:
                try:
                    cb(address)
                except Exception:
                    log.exception("on_get callback of published %r failed", t)
            if t not in self._once:
                continue
            self._published.pop(t, None)
            self._once.discard(t)
            self._on_get.pop(t, None)
            # one loop pass later: the GET's own reply (spawned next by the server) starts
            # first, and whatever the waiter sends that peer goes after it
            self._owner._loop.call_soon(self._fetched_by, t, address)
        return items

    def _fetched_by(self, tensor_id: str, address: str) -> None:
        """A once-published tensor was taken by the peer at ``address``: tell its
        :meth:`wait_fetched`, or keep it for the next one."""
        fut = self._fetch_waiters.pop(tensor_id, None)
        if fut is not None and not fut.done():
            fut.set_result(address)
            return
        self._fetched[tensor_id] = address
        while len(self._fetched) > self.config.limits.max_published:
            self._fetched.popitem(last=False)

    async def get(self, tensor_id: str, *, frm: str, timeout: float | None = None) -> torch.Tensor:
        """GET mode, consumer side: see :meth:`Engine.get`."""
        self._owner._check_open()
        self._owner._check_id(tensor_id)
        t = self._owner._timeout(timeout)
        key = (frm, tensor_id)
        sg = self._getting.get(key)
        if sg is None:
            sg = _SharedGet(self._owner._loop.create_task(self._get(tensor_id, frm, t)))
            sg.task.add_done_callback(_retrieve)
            sg.task.add_done_callback(lambda _t: self._got(key, sg))
            self._getting[key] = sg
        sg.waiters += 1
        try:
            return await _await_shielded(sg.task, t)  # type: ignore[no-any-return]
        except TimeoutError:
            if sg.task.done():
                raise  # the shared GET's own TransferTimeoutError
            raise TransferTimeoutError(f"GET {tensor_id!r} from {frm}: no reply in time") from None
        finally:
            sg.waiters -= 1
            if not sg.waiters and not sg.task.done():
                sg.task.cancel()  # nobody waits any more (a tensor handed over goes back)

    def _got(self, key: tuple[str, str], sg: _SharedGet) -> None:
        if self._getting.get(key) is sg:
            del self._getting[key]

    async def _get(self, tensor_id: str, frm: str, t: float) -> torch.Tensor:
        """One GET: ask ``frm`` for ``tensor_id`` and collect it (see :meth:`get`)."""
        dl = _Deadline(t)
        cs = await self._owner._client(frm, dl)
        req = next(cs.get_ids)
        reply: asyncio.Future[GetReply] = asyncio.get_running_loop().create_future()
        reply.add_done_callback(_retrieve)
        cs.gets[req] = reply
        cs._send_ctrl(cs.sess.send(Get(req, (tensor_id,), self._owner.address)))
        peer_id = cs.peer_id
        try:
            r = await _await_shielded(reply, dl.left())
        except TimeoutError:
            cs.gets.pop(req, None)
            raise TransferTimeoutError(f"GET {tensor_id!r} from {frm}: no reply in time") from None
        if r.code == "not_published":
            raise NotPublishedError(f"{frm} does not publish {tensor_id!r}")
        if r.code != "ok":
            raise TransferAbortedError(f"GET {tensor_id!r} from {frm} failed: {r.code}: {r.detail}")
        return await self._owner._recv(tensor_id, peer_id or frm, dl.left())

    def is_published(self, tensor_id: str) -> bool:
        """Whether a GET of ``tensor_id`` finds it published now."""
        return tensor_id in self._published
