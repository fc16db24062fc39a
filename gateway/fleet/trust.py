"""Which URL a replica may announce for its name.

A heartbeat names a replica and the URL the gateway should send it prompts. Even with
NATS credentials, a URL that does not belong to the name would let one replica (or a
stolen credential) draw another's traffic to any server, so the gateway accepts a URL
only by one of these rules:

- ``exact``: the configured name -> URL map, and nothing else;
- ``k8s-dns``: the map, or a pod's DNS name under its headless Service,
  ``http(s)://POD.SERVICE.NAMESPACE.svc[.cluster.local][:PORT]``, whose namespace and
  pod give the announced name (``NAMESPACE_POD``, as the operator names replicas);
- ``off``: any URL (development, or a bus nobody else can reach).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

URL_CHECKS = ("exact", "k8s-dns", "off")

_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"  # one DNS-1123 label
_K8S_DNS = re.compile(
    rf"^https?://(?P<pod>{_LABEL})\.(?P<service>{_LABEL})\.(?P<namespace>{_LABEL})"
    r"\.svc(?:\.cluster\.local)?(?::(?P<port>\d{1,5}))?/?$"
)


def k8s_dns_name(url: str) -> str | None:
    """The replica name a pod DNS URL stands for (``NAMESPACE_POD``, as the operator
    names members), or None."""
    m = _K8S_DNS.match(url)
    if m is None:
        return None
    return f"{m['namespace']}_{m['pod']}"


def _norm(url: str) -> str:
    return url.rstrip("/")


@dataclass(slots=True, frozen=True)
class UrlPolicy:
    """The rule a replica's announced URL must pass."""

    mode: str = "off"  # one of URL_CHECKS
    exact: Mapping[str, str] = field(default_factory=dict)  # name -> URL from configuration

    def __post_init__(self) -> None:
        if self.mode not in URL_CHECKS:
            raise ValueError(f"unknown replica URL check {self.mode!r}; one of {URL_CHECKS}")

    def refuses(self, name: str, url: str) -> str | None:
        """Why ``url`` may not serve as ``name``; None when it may."""
        if self.mode == "off":
            return None
        configured = self.exact.get(name)
        if configured is not None:
            if _norm(configured) == _norm(url):
                return None
            return f"configured URL of {name} is {configured}, announced {url}"
        if self.mode == "k8s-dns":
            owner = k8s_dns_name(url)
            if owner == name:
                return None
            if owner is None:
                return f"{url} is not a pod DNS URL (POD.SERVICE.NAMESPACE.svc)"
            return f"{url} belongs to replica {owner}, not {name}"
        return f"{name} is not in the configured replica map"
