"""The router's configuration: :class:`RouterConfig` and its checks, the endpoints it serves."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from aiokv import envs
from aiokv._exceptions import ConfigError
from aiokv.serving.router.registry import (
    POLICIES,
    Policy,
)
from aiokv.serving.router.urls import UrlPolicy, UrlPolicyError

__all__ = [
    "CHAT_COMPLETIONS",
    "COMPLETIONS",
    "HOP_HEADER",
    "TOKEN_ENV",
    "RouterConfig",
    "prefill_kv_params",
    "token_from_env",
]

log = logging.getLogger("aiokv.serving.router")

COMPLETIONS = "/v1/completions"


CHAT_COMPLETIONS = "/v1/chat/completions"


#: the environment variable the router (and the workers) read the shared token from
TOKEN_ENV = "AIOKV_ROUTER_TOKEN"


#: header that marks requests the router sent; a request carrying our own mark is a loop
HOP_HEADER = "x-aiokv-router-hop"


_MAX_HOPS = 8


_MAX_ERROR_PASSTHROUGH = 16 * 1024


_MAX_INT_DIGITS = 30


_MAX_NAME = 256


def prefill_kv_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill request, as vLLM's toy proxy sends them."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Settings of one router app.

    ``max_prompt_length`` counts characters of text prompts (all messages of a
    chat) or token ids of pre-tokenised prompts.

    ``token``: the shared secret workers present as ``Authorization: Bearer``
    on ``/register``, ``/heartbeat``, ``/deregister`` and ``/instances``.
    Without one, those endpoints answer loopback clients only.

    ``prefill`` / ``decode``: static worker base URLs (vLLM's toy-proxy style).
    ``discovery``: ``host:port`` to bind a ZMQ ROUTER socket on for vLLM-style
    discovery; messages from non-loopback peers are accepted only with
    ``discovery_allow_remote`` or a ``"token"`` field equal to ``token``.
    """

    policy: Policy = "round_robin"
    evict_after: float = 3.0
    eviction_interval: float | None = None  # default: evict_after / 4
    unhealthy_cooldown: float | None = None  # default: evict_after
    max_attempts: int = 3
    #: how long a request waits, retrying, while every instance it may use answers
    #: "overloaded" (429, or 503 with ``out_of_kv_blocks`` or ``Retry-After``); then 503
    overload_wait: float = 30.0
    max_prompt_length: int = 32_768
    max_tokens_limit: int = 32_768
    max_body_bytes: int = 4 * 1024 * 1024
    connect_timeout: float = 2.0
    upstream_timeout: float = 120.0
    token: str | None = field(default=None, repr=False)
    allow_link_local: bool = False
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    discovery: str | None = None
    discovery_ttl: float = 5.0
    discovery_allow_remote: bool = False
    probe_interval: float = 2.0
    max_json_depth: int = 64
    max_concurrent_per_client: int = 64
    max_instances: int = 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    expose_topology: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in (
            "evict_after",
            "connect_timeout",
            "upstream_timeout",
            "discovery_ttl",
            "probe_interval",
            "header_timeout",
            "body_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"RouterConfig.{name} must be positive")
        for name in (
            "max_attempts",
            "max_prompt_length",
            "max_tokens_limit",
            "max_body_bytes",
            "max_json_depth",
            "max_concurrent_per_client",
            "max_instances",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"RouterConfig.{name} must be >= 1")
        if self.eviction_interval is not None and self.eviction_interval <= 0:
            raise ConfigError("RouterConfig.eviction_interval must be positive")
        if self.token is not None and len(self.token) < 16:
            raise ConfigError("the router token must be at least 16 characters")
        policy = UrlPolicy(self.allow_link_local)
        for url in (*self.prefill, *self.decode):
            try:
                policy.check_url(url)
            except UrlPolicyError as e:
                raise ConfigError(f"worker URL {url!r}: {e}") from None
        if self.discovery is not None:
            try:
                policy.check_kv_address(self.discovery)
            except UrlPolicyError as e:
                raise ConfigError(f"discovery address: {e}") from None

    @property
    def heartbeat_interval(self) -> float:
        """The interval the router asks workers to heartbeat at."""
        return self.evict_after / 3


def _warn_open(cfg: RouterConfig) -> None:
    if cfg.token:
        log.info("registration needs the router token (Authorization: Bearer)")
    else:
        log.warning(
            "no router token configured: /register, /heartbeat, /deregister and /instances "
            "answer loopback clients only (set --token or $%s for remote workers)",
            TOKEN_ENV,
        )


def token_from_env() -> str | None:
    """The router token from ``$AIOKV_ROUTER_TOKEN`` (``None`` when unset or empty)."""
    return envs.get(TOKEN_ENV) or None
