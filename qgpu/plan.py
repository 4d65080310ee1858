"""Offline planning: place a list of requests on a list of nodes and report the outcome.

Used by ``qgpu plan`` and the placement demo. Input files are YAML or JSON; each request
may carry a ``name`` and a ``count``; node GPUs give memory as ``memory_mib`` or as a
quantity ``memory`` ("80Gi"), parsed by `qgpu.units`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from qgpu.errors import NoFit, RuleViolation, first_violation
from qgpu.model import NodeInventory, PlacementPolicy, SliceRequest
from qgpu.placement import ClusterState, Decision, Engine
from qgpu.units import MIB_PER_GIB, parse_memory_gib


class NamedRequest(BaseModel):
    """A request line of a plan file: a name, how many, and the slice request itself."""

    model_config = ConfigDict(extra="forbid")

    name: str
    count: int = Field(default=1, ge=1, le=100_000)
    request: SliceRequest


@dataclass
class PlanResult:
    placed: list[tuple[str, SliceRequest, Decision]] = field(default_factory=list)
    unplaced: list[tuple[str, SliceRequest, str]] = field(default_factory=list)
    state: ClusterState | None = None


def load_document(path: str | Path) -> Any:
    """Read a YAML or JSON file; raise RuleViolation naming the file when unreadable."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise RuleViolation(str(p), None, f"cannot be read: {exc.strerror}") from exc
    try:
        if p.suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise RuleViolation(str(p), None, f"is not valid YAML/JSON: {exc}") from exc


def _items(doc: Any, key: str, path: str | Path) -> list[Any]:
    if isinstance(doc, dict) and key in doc:
        doc = doc[key]
    if not isinstance(doc, list):
        raise RuleViolation(str(path), type(doc).__name__, f"must be a list of {key}")
    return doc


def _normalise_gpu(gpu: Any, where: str) -> Any:
    if isinstance(gpu, dict) and "memory" in gpu and "memory_mib" not in gpu:
        gpu = dict(gpu)
        gpu["memory_mib"] = parse_memory_gib(gpu.pop("memory"), f"{where}.memory") * MIB_PER_GIB
    return gpu


def load_nodes(path: str | Path) -> list[NodeInventory]:
    nodes = []
    for i, raw in enumerate(_items(load_document(path), "nodes", path)):
        if isinstance(raw, dict) and isinstance(raw.get("gpus"), list):
            raw = dict(raw)
            raw["gpus"] = [
                _normalise_gpu(g, f"nodes[{i}].gpus[{j}]") for j, g in enumerate(raw["gpus"])
            ]
        try:
            nodes.append(NodeInventory.model_validate(raw))
        except ValidationError as exc:
            v = first_violation(exc)
            raise RuleViolation(f"nodes[{i}].{v.field}", v.value, v.rule) from exc
    return nodes


def load_requests(path: str | Path) -> list[NamedRequest]:
    out = []
    for i, raw in enumerate(_items(load_document(path), "requests", path)):
        if not isinstance(raw, dict):
            raise RuleViolation(f"requests[{i}]", raw, "must be a mapping")
        body = {k: v for k, v in raw.items() if k not in {"name", "count"}}
        try:
            req = SliceRequest.model_validate(body)
            out.append(
                NamedRequest(
                    name=str(raw.get("name", f"req-{i}")), count=raw.get("count", 1), request=req
                )
            )
        except ValidationError as exc:
            v = first_violation(exc)
            raise RuleViolation(f"requests[{i}].{v.field}", v.value, v.rule) from exc
    return out


def plan(
    nodes: list[NodeInventory],
    requests: list[NamedRequest],
    policy: PlacementPolicy | str | None = None,
    gpu_policy: PlacementPolicy | str | None = None,
) -> PlanResult:
    """Place requests in order; those that do not fit are reported with the reason."""
    state = ClusterState(nodes)
    engine = Engine(state, policy, gpu_policy)
    result = PlanResult(state=state)
    cards = [g for n in nodes for g in n.gpus]
    for named in requests:
        for k in range(named.count):
            label = named.name if named.count == 1 else f"{named.name}-{k}"
            while label in state.held or any(label == u[0] for u in result.unplaced):
                label += "'"
            req = named.request
            try:
                fitting_cards = [g for g in cards if g.matches_model(req.model_names)]
                if fitting_cards and req.memory_gib is not None:
                    req.check_against(max(fitting_cards, key=lambda g: g.memory_gib))
                decision = engine.place(label, req)
            except (NoFit, RuleViolation) as exc:
                result.unplaced.append((label, req, str(exc)))
            else:
                result.placed.append((label, req, decision))
    return result
