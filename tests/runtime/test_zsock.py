"""LoopSocket: a plain zmq socket driven by the loop through its edge-triggered FD."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import zmq

from aiokv._runtime.zsock import LoopSocket, Outbox

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def _pair(ctx: zmq.Context[Any], **kw: Any) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    a = ctx.socket(zmq.PAIR)
    b = ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
        for k, v in kw.items():
            s.setsockopt(getattr(zmq, k), v)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    return a, b


async def _until(cond: Any, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.001)


async def test_every_message_arrives_in_order_across_batches() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = await _pair(ctx)
    got: list[int] = []
    rx = LoopSocket(b, lambda fr: got.append(int(fr[0].bytes)), max_batch=7)
    tx = LoopSocket(a)
    try:
        for i in range(1000):
            tx.send([str(i).encode()])
        await _until(lambda: len(got) == 1000)
        assert got == list(range(1000))
    finally:
        rx.close(0)
        tx.close(0)
        ctx.term()


async def test_a_callback_that_raises_does_not_strand_queued_messages() -> None:
    """The FD's edge is consumed by the read that raised: the socket must look again."""
    ctx: zmq.Context[Any] = zmq.Context()
    b = ctx.socket(zmq.PAIR)
    b.bind("inproc://zsock-strand")
    a = ctx.socket(zmq.PAIR)
    a.connect("inproc://zsock-strand")
    got: list[bytes] = []
    loop = asyncio.get_running_loop()
    errors: list[Any] = []
    loop.set_exception_handler(lambda _l, c: errors.append(c.get("exception")))

    def on_message(frames: list[zmq.Frame]) -> None:
        data = frames[0].bytes
        got.append(data)
        if data == b"boom":
            raise RuntimeError("handler bug")

    # everything is queued before the reader first looks: one edge for all of it
    a.send(b"boom")
    for i in range(5):
        a.send(str(i).encode())
    await asyncio.sleep(0.2)
    rx = LoopSocket(b, on_message)
    # whether zmq re-arms the FD after a read is not guaranteed (an edge may be all
    # there is): take the FD away so that only the socket's own re-check can read on
    loop.remove_reader(rx._fd)
    try:
        await _until(lambda: len(got) == 6)
        assert got == [b"boom", b"0", b"1", b"2", b"3", b"4"]
        assert any(isinstance(e, RuntimeError) for e in errors)
    finally:
        rx.close(0)
        a.close(0)
        ctx.term()


async def test_sends_that_would_block_keep_their_order() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = await _pair(ctx, SNDHWM=2, RCVHWM=2)
    tx = LoopSocket(a)
    rx: LoopSocket | None = None
    got: list[int] = []
    payload = b"x" * (256 << 10)  # 200 x 256 KiB: more than zmq's and the kernel's buffers
    try:
        for i in range(200):
            tx.send([str(i).encode(), payload])
        waited = asyncio.ensure_future(tx.send_wait([b"last", b""]))
        await asyncio.sleep(0.1)
        assert not waited.done()  # the receiver has not read: the queues are full
        rx = LoopSocket(
            b, lambda fr: got.append(-1 if fr[0].bytes == b"last" else int(fr[0].bytes))
        )
        await asyncio.wait_for(waited, 10)
        await _until(lambda: len(got) == 201)
        assert got == [*range(200), -1]
    finally:
        if rx is not None:
            rx.close(0)
        else:
            b.close(0)
        tx.close(0)
        ctx.term()


# --------------------------------------------------------------------------- Outbox


async def test_outbox_coalesces_a_loop_pass_and_flushes_at_once_when_asked() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = await _pair(ctx)
    msgs: list[list[bytes]] = []
    rx = LoopSocket(b, lambda fr: msgs.append([f.bytes for f in fr]))
    tx = LoopSocket(a)
    errors: list[Any] = []
    out = Outbox(tx, errors.append, max_frames=3)
    try:
        for i in range(7):  # one loop pass: split into messages of at most 3 frames
            out.put([b"%d" % i])
        assert len(out) == 7  # nothing left yet: it goes at the end of the pass
        await _until(lambda: sum(map(len, msgs)) == 7)
        assert msgs == [[b"0", b"1", b"2"], [b"3", b"4", b"5"], [b"6"]]
        msgs.clear()
        out.put([b"a"])
        out.put([b"b"], now=True)  # a waiting caller: both leave now, in order
        assert len(out) == 0
        await _until(lambda: len(msgs) == 1)
        assert msgs == [[b"a", b"b"]] and not errors
    finally:
        rx.close(0)
        tx.close(0)
        ctx.term()


async def test_outbox_batches_by_frames_and_bytes_and_keeps_a_put_whole() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = await _pair(ctx)
    msgs: list[list[bytes]] = []
    rx = LoopSocket(b, lambda fr: msgs.append([f.bytes for f in fr]))
    tx = LoopSocket(a)
    out = Outbox(tx, lambda e: None, copy=False, batch_frames=4, batch_bytes=100)
    try:
        out.put([b"h1", b"x"], nbytes=1)
        out.put([b"h2", b"y", b"z"], nbytes=2)  # 5 frames >= 4: sent now, as one message
        assert len(out) == 0
        out.put([b"h3", b"big"], nbytes=100)  # 100 bytes: now
        out.put([b"h4", b"s"], nbytes=1)  # below both: end of the pass
        assert len(out) == 2
        await _until(lambda: len(msgs) == 3)
        assert msgs == [[b"h1", b"x", b"h2", b"y", b"z"], [b"h3", b"big"], [b"h4", b"s"]]
    finally:
        rx.close(0)
        tx.close(0)
        ctx.term()


async def test_outbox_failure_reports_once_and_closing_drops_what_is_queued() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    r.setsockopt(zmq.ROUTER_MANDATORY, 1)
    r.bind("inproc://zsock-outbox")
    tx = LoopSocket(r)
    errors: list[zmq.ZMQError] = []
    out = Outbox(tx, errors.append, prefix=b"nobody")
    try:
        out.put([b"m1"])
        out.put([b"m2"], now=True)  # no such peer: EHOSTUNREACH
        assert len(errors) == 1 and out.closed
        out.put([b"m3"], now=True)  # dropped: the owner was told once
        assert len(errors) == 1 and len(out) == 0
        out2 = Outbox(tx, errors.append, prefix=b"nobody")
        out2.put([b"x"])
        out2.close()
        await asyncio.sleep(0.01)  # the pass ends: nothing is sent, nothing fails
        assert len(errors) == 1
    finally:
        tx.close(0)
        ctx.term()


async def test_on_drained_follows_each_run_of_messages() -> None:
    """The owner hears once per run of messages read together (to answer them with one
    reply), after the last of them, and never for a wake-up that read nothing."""
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = await _pair(ctx)
    events: list[str] = []
    rx = LoopSocket(
        b,
        lambda fr: events.append(fr[0].bytes.decode()),
        on_drained=lambda: events.append("|"),
        max_batch=4,
    )
    tx = LoopSocket(a)
    try:
        for i in range(10):
            tx.send([b"%d" % i])
        await _until(lambda: events.count("|") >= 3 and len(events) >= 13)
        assert [e for e in events if e != "|"] == [str(i) for i in range(10)]
        assert events[-1] == "|"  # the last message is followed by its run's end
        runs = "".join("m" if e != "|" else "|" for e in events).split("|")[:-1]
        assert all(0 < len(r) <= 4 for r in runs)  # runs respect max_batch, none empty
        n = len(events)
        rx._ready()  # a look that reads nothing: no call
        assert len(events) == n
    finally:
        rx.close(0)
        tx.close(0)
        ctx.term()


async def test_direct_multipart_send_and_receive_match_pyzmq() -> None:
    """send_parts/recv_parts (the backend called directly) keep multipart framing: a
    part that is not a buffer fails before anything was sent, so the next message
    is not glued to half of the bad one."""
    from aiokv._runtime.zsock import recv_parts, send_parts

    ctx: zmq.Context[Any] = zmq.Context()
    a, b = await _pair(ctx)
    try:
        with pytest.raises(TypeError):
            send_parts(a, [b"head", object(), b"tail"], 0, True)
        payload = bytearray(b"x" * 70000)  # over pyzmq's copy threshold: zero-copy path
        send_parts(a, [b"one", memoryview(payload), zmq.Frame(b"three")], 0, False)
        send_parts(a, [b"solo"], 0, True)
        b.setsockopt(zmq.RCVTIMEO, 5000)
        first = recv_parts(b, 0)
        assert [f.bytes for f in first] == [b"one", bytes(payload), b"three"]
        assert [f.bytes for f in recv_parts(b, 0)] == [b"solo"]
        with pytest.raises(zmq.Again):
            recv_parts(b, zmq.NOBLOCK)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def _costly(ms: float, got: list[int]) -> Any:
    """An on_message that costs ``ms`` of CPU (a 1000-tensor RESERVE is ~3-7 ms here)."""

    def on(fr: list[zmq.Frame]) -> None:
        until = time.perf_counter() + ms / 1e3
        while time.perf_counter() < until:
            pass
        got.append(int(fr[0].bytes))

    return on


async def test_a_run_stops_before_a_message_that_would_overrun_its_budget() -> None:
    """Messages that cost 3 ms each against a 5 ms budget: one per run, not two (the
    second would end at 6 ms: the run stops when the next message, costing what the
    last one did, would end past the budget, not only once past it)."""
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = await _pair(ctx)
    got: list[int] = []
    tx = LoopSocket(a)
    rx = None
    try:
        for i in range(4):
            tx.send([b"%d" % i])
        await asyncio.sleep(0.2)
        assert b.poll(1000, zmq.POLLIN)  # queued in b, nobody reads b yet
        rx = LoopSocket(b, _costly(3.0, got), max_busy_s=0.005)
        rx._ready()  # (before the loop runs anything: this is the only reader)
        assert got == [0]
        rx._ready()
        assert got == [0, 1]
    finally:
        if rx is not None:
            rx.close(0)
        tx.close(0)
        ctx.term()


async def test_a_flood_of_costly_messages_leaves_timers_their_turn() -> None:
    """A queue of 3 ms messages: a task sleeping 2 ms at a time sees at most a few of them
    handled between two of its wake-ups -- one run per loop pass (the FD's event does
    not add a second run to a pass that already has one queued), one message per run.
    Run by run that was two runs of two messages per pass, eight or more between ticks."""
    ctx: zmq.Context[Any] = zmq.Context()
    a, b = await _pair(ctx)
    got: list[int] = []
    rx = LoopSocket(b, _costly(3.0, got), max_busy_s=0.005)
    tx = LoopSocket(a)
    between: list[int] = []
    try:
        await asyncio.sleep(0.05)
        for i in range(80):
            tx.send([b"%d" % i])
        last = len(got)
        while len(got) < 80:
            await asyncio.sleep(0.002)
            between.append(len(got) - last)
            last = len(got)
        assert got == list(range(80))
        assert max(between) <= 4, between
    finally:
        rx.close(0)
        tx.close(0)
        ctx.term()
