"""The router's URL policy: which worker URLs and KV addresses it accepts.

The router POSTs users' prompts to worker URLs and hands KV addresses to other
workers, so an address someone registers decides where data goes. The rules:

* a worker URL is ``http://host[:port]`` or ``https://host[:port]`` and nothing
  else: no path (a trailing ``/`` is dropped), query, fragment or userinfo;
* a KV address is ``host:port`` (IPv6 literals in brackets);
* the host is an IP literal or a DNS name made of letters, digits and ``-``
  (no spaces, no ``%`` zone ids, no other characters); the numeric IPv4 forms
  a connection accepts besides dotted quads (``127.1``, ``0x7f000001``,
  ``2130706433``, ``0177.0.0.1``) are IP literals too, normalised to the dotted
  quad before any rule is applied;
* refused unless :attr:`UrlPolicy.allow_link_local`: link-local addresses
  (``169.254.0.0/16``, ``fe80::/10``, also as IPv4-mapped IPv6) and the
  cloud metadata endpoints (``metadata.google.internal``, ``100.100.100.200``,
  ``fd00:ec2::254``, ...);
* always refused: unspecified (``0.0.0.0``, ``::``), multicast and broadcast
  addresses, and the router's own listening address (see
  :meth:`UrlPolicy.check_url`'s ``own``).

Names are not resolved: a DNS name that points at a refused address is only
caught by its name. Deployments that fear that run the router where such
addresses are not routable (the usual container egress rules).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["METADATA_HOSTS", "UrlPolicy", "UrlPolicyError"]

#: host names and addresses of cloud instance-metadata services
METADATA_HOSTS = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "instance-data",
        "instance-data.ec2.internal",
        "metadata.azure.com",
        "metadata.platformequinix.com",
        "100.100.100.200",  # Alibaba Cloud
        "fd00:ec2::254",  # AWS IMDS over IPv6
    }
)

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^{_LABEL}(?:\.{_LABEL})*\.?$")
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class UrlPolicyError(ValueError):
    """An address the router refuses; the message says which rule it broke."""


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


_NUMERIC_V4 = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)(?:\.(?:0x[0-9a-f]*|[0-9]+)){0,3}$")


def _ip(host: str) -> IPAddress | None:
    """The address ``host`` names when it is an IP literal, in any form a connection
    would accept: besides the canonical forms, the short, octal, hexadecimal and
    single-integer IPv4 forms of ``inet_aton`` (``127.1``, ``0x7f000001``,
    ``2130706433``, ``0177.0.0.1``), which the resolver maps to an address without
    any lookup."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if not _NUMERIC_V4.match(host.lower()):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def is_loopback_host(host: str) -> bool:
    """True for ``localhost`` and loopback IPs (``127.0.0.0/8``, ``::1``, IPv4-mapped)."""
    h = host.strip("[]").lower().rstrip(".")
    if h in _LOOPBACK_NAMES:
        return True
    ip = _ip(h)
    if ip is None:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@dataclass(frozen=True, slots=True)
class UrlPolicy:
    """Checks worker URLs and KV addresses (see the module docstring)."""

    allow_link_local: bool = False

    def check_host(self, host: str, what: str) -> str:
        """Return the host, lower-cased; raise :class:`UrlPolicyError` when refused."""
        h = host.lower()
        if not h:
            raise UrlPolicyError(f"{what}: the host is empty")
        ip = _ip(h)
        if ip is None:
            if len(h) > 253 or not _HOSTNAME.match(h):
                raise UrlPolicyError(f"{what}: {host[:80]!r} is not a valid host name")
            if not self.allow_link_local and h.rstrip(".") in METADATA_HOSTS:
                raise UrlPolicyError(f"{what}: {h!r} is a cloud metadata service")
            return h
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        eff: IPAddress = mapped if mapped is not None else ip
        if eff.is_unspecified or eff.is_multicast or str(eff) == "255.255.255.255":
            raise UrlPolicyError(f"{what}: {h} is not a unicast address")
        if not self.allow_link_local:
            if eff.is_link_local:
                raise UrlPolicyError(
                    f"{what}: {h} is link-local (start the router with --allow-link-local "
                    "to accept it)"
                )
            if str(eff) in METADATA_HOSTS or str(ip) in METADATA_HOSTS:
                raise UrlPolicyError(f"{what}: {h} is a cloud metadata service")
        return str(ip) if mapped is None else h

    def check_url(self, url: object, own: tuple[str, int] | None = None) -> str:
        """Validate a worker base URL; return it normalised as ``scheme://host:port``.

        ``own``: the router's listening address (host, port); a URL naming it
        (or a loopback / wildcard host with its port, when it listens on one)
        is refused, so the router never proxies to itself.
        """
        if not isinstance(url, str) or not url:
            raise UrlPolicyError("'url' must be a non-empty string")
        if len(url) > 2048 or any(c.isspace() or ord(c) < 0x21 or c == "\\" for c in url):
            raise UrlPolicyError("'url' holds white space, control characters or a backslash")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise UrlPolicyError(f"'url' is not a valid URL: {e}") from None
        if parts.scheme not in ("http", "https"):
            raise UrlPolicyError(f"'url' must be http:// or https://, got {parts.scheme!r}")
        if parts.username is not None or parts.password is not None or "@" in parts.netloc:
            raise UrlPolicyError("'url' must not carry user information")
        if parts.path not in ("", "/") or parts.query or parts.fragment or url.endswith(("?", "#")):
            raise UrlPolicyError("'url' must be scheme://host:port only (no path, query, fragment)")
        host = self.check_host(parts.hostname or "", "'url'")
        if port is None:
            port = 443 if parts.scheme == "https" else 80
        if port == 0:
            raise UrlPolicyError("'url': port 0 is not a port one can connect to")
        if own is not None and self._is_own(host, port, own):
            raise UrlPolicyError("'url' is this router's own address")
        shown = f"[{host}]" if ":" in host else host
        return f"{parts.scheme}://{shown}:{port}"

    def check_kv_address(self, addr: object) -> str:
        """Validate a ``host:port`` KV address; return it normalised."""
        if not isinstance(addr, str) or ":" not in addr or len(addr) > 300:
            raise UrlPolicyError("'kv_address' must look like 'host:port'")
        host, _, port_s = addr.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        elif ":" in host:
            raise UrlPolicyError("'kv_address': put an IPv6 address in brackets: [addr]:port")
        if not port_s.isdigit() or not 0 < int(port_s) < 65536:
            raise UrlPolicyError(f"'kv_address': bad port {port_s[:10]!r}")
        h = self.check_host(host, "'kv_address'")
        shown = f"[{h}]" if ":" in h else h
        return f"{shown}:{int(port_s)}"

    @staticmethod
    def _is_own(host: str, port: int, own: tuple[str, int]) -> bool:
        own_host, own_port = own[0].lower().strip("[]"), own[1]
        if port != own_port:
            return False
        if host == own_host:
            return True
        own_ip = _ip(own_host)
        wildcard = own_ip is not None and own_ip.is_unspecified
        # a loopback name reaches a router listening on loopback or on every interface
        return is_loopback_host(host) and (wildcard or is_loopback_host(own_host))
