"""Listen and advertise addresses of the services peers on other hosts reach.

A service binds the address its config names (loopback by default: one host), and tells peers
where to reach it: the bound address, or, when it binds every interface (``0.0.0.0`` / ``::``),
the address of the node it runs on (under Ray, :func:`ray.util.get_node_ip_address` in that
process). A listener that does not authenticate its callers may only bind a loopback address
(:func:`check_listener`).
"""

from __future__ import annotations

import ipaddress

from relax_agent.errors import ConfigError

WILDCARDS = frozenset({"0.0.0.0", "::", ""})
"""Bind addresses that mean "every interface"."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface."""
    return host in WILDCARDS


def advertised(bind: str, node_ip: str) -> str:
    """The address peers use to reach a service bound to ``bind`` on a node whose address is
    ``node_ip``: ``node_ip`` for a wildcard bind, else ``bind`` itself."""
    return node_ip if is_wildcard(bind) else bind


def check_listener(key: str, host: str, authenticated: bool) -> None:
    """Refuse an unauthenticated listener on a non-loopback address.

    Args:
        key: the config key (or CLI option) that names ``host``, quoted in the error.
        host: the address the listener would bind.
        authenticated: whether every caller must prove a run secret (bearer token, challenge).

    Raises:
        ConfigError: ``host`` is not loopback and ``authenticated`` is False (names ``key``).
    """
    if not authenticated and not is_loopback(host):
        raise ConfigError(f"{key}={host!r}: a listener that does not authenticate its callers may only bind a "
                          "loopback address (127.0.0.0/8, ::1, localhost); set a token for it, or bind 127.0.0.1")
