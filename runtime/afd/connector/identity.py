"""Per-connection peer identities on the FFN's sockets, bound to the group secret.

An attention rank opens every connection (the first, and each one after a loss) under a
fresh identity `attn-<rank>.<nonce>.<mac>`: a random 64-bit nonce and a MAC of rank and
nonce keyed by the group secret. The FFN accepts a Hello only from an identity whose
MAC it can recompute and that it has not seen retired, and its ROUTER sockets refuse a
second connection under a live identity (no handover). So a process without the secret
can neither guess a live route nor make one the FFN will take as a rank; repeated Hellos
of one connection are recognisable as repeats. Without a secret (local runs), identities
are still unguessable per connection, but anyone can mint a valid one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re

_PATTERN = re.compile(rb"attn-(\d{1,6})\.([0-9a-f]{16})\.([0-9a-f]{16})")


def identity_key(group_token: str, group_secret: str) -> bytes:
    """The MAC key of a group: what only its members know (empty strings give a public key)."""
    return hashlib.sha256(f"afd-identity\0{group_secret}\0{group_token}".encode()).digest()


def _mac(key: bytes, rank: int, nonce: str) -> str:
    return hmac.new(key, f"attn-{rank}.{nonce}".encode(), hashlib.sha256).hexdigest()[:16]


def new_identity(rank: int, key: bytes) -> bytes:
    """A fresh identity for one connection of attention rank `rank`."""
    nonce = os.urandom(8).hex()
    return f"attn-{rank}.{nonce}.{_mac(key, rank, nonce)}".encode()


def check_identity(identity: bytes, rank: int, key: bytes) -> str | None:
    """None when `identity` was minted for `rank` with `key`; otherwise why not."""
    match = _PATTERN.fullmatch(identity)
    if match is None:
        return f"identity {show(identity)} is not a connection identity (attn-<rank>.<nonce>.<mac>)"
    if int(match.group(1)) != rank:
        return f"identity {show(identity)} was made for another attention rank than {rank}"
    if not hmac.compare_digest(match.group(3).decode(), _mac(key, rank, match.group(2).decode())):
        return f"identity {show(identity)} does not carry this group's secret (is AFD_GROUP_SECRET the same on both roles?)"
    return None


def show(identity: bytes) -> str:
    """`identity` fit for a log line: a connection identity shortened, anything else escaped (no raw NULs)."""
    match = _PATTERN.fullmatch(identity)
    if match is not None:
        return f"attn-{int(match.group(1))}#{match.group(2)[:6].decode()}"
    text = repr(bytes(identity[:64]))[2:-1]
    return text + ("..." if len(identity) > 64 else "")
