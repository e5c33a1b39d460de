"""Where a webhook (or a grader's judge endpoint, core/graders/judge.py) may be sent: the URL is checked at registration and again before every
attempt, and the attempt connects to the very address that was checked (no second DNS
lookup a rebinding attacker could answer differently).

Refused unless the operator allows them (``webhook_allowed_networks``): private, loopback,
link-local, multicast, reserved and unspecified addresses, and anything that is not a
global unicast address. ``http`` only with ``webhook_allow_http``; no credentials in the
URL; ports 1-65535."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from core.infra.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_URL_LENGTH = 2048


class UrlRefused(ValueError):
    """The URL may not be called; the message says why."""


@dataclass(frozen=True)
class NetPolicy:
    """Which addresses beyond the public ones may be called, and whether http is."""

    allowed_networks: tuple[str, ...] = ()
    allow_http: bool = False

    @classmethod
    def webhooks(cls, settings: Settings) -> NetPolicy:
        return cls(tuple(settings.webhook_allowed_networks), settings.webhook_allow_http)


@dataclass(frozen=True)
class Target:
    """A checked URL and the address to connect to."""

    url: str
    scheme: str
    host: str
    port: int
    address: IPAddress

    @property
    def connect_url(self) -> str:
        """The URL with its host replaced by the checked address (TLS still verifies the
        certificate against ``host``, sent as SNI and Host)."""
        parts = urlsplit(self.url)
        literal = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return parts._replace(netloc=f"{literal}:{self.port}").geturl()

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


def check_syntax(url: str, policy: NetPolicy) -> tuple[str, str, int]:
    """(scheme, host, port) of an acceptable URL, without resolving it."""
    if len(url) > MAX_URL_LENGTH:
        raise UrlRefused(f"longer than {MAX_URL_LENGTH} characters")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise UrlRefused("must not contain spaces or control characters (percent-encode them)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise UrlRefused(f"not a valid URL ({e})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("https", "http"):
        raise UrlRefused("must be an https:// URL")
    if scheme == "http" and not policy.allow_http:
        raise UrlRefused("must use https (this server does not call http:// URLs)")
    if parts.username is not None or parts.password is not None:
        raise UrlRefused("must not contain credentials")
    if not parts.hostname:
        raise UrlRefused("has no host")
    if parts.fragment:
        raise UrlRefused("must not contain a fragment")
    if port == 0:
        raise UrlRefused("port 0 is not a port")
    return scheme, parts.hostname, port or (443 if scheme == "https" else 80)


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to (a literal address is itself)."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise UrlRefused(f"host {host!r} does not resolve ({e})") from None
    out: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in out:
            out.append(address)
    if not out:
        raise UrlRefused(f"host {host!r} does not resolve")
    return out


def address_refusal(address: IPAddress, policy: NetPolicy) -> str | None:
    """Why ``address`` may not be called, or None."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    for network in policy.allowed_networks:
        if address in ipaddress.ip_network(network, strict=False):
            return None
    # Most specific first: link-local and loopback addresses are "private" too.
    for kind in ("loopback", "link_local", "multicast", "unspecified", "reserved", "private"):
        if getattr(address, f"is_{kind}"):
            return f"{address} is a {kind.replace('_', '-')} address"
    if not address.is_global:
        return f"{address} is not a public address"
    return None


def check(url: str, settings: Settings) -> Target:
    """A webhook URL, checked against the operator's webhook settings."""
    return check_url(url, NetPolicy.webhooks(settings))


def check_url(url: str, policy: NetPolicy) -> Target:
    """Resolve and check a URL; the target to connect to. Every address the host resolves
    to must be allowed (one bad one refuses the URL: the choice is not the caller's)."""
    scheme, host, port = check_syntax(url, policy)
    addresses = resolve(host, port)
    for address in addresses:
        why = address_refusal(address, policy)
        if why is not None:
            where = "" if str(address) == host else f"{host} resolves to {address}; "
            raise UrlRefused(f"not allowed: {where}{why}")
    return Target(url=url, scheme=scheme, host=host, port=port, address=addresses[0])
