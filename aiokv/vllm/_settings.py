"""``kv_connector_extra_config`` of :class:`~aiokv.vllm.AiokvConnector`, checked.

Pure Python (no vLLM import), so the default test session covers it. aiokv's own
keys and the keys of vLLM's former ``P2pNcclConnector`` that still mean something are
accepted; the old connector's other keys, and unknown keys, give a warning each
(docs/vllm.md has the table).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .._exceptions import ConfigError

__all__ = ["MIGRATED", "UNSUPPORTED", "Settings", "parse_settings"]

Mode = Literal["auto", "pull", "push"]

MiB = 1 << 20
GiB = 1 << 30

#: ``P2pNcclConnector`` keys aiokv reads, and what they become
MIGRATED: Mapping[str, str] = {
    "send_type": "mode: GET -> pull; PUT and PUT_ASYNC -> push",
    "nccl_num_channels": "EngineConfig.nccl_max_channels",
    "mem_pool_size_gb": "Limits.store_bytes (the receive store, where pushed KV waits)",
}
#: ``P2pNcclConnector`` keys that mean nothing here (a warning each), and why
UNSUPPORTED: Mapping[str, str] = {
    "proxy_ip": "the P2P proxy's ping registration is not used: give the router the "
    "workers' URLs (aiokv router --prefill URL --decode URL)",
    "proxy_port": "see proxy_ip",
    "http_port": "see proxy_ip",
    "kv_buffer_size": "aiokv bounds the receive store with mem_pool_size_gb / store_gb",
}
_OWN = frozenset(
    {
        "mode",
        "listen",
        "advertise_host",
        "timeout",
        "lease_seconds",
        "chunk_mb",
        "staging_mb",
        "store_gb",
        "nccl_max_channels",
        "layerwise",
    }
)
_SEND_TYPES: Mapping[str, Mode] = {"GET": "pull", "PUT": "push", "PUT_ASYNC": "push"}


@dataclass(frozen=True, slots=True)
class Settings:
    """What the connector runs with (see docs/vllm.md)."""

    #: pull: the decode fetches the prefill's KV; push: the prefill sends it to the
    #: decode its request names; auto: push when the request names its decode, else pull
    mode: Mode = "auto"
    #: where this worker's aiokv engine listens; rank r of a tensor-parallel group
    #: listens on port + r (port 0: a free port each)
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    #: the host the prefill reports to the decode (default: listen_host)
    advertise_host: str | None = None
    #: bound on one load (decode) in seconds
    timeout: float = 30.0
    #: how long a prefill keeps a finished request's blocks for its decode
    lease_seconds: float = 120.0
    chunk_bytes: int = 64 * MiB
    staging_bytes: int | None = None
    store_bytes: int = 2 * GiB
    nccl_max_channels: int | None = None
    #: push: send each layer as vLLM's forward saves it (the transfer overlaps the
    #: rest of the forward) instead of the whole request after the forward
    layerwise: bool = True

    def address_for(self, rank: int) -> str:
        port = self.listen_port + rank if self.listen_port else 0
        return f"{self.listen_host}:{port}"

    def advertised(self, bound: str, rank: int) -> str:
        """The address peers use for the engine bound at ``bound`` (``host:port``)."""
        host = self.advertise_host or self.listen_host
        if host in ("0.0.0.0", "::", ""):
            raise ConfigError(
                "AiokvConnector: listen host is a wildcard; set advertise_host to the "
                "address the other side reaches this worker at"
            )
        return f"{host}:{bound.rsplit(':', 1)[1]}"


def _number(key: str, v: object, lo: float, hi: float) -> float:
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a number") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a number, got {v!r}")
    if not lo <= v <= hi:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be in [{lo}, {hi}], got {v}")
    return float(v)


def _split_listen(v: object) -> tuple[str, int]:
    if not isinstance(v, str) or ":" not in v:
        raise ConfigError(f"kv_connector_extra_config['listen'] must be 'host:port', got {v!r}")
    host, _, port = v.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"kv_connector_extra_config['listen'] must be 'host:port', got {v!r}")
    return host, int(port)


def parse_settings(extra: Mapping[str, Any] | None) -> tuple[Settings, list[str]]:
    """Check ``kv_connector_extra_config``; return the settings and the warnings to log.

    Raises :class:`~aiokv.ConfigError` for a value it cannot use (a key it reads, with
    the wrong type or out of range).
    """
    extra = dict(extra or {})
    warnings: list[str] = []
    kw: dict[str, Any] = {}
    mode_from: str | None = None
    for key in sorted(extra):
        if not isinstance(key, str):
            raise ConfigError(f"kv_connector_extra_config has a non-string key {key!r}")
        if key in UNSUPPORTED:
            warnings.append(f"kv_connector_extra_config[{key!r}] is ignored: {UNSUPPORTED[key]}")
        elif key not in _OWN and key not in MIGRATED:
            warnings.append(f"kv_connector_extra_config[{key!r}] is not an AiokvConnector key")
    if "send_type" in extra:
        st = extra["send_type"]
        if not isinstance(st, str) or st.upper() not in _SEND_TYPES:
            raise ConfigError(
                f"kv_connector_extra_config['send_type'] must be one of "
                f"{sorted(_SEND_TYPES)}, got {st!r}"
            )
        kw["mode"] = _SEND_TYPES[st.upper()]
        mode_from = "send_type"
    if "mode" in extra:
        m = extra["mode"]
        if m not in ("auto", "pull", "push"):
            raise ConfigError(
                f"kv_connector_extra_config['mode'] must be auto, pull or push, got {m!r}"
            )
        if mode_from is not None and kw["mode"] != m:
            raise ConfigError(
                f"kv_connector_extra_config: mode={m!r} contradicts send_type="
                f"{extra['send_type']!r}"
            )
        kw["mode"] = m
    if "listen" in extra:
        kw["listen_host"], kw["listen_port"] = _split_listen(extra["listen"])
    if "advertise_host" in extra:
        h = extra["advertise_host"]
        if not isinstance(h, str) or not h or any(c in h for c in " /@#"):
            raise ConfigError(
                f"kv_connector_extra_config['advertise_host'] must be a host name, got {h!r}"
            )
        kw["advertise_host"] = h
    if "timeout" in extra:
        kw["timeout"] = _number("timeout", extra["timeout"], 0.1, 3600)
    if "lease_seconds" in extra:
        kw["lease_seconds"] = _number("lease_seconds", extra["lease_seconds"], 0.1, 86400)
    if "chunk_mb" in extra:
        kw["chunk_bytes"] = int(_number("chunk_mb", extra["chunk_mb"], 1, 4096) * MiB)
    if "staging_mb" in extra:
        kw["staging_bytes"] = int(_number("staging_mb", extra["staging_mb"], 1, 1 << 20) * MiB)
    for key in ("store_gb", "mem_pool_size_gb"):
        if key in extra:
            gb = _number(key, extra[key], 1 / 1024, 4096)
            if "store_bytes" in kw and kw["store_bytes"] != int(gb * GiB):
                raise ConfigError(
                    "kv_connector_extra_config: store_gb and mem_pool_size_gb disagree"
                )
            kw["store_bytes"] = int(gb * GiB)
    for key in ("nccl_max_channels", "nccl_num_channels"):
        if key in extra:
            n = _number(key, extra[key], 1, 64)
            if n != int(n):
                raise ConfigError(f"kv_connector_extra_config[{key!r}] must be an integer")
            kw["nccl_max_channels"] = int(n)
    if "layerwise" in extra:
        v = extra["layerwise"]
        if not isinstance(v, bool):
            raise ConfigError(f"kv_connector_extra_config['layerwise'] must be a bool, got {v!r}")
        kw["layerwise"] = v
    return Settings(**kw), warnings
