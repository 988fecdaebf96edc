"""Who is asking: the client's address behind trusted proxies (their X-Forwarded-For and -Proto,
believed only from QUOTES_TRUSTED_PROXIES), the address and network the limits count it by, and
`Client`, its salted identity.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # ::ffff:192.0.2.1 is 192.0.2.1, whichever stack accepted it
    return address


def client_address(ip: str) -> str:
    """The address an anonymous client is counted by: an IPv6 one as its QUOTES_IPV6_PREFIX network
    (a /64, what one subscriber or instance is given: no rotating out), as its first address; what
    is no address (a unix socket's peer), as it is."""
    address = _address(ip)
    if address is None:
        return ip
    if isinstance(address, ipaddress.IPv6Address):
        network = ipaddress.IPv6Network((int(address), settings.QUOTES_IPV6_PREFIX), strict=False)
        return str(network.network_address)
    return str(address)


def client_network(ip: str) -> str:
    """The network the coarser rate limit counts an address by (QUOTES_IPV6_NETWORK_PREFIX,
    QUOTES_IPV4_NETWORK_PREFIX); "" when it is not an address."""
    address = _address(ip)
    if address is None:
        return ""
    v6 = isinstance(address, ipaddress.IPv6Address)
    prefix = settings.QUOTES_IPV6_NETWORK_PREFIX if v6 else settings.QUOTES_IPV4_NETWORK_PREFIX
    return str(ipaddress.ip_network((int(address), prefix), strict=False))


@dataclass(frozen=True, slots=True)
class TrustedProxies:
    entries: tuple[str, ...]
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    #: a unix socket has no peer address: only a local process (nginx) can reach it
    unix: bool

    @staticmethod
    def parse(entries: tuple[str, ...]) -> TrustedProxies:
        networks = tuple(ipaddress.ip_network(entry, strict=False) for entry in entries if entry != "unix")
        return TrustedProxies(entries=entries, networks=networks, unix="unix" in entries)

    def trusts(self, address: Address) -> bool:
        return any(address in network for network in self.networks)

    def trusts_peer(self, client: Sequence[Any] | None) -> bool:
        if not client or not client[0]:
            return self.unix
        address = _address(str(client[0]))
        return address is not None and self.trusts(address)

    def forwarded_client(self, hops: list[str]) -> str | None:
        """The client in an X-Forwarded-For chain: the first hop from the right that is not a
        trusted proxy (each appends the address it saw; what is left of it, the client wrote)."""
        for hop in reversed(hops):
            address = _hop_address(hop)
            if address is None:
                return None  # garbage (or "unknown") where an address should be: believe none
            if not self.trusts(address):
                return str(address)
        first = _hop_address(hops[0]) if hops else None  # every hop a proxy of ours
        return str(first) if first is not None else None


def _hop_address(hop: str) -> Address | None:
    """One X-Forwarded-For entry: `192.0.2.1`, `192.0.2.1:4711`, `2001:db8::1` or `[2001:db8::1]:4711`."""
    hop = hop.strip()
    if hop.startswith("["):
        hop = hop[1 : hop.find("]")] if "]" in hop else ""
    elif hop.count(":") == 1:
        hop = hop.partition(":")[0]
    return _address(hop)


def header_values(scope: Scope, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in scope.get("headers", ()) if key.lower() == name]


class TrustedProxyMiddleware:
    """Pure ASGI, around the whole app (HTTP and WebSocket): when the peer is one of
    QUOTES_TRUSTED_PROXIES, the client and scheme it forwarded (X-Forwarded-For, -Proto) replace
    the peer's in the scope. Not daphne's `--proxy-headers`, which believes whoever connects."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.proxies = TrustedProxies.parse(())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            entries = tuple(settings.QUOTES_TRUSTED_PROXIES)
            if entries != self.proxies.entries:  # (settings change in tests)
                self.proxies = TrustedProxies.parse(entries)
            proxies = self.proxies
            if proxies.trusts_peer(scope.get("client")):
                scope = _forwarded_scope(scope, proxies)
        await self.app(scope, receive, send)


def _forwarded_scope(scope: Scope, proxies: TrustedProxies) -> Scope:
    hops = [
        hop for value in header_values(scope, b"x-forwarded-for") for hop in value.split(",") if hop.strip()
    ]
    protos = header_values(scope, b"x-forwarded-proto")
    if not hops and not protos:
        return scope
    scope = dict(scope)  # the server's dict is its own
    client = proxies.forwarded_client(hops) if hops else None
    if client is not None:
        scope["client"] = (client, 0)  # the client's port is not forwarded
    proto = protos[-1].strip().lower() if protos else ""
    if proto in ("http", "https"):
        scope["scheme"] = proto if scope["type"] == "http" else proto.replace("http", "ws")
    return scope


# -- who asks ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Client:
    """Who asks: the user when logged in, else a salted hash of the address (an IPv6 address by
    its /64); `network` is the salted hash of its /24 or /48, for the coarser limit; `reader`,
    what keeps a reader in one arm of an experiment: a salted hash of the browser's CSRF cookie
    (one per browser, kept across visits), else the key."""

    key: str
    ip_hash: str = ""
    network: str = ""
    reader: str = ""

    @classmethod
    def of(cls, ip: str, user_id: int | None = None, cookie: str = "") -> Client:
        ip_hash = _salted(client_address(ip))
        network = client_network(ip)
        key = f"user:{user_id}" if user_id else f"ip:{ip_hash}"
        return cls(
            key=key,
            ip_hash=ip_hash,
            network=f"net:{_salted(network)}" if network else "",
            reader=_salted(f"cookie:{cookie}") if cookie else key,
        )


def _salted(text: str) -> str:
    return hmac.new(settings.SECRET_KEY.encode(), text.encode(), hashlib.sha256).hexdigest()[:32]
