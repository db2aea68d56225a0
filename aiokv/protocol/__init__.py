"""The aiokv wire protocol, sans-IO.

This package imports no zmq, torch or asyncio (a test checks it): it turns
bytes into message objects and message objects into bytes
(:mod:`.codec`), and keeps the per-peer state that says which message may
come next (:mod:`.session`).
"""

from .codec import PRE_HELLO_MAX_FRAME_BYTES, Codec, WireLimits
from .messages import (
    ALLOWED_DTYPES,
    DATA_FRAME_BYTES,
    MAX_DIM,
    PROTOCOL_VERSION,
    Bye,
    DataHeader,
    DataHello,
    Done,
    ErrorMsg,
    Failed,
    Get,
    GetReply,
    Grant,
    Hello,
    Message,
    NcclReady,
    NcclSetup,
    Ping,
    Pong,
    Refuse,
    Reserve,
    TensorSpec,
    Welcome,
    Withdraw,
    Withdrawn,
    shape_problem,
)
from .session import Role, Session, SessionState, XferState

__all__ = [
    "ALLOWED_DTYPES",
    "DATA_FRAME_BYTES",
    "MAX_DIM",
    "PRE_HELLO_MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "Bye",
    "Codec",
    "DataHeader",
    "DataHello",
    "Done",
    "ErrorMsg",
    "Failed",
    "Get",
    "GetReply",
    "Grant",
    "Hello",
    "Message",
    "NcclReady",
    "NcclSetup",
    "Ping",
    "Pong",
    "Refuse",
    "Reserve",
    "Role",
    "Session",
    "SessionState",
    "TensorSpec",
    "Welcome",
    "WireLimits",
    "Withdraw",
    "Withdrawn",
    "XferState",
    "shape_problem",
]
