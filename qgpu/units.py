"""Quantities: the one parser of GPU memory and GPU core amounts used everywhere.

Memory is always carried as whole GiB (an integer >= 1, the Kubernetes rule). Accepted
spellings: ``8``, ``"8"``, ``"8Gi"``, ``"8192Mi"``, ``"1Ti"``, ``"8G"``/``"8GB"``/``"8GiB"``.
A bare ``G`` is read as GiB (Docker's and nvidia-smi's convention) because a decimal 8 GB is
not a whole number of GiB and would otherwise be rejected; this is documented in
docs/configuration.md. Core is an integer percent of one GPU (``30``, ``"30"``, ``"30%"``).
"""

from __future__ import annotations

import math
import re
from typing import Any

from qgpu.errors import RuleViolation

CORE_FIELD = "qgpu-core"
MEMORY_FIELD = "qgpu-memory"

MIB_PER_GIB = 1024
BYTES_PER_GIB = 1024**3
BYTES_PER_MIB = 1024**2

_MEMORY_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[A-Za-z]*)\s*$")
_UNIT_TO_MIB = {
    "": MIB_PER_GIB,
    "gi": MIB_PER_GIB,
    "gib": MIB_PER_GIB,
    "g": MIB_PER_GIB,
    "gb": MIB_PER_GIB,
    "mi": 1,
    "mib": 1,
    "m": 1,
    "mb": 1,
    "ti": MIB_PER_GIB * 1024,
    "tib": MIB_PER_GIB * 1024,
    "t": MIB_PER_GIB * 1024,
    "tb": MIB_PER_GIB * 1024,
}
MEMORY_RULE = "must be a whole number of GiB >= 1, written 8, '8', '8Gi', '8G' or '8192Mi'"
MAX_MEMORY_GIB = 1 << 16  # per GPU: 64 TiB, far above any card; MiB still fit an int32
MAX_MEMORY_RULE = f"must be at most {MAX_MEMORY_GIB} GiB (no GPU has more)"
_MAX_DIGITS = 24  # a longer number is refused before it is converted


def parse_memory_gib(value: Any, field: str = MEMORY_FIELD) -> int:
    """Parse a GPU memory quantity into whole GiB (>= 1); raise RuleViolation otherwise."""
    if isinstance(value, bool) or value is None:
        raise RuleViolation(field, value, MEMORY_RULE)
    if isinstance(value, int):
        mib = value * MIB_PER_GIB
    elif isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise RuleViolation(field, value, MEMORY_RULE)
        mib = int(value) * MIB_PER_GIB
    elif isinstance(value, str):
        if len(value) > 2 * _MAX_DIGITS:  # refused before it is converted
            rule = MAX_MEMORY_RULE if value.strip().isdigit() else MEMORY_RULE
            raise RuleViolation(field, value, rule)
        match = _MEMORY_RE.match(value)
        unit = match.group("unit").lower() if match else None
        if match is None or unit not in _UNIT_TO_MIB:
            raise RuleViolation(field, value, MEMORY_RULE)
        number = float(match.group("num"))
        mib_f = number * _UNIT_TO_MIB[unit]
        if not mib_f.is_integer():
            raise RuleViolation(field, value, MEMORY_RULE)
        mib = int(mib_f)
    else:
        raise RuleViolation(field, value, MEMORY_RULE)
    if mib <= 0 or mib % MIB_PER_GIB:
        raise RuleViolation(field, value, MEMORY_RULE)
    if mib > MAX_MEMORY_GIB * MIB_PER_GIB:
        raise RuleViolation(field, value, MAX_MEMORY_RULE)
    return mib // MIB_PER_GIB


CORE_SYNTAX_RULE = "must be an integer percent of one GPU, written 30, '30' or '30%'"


def parse_core(value: Any, field: str = CORE_FIELD) -> int:
    """Parse a core quantity (integer percent of one GPU); range rules live in the model."""
    if isinstance(value, bool) or value is None:
        raise RuleViolation(field, value, CORE_SYNTAX_RULE)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise RuleViolation(field, value, CORE_SYNTAX_RULE)
    if isinstance(value, str):
        text = value.strip().removesuffix("%").strip()
        if re.fullmatch(r"-?[0-9]+", text):
            if len(text.lstrip("-").lstrip("0")) > 18:  # past int64: no amount of GPUs
                raise RuleViolation(field, value, "is out of range (more than 18 digits)")
            return int(text)
        raise RuleViolation(field, value, CORE_SYNTAX_RULE)
    raise RuleViolation(field, value, CORE_SYNTAX_RULE)


def gib_to_bytes(gib: int) -> int:
    return gib * BYTES_PER_GIB


def mib_to_gib_floor(mib: int) -> int:
    """A card's usable whole GiB (an 81559 MiB H100 offers 79 GiB of slices)."""
    return mib // MIB_PER_GIB


def format_gib(gib: int | float) -> str:
    return f"{gib:g} GiB"
