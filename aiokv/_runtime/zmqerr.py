"""zmq failures as aiokv exceptions: the one place the engine translates them.

pyzmq raises :class:`zmq.ZMQError` (with an ``errno``) from sends, binds and
socket options. The engine never lets one escape to its caller: each is mapped
here, at the edge where the engine touched zmq, onto aiokv's tree
(:mod:`aiokv._exceptions`), keeping the zmq text in the message:

- a bind of a listening socket: :class:`~aiokv.ConfigError`;
- anything after ``Context.term()`` (``ETERM``): :class:`~aiokv.EngineClosedError`;
- a channel to a peer (send, flush, monitor): :class:`~aiokv.PeerLostError`.

An :class:`~aiokv.AiokvError` raised by a transport while posting on a channel
(an aborted NCCL communicator, say) is a lost channel too.
"""

from __future__ import annotations

import zmq

from aiokv._exceptions import AiokvError, ConfigError, EngineClosedError, PeerLostError

__all__ = ["channel_error", "listen_error"]


def channel_error(exc: zmq.ZMQError | AiokvError, what: str) -> AiokvError:
    """The error for a failure of ``what`` (e.g. ``"control channel to host:port"``)."""
    if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.ETERM:
        return EngineClosedError(f"{what}: the engine is closed ({exc})")
    return PeerLostError(f"{what} failed: {exc}")


def listen_error(exc: zmq.ZMQError, address: str) -> ConfigError:
    """The error for a listening socket that could not bind ``address``."""
    return ConfigError(f"cannot listen on {address}: {exc}")
