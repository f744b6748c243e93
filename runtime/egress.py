"""The egress guard of http steps: which addresses a step may reach.

An http step names a host; what it reaches is an address. A check on the
URL's text is no check (``127.1``, ``2130706433``, ``[::ffff:127.0.0.1]``
and a name whose DNS answer is 127.0.0.1 all reach the host's loopback), so
the guard, like Stripe's smokescreen and the OWASP SSRF cheat sheet, works
on addresses, in this order:

1. parse the host the way the resolver would: an IPv6 literal, an IPv4
   literal in any spelling ``inet_aton`` accepts (``127.1``, ``0x7f000001``,
   ``0177.0.0.1``), a name under ``localhost`` (RFC 6761: loopback without
   asking anyone), or else a name, resolved *once*;
2. classify every address: loopback, unspecified, link-local, private
   (RFC 1918, unique local fc00::/7, site-local fec0::/10), shared CGNAT
   100.64.0.0/10, multicast, broadcast and reserved, documentation and
   benchmarking ranges, the IPv4 embeddings (IPv4-mapped ``::ffff:0:0/96``,
   IPv4-compatible ``::/96``, NAT64 ``64:ff9b::/96`` and ``64:ff9b:1::/48``:
   refused whatever they embed; 6to4 and Teredo: refused when what they
   embed is), the cloud metadata endpoints, and anything else not globally
   routable;
3. refuse the step (``denied``) if any address of the answer is internal and
   not on the operator's allow-list ``EXECGO_HTTP_ALLOWED_NETWORKS`` (a
   metadata address only when the list names it exactly, never as part of a
   wider network);
4. hand the caller the address that was checked: the request connects to
   it and nothing else (runtime/tools/http.py), so a DNS answer that
   changes between the check and the connect changes nothing.

Every redirect hop goes through the guard again. The policy rates with the
same classification (``rate_destination``): a literal address never leaves
the process; a name is resolved with a short deadline, and a lookup that
fails or is slow says nothing (the step is checked again when it runs).

``resolve_name`` is the one place a name becomes addresses; tests swap it
for a resolver of their own, since real DNS would leave the machine.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from runtime.envelopes import EnvelopeError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Instance metadata services: credentials of the machine itself.
METADATA = {
    ipaddress.ip_address(text): name
    for text, name in (
        ("169.254.169.254", "cloud metadata (AWS, GCP, Azure, OpenStack, Oracle)"),
        ("169.254.170.2", "cloud metadata (AWS ECS task credentials)"),
        ("169.254.170.23", "cloud metadata (AWS EKS pod identity)"),
        ("fd00:ec2::254", "cloud metadata (AWS IMDS over IPv6)"),
        ("fd00:ec2::23", "cloud metadata (AWS EKS pod identity over IPv6)"),
        ("100.100.100.200", "cloud metadata (Alibaba Cloud)"),
        ("168.63.129.16", "cloud metadata (Azure wire server)"),
    )
}

# (network, class), most specific first: the first that holds the address names it.
_CLASSES: list[tuple[Network, str]] = [
    (ipaddress.ip_network(text), name)
    for text, name in (
        ("0.0.0.0/32", "unspecified"),
        ("0.0.0.0/8", "this-network (reserved)"),
        ("10.0.0.0/8", "private (RFC 1918)"),
        ("100.64.0.0/10", "shared CGNAT (RFC 6598)"),
        ("127.0.0.0/8", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private (RFC 1918)"),
        ("192.0.0.0/24", "IETF protocol assignment (reserved)"),
        ("192.0.2.0/24", "documentation"),
        ("192.88.99.0/24", "6to4 relay anycast (reserved)"),
        ("192.168.0.0/16", "private (RFC 1918)"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("255.255.255.255/32", "broadcast"),
        ("240.0.0.0/4", "reserved"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("::ffff:0:0/96", "IPv4-mapped"),
        ("::/96", "IPv4-compatible"),
        ("64:ff9b::/96", "NAT64"),
        ("64:ff9b:1::/48", "NAT64 (local use)"),
        ("100::/64", "discard-only (reserved)"),
        ("2001:2::/48", "benchmarking"),
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("fc00::/7", "private (unique local)"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "private (site-local)"),
        ("ff00::/8", "multicast"),
    )
]
_SIX_TO_FOUR = ipaddress.ip_network("2002::/16")
_TEREDO = ipaddress.ip_network("2001::/32")
# Only these forms hold an IPv4 address worth naming in a refusal.
_EMBEDDING = {"IPv4-mapped", "IPv4-compatible", "NAT64", "NAT64 (local use)"}

RATING_RESOLVE_TIMEOUT_S = 1.0
_lookups = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="egress-resolve")


def _new_lookups() -> None:
    # A forked process (runtime/tool_process.py) has none of its parent's
    # threads: the parent's pool would take lookups and never run them.
    global _lookups
    _lookups = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="egress-resolve")


os.register_at_fork(after_in_child=_new_lookups)


def classify(address: Address) -> str | None:
    """The class that makes ``address`` internal, or None for a public one."""
    if address.version == 6 and address.scope_id:
        address = ipaddress.IPv6Address(str(address).split("%", 1)[0])
    if address in METADATA:
        return METADATA[address]
    for network, name in _CLASSES:
        if address.version == network.version and address in network:
            if name in _EMBEDDING:
                embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
                inner = classify(embedded) or "public"
                return f"{name} (embeds {embedded}, {inner})"
            return name
    if address.version == 6 and address in _SIX_TO_FOUR:
        embedded = address.sixtofour
        inner = classify(embedded) if embedded is not None else None
        if inner:
            return f"6to4 (embeds {embedded}, {inner})"
        return None
    if address.version == 6 and address in _TEREDO:
        server, client = address.teredo or (None, None)
        for embedded in (server, client):
            inner = classify(embedded) if embedded is not None else None
            if inner:
                return f"Teredo (embeds {embedded}, {inner})"
        return None
    if address.version == 6 and address not in ipaddress.ip_network("2000::/3"):
        return "reserved"
    if not address.is_global:
        return "reserved"
    return None


def allowed_networks() -> list[Network]:
    """``EXECGO_HTTP_ALLOWED_NETWORKS`` as networks (ImproperlyConfigured on a bad entry)."""
    entries = settings.EXECGO_HTTP_ALLOWED_NETWORKS
    if isinstance(entries, str):
        raise ImproperlyConfigured("EXECGO_HTTP_ALLOWED_NETWORKS must be a list of CIDRs")
    key = tuple(entries)
    if key not in _parsed:
        networks = []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(str(entry).strip(), strict=False))
            except ValueError:
                raise ImproperlyConfigured(
                    f"EXECGO_HTTP_ALLOWED_NETWORKS: {entry!r} is not an IP network (CIDR)") from None
        _parsed[key] = networks
    return _parsed[key]


_parsed: dict[tuple, list[Network]] = {}


def allow_listed(address: Address) -> bool:
    for network in allowed_networks():
        if address.version != network.version or address not in network:
            continue
        # A metadata endpoint holds the machine's credentials: only a list that names it lets it through.
        if address in METADATA and network.num_addresses != 1:
            continue
        return True
    return False


def literal_address(host: str) -> Address | None:
    """``host`` as the address a resolver would read it as, without asking one."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if host and all(c in "0123456789abcdefxABCDEFX." for c in host):
        try:
            # The C library's parser: what getaddrinfo (and so the connect) would read it as.
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def normalized_host(host: str) -> str:
    return host.strip("[]").lower().rstrip(".")


def resolve_name(host: str, port: int) -> list[str]:
    """The addresses of a name (the seam tests replace: real DNS would leave the machine)."""
    answers = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(answer[4][0] for answer in answers))


@dataclass(frozen=True)
class Destination:
    host: str  # as the URL names it (the Host header, the TLS server name)
    address: str  # the checked address the request connects to
    port: int
    allow_listed: bool = False
    internal_class: str | None = None  # set on an allow-listed internal address

    @property
    def family(self) -> int:
        return socket.AF_INET6 if ":" in self.address else socket.AF_INET


def explain(address: Any, kind: str) -> str:
    """"destination 127.0.0.1 is a loopback address"."""
    article = "an" if kind[:1].lower() in "aeiou" or kind.startswith(("IPv4", "NAT")) else "a"
    return f"destination {address} is {article} {kind} address"


def refusal(host: str, address: Address, kind: str, **details: Any) -> EnvelopeError:
    return EnvelopeError.of(
        "denied", explain(address, kind) + (f" ({host} resolves to it)"
                                                                   if normalized_host(host) != str(address) else ""),
        source="executor",
        details={"host": host, "address": str(address), "class": kind, **details},
    )


def _addresses(host: str, port: int, *, timeout_s: float) -> list[Address]:
    """The addresses ``host`` stands for."""
    name = normalized_host(host)
    literal = literal_address(name)
    if literal is not None:
        return [literal]
    if name == "localhost" or name.endswith(".localhost"):
        return [ipaddress.ip_address("127.0.0.1")]  # RFC 6761: whatever /etc/hosts says
    future = _lookups.submit(resolve_name, name, port)
    answers = future.result(timeout=timeout_s)
    return [ipaddress.ip_address(answer.split("%", 1)[0]) for answer in answers]


def check_destination(host: str, port: int, *, timeout_s: float, **details: Any) -> Destination:
    """Resolve ``host`` once and return the address to connect to, or raise
    ``denied`` when any address of the answer is internal and not allow-listed."""
    try:
        addresses = _addresses(host, port, timeout_s=timeout_s)
    except concurrent.futures.TimeoutError:
        raise EnvelopeError.of("timeout", f"resolving {host} exceeded {int(timeout_s * 1000)}ms", retryable=True,
                               details={"host": host, "timeout_ms": int(timeout_s * 1000)}) from None
    except (OSError, UnicodeError, ValueError) as exc:
        raise EnvelopeError.of("external_failure", f"cannot resolve {host}: {exc}", retryable=True,
                               details={"host": host}) from None
    if not addresses:
        raise EnvelopeError.of("external_failure", f"{host} has no address", retryable=True, details={"host": host})
    for address in addresses:
        kind = classify(address)
        if kind is not None and not allow_listed(address):
            raise refusal(host, address, kind, **details)
    chosen = addresses[0]
    return Destination(host=host, address=str(chosen), port=port, allow_listed=allow_listed(chosen),
                       internal_class=classify(chosen))


def rate_destination(host: str, port: int) -> dict[str, Any] | None:
    """What the policy says of an http step's destination, without hanging:
    ``{"address", "class", "allow_listed"}`` for an internal one (the first
    refused address, else the first allow-listed internal one), None for a
    public one or a name that does not resolve in time."""
    try:
        addresses = _addresses(host, port, timeout_s=RATING_RESOLVE_TIMEOUT_S)
    except (concurrent.futures.TimeoutError, OSError, UnicodeError, ValueError):
        return None
    found = []
    for address in addresses:
        kind = classify(address)
        if kind is not None:
            found.append({"address": str(address), "class": kind, "allow_listed": allow_listed(address)})
    found.sort(key=lambda entry: entry["allow_listed"])
    return found[0] if found else None

