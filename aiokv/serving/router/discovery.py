"""vLLM-style ZMQ discovery of prefill/decode workers.

vLLM's P/D proxies (the P2P NCCL example proxy and vllm-project/router) learn
their workers from a ZMQ ROUTER socket: each worker connects a DEALER socket
and sends, every few seconds, one msgpack map::

    {"type": "P" | "D", "http_address": "host:port", "zmq_address": "host:port"}

A worker silent for ``discovery_ttl`` seconds (5 by default, as there) is
dropped. Here a message registers or refreshes a ``zmq`` instance in the
router's registry: ``http://`` + ``http_address`` is its URL, ``zmq_address``
its KV address; both pass the URL policy.

The protocol has no credential. Messages are therefore accepted from loopback
peers; from other peers only with ``RouterConfig.discovery_allow_remote``
(a network you trust) or when the map carries ``"token"`` equal to the router
token. A URL held by an HTTP registration or a static entry is never taken
over by a discovery message. Messages are at most 4 KiB and decoded with
msgpack's size limits; anything malformed is counted and dropped.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from aiokv.serving.router.registry import ANY_MODEL, IdentityError, RegistryFullError, Role
from aiokv.serving.router.state import RouterState
from aiokv.serving.router.urls import UrlPolicyError, is_loopback_host

__all__ = ["Discovery"]

log = logging.getLogger("aiokv.serving.router.discovery")

_MAX_MESSAGE = 4096


class Discovery:
    """The ZMQ ROUTER socket of one router app and its receive loop."""

    def __init__(self, state: RouterState, address: str) -> None:
        self.state = state
        self.address = address
        self.ctx: zmq.asyncio.Context | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self.accepted = 0
        self.dropped = 0
        self._warned: set[str] = set()

    def bind(self) -> None:
        """Bind now, so a bad address fails the router's start-up."""
        self.ctx = zmq.asyncio.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE)
        host, _, port = self.address.rpartition(":")
        try:
            sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError:
            sock.close(0)
            self.ctx.term()
            raise
        self.sock = sock

    async def run(self) -> None:
        assert self.sock is not None and self.ctx is not None, "bind() first"
        try:
            while True:
                frames = await self.sock.recv_multipart(copy=False)
                try:
                    self.handle(frames)
                except Exception as e:  # one bad message never stops discovery
                    self.dropped += 1
                    log.debug("discovery message dropped: %r", e)
        finally:
            self.sock.close(0)
            self.ctx.term()

    def _peer_ok(self, peer: str, msg: dict[str, Any]) -> bool:
        cfg = self.state.config
        if is_loopback_host(peer) or cfg.discovery_allow_remote:
            return True
        token = msg.get("token")
        if cfg.token and isinstance(token, str):
            return hmac.compare_digest(token.encode(), cfg.token.encode())
        return False

    def handle(self, frames: list[Any]) -> None:
        if len(frames) != 2:
            raise ValueError(f"{len(frames)} frames")
        payload = frames[1]
        try:
            peer = str(payload.get("Peer-Address"))
        except (zmq.ZMQError, AttributeError):
            peer = ""
        msg = msgpack.unpackb(
            payload.bytes,
            raw=False,
            strict_map_key=True,
            max_str_len=1024,
            max_bin_len=0,
            max_array_len=16,
            max_map_len=16,
            max_ext_len=0,
        )
        if not isinstance(msg, dict):
            raise ValueError("not a map")
        kind = msg.get("type")
        http_address, zmq_address = msg.get("http_address"), msg.get("zmq_address")
        if kind not in ("P", "D") or not isinstance(http_address, str):
            raise ValueError("needs type 'P' or 'D' and http_address")
        if not isinstance(zmq_address, str):
            raise ValueError("needs zmq_address")
        if not self._peer_ok(peer, msg):
            self.dropped += 1
            if peer not in self._warned and len(self._warned) < 1024:
                self._warned.add(peer)
                log.warning(
                    "discovery message from non-loopback peer %s refused (allow remote peers "
                    "with --discovery-allow-remote, or send the router token as 'token')",
                    peer,
                )
            return
        st = self.state
        url = http_address if "://" in http_address else f"http://{http_address}"
        try:
            url = st.policy.check_url(url, own=st.own_address)
            kv = st.policy.check_kv_address(zmq_address)
        except UrlPolicyError as e:
            self.dropped += 1
            log.warning("discovery message refused: %s", e)
            return
        role: Role = "prefill" if kind == "P" else "decode"
        known = any(i.url == url and i.role == role for i in st.registry)
        try:
            st.registry.register(
                role, url, kv, ANY_MODEL, source="zmq", ttl=st.config.discovery_ttl
            )
        except (IdentityError, RegistryFullError) as e:
            self.dropped += 1
            log.warning("discovery message refused: %s", e)
            return
        self.accepted += 1
        if not known:
            log.info("discovered %s instance %s (zmq %s)", role, url, kv)
            st.metrics.refresh_instances(st.registry)
