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
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Literal

from .._exceptions import ConfigError

__all__ = [
    "POLICIES",
    "Instance",
    "NoInstanceError",
    "Policy",
    "Registry",
    "Role",
    "UnknownModelError",
]

Role = Literal["prefill", "decode"]
Policy = Literal["round_robin", "least_outstanding"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
POLICIES: tuple[Policy, ...] = ("round_robin", "least_outstanding")


class UnknownModelError(LookupError):
    """No registered instance (of any health) serves the requested model."""


class NoInstanceError(LookupError):
    """The model is known but no live, healthy instance of the role can take the request."""


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

    def to_json(self, now: float) -> dict[str, object]:
        return {
            "instance_id": self.instance_id,
            "role": self.role,
            "url": self.url,
            "kv_address": self.kv_address,
            "model": self.model,
            "healthy": self.healthy,
            "outstanding": self.outstanding,
            "served": self.served,
            "failures": self.failures,
            "last_seen_seconds_ago": round(max(0.0, now - self.last_seen), 3),
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
    ) -> None:
        if evict_after <= 0:
            raise ConfigError(f"evict_after must be positive, got {evict_after!r}")
        if policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.evict_after = evict_after
        self.policy: Policy = policy
        self.unhealthy_cooldown = evict_after if unhealthy_cooldown is None else unhealthy_cooldown
        self._clock = clock
        self._by_id: dict[str, Instance] = {}
        self._rr: dict[Role, int] = {"prefill": 0, "decode": 0}
        self._seq = itertools.count()

    # -- membership -----------------------------------------------------------

    def register(self, role: Role, url: str, kv_address: str, model: str) -> Instance:
        """Add an instance, or refresh it when the same (role, url) registers again."""
        if role not in ROLES:
            raise ConfigError(f"role must be 'prefill' or 'decode', got {role!r}")
        now = self._clock()
        for inst in self._by_id.values():
            if inst.role == role and inst.url == url:
                inst.kv_address = kv_address
                inst.model = model
                inst.last_seen = now
                inst.healthy = True
                inst.unhealthy_since = None
                return inst
        inst = Instance(
            instance_id=uuid.uuid4().hex,
            role=role,
            url=url,
            kv_address=kv_address,
            model=model,
            registered_at=now,
            last_seen=now,
            seq=next(self._seq),
        )
        self._by_id[inst.instance_id] = inst
        return inst

    def heartbeat(self, instance_id: str) -> Instance | None:
        """Record a heartbeat; ``None`` when the instance is unknown (re-register)."""
        inst = self._by_id.get(instance_id)
        if inst is None:
            return None
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

    def deregister(self, instance_id: str) -> Instance | None:
        return self._by_id.pop(instance_id, None)

    def evict_stale(self) -> list[Instance]:
        """Remove every instance silent for ``evict_after`` seconds; return them."""
        now = self._clock()
        stale = [i for i in self._by_id.values() if now - i.last_seen >= self.evict_after]
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
        return sorted({i.model for i in self._by_id.values()})

    def live(self, role: Role, model: str | None = None) -> list[Instance]:
        """Healthy instances of ``role`` (serving ``model`` when given), in registration order."""
        return [
            i for i in self if i.role == role and i.healthy and (model is None or i.model == model)
        ]

    def select(self, role: Role, model: str, exclude: Collection[str] = ()) -> Instance:
        """Pick an instance by the policy.

        Raises :class:`UnknownModelError` when nothing serves ``model`` at all
        and :class:`NoInstanceError` when no healthy, non-excluded one is left.
        """
        if not any(i.model == model for i in self._by_id.values()):
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
