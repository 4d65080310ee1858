"""Render helm/qgpu with Helm's own engine and look at the objects it makes.

`helm-python-sdk` (PyPI) bundles Helm's Go library: rendering, values.schema.json checks,
`lookup` (answers nothing offline), genCA/genSignedCert and lint are Helm's, not ours.
Every rendered object is checked against the Kubernetes OpenAPI schemas with
`kubernetes-validate` (strict: unknown fields are errors).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

helm_python = pytest.importorskip("helm_python", reason="needs helm-python-sdk (dev extra)")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs kubernetes-validate (dev extra)"
)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "qgpu"
KUBE_VERSIONS = ("1.28", "1.30", "1.34")
Obj = dict[str, Any]


@dataclass
class Rendered:
    """The objects of one render, with lookups by kind and name."""

    objects: list[Obj]
    notes: str

    def kinds(self) -> list[tuple[str, str]]:
        return sorted((o["kind"], o["metadata"]["name"]) for o in self.objects)

    def find(self, kind: str, name: str) -> Obj | None:
        for o in self.objects:
            if o["kind"] == kind and o["metadata"]["name"] == name:
                return o
        return None

    def get(self, kind: str, name: str) -> Obj:
        o = self.find(kind, name)
        assert o is not None, f"no {kind}/{name} in {self.kinds()}"
        return o

    def of_kind(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    @property
    def manager(self) -> Obj:
        """The qgpu-manager DaemonSet (named after the release and overrides)."""
        (ds,) = self.of_kind("DaemonSet")
        return ds

    @property
    def scheduler(self) -> Obj:
        """The qgpu-scheduler Deployment (named after the release and overrides)."""
        (dep,) = self.of_kind("Deployment")
        return dep

    def scheduler_config(self) -> Obj:
        cm = self.get("ConfigMap", "qgpu-scheduler-config")
        return yaml.safe_load(cm["data"]["config.yaml"])


def render(
    values: Mapping[str, Any] | None = None,
    *,
    name: str = "qgpu",
    namespace: str = "default",
) -> Rendered:
    """Render the chart as `helm install` would (is_install) and parse every document."""
    out = helm_python.Chart.load(str(CHART)).render(
        values=dict(values or {}), name=name, namespace=namespace, is_install=True
    )
    objects: list[Obj] = []
    notes = ""
    for path, text in out.items():
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return Rendered(objects, notes)


def validate_all(objects: Iterable[Obj], version: str) -> list[str]:
    """Validate against the Kubernetes schemas of `version`; returns the CRD kinds skipped."""
    skipped = []
    for o in objects:
        if o["apiVersion"].startswith(("cert-manager.io/", "monitoring.coreos.com/")):
            skipped.append(o["kind"])
            continue
        kubernetes_validate.validate(o, version, strict=True)
    return skipped


def containers(workload: Obj, init: bool = False) -> dict[str, Obj]:
    spec = workload["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers" if init else "containers") or []}


def command(container: Obj, **downward: str) -> list[str]:
    """The container's argv with $(VAR) references expanded from its env; variables from
    the downward API (valueFrom) take the value given here, else ``<NAME>``."""
    env = {
        e["name"]: e.get("value", downward.get(e["name"], f"<{e['name']}>"))
        for e in container.get("env") or []
    }
    argv = []
    for arg in container["command"] + (container.get("args") or []):
        for k, v in env.items():
            arg = arg.replace(f"$({k})", v)
        argv.append(arg)
    return argv


def flags(container: Obj) -> dict[str, str | bool]:
    """``--flag=value`` / ``--flag`` of a qgpu container's command."""
    out: dict[str, str | bool] = {}
    for arg in command(container):
        if arg.startswith("--"):
            key, sep, value = arg[2:].partition("=")
            out[key] = value if sep else True
    return out
