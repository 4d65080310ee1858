"""Signed assignments: the extender's MAC on ``<prefix>/qgpu-assignment``.

Owns the one rule by which the device plugin tells an assignment the extender wrote from
one anybody else wrote (a tenant with pod ``patch`` RBAC, a pod that bypassed the webhook):
the extender's bind puts ``<prefix>/qgpu-assignment-mac`` next to the assignment, an
HMAC-SHA256 (stdlib `hmac`) with a key only the extender and the device plugin hold (a
Kubernetes Secret mounted into both), over

    "qgpu-assignment/v1", the pod's UID, the node, the assignment's exact text

each length-prefixed. The text carries the GPU(s), caps, device layout, ``bound_at`` and the
node's ``lock_epoch`` of the bind, so the MAC cannot be moved to another pod (UID), another
node, or another assignment. Verification tries the current key and, during a rotation, the
previous one, comparing in constant time (`hmac.compare_digest`).

Keys come from files (the Secret's keys); a missing, unreadable, empty or short key file is
a `RuleViolation` naming the flag, the path and the rule.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path

from qgpu.errors import RuleViolation

MAC_VERSION = "v1"
_DOMAIN = b"qgpu-assignment/v1"
MIN_KEY_BYTES = 32


def _message(pod_uid: str, node: str, assignment_text: str) -> bytes:
    parts = [_DOMAIN, pod_uid.encode(), node.encode(), assignment_text.encode()]
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def _digest(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def load_key(path: str | Path, flag: str) -> bytes:
    """The key in `path` (surrounding whitespace stripped); RuleViolation naming `flag`."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise RuleViolation(flag, str(path), f"cannot be read: {exc.strerror}") from exc
    key = raw.strip()
    if not key:
        raise RuleViolation(
            flag, str(path), f"is empty: an assignment key needs at least {MIN_KEY_BYTES} bytes"
        )
    if len(key) < MIN_KEY_BYTES:
        raise RuleViolation(
            flag,
            str(path),
            f"holds {len(key)} bytes: an assignment key needs at least {MIN_KEY_BYTES}",
        )
    return key


@dataclass(frozen=True)
class AssignmentKeys:
    """The key that signs (current) and the keys that verify (current, then previous)."""

    current: bytes
    previous: bytes | None = None

    def __post_init__(self) -> None:
        for name, key in (("current", self.current), ("previous", self.previous)):
            if key is not None and len(key) < MIN_KEY_BYTES:
                raise RuleViolation(
                    f"assignment key ({name})",
                    f"{len(key)} bytes",
                    f"needs at least {MIN_KEY_BYTES} bytes",
                )

    @classmethod
    def from_files(
        cls,
        current: str | Path,
        previous: str | Path | None = None,
        flags: tuple[str, str] = ("--assignment-key-file", "--assignment-previous-key-file"),
    ) -> AssignmentKeys:
        """Keys from files; a previous key file that does not exist means "no rotation"
        (the chart mounts the Secret's optional ``previous`` key only when it is set)."""
        prev = None
        if previous is not None and Path(previous).exists():
            prev = load_key(previous, flags[1])
        return cls(load_key(current, flags[0]), prev)

    def sign(self, pod_uid: str, node: str, assignment_text: str) -> str:
        """The MAC annotation's value for this pod, node and assignment text."""
        return f"{MAC_VERSION}.{_digest(self.current, _message(pod_uid, node, assignment_text))}"

    def check(self, pod_uid: str, node: str, assignment_text: str, mac: str | None) -> str | None:
        """None when `mac` is a valid MAC of this pod, node and text; else the reason."""
        if not mac:
            return "its assignment MAC annotation is missing"
        version, _, digest = mac.partition(".")
        if version != MAC_VERSION or not digest:
            return f"its assignment MAC is not a {MAC_VERSION} MAC"
        message = _message(pod_uid, node, assignment_text)
        ok = False
        for key in (self.current, self.previous):
            if key is not None:
                # every key is tried (no early exit), each compare in constant time
                ok |= hmac.compare_digest(_digest(key, message), digest)
        return (
            None
            if ok
            else (
                "its assignment MAC does not match (not written by the qgpu extender for this "
                "pod and node, or changed since)"
            )
        )
