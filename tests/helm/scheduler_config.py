"""KubeSchedulerConfiguration (kubescheduler.config.k8s.io/v1) as kube-scheduler reads it.

No OpenAPI schema ships for it (it is a component config, not an API object), so the fields
the chart may write are modelled here after the upstream Go types
(k8s.io/kube-scheduler/config/v1: KubeSchedulerConfiguration, KubeSchedulerProfile, Extender,
ExtenderManagedResource, LeaderElectionConfiguration) with unknown keys refused, and the
checks kube-scheduler's validation makes on extenders
(pkg/scheduler/apis/config/validation: a positive weight with a prioritize verb, at most
one extender that binds, managed resource names that are extended resource names).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# metav1.Duration as Go's time.ParseDuration reads it (the units the chart may use)
_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")
_QUALIFIED = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


class _Go(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


class ManagedResource(_Go):
    name: str
    ignored_by_scheduler: bool = Field(False, alias="ignoredByScheduler")

    @field_validator("name")
    @classmethod
    def _extended(cls, v: str) -> str:
        if not _QUALIFIED.match(v) or v.startswith("kubernetes.io/"):
            raise ValueError(f"{v!r} is not an extended resource name")
        return v


class ExtenderTLS(_Go):
    """ExtenderTLSConfig (client side of kube-scheduler's calls)."""

    insecure: bool = False
    server_name: str = Field("", alias="serverName")
    cert_file: str = Field("", alias="certFile")
    key_file: str = Field("", alias="keyFile")
    ca_file: str = Field("", alias="caFile")
    cert_data: str = Field("", alias="certData")
    key_data: str = Field("", alias="keyData")
    ca_data: str = Field("", alias="caData")


class Extender(_Go):
    url_prefix: str = Field(alias="urlPrefix")
    filter_verb: str = Field("", alias="filterVerb")
    preempt_verb: str = Field("", alias="preemptVerb")
    prioritize_verb: str = Field("", alias="prioritizeVerb")
    weight: int = 0
    bind_verb: str = Field("", alias="bindVerb")
    enable_https: bool = Field(False, alias="enableHTTPS")
    tls_config: ExtenderTLS | None = Field(None, alias="tlsConfig")
    http_timeout: str = Field("30s", alias="httpTimeout")
    node_cache_capable: bool = Field(False, alias="nodeCacheCapable")
    managed_resources: list[ManagedResource] = Field(default_factory=list, alias="managedResources")
    ignorable: bool = False

    @field_validator("url_prefix")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"urlPrefix {v!r} is not an http(s) URL")
        return v

    @field_validator("http_timeout")
    @classmethod
    def _duration(cls, v: str) -> str:
        if not _DURATION.match(v):
            raise ValueError(f"httpTimeout {v!r} is not a Go duration")
        return v

    @model_validator(mode="after")
    def _weight(self) -> Extender:
        if self.prioritize_verb and self.weight <= 0:
            raise ValueError("an extender with a prioritizeVerb needs a positive weight")
        return self


class Profile(_Go):
    scheduler_name: str = Field(alias="schedulerName")


class LeaderElection(_Go):
    leader_elect: bool = Field(alias="leaderElect")
    resource_namespace: str = Field(alias="resourceNamespace")
    resource_name: str = Field(alias="resourceName")


class KubeSchedulerConfiguration(_Go):
    api_version: str = Field(alias="apiVersion")
    kind: str
    leader_election: LeaderElection = Field(alias="leaderElection")
    profiles: list[Profile]
    extenders: list[Extender]

    @model_validator(mode="after")
    def _rules(self) -> KubeSchedulerConfiguration:
        if (self.api_version, self.kind) != (
            "kubescheduler.config.k8s.io/v1",
            "KubeSchedulerConfiguration",
        ):
            raise ValueError(f"not a v1 KubeSchedulerConfiguration: {self.api_version}")
        if sum(1 for e in self.extenders if e.bind_verb) > 1:
            raise ValueError("only one extender can implement bind")
        names = [p.scheduler_name for p in self.profiles]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"profiles need distinct, non-empty schedulerNames: {names}")
        return self
