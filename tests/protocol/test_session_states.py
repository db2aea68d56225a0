"""Session state machine: every transition from the docstring table, checked from both ends.

The expected legality comes from :func:`oracle`, written from the table in
``aiokv/protocol/session.py``'s docstring (not from its data tables), so a
wrong table is caught too. Sessions are paired over a fake link (h11 style).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aiokv
from aiokv.protocol import messages as m
from aiokv.protocol.codec import Codec
from aiokv.protocol.session import Role, Session, SessionState, XferState

pytestmark = pytest.mark.timeout(120)

C, S = Role.CLIENT, Role.SERVER
CODEC = Codec()
SPEC = (m.TensorSpec("t", "float32", (4,)),)


def hello(version: int = m.PROTOCOL_VERSION) -> m.Hello:
    return m.Hello(version, "client-id", "127.0.0.1:1", ("tcp",), None)


def welcome(version: int = m.PROTOCOL_VERSION) -> m.Welcome:
    return m.Welcome(version, "server-id", "127.0.0.1:2", ("tcp",), None, b"\x01" * 16)


def link(sender: Session, receiver: Session, msg: m.Message) -> m.Message:
    return receiver.receive(sender.send(msg))


def snap(s: Session) -> dict[str, Any]:
    return {
        f.name: copy.deepcopy(getattr(s, f.name))
        for f in dataclasses.fields(s)
        if f.name != "codec"
    }


def pair_open() -> tuple[Session, Session]:
    c, s = Session(C), Session(S)
    link(c, s, hello())
    link(s, c, welcome())
    assert c.state is s.state is SessionState.OPEN
    return c, s


def pair_in(xstate: XferState | None) -> tuple[Session, Session]:
    """An open pair with transfer 1 in ``xstate`` on both ends (None: no transfer)."""
    c, s = pair_open()
    if xstate is None:
        return c, s
    link(c, s, m.Reserve(c.new_xfer_id(), "tcp", SPEC))
    if xstate is XferState.WITHDRAWING:
        link(c, s, m.Withdraw(1))
    if xstate in (XferState.GRANTED, XferState.SENT):
        link(s, c, m.Grant(1, 0))
    if xstate is XferState.SENT:
        link(c, s, m.DataHeader(1, 0, 1))
    assert c.xfer_state(1) is s.xfer_state(1) is xstate
    return c, s


CONFIGS: dict[str, Callable[[], tuple[Session, Session]]] = {
    "idle": lambda: (Session(C), Session(S)),
    "hello_sent": lambda: _hello_sent(),
    "open": lambda: pair_in(None),
    "reserved": lambda: pair_in(XferState.RESERVED),
    "withdrawing": lambda: pair_in(XferState.WITHDRAWING),
    "granted": lambda: pair_in(XferState.GRANTED),
    "sent": lambda: pair_in(XferState.SENT),
    "closed": lambda: _closed(),
}


def _hello_sent() -> tuple[Session, Session]:
    c, s = Session(C), Session(S)
    link(c, s, hello())
    assert c.state is SessionState.HELLO_SENT and s.state is SessionState.OPEN
    return c, s


def _closed() -> tuple[Session, Session]:
    c, s = pair_in(XferState.GRANTED)
    link(c, s, m.Bye())
    assert c.state is s.state is SessionState.CLOSED
    return c, s


def candidates(sess: Session, xfer: int) -> list[m.Message]:
    """One message of every type, aimed at transfer ``xfer``, with otherwise valid fields."""
    x = sess._xfers.get(xfer)
    seq = x.seq if x is not None and x.seq >= 0 else 0
    return [
        hello(),
        welcome(),
        m.DataHello(b"\x01" * 16),
        m.Reserve(xfer, "tcp", SPEC),
        m.Grant(xfer, sess.next_grant_seq),
        m.Refuse(xfer, "busy", ""),
        m.Withdraw(xfer),
        m.Withdrawn(xfer),
        m.DataHeader(xfer, seq, 1),
        m.Done(xfer),
        m.Failed(xfer, "aborted", ""),
        m.Get(7, ("t",), "127.0.0.1:1"),
        m.GetReply(7, "ok", ""),
        m.NcclSetup(7, b"\x00" * 128),
        m.NcclReady(7, True, ""),
        m.Ping(1),
        m.Pong(1),
        m.ErrorMsg("protocol", "x"),
        m.Bye(),
    ]


R, W, G, SE = XferState.RESERVED, XferState.WITHDRAWING, XferState.GRANTED, XferState.SENT
# The docstring's transfer table: (sender, type) -> allowed "before" states (None = must not exist).
XFER_TABLE: dict[tuple[Role, type], set[Any]] = {
    (C, m.Reserve): {None},
    (S, m.Grant): {R, W},
    (S, m.Refuse): {R, W},
    (C, m.Withdraw): {R, G},
    (S, m.Withdrawn): {W},
    (C, m.DataHeader): {G},
    (S, m.Done): {SE},
    (C, m.Failed): {R, W, G, SE},
    (S, m.Failed): {R, W, G, SE},
}
SESSION_MSGS = {C: {m.Get, m.NcclSetup, m.Ping}, S: {m.GetReply, m.NcclReady, m.Pong}}


def oracle(me: Session, sender: Role, msg: m.Message, xstate: Any) -> bool:
    t = type(msg)
    state = me.state
    if state is SessionState.CLOSED:
        return False
    if t in (m.Bye, m.ErrorMsg):
        return True
    sending = sender is me.role
    if t is m.Hello:
        return sender is C and state is SessionState.IDLE
    if t is m.Welcome:
        if sender is not S:
            return False
        return state is (SessionState.OPEN if sending else SessionState.HELLO_SENT)
    if t is m.DataHello or state is not SessionState.OPEN:
        return False
    if (sender, t) in XFER_TABLE:
        if t is m.Withdraw and xstate is None and 0 < msg.xfer <= me.max_xfer_seen:  # type: ignore[attr-defined]
            return True  # crossed an end (REFUSE/FAILED) of a transfer that did exist: moot
        return xstate in XFER_TABLE[(sender, t)]
    if (C, t) in XFER_TABLE or (S, t) in XFER_TABLE:
        return False  # a transfer message from the wrong end
    if any(t in v for v in SESSION_MSGS.values()):
        if t not in SESSION_MSGS[sender]:
            return False
        # a reply to a request never made (GET_REPLY 7 / NCCL_READY 7) is illegal
        return t not in (m.GetReply, m.NcclReady)
    raise AssertionError(f"oracle has no rule for {t.__name__}")


def test_every_transition_from_both_ends() -> None:
    checked = legal = 0
    failures: list[str] = []
    for cname, factory in CONFIGS.items():
        for end in (C, S):
            for direction in ("send", "receive"):
                for xfer in (1, 9):
                    proto = factory()[0 if end is C else 1]
                    for i in range(len(candidates(proto, xfer))):
                        pair = factory()
                        me = pair[0 if end is C else 1]
                        msg = candidates(me, xfer)[i]
                        x = me._xfers.get(xfer)
                        xstate = x.state if x is not None else None
                        sender = end if direction == "send" else (S if end is C else C)
                        want = oracle(me, sender, msg, xstate)
                        before = snap(me)
                        err_t = (
                            aiokv.LocalProtocolError
                            if direction == "send"
                            else aiokv.RemoteProtocolError
                        )
                        where = f"{cname}/{end.value}/{direction} {msg.NAME} xfer={xfer} ({xstate})"
                        checked += 1
                        try:
                            if direction == "send":
                                me.send(msg)
                            else:
                                me.receive(CODEC.encode(msg))
                        except aiokv.ProtocolError as exc:
                            if want:
                                failures.append(f"{where}: legal but raised {exc!r}")
                            elif not isinstance(exc, err_t):
                                failures.append(
                                    f"{where}: raised {type(exc).__name__}, want {err_t.__name__}"
                                )
                            elif snap(me) != before:
                                failures.append(f"{where}: state changed by a refused message")
                        else:
                            legal += 1
                            if not want:
                                failures.append(f"{where}: illegal but accepted")
    assert not failures, f"{len(failures)} of {checked} wrong:\n" + "\n".join(failures[:60])
    assert checked > 1000 and legal > 50


@pytest.mark.parametrize("bad", ["client_hello", "server_welcome"])
def test_version_mismatch_refused_and_state_kept(bad: str) -> None:
    c, s = Session(C), Session(S)
    if bad == "client_hello":
        before = snap(s)
        with pytest.raises(aiokv.RemoteProtocolError):
            s.receive(CODEC.encode(hello(version=m.PROTOCOL_VERSION - 1)))  # an older peer
        assert snap(s) == before
    else:
        link(c, s, hello())
        before = snap(c)
        with pytest.raises(aiokv.RemoteProtocolError):
            c.receive(CODEC.encode(welcome(version=99)))
        assert snap(c) == before


def test_full_happy_path_and_get() -> None:
    c, s = pair_open()
    for k in range(3):
        xid = c.new_xfer_id()
        link(c, s, m.Reserve(xid, "tcp", SPEC))
        link(s, c, m.Grant(xid, k))
        link(c, s, m.DataHeader(xid, k, 1))
        link(s, c, m.Done(xid))
    assert c.live_transfers == s.live_transfers == 0
    link(c, s, m.Get(1, ("a",), "x:1"))
    link(s, c, m.GetReply(1, "ok", ""))
    with pytest.raises(aiokv.RemoteProtocolError):  # answered once only
        c.receive(CODEC.encode(m.GetReply(1, "ok", "")))
    link(c, s, m.NcclSetup(3, b"\x00" * 128))
    link(s, c, m.NcclReady(3, False, "no"))
    with pytest.raises(aiokv.LocalProtocolError):
        s.new_xfer_id()


def test_grant_seq_must_be_consecutive() -> None:
    c, s = pair_open()
    for _ in range(3):
        link(c, s, m.Reserve(c.new_xfer_id(), "tcp", SPEC))
    link(s, c, m.Grant(1, 0))
    # skipping a number: refused on the way out and on the way in, state kept
    before_s, before_c = snap(s), snap(c)
    with pytest.raises(aiokv.LocalProtocolError):
        s.send(m.Grant(2, 2))
    with pytest.raises(aiokv.RemoteProtocolError):
        c.receive(CODEC.encode(m.Grant(2, 2)))
    with pytest.raises(aiokv.RemoteProtocolError):
        c.receive(CODEC.encode(m.Grant(2, 0)))  # a repeat of a used number
    assert snap(s) == before_s and snap(c) == before_c
    link(s, c, m.Grant(3, 1))  # grants may go in any transfer order, numbers may not
    link(s, c, m.Grant(2, 2))
    assert c._xfers[3].seq == 1 and c._xfers[2].seq == 2


def test_data_out_of_seq_order_rejected() -> None:
    c, s = pair_open()
    for k in range(3):
        link(c, s, m.Reserve(c.new_xfer_id(), "tcp", SPEC))
        link(s, c, m.Grant(k + 1, k))
    # DATA must carry the seq of its grant
    for who, data in ((c, m.DataHeader(1, 1, 1)),):
        before = snap(who)
        with pytest.raises(aiokv.LocalProtocolError):
            who.send(data)
        assert snap(who) == before
    before = snap(s)
    with pytest.raises(aiokv.RemoteProtocolError):
        s.receive(CODEC.encode(m.DataHeader(1, 1, 1)))
    assert snap(s) == before
    # once seq 2 went, seq 0 and 1 on the same plane are out of order
    link(c, s, m.DataHeader(3, 2, 1))
    for k in (1, 2):
        before_c, before_s = snap(c), snap(s)
        with pytest.raises(aiokv.LocalProtocolError):
            c.send(m.DataHeader(k, k - 1, 1))
        with pytest.raises(aiokv.RemoteProtocolError):
            s.receive(CODEC.encode(m.DataHeader(k, k - 1, 1)))
        assert snap(c) == before_c and snap(s) == before_s
    # DATA twice for one transfer
    with pytest.raises(aiokv.RemoteProtocolError):
        s.receive(CODEC.encode(m.DataHeader(3, 2, 1)))


def test_withdraw_crosses_grant() -> None:
    c, s = pair_in(XferState.RESERVED)
    w = c.send(m.Withdraw(1))  # client: RESERVED -> WITHDRAWING
    g = s.send(m.Grant(1, 0))  # server, at the same time: RESERVED -> GRANTED
    assert c.xfer_state(1) is W and s.xfer_state(1) is G
    s.receive(w)  # a withdraw meeting a grant leaves it granted
    c.receive(g)  # a grant meeting a withdraw commits the transfer
    assert c.xfer_state(1) is s.xfer_state(1) is G
    link(c, s, m.DataHeader(1, 0, 1))  # its data still comes, in order
    link(s, c, m.Done(1))
    assert c.live_transfers == s.live_transfers == 0


def test_withdraw_then_withdrawn() -> None:
    c, s = pair_in(XferState.WITHDRAWING)
    link(s, c, m.Withdrawn(1))
    assert c.live_transfers == s.live_transfers == 0
    with pytest.raises(aiokv.RemoteProtocolError):
        c.receive(CODEC.encode(m.Withdrawn(1)))


@pytest.mark.parametrize(
    "ender", [m.Refuse(1, "busy", ""), m.Failed(1, "timeout", "")], ids=["REFUSE", "FAILED"]
)
def test_withdraw_crosses_refuse_or_failed(ender: m.Message) -> None:
    """The server ends a transfer while the client withdraws it: neither end may call that a protocol error."""
    c, s = pair_in(XferState.RESERVED)
    w = c.send(m.Withdraw(1))
    r = s.send(ender)
    assert s.live_transfers == 0
    s.receive(w)  # the transfer is already gone here; the withdraw is moot
    c.receive(r)
    assert c.live_transfers == s.live_transfers == 0
    assert c.state is s.state is SessionState.OPEN
    # a withdraw of a transfer that never existed is still an error
    before = snap(s)
    with pytest.raises(aiokv.RemoteProtocolError):
        s.receive(CODEC.encode(m.Withdraw(99)))
    assert snap(s) == before


# --------------------------------------------------------------------------- hostile sequences

small_ids = st.integers(1, 3)
session_msgs = st.one_of(
    st.builds(m.Reserve, small_ids, st.just("tcp"), st.just(SPEC)),
    st.builds(m.Grant, small_ids, st.integers(0, 3)),
    st.builds(m.Refuse, small_ids, st.just("busy"), st.just("")),
    st.builds(m.Withdraw, small_ids),
    st.builds(m.Withdrawn, small_ids),
    st.builds(m.DataHeader, small_ids, st.integers(0, 3), st.integers(0, 2)),
    st.builds(m.Done, small_ids),
    st.builds(m.Failed, small_ids, st.just("aborted"), st.just("")),
    st.builds(m.Get, small_ids, st.just(("a",)), st.just("x:1")),
    st.builds(m.GetReply, small_ids, st.just("ok"), st.just("")),
    st.builds(m.NcclSetup, small_ids, st.just(b"\x00" * 128)),
    st.builds(m.NcclReady, small_ids, st.booleans(), st.just("")),
    st.builds(m.Ping, small_ids),
    st.builds(m.Pong, small_ids),
    st.just(hello()),
    st.just(welcome()),
    st.just(m.DataHello(b"\x02" * 16)),
)
frames = st.one_of(
    session_msgs.map(CODEC.encode),
    st.binary(max_size=64),
    st.lists(st.integers(0, 20) | st.binary(max_size=4) | st.text(max_size=4), max_size=5).map(
        lambda xs: msgpack.packb(xs, use_bin_type=True)
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["client", "server"]), st.lists(frames, max_size=25))
def test_random_frames_into_receive_raise_only_remote_protocol_error(
    end: str, seq: list[bytes]
) -> None:
    c, s = pair_in(XferState.GRANTED)
    me = c if end == "client" else s
    if end == "client":
        link(c, s, m.Reserve(c.new_xfer_id(), "tcp", SPEC))  # transfer 2, RESERVED
    for raw in seq:
        before = snap(me)
        try:
            me.receive(raw)
        except aiokv.RemoteProtocolError:
            assert snap(me) == before


def test_note_sent_applies_like_send_without_encoding() -> None:
    """NCCL data carries no header: the client notes the DATA it implied by posting."""
    c, s = pair_open()
    xid = c.new_xfer_id()
    link(c, s, m.Reserve(xid, "nccl", SPEC))
    link(s, c, m.Grant(xid, 0))
    before = snap(c)
    with pytest.raises(aiokv.LocalProtocolError):  # checked like send: wrong seq refused
        c.note_sent(m.DataHeader(xid, 5, 1))
    assert snap(c) == before
    assert c.note_sent(m.DataHeader(xid, 0, 1)) is None
    assert c.xfer_state(xid) is XferState.SENT
    s.receive_message(m.DataHeader(xid, 0, 1))  # the server's side of the same posting order
    link(s, c, m.Done(xid))
    assert c.live_transfers == s.live_transfers == 0
