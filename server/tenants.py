"""Tenants: who a request comes from, as far as the prefix cache is concerned.

A tenant is an API key. A server with several keys (`--api-key` given more than once, or a key
file of several lines) serves several tenants, and under `--prefix-cache-scope api-key` (the
default) they share no cached prompt prefixes: a cache hit is visible to a client (in
`usage.prompt_tokens_details.cached_tokens`, and in how fast the answer comes), so a shared
cache would let one tenant test guesses of another's prompts, block by block. A server with one
key or none has one tenant, and loses nothing.

The scheduler separates requests by a `cache_salt` string that roots each prompt's block-hash
chain (scheduler/block_allocator.py). Under `api-key`, the salt the engine gets is derived from
the tenant and the client's own `cache_salt`; under `shared`, it is the client's `cache_salt`
alone. A tenant is known by a tag, an HMAC of its key under a secret drawn at start-up: the
key itself is never stored with a request, sent to a prefill server, or logged, and the tag
means nothing outside this process (or, with a cluster key, outside the deployment: decode
servers derive it from that key, so one tenant shares its prefixes at their prefill servers).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

PrefixCacheScope = Literal["api-key", "shared"]
PREFIX_CACHE_SCOPES: tuple[PrefixCacheScope, ...] = ("api-key", "shared")


@dataclass(frozen=True)
class Tenant:
    """A client that proved a key (or any client, on a server without keys: `tag` b"")."""

    tag: bytes  # HMAC-SHA256(secret, key), truncated: names the key without holding it


ANONYMOUS = Tenant(b"")


class Tenants:
    def __init__(
        self, keys: Sequence[str], scope: PrefixCacheScope = "api-key", cluster_key: bytes | None = None
    ) -> None:
        """`cluster_key`: decode servers of one disaggregated deployment derive the tags from it, so
        that a tenant is one tenant at their shared prefill servers (its cached prefixes shared);
        without it, the tags come from a secret drawn at start-up."""
        if scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix cache scope must be one of {', '.join(PREFIX_CACHE_SCOPES)}, got {scope!r}")
        self.scope = scope
        if cluster_key is None:
            secret = secrets.token_bytes(32)
        else:
            secret = hashlib.blake2b(cluster_key, digest_size=32, person=b"ppserve-tenant").digest()
        # Bytes, so that any header or JSON string (even one with lone surrogates, through
        # "surrogatepass") compares unequal rather than crash.
        encoded = [key.encode("utf-8", "surrogatepass") for key in dict.fromkeys(keys) if key]
        self._keys = [(key, Tenant(hmac.digest(secret, key, "sha256")[:16])) for key in encoded]

    @property
    def keyed(self) -> bool:
        """Whether requests need a key."""
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, given: bytes) -> Tenant | None:
        """The tenant whose key `given` is (ANONYMOUS on a server without keys), else None.
        Constant-time per key, and every key is compared whatever matched: response timing says
        nothing about a key, nor about which one matched."""
        if not self._keys:
            return ANONYMOUS
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(given, key) and found is None:
                found = tenant
        return found

    def cache_salt(self, tenant: Tenant, salt: str | None) -> str | None:
        """The salt the engine gets for a request of `tenant` with the client's `salt`. Under
        `api-key` every keyed tenant's salt is a keyed hash of the client's (or of nothing), so
        no choice of `cache_salt` reaches another tenant's blocks; without keys (one tenant),
        or under `shared`, the client's salt alone separates."""
        if self.scope == "shared" or not tenant.tag:
            return salt
        # b"" for no salt vs b"\x01" + salt: the two never hash alike (an empty salt is refused anyway).
        data = b"" if salt is None else b"\x01" + salt.encode("utf-8", "surrogatepass")
        return self.salt_prefix(tenant) + hashlib.blake2b(data, key=tenant.tag, digest_size=16).hexdigest()

    def salt_prefix(self, tenant: Tenant) -> str:
        """What every cache salt of `tenant` starts with (under `api-key`), so that its cached
        prefixes can be flushed without the others' (`/flush_cache` with its key)."""
        return f"tenant:{tenant.tag[:8].hex()}:"
