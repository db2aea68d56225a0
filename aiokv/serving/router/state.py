"""The router's live state: :class:`RouterState` (config, registry, HTTP client, metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets

import httpx

from aiokv.serving.router.config import _MAX_NAME, RouterConfig
from aiokv.serving.router.metrics import RouterMetrics
from aiokv.serving.router.registry import (
    ANY_MODEL,
    Instance,
    Registry,
)
from aiokv.serving.router.urls import UrlPolicy

__all__ = ["RouterState"]

log = logging.getLogger("aiokv.serving.router")


class RouterState:
    """Everything one router app owns: registry, metrics, HTTP client."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.registry = Registry(
            evict_after=config.evict_after,
            policy=config.policy,
            unhealthy_cooldown=config.unhealthy_cooldown,
            max_instances=config.max_instances,
        )
        self.metrics = RouterMetrics()
        self.policy = UrlPolicy(config.allow_link_local)
        self.hop_id = secrets.token_hex(8)
        self.per_client: dict[str, int] = {}
        #: the router's own listening address (host, port), when known (set by serve)
        self.own_address: tuple[str, int] | None = None
        self._client: httpx.AsyncClient | None = None
        #: connections being opened to newly registered workers (see warm_connection)
        self._warming: dict[str, asyncio.Task[None]] = {}
        for role, urls in (("prefill", config.prefill), ("decode", config.decode)):
            for url in urls:
                self.registry.register(
                    "prefill" if role == "prefill" else "decode",
                    self.policy.check_url(url),
                    "",
                    ANY_MODEL,
                    source="static",
                )

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("router app is not running (lifespan not entered)")
        return self._client

    def warm_connection(self, url: str) -> None:
        """Open the HTTP connection to a newly registered worker now, in the background.

        One ``GET /v1/models`` (its answer is not used): the connection then waits in
        the client's keep-alive pool, so the first request routed to the worker does
        not pay for connecting. Best effort, errors ignored; at most 64 at a time.
        """
        if self._client is None or url in self._warming or len(self._warming) >= 64:
            return
        task = asyncio.create_task(self._warm(url), name="aiokv-router-warm")
        self._warming[url] = task
        task.add_done_callback(lambda _t: self._warming.pop(url, None))

    async def _warm(self, url: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.client.get(url + "/v1/models", timeout=httpx.Timeout(2.0, connect=1.0))

    async def run_eviction(self) -> None:
        cfg = self.config
        interval = cfg.eviction_interval or cfg.evict_after / 4
        while True:
            await asyncio.sleep(interval)
            for inst in self.registry.evict_stale():
                log.warning(
                    "evicted %s instance %s (%s): no sign of life for %.1fs",
                    inst.role,
                    inst.url,
                    inst.instance_id,
                    inst.ttl or cfg.evict_after,
                )
                self.metrics.evictions.labels(inst.role).inc()
            self.metrics.refresh_instances(self.registry)

    async def probe_static(self) -> None:
        """Health of static workers: ``GET /v1/models`` every ``probe_interval`` seconds.

        A 200 is a sign of life (the instance becomes selectable, after the
        cool-down when it had failed); a one-model answer also tells the model
        name and its ``max_model_len``. A failed probe marks it unhealthy.
        """
        timeout = httpx.Timeout(max(1.0, self.config.probe_interval), connect=1.0)
        while True:
            for inst in [i for i in self.registry if i.source == "static"]:
                try:
                    r = await self.client.get(inst.url + "/v1/models", timeout=timeout)
                    if r.status_code != 200:
                        raise ValueError(f"HTTP {r.status_code}")
                    _learn_models(inst, r.content[:65536])
                    was = inst.healthy
                    self.registry.touch(inst)
                    inst.probe_error = None
                    if inst.healthy and not was:
                        log.info("static %s instance %s is up", inst.role, inst.url)
                except (httpx.HTTPError, ValueError) as e:
                    why = f"{type(e).__name__}: {e}"[:200]
                    if why != inst.probe_error:  # once per reason, also before the first success
                        log.warning(
                            "static %s instance %s is unreachable: %s", inst.role, inst.url, why
                        )
                    inst.probe_error = why
                    if inst.healthy:
                        self.registry.mark_unhealthy(inst)
            self.metrics.refresh_instances(self.registry)
            await asyncio.sleep(self.config.probe_interval)


def _learn_models(inst: Instance, raw: bytes) -> None:
    try:
        data = json.loads(raw)
    except ValueError:
        return
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or len(models) != 1 or not isinstance(models[0], dict):
        return
    mid, mlen = models[0].get("id"), models[0].get("max_model_len")
    if isinstance(mid, str) and 0 < len(mid) <= _MAX_NAME:
        inst.model = mid
    if isinstance(mlen, int) and not isinstance(mlen, bool) and mlen > 0:
        inst.max_model_len = mlen
