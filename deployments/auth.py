"""API-key check shared by HTTP and gRPC.

Keys come from the environment variable named in the Serve config (`api_key_env`; on Kubernetes, filled from a
Secret), never from the config itself. No keys configured = auth off. HTTP: `Authorization: Bearer <key>` (or
`x-api-key`); gRPC: the same names as metadata. A missing or wrong key is 401 / UNAUTHENTICATED.
"""

from __future__ import annotations

import hmac
import os


class ApiKeys:
    def __init__(self, keys: list[str] | None = None):
        self.keys = [k.encode() for k in (keys or []) if k]

    @classmethod
    def from_env(cls, name: str | None) -> "ApiKeys":
        """Comma-separated keys from the variable `name` (several keys allow rotation without downtime)."""
        if not name:
            return cls()
        return cls([k.strip() for k in os.environ.get(name, "").split(",")])

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def allows(self, headers: dict[str, str] | list[tuple[str, str]]) -> bool:
        """True if auth is off or the headers / gRPC metadata carry a valid key (names in lower case)."""
        if not self.enabled:
            return True
        items = headers.items() if isinstance(headers, dict) else headers
        given = None
        for name, value in items:
            name = name.lower()
            if name == "authorization" and value[:7].lower() == "bearer ":
                given = value[7:].strip()
            elif name == "x-api-key":
                given = value.strip()
        if not given:
            return False
        g = given.encode()
        return any(hmac.compare_digest(g, k) for k in self.keys)  # constant-time compare
