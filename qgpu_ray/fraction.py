"""How Ray's ``num_gpus`` becomes a slice on a qgpu node (the one rule, per node).

A qgpu node advertises its GPUs to Ray as ``GPU`` too, so unchanged code that asks for
``num_gpus=f`` runs there. For a fraction ``0 < f < 1`` the worker gets a slice of the GPU:

- compute share ``round(f * 100)`` percent (or ``round(f * 10 * core_per_tenth)``), at least
  1 and at most 99 (the slice model's shares; ``f >= 0.995`` is a 99 % share, still a
  slice with a memory cap, never a whole card);
- memory ``floor(f * card GiB)`` (or ``floor(f * 10 * memory_gib_per_tenth)``: a fixed
  number of GiB per 0.1 of a GPU), at least 1 GiB: a fraction that gives 0 GiB is refused
  with a message naming the smallest fraction the card allows (never a silent round-up).

The GPU's qgpu ledger (its ``qgpu-core/<uuid>`` resource) books exactly ``f * 100`` (or
``f * 10 * core_per_tenth``): the amount Ray itself booked for the fraction, so any set of
``num_gpus`` users that Ray admits on one GPU also fits that GPU's qgpu ledger, whatever
the rounding of the caps. Whole ``num_gpus`` (1, 2, ...) are whole cards, uncapped.

The rule is set per node (``qgpu-ray start --fraction-core/--fraction-memory``,
`qgpu_ray.LocalCluster(fraction=...)`) and reaches the node's workers in its environment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qgpu.errors import RuleViolation, violations_from_pydantic

MAX_SHARE = 99
FIELD = "num_gpus"


class FractionRule(BaseModel):
    """What ``num_gpus=f`` means on one node (None = in proportion to the card)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    core_per_tenth: int | None = Field(
        default=None, ge=1, le=10, description="percent of compute per 0.1 of a GPU"
    )
    memory_gib_per_tenth: int | None = Field(
        default=None, ge=1, description="GiB of memory per 0.1 of a GPU"
    )

    @classmethod
    def parse(cls, core: Any = None, memory: Any = None) -> FractionRule:
        """From the textual form: ``"fraction"`` (or None) = in proportion, else an integer."""
        raw: dict[str, Any] = {}
        for key, value, field in (
            ("core_per_tenth", core, "fraction-core"),
            ("memory_gib_per_tenth", memory, "fraction-memory"),
        ):
            if value is None or str(value).strip().lower() in ("", "fraction"):
                continue
            text = str(value).strip().removesuffix("Gi").removesuffix("%")
            if not text.isdigit():
                raise RuleViolation(
                    field, value, "must be 'fraction' or a whole number per 0.1 of a GPU"
                )
            raw[key] = int(text)
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            first = violations_from_pydantic(exc)[0]
            flag = {"core_per_tenth": "fraction-core", "memory_gib_per_tenth": "fraction-memory"}
            given = {"core_per_tenth": core, "memory_gib_per_tenth": memory}
            raise RuleViolation(
                flag.get(first.field, first.field), given.get(first.field, first.value), first.rule
            ) from exc

    def check_cards(self, card_gib: list[int]) -> None:
        """A rule whose whole GPU (10 tenths) is more memory than a card has is refused:
        Ray would admit fractions that the card cannot hold."""
        if self.memory_gib_per_tenth is not None and card_gib:
            smallest = min(card_gib)
            if self.memory_gib_per_tenth * 10 > smallest:
                raise RuleViolation(
                    "fraction-memory",
                    self.memory_gib_per_tenth,
                    f"10 x GiB per 0.1 must fit the node's smallest card ({smallest} GiB)",
                )

    def to_text(self) -> str:
        """The form kept in a node's environment and shown in its label."""
        core = "fraction" if self.core_per_tenth is None else str(self.core_per_tenth)
        memory = "fraction" if self.memory_gib_per_tenth is None else str(self.memory_gib_per_tenth)
        return f"core={core},memory={memory}"

    @classmethod
    def from_text(cls, text: str | None) -> FractionRule:
        if not text:
            return cls()
        parts = dict(p.split("=", 1) for p in text.split(",") if "=" in p)
        return cls.parse(parts.get("core"), parts.get("memory"))


@dataclass(frozen=True)
class FractionSlice:
    """The slice a fraction gets on one card."""

    fraction: float
    core: int  # the compute cap, percent
    booked_core: float  # what the GPU's qgpu ledger books (what Ray booked for the fraction)
    memory_gib: int


def whole_gpus(amount: float) -> int | None:
    """The number of whole cards for ``num_gpus >= 1`` (None for a fraction)."""
    if amount < 1:
        return None
    if abs(amount - round(amount)) > 1e-6:
        raise RuleViolation(FIELD, amount, "above 1 must be a whole number of GPUs (Ray's rule)")
    return round(amount)


def fraction_slice(amount: float, card_gib: int, rule: FractionRule | None = None) -> FractionSlice:
    """The slice ``num_gpus=amount`` (0 < amount < 1) gets on a card of ``card_gib``."""
    rule = rule or FractionRule()
    if not 0 < amount < 1:
        raise RuleViolation(FIELD, amount, "a slice needs a fraction 0 < num_gpus < 1")
    tenths = amount * 10
    booked = amount * 100 if rule.core_per_tenth is None else tenths * rule.core_per_tenth
    core = min(MAX_SHARE, round(booked))
    if core < 1:
        raise RuleViolation(
            FIELD,
            amount,
            f"gives a compute share of {booked:.2f} % on this node; a slice needs 1 %",
        )
    if rule.memory_gib_per_tenth is None:
        memory = math.floor(amount * card_gib + 1e-9)
        smallest = f"1/{card_gib} = {1 / card_gib:.4g}"
        how = f"floor({amount} x {card_gib} GiB)"
    else:
        memory = math.floor(tenths * rule.memory_gib_per_tenth + 1e-9)
        smallest = f"{0.1 / rule.memory_gib_per_tenth:.4g}"
        how = f"floor({amount} x 10 x {rule.memory_gib_per_tenth} GiB)"
    if memory < 1:
        raise RuleViolation(
            FIELD,
            amount,
            f"gives {how} = 0 GiB of memory; the smallest num_gpus a slice of this card "
            f"can have is {smallest}",
        )
    return FractionSlice(amount, core, round(booked, 4), memory)
