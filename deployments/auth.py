"""API-key check shared by HTTP and gRPC.

Keys come from the environment variable named in the Serve config (`api_key_env`; on Kubernetes, filled from a
Secret), never from the config itself. No keys configured = auth off. HTTP: `Authorization: Bearer <key>` (or
`x-api-key`); gRPC: the same names as metadata. A missing or wrong key is 401 / UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac
import logging
import os

log = logging.getLogger("ray.serve")


class ApiKeys:
    def __init__(self, keys: list[str] | None = None):
        self.keys = [k.encode() for k in (keys or []) if k]

    @classmethod
    def from_env(cls, name: str | None) -> "ApiKeys":
        """Comma-separated keys from the variable `name` (several keys allow rotation without downtime)."""
        if not name:
            return cls()
        keys = cls([k.strip() for k in os.environ.get(name, "").split(",")])
        if not keys.enabled:  # a Secret that didn't reach the pod must not pass unnoticed
            log.warning("api_key_env names %s, but that variable is unset or empty: API-key auth is OFF and every "
                        "request is accepted; set %s to comma-separated keys, or drop api_key_env", name, name)
        return keys

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def allows(self, headers: dict[str, str] | list[tuple[str, str]]) -> bool:
        """True if auth is off or any key the headers / gRPC metadata carry is valid (names in lower case)."""
        if not self.enabled:
            return True
        items = headers.items() if isinstance(headers, dict) else headers
        given = []  # every credential presented: `Authorization: Bearer` and `x-api-key` may both be sent
        for name, value in items:
            name = name.lower()
            if name == "authorization" and value[:7].lower() == "bearer ":
                given.append(value[7:].strip())
            elif name == "x-api-key":
                given.append(value.strip())
        return any(hmac.compare_digest(g.encode(), k) for g in given if g for k in self.keys)  # constant-time compare
