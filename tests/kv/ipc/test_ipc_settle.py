"""How the producer settles a request after the consumer's release, in both roles.

``IpcPlane.send_request`` (whole request) and ``IpcPlane.wait_saved`` (layer-wise) wait
for the same release and settle it the same way -- events back to the pool, counters,
``finished_sending()``, a fallback -- with one edge on purpose different: a non-cancel
error while waiting (here: a release naming another request) counts as a send failure
in ``wait_saved`` only. This table pins every outcome for both, so that the one helper
they share keeps each role's behaviour. The release comes through a scripted
:class:`~aiokv.kv.ipc.ControlChannel` (no consumer); CUDA is faked as in
tests/kv/ipc/test_ipc_plane.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from support.kvutil import filled, make_layout
from test_ipc_plane import OPTS, FakeBackend

from aiokv import (
    Engine,
    EngineConfig,
    RemoteProtocolError,
    TransferAbortedError,
    TransferTimeoutError,
)
from aiokv.kv import KVConnector
from aiokv.kv.ipc import IpcPlane, Release, encode_message

PEER = "127.0.0.1:9"  # never contacted: the channel is scripted


class ScriptedChannel:
    """Sends go nowhere; the release of a request is whatever ``outcome`` says."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self.sent: list[str] = []
        self.gate = asyncio.Event()  # "cancelled": the release arrives once set

    def send(self, tensor_id: str, msg: Any, *, to: str, timeout: float) -> Any:
        self.sent.append(tensor_id)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def recv(self, tensor_id: str, *, frm: str | None, timeout: float) -> Any:
        rid = tensor_id.split("#")[0]
        o = self.outcome
        if o == "lease":
            raise TransferTimeoutError("no release (scripted)")
        if o == "cancelled":
            await self.gate.wait()
            o = "ok"
        rel = {
            "ok": Release(rid, True),
            "fallback": Release(rid, False, fallback=True, reason="map_failed"),
            "failed": Release(rid, False, reason="cancelled"),
            "other_rid": Release(rid + "x", True),
        }[o]
        return encode_message(rel.to_wire())


@asynccontextmanager
async def producer(outcome: str) -> AsyncIterator[tuple[KVConnector, IpcPlane, ScriptedChannel]]:
    pl = make_layout("fa", "bfloat16", 20)
    async with Engine(EngineConfig(layout=pl.to_wire())) as eng:
        con = KVConnector(eng, pl, filled(pl, 1), ipc=OPTS)
        ch = ScriptedChannel(outcome)
        plane = IpcPlane(con._port, OPTS, backend=FakeBackend(), channel=ch)
        con._ipc = plane
        plain: list[str] = []

        # the plane's ordinary path is the connector port's *_plain calls, and only those
        async def plain_send(rid: str, ids: Any, **kw: Any) -> None:
            plain.append(f"send:{rid}")

        def plain_save(rid: str, layer: int, ids: Any, **kw: Any) -> None:
            plain.append(f"save:{rid}:{layer}")

        async def plain_wait(rid: str) -> None:
            plain.append(f"wait:{rid}")

        port = con._port
        port.send_plain = plain_send  # type: ignore[method-assign]
        port.save_layer_plain = plain_save  # type: ignore[method-assign]
        port.wait_saved_plain = plain_wait  # type: ignore[method-assign]
        con.plain_calls = plain  # type: ignore[attr-defined]
        try:
            yield con, plane, ch
        finally:
            await plane.aclose(timeout=1)


async def run_role(role: str, con: KVConnector, plane: IpcPlane) -> None:
    if role == "send_request":
        await plane.send_request("r", [1, 2], to=PEER, timeout=5)
        return
    for layer in range(con.layout.num_layers):
        plane.save_layer("r", layer, [1, 2], to=PEER, timeout=5)
    await plane.wait_saved("r")


# outcome -> (exception, send_failures by role, lease_expired, finished, events back, fallback)
TABLE: dict[str, tuple[type[BaseException] | None, dict[str, int], int, bool, bool, bool]] = {
    "ok": (None, {"send_request": 0, "wait_saved": 0}, 0, True, True, False),
    "fallback": (None, {"send_request": 0, "wait_saved": 0}, 0, False, True, True),
    "failed": (TransferAbortedError, {"send_request": 1, "wait_saved": 1}, 0, False, True, False),
    "lease": (TransferTimeoutError, {"send_request": 1, "wait_saved": 1}, 1, False, False, False),
    # the one edge that differs: wait_saved counts this error as a send failure
    "other_rid": (
        RemoteProtocolError,
        {"send_request": 0, "wait_saved": 1},
        0,
        False,
        False,
        False,
    ),
}


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("role", ["send_request", "wait_saved"])
@pytest.mark.parametrize("outcome", sorted(TABLE))
async def test_settle_outcomes(role: str, outcome: str) -> None:
    exc, failures, expired, finished, events_back, fellback = TABLE[outcome]
    async with producer(outcome) as (con, plane, _ch):
        if exc is None:
            await run_role(role, con, plane)
        else:
            with pytest.raises(exc):
                await run_role(role, con, plane)
        st, ipc = con._st.stats, plane.statistics()
        assert st.send_failures == failures[role]
        assert ipc.lease_expired == expired
        assert ("r" in con._st.finished_sent) == finished
        n_events = 1 if role == "send_request" else con.layout.num_layers
        assert len(plane.producer.free_events) == (n_events if events_back else 0)
        assert ipc.requests_sent == (1 if finished else 0)
        assert st.requests_sent == (1 if finished else 0)
        assert (PEER in plane.producer.acked) == finished
        plain = con.plain_calls  # type: ignore[attr-defined]
        if fellback:
            assert plane.producer.broken_to == {PEER: "map_failed"}
            assert ipc.fallbacks == {"map_failed": 1}
            if role == "send_request":
                assert plain == ["send:r"]
            else:
                L = con.layout.num_layers
                assert plain == [*(f"save:r:{i}" for i in range(L)), "wait:r"]
        else:
            assert plane.producer.broken_to == {} and ipc.fallbacks == {} and plain == []
        if finished:
            assert st.bytes_sent == con.layout.request_nbytes(2)


@pytest.mark.anyio
@pytest.mark.timeout(30)
@pytest.mark.parametrize("role", ["send_request", "wait_saved"])
async def test_settle_cancelled(role: str) -> None:
    """Cancelled while the consumer may still read: one send failure at once; the events
    come back and the request joins finished_sending() only when the release arrives."""
    async with producer("cancelled") as (con, plane, ch):
        task = asyncio.create_task(run_role(role, con, plane))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert con._st.stats.send_failures == 1
        assert "r" not in con._st.finished_sent and plane.producer.free_events == []
        ch.gate.set()
        for _ in range(100):
            if "r" in con._st.finished_sent:
                break
            await asyncio.sleep(0.01)
        assert "r" in con._st.finished_sent
        n_events = 1 if role == "send_request" else con.layout.num_layers
        assert len(plane.producer.free_events) == n_events
        assert con._st.stats.send_failures == 1 and plane.statistics().requests_sent == 0
