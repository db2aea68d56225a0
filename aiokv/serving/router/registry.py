"""Instance registry of the disaggregated router: registration, heartbeats,
eviction, health and xPyD selection.

Pure state, no I/O: the app feeds it registrations, heartbeats and failures,
and a background task in the app's lifespan calls :meth:`Registry.evict_stale`.
Time comes from an injectable clock so the logic is testable without sleeping.

Selection policies
    ``round_robin``
        cycle through the live instances of a role serving the model.
    ``least_outstanding``
        the live instance with the fewest requests in flight; ties are broken
        round-robin so equal instances share the load.

An instance that failed a request (connection error or 5xx) is marked
unhealthy and is not selected again until a heartbeat arrives after
``unhealthy_cooldown`` seconds; an instance that misses heartbeats for
``evict_after`` seconds is removed.

Identity
    Every registration gets an ``instance_id`` and a random ``secret``. A
    worker URL belongs to the first registration that claimed it: heartbeats,
    deregistration and re-registration of that URL (any role) must present the
    secret, otherwise :class:`IdentityError`. A worker that lost its secret
    (it restarted) registers again once the old entry is evicted.

Sources
    ``register`` (HTTP registration with heartbeats), ``static`` (given on the
    command line; never evicted; health from the router's probes) and ``zmq``
    (vLLM-style discovery messages; evicted after their own ``ttl``). Static
    and discovered instances serve any model (``model == "*"``): the worker
    itself answers for the model name.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Literal

from aiokv._exceptions import ConfigError

__all__ = [
    "ANY_MODEL",
    "POLICIES",
    "IdentityError",
    "Instance",
    "NoInstanceError",
    "Policy",
    "Registry",
    "RegistryFullError",
    "Role",
    "UnknownModelError",
]

Role = Literal["prefill", "decode"]
Policy = Literal["round_robin", "least_outstanding"]
Source = Literal["register", "static", "zmq"]
ANY_MODEL = "*"
ROLES: tuple[Role, ...] = ("prefill", "decode")
POLICIES: tuple[Policy, ...] = ("round_robin", "least_outstanding")


class UnknownModelError(LookupError):
    """No registered instance (of any health) serves the requested model."""


class NoInstanceError(LookupError):
    """The model is known but no live, healthy instance of the role can take the request."""


class IdentityError(PermissionError):
    """The URL or instance belongs to another registration (wrong or missing secret)."""


class RegistryFullError(RuntimeError):
    """As many instances as the registry holds are registered already."""


@dataclass(slots=True)
class Instance:
    """One registered prefill or decode server."""

    instance_id: str
    role: Role
    url: str
    kv_address: str
    model: str
    registered_at: float
    last_seen: float
    healthy: bool = True
    unhealthy_since: float | None = None
    outstanding: int = 0
    served: int = 0
    failures: int = 0
    seq: int = field(default=0)
    secret: str = field(default="", repr=False)
    source: Source = "register"
    max_model_len: int | None = None
    ttl: float | None = None  # eviction after this many silent seconds (None: the registry's)
    #: why the last health probe of a static instance failed (None: it answered)
    probe_error: str | None = None

    def serves(self, model: str) -> bool:
        return self.model == ANY_MODEL or self.model == model

    def secret_ok(self, secret: object) -> bool:
        """Constant-time check of the per-instance secret."""
        if not isinstance(secret, str) or not self.secret:
            return False
        return hmac.compare_digest(secret.encode(), self.secret.encode())

    def to_json(self, now: float) -> dict[str, object]:
        return {
            "instance_id": self.instance_id,
            "role": self.role,
            "url": self.url,
            "kv_address": self.kv_address,
            "model": self.model,
            "source": self.source,
            "max_model_len": self.max_model_len,
            "healthy": self.healthy,
            "outstanding": self.outstanding,
            "served": self.served,
            "failures": self.failures,
            "last_seen_seconds_ago": round(max(0.0, now - self.last_seen), 3),
            "probe_error": self.probe_error,
        }


class Registry:
    """The set of live instances and the policy that picks among them."""

    def __init__(
        self,
        *,
        evict_after: float = 3.0,
        policy: Policy = "round_robin",
        unhealthy_cooldown: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_instances: int = 1024,
    ) -> None:
        if evict_after <= 0:
            raise ConfigError(f"evict_after must be positive, got {evict_after!r}")
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.evict_after = evict_after
        self.policy: Policy = policy
        self.unhealthy_cooldown = evict_after if unhealthy_cooldown is None else unhealthy_cooldown
        self._clock = clock
        self.max_instances = max_instances
        self._by_id: dict[str, Instance] = {}
        self._rr: dict[Role, int] = {"prefill": 0, "decode": 0}
        self._seq = itertools.count()

    # -- membership -----------------------------------------------------------

    def register(
        self,
        role: Role,
        url: str,
        kv_address: str,
        model: str,
        *,
        secret: str | None = None,
        max_model_len: int | None = None,
        source: Source = "register",
        ttl: float | None = None,
    ) -> Instance:
        """Add an instance, or refresh it when the same (role, url) registers again.

        A URL already held by a registration is refreshed (or given another role)
        only when ``secret`` matches that registration's; else
        :class:`IdentityError`. Discovered (``zmq``) URLs are refreshed by
        discovery messages, which carry no secret, and never mix with
        registrations of the other sources.
        """
        if role not in ROLES:
            raise ConfigError(f"role must be 'prefill' or 'decode', got {role!r}")
        now = self._clock()
        holders = [i for i in self._by_id.values() if i.url == url]
        for inst in holders:
            if inst.source != source:
                raise IdentityError(f"{url} is already a {inst.source} instance")
            if source == "register" and not inst.secret_ok(secret):
                raise IdentityError(f"{url} is registered by another worker")
        for inst in holders:
            if inst.role == role:
                inst.kv_address = kv_address
                inst.model = model
                inst.max_model_len = max_model_len
                if source == "register":  # the worker (re)started: trust it again
                    inst.last_seen = now
                    inst.healthy = True
                    inst.unhealthy_since = None
                else:  # a periodic sign of life: health returns after the cool-down
                    self.touch(inst)
                return inst
        if len(self._by_id) >= self.max_instances:
            raise RegistryFullError(f"the router holds {self.max_instances} instances already")
        inst = Instance(
            instance_id=uuid.uuid4().hex,
            role=role,
            url=url,
            kv_address=kv_address,
            model=model,
            registered_at=now,
            last_seen=now,
            seq=next(self._seq),
            secret=holders[0].secret if holders else secrets.token_urlsafe(32),
            source=source,
            max_model_len=max_model_len,
            ttl=ttl,
        )
        if source == "static":
            # not selected before the first successful probe
            inst.healthy = False
            inst.unhealthy_since = float("-inf")
        self._by_id[inst.instance_id] = inst
        return inst

    def heartbeat(self, instance_id: str, secret: str | None = None) -> Instance | None:
        """Record a heartbeat; ``None`` when the instance is unknown (re-register).

        ``secret`` is checked for registered instances (:class:`IdentityError`).
        """
        inst = self._by_id.get(instance_id)
        if inst is None:
            return None
        if inst.source != "register" or not inst.secret_ok(secret):
            # static and discovered instances get no HTTP heartbeats: their health is the router's
            raise IdentityError("wrong instance secret")
        return self.touch(inst)

    def touch(self, inst: Instance) -> Instance:
        """A sign of life from ``inst`` (heartbeat, probe, discovery message)."""
        now = self._clock()
        inst.last_seen = now
        if (
            not inst.healthy
            and inst.unhealthy_since is not None
            and now - inst.unhealthy_since >= self.unhealthy_cooldown
        ):
            inst.healthy = True
            inst.unhealthy_since = None
        return inst

    def deregister(self, instance_id: str, secret: str | None = None) -> Instance | None:
        """Remove a registered instance; its ``secret`` must match (:class:`IdentityError`)."""
        inst = self._by_id.get(instance_id)
        if inst is None:
            return None
        if inst.source != "register" or not inst.secret_ok(secret):
            raise IdentityError("wrong instance secret")
        return self._by_id.pop(instance_id)

    def evict_stale(self) -> list[Instance]:
        """Remove every instance silent for its ttl (default ``evict_after``); return them.

        Static instances are never evicted.
        """
        now = self._clock()
        stale = [
            i
            for i in self._by_id.values()
            if i.source != "static" and now - i.last_seen >= (i.ttl or self.evict_after)
        ]
        for inst in stale:
            del self._by_id[inst.instance_id]
        return stale

    def mark_unhealthy(self, inst: Instance) -> None:
        inst.failures += 1
        inst.healthy = False
        inst.unhealthy_since = self._clock()

    # -- queries ----------------------------------------------------------------

    def get(self, instance_id: str) -> Instance | None:
        return self._by_id.get(instance_id)

    def __iter__(self) -> Iterator[Instance]:
        return iter(sorted(self._by_id.values(), key=lambda i: i.seq))

    def __len__(self) -> int:
        return len(self._by_id)

    def models(self) -> list[str]:
        return sorted({i.model for i in self._by_id.values() if i.model != ANY_MODEL})

    def max_model_len(self, model: str) -> int | None:
        """The smallest context length announced by an instance serving ``model``."""
        lens = [
            i.max_model_len
            for i in self._by_id.values()
            if i.model == model and i.max_model_len is not None
        ]
        return min(lens) if lens else None

    def live(self, role: Role, model: str | None = None) -> list[Instance]:
        """Healthy instances of ``role`` (serving ``model`` when given), in registration order."""
        return [
            i for i in self if i.role == role and i.healthy and (model is None or i.serves(model))
        ]

    def select(self, role: Role, model: str, exclude: Collection[str] = ()) -> Instance:
        """Pick an instance by the policy.

        Raises :class:`UnknownModelError` when nothing serves ``model`` at all
        and :class:`NoInstanceError` when no healthy, non-excluded one is left.
        """
        if not any(i.serves(model) for i in self._by_id.values()):
            raise UnknownModelError(model)
        candidates = [i for i in self.live(role, model) if i.instance_id not in exclude]
        if not candidates:
            raise NoInstanceError(f"no healthy {role} instance for model {model!r}")
        start = self._rr[role]
        self._rr[role] = start + 1
        n = len(candidates)
        if self.policy == "round_robin":
            return candidates[start % n]
        # least outstanding, ties broken round-robin
        rotated = [candidates[(start + k) % n] for k in range(n)]
        return min(rotated, key=lambda i: i.outstanding)
