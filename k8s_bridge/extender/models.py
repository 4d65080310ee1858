"""The extender's HTTP wire types, with kube-scheduler's Go field names as JSON keys.

Mirrors k8s.io/kube-scheduler/extender/v1: `ExtenderArgs`, `ExtenderFilterResult`,
`HostPriority` (a `HostPriorityList` is a JSON list of them), `ExtenderBindingArgs` and
`ExtenderBindingResult`. Pods and nodes stay plain JSON objects here; the bridge parses the
parts it needs with `k8s_bridge.resources.PodModel`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from typing_extensions import TypedDict


class _Go(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class NodeList(_Go):
    items: list[dict[str, Any]] = Field(default_factory=list)


class ExtenderArgs(_Go):
    pod: dict[str, Any] = Field(alias="Pod")
    nodes: NodeList | None = Field(default=None, alias="Nodes")
    node_names: list[str] | None = Field(default=None, alias="NodeNames")

    def candidate_names(self) -> list[str]:
        if self.node_names is not None:
            return list(self.node_names)
        if self.nodes is not None:
            return [n["metadata"]["name"] for n in self.nodes.items]
        return []


class ExtenderFilterResult(_Go):
    nodes: NodeList | None = Field(default=None, alias="Nodes")
    node_names: list[str] | None = Field(default=None, alias="NodeNames")
    failed_nodes: dict[str, str] = Field(default_factory=dict, alias="FailedNodes")
    failed_and_unresolvable_nodes: dict[str, str] = Field(
        default_factory=dict, alias="FailedAndUnresolvableNodes"
    )
    error: str = Field(default="", alias="Error")


MAX_SCORE = 10  # kube-scheduler's extender scores are 0..10 (MaxExtenderPriority)


class HostPriority(TypedDict):
    """One ``HostPriority`` (a TypedDict: validating 1,000 of them creates no objects)."""

    Host: str
    Score: Annotated[int, Field(ge=0, le=MAX_SCORE)]


HostPriorityList = TypeAdapter(list[HostPriority])
"""A ``HostPriorityList``: validated and serialized in one call."""

_ENTRIES: dict[str, list[str]] = {}  # node name -> its 11 entries, one per score 0..10
_ENTRIES_MAX = 100_000


def host_priority_list_json(names: list[str], scores: list[int]) -> bytes:
    """Serialize a ``HostPriorityList`` from our own names and 0..10 scores.

    The scores come from the extender's own scoring (integers 0..10 by construction), so
    nothing is validated. Node names repeat with every pod, so each name's eleven possible
    entries are built once and remembered: serializing 1,000 hosts is then a join (~50 us,
    a tenth of building 1,000 dicts for a JSON encoder).
    """
    if len(names) != len(scores):
        raise ValueError(f"{len(names)} names but {len(scores)} scores")
    if scores and (min(scores) < 0 or max(scores) > MAX_SCORE):
        raise ValueError(f"scores must be 0..{MAX_SCORE}, got {min(scores)}..{max(scores)}")
    if len(_ENTRIES) > _ENTRIES_MAX:
        _ENTRIES.clear()
    entries = _ENTRIES
    try:
        parts = [entries[name][score] for name, score in zip(names, scores, strict=True)]
    except KeyError:  # names not seen before: build their entries, then join
        for name in names:
            if name not in entries:
                quoted = json.dumps(name)
                entries[name] = [f'{{"Host":{quoted},"Score":{v}}}' for v in range(MAX_SCORE + 1)]
        parts = [entries[name][score] for name, score in zip(names, scores, strict=True)]
    return f"[{','.join(parts)}]".encode()


class ExtenderBindingArgs(_Go):
    pod_name: str = Field(alias="PodName")
    pod_namespace: str = Field(alias="PodNamespace")
    pod_uid: str = Field(alias="PodUID")
    node: str = Field(alias="Node")


class ExtenderBindingResult(_Go):
    error: str = Field(default="", alias="Error")
