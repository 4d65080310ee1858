"""The qgpu Ray SDK: ``options()``, ``@remote`` and ``placement_group()``.

``options(core=30, memory="8Gi", policy="binpack")`` validates the request with the core
slice model, decides node and GPU with the core placement engine over Ray's live per-GPU
resources, and returns kwargs for ``.options()``: the totals plus that GPU's per-GPU
resources (so Ray's own accounting keeps each GPU exact). How the worker learns its slice
(``via``): on nodes whose workers run the qgpu worker hook (label ``qgpu.io/worker-hook``,
every node of ``qgpu-ray start`` / `LocalCluster`) the per-GPU resources and an isolation
marker are all it needs — it binds when Ray starts it and Ray reuses pooled workers
(``via="resources"``); elsewhere ``runtime_env.env_vars`` carry the device, the interposer
and the caps, which costs a dedicated worker process per slice (``via="runtime_env"``).
``via="auto"`` (the default) picks by the chosen node's label.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable
from typing import Any

from qgpu.errors import NoFit, RuleViolation
from qgpu.model import Allocation, IsolationPolicy, PlacementPolicy, SliceRequest
from qgpu.placement import Decision, Engine
from qgpu_ray.env import slice_env
from qgpu_ray.resources import (
    ISOLATION_AMOUNT,
    ISOLATION_PREFIX,
    LABEL_HOOK,
    LABEL_ISOLATION,
    SLOTS,
    TOTAL_CORE,
    TOTAL_MEMORY,
    gpu_resource,
    parse_gpu_resource,
)
from qgpu_ray.view import PENDING, RayNode, live_state

# keyword arguments of options()/remote() that describe the slice (the rest go to Ray)
SLICE_KEYS = frozenset(
    {"policy", "gpu_policy", "isolation", "model", "include_uuids", "exclude_uuids", "via"}
)


def pg_strategy(policy: PlacementPolicy) -> str:
    """Ray placement-group strategy for a qgpu policy: spread -> SPREAD, others -> PACK."""
    return "SPREAD" if policy is PlacementPolicy.SPREAD else "PACK"


def build_request(core: Any, memory: Any = None, **fields: Any) -> SliceRequest:
    """Validate through the core model; raise RuleViolation naming field, value and rule."""
    raw = {"core": core, **{k: v for k, v in fields.items() if v is not None}}
    if memory is not None:
        raw["memory"] = memory
    return SliceRequest.parse(raw)


def decision_resources(decision: Decision) -> dict[str, float]:
    """Totals plus the per-GPU triple of every GPU in the decision."""
    out = {
        TOTAL_CORE: float(decision.core_per_gpu * len(decision.gpu_uuids)),
        TOTAL_MEMORY: float(sum(decision.memory_gib_per_gpu)),
    }
    for uuid_, mem in zip(decision.gpu_uuids, decision.memory_gib_per_gpu, strict=True):
        out[gpu_resource(TOTAL_CORE, uuid_)] = float(decision.core_per_gpu)
        out[gpu_resource(TOTAL_MEMORY, uuid_)] = float(mem)
        out[gpu_resource(SLOTS, uuid_)] = 1.0
    return out


def _per_gpu(resources: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in resources.items() if parse_gpu_resource(k)}


def _allocation(decision: Decision, req: SliceRequest, node: RayNode) -> Allocation:
    default = node.labels.get(LABEL_ISOLATION)
    isolation = req.effective_isolation(IsolationPolicy.parse(default) if default else None)
    return Allocation(
        slice_id="r-" + uuid.uuid4().hex[:16],
        node=decision.node,
        gpu_uuids=list(decision.gpu_uuids),
        core=decision.core_per_gpu,
        memory_gib=min(decision.memory_gib_per_gpu),
        isolation=isolation,
    )


def _merge(base: dict[str, Any], resources: dict[str, float], env: dict[str, str]) -> dict:
    out = copy.deepcopy(base)
    res = dict(out.get("resources") or {})
    for key in resources:
        if key in res:
            raise ValueError(f"resources already names {key!r}; let qgpu_ray set it")
    res.update(resources)
    out["resources"] = res
    if env:
        runtime_env = dict(out.get("runtime_env") or {})
        env_vars = dict(runtime_env.get("env_vars") or {})
        env_vars.update(env)
        runtime_env["env_vars"] = env_vars
        out["runtime_env"] = runtime_env
    return out


def _no_fit(req: SliceRequest, exc: NoFit) -> NoFit:
    return NoFit(f"Ray cluster: {exc}", exc.reasons)


VIAS = ("auto", "resources", "runtime_env")


def _via(via: str, node: RayNode) -> str:
    if via not in VIAS:
        raise RuleViolation("via", via, "must be 'auto', 'resources' or 'runtime_env'")
    if via == "auto":
        return "resources" if node.labels.get(LABEL_HOOK) == "ray" else "runtime_env"
    return via


def _slice_options(
    base: dict[str, Any], decision: Decision, alloc: Allocation, via: str
) -> dict[str, Any]:
    """Ray options for one slice: the decision's resources, plus the isolation marker
    (resources form) or the slice's environment (runtime_env form)."""
    resources = decision_resources(decision)
    if via == "resources":
        if decision.core_per_gpu < 100:
            resources[ISOLATION_PREFIX + alloc.isolation.value] = ISOLATION_AMOUNT
        return _merge(base, resources, {})
    return _merge(base, resources, slice_env(alloc))


def options(
    core: Any,
    memory: Any = None,
    *,
    policy: PlacementPolicy | str | None = None,
    gpu_policy: PlacementPolicy | str | None = None,
    isolation: IsolationPolicy | str | None = None,
    model: str | None = None,
    include_uuids: list[str] | None = None,
    exclude_uuids: list[str] | None = None,
    via: str = "auto",
    **ray_options: Any,
) -> dict[str, Any]:
    """kwargs for ``.options()`` that put the task or actor on one slice (see module doc).

    Extra keyword arguments (num_cpus, runtime_env, name, ...) are passed through;
    ``runtime_env.env_vars`` is merged with the slice's variables (runtime_env form).

    ``via="resources"`` leaves the runtime_env out: the chosen GPU travels in the per-GPU
    resources alone (and the isolation in a ``qgpu-isolation/<policy>`` marker), and the
    worker hook applies device and caps when Ray starts the work. Workers are then reused
    from Ray's pool instead of started per runtime_env (as fast as Ray's own ``num_gpus``);
    it needs nodes started by ``qgpu-ray start`` / `LocalCluster`. ``via="runtime_env"``
    works on any node that has the interposer. ``"auto"`` chooses by the node's label.
    """
    if via not in VIAS:
        raise RuleViolation("via", via, "must be 'auto', 'resources' or 'runtime_env'")
    req = build_request(
        core,
        memory,
        isolation=isolation,
        placement=policy,
        gpu_placement=gpu_policy,
        model=model,
        include_uuids=include_uuids,
        exclude_uuids=exclude_uuids,
    )
    view = live_state()
    engine = Engine(view.state, policy, gpu_policy)
    try:
        decision = engine.decide(req)
    except NoFit as exc:
        raise _no_fit(req, exc) from exc
    node = view.nodes[decision.node]
    alloc = _allocation(decision, req, node)
    PENDING.add(_per_gpu(decision_resources(decision)), view.effective)
    ray_options.setdefault("num_gpus", 0)
    return _slice_options(ray_options, decision, alloc, _via(via, node))


class SliceRemote:
    """What ``@qgpu_ray.remote(core=..., memory=...)`` returns for a function or class.

    Every ``.remote()`` call decides a fresh slice (placement is made at call time, over
    the cluster as it is then), so a class decorated once can make many actors.
    """

    def __init__(self, target: Any, slice_kwargs: dict[str, Any], ray_kwargs: dict[str, Any]):
        import ray

        self._target = target
        self._slice_kwargs = slice_kwargs
        self._ray_kwargs = ray_kwargs
        self._remote = ray.remote(target)

    def options(self, **overrides: Any) -> _BoundOptions:
        return _BoundOptions(self, overrides)

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.options().remote(*args, **kwargs)

    def _call(self, overrides: dict[str, Any], args: tuple, kwargs: dict) -> Any:
        slice_kwargs = {**self._slice_kwargs}
        for key in list(overrides):
            if key in SLICE_KEYS | {"core", "memory"}:
                slice_kwargs[key] = overrides.pop(key)
        opts = options(**slice_kwargs, **{**self._ray_kwargs, **overrides})
        return self._remote.options(**opts).remote(*args, **kwargs)


class _BoundOptions:
    def __init__(self, owner: SliceRemote, overrides: dict[str, Any]) -> None:
        self._owner = owner
        self._overrides = overrides

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner._call(dict(self._overrides), args, kwargs)


def remote(core: Any, memory: Any = None, **kwargs: Any) -> Callable[[Any], SliceRemote]:
    """Decorator: ``@qgpu_ray.remote(core=30, memory=8)`` on a function or actor class.

    Keyword arguments that are slice fields (policy, gpu_policy, isolation, model,
    include_uuids, exclude_uuids) select the slice; the rest go to Ray's ``.options()``.
    """
    slice_keys = SLICE_KEYS
    slice_kwargs = {"core": core, "memory": memory}
    slice_kwargs.update({k: v for k, v in kwargs.items() if k in slice_keys})
    ray_kwargs = {k: v for k, v in kwargs.items() if k not in slice_keys}
    build_request(core, memory, isolation=slice_kwargs.get("isolation"))  # fail early

    def wrap(target: Any) -> SliceRemote:
        return SliceRemote(target, slice_kwargs, ray_kwargs)

    return wrap


class SlicePlacementGroup:
    """A gang of slices reserved together; ``bundle_options(i)`` places work in slice i."""

    def __init__(
        self,
        pg: Any,
        decisions: list[Decision],
        allocations: list[Allocation],
        pending: list[object] | None = None,
        vias: list[str] | None = None,
        cpus_per_bundle: float = 0,
    ):
        self.pg = pg
        self.decisions = decisions
        self.allocations = allocations
        self._pending = pending or []
        self.vias = vias or ["runtime_env"] * len(decisions)
        self.cpus_per_bundle = cpus_per_bundle

    def ready(self) -> Any:
        return self.pg.ready()

    def wait(self, timeout_seconds: float = 30) -> bool:
        """Wait until the group is reserved (then Ray's availability shows it)."""
        ok = bool(self.pg.wait(timeout_seconds))
        if ok:
            PENDING.discard(self._pending)
        return ok

    def bundle_options(self, index: int, **ray_options: Any) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        decision = self.decisions[index]
        ray_options.setdefault("num_gpus", 0)
        ray_options.setdefault("num_cpus", self.cpus_per_bundle)
        ray_options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=index
        )
        return _slice_options(ray_options, decision, self.allocations[index], self.vias[index])

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)
        PENDING.discard(self._pending)


def placement_group(
    slices: list[dict[str, Any]],
    policy: PlacementPolicy | str = PlacementPolicy.BINPACK,
    *,
    name: str = "",
    gpu_policy: PlacementPolicy | str | None = None,
    via: str = "auto",
    cpus_per_bundle: float = 0,
) -> SlicePlacementGroup:
    """Reserve a gang of slices at once (binpack -> PACK, spread -> SPREAD underneath).

    Each item of `slices` is ``{"core": ..., "memory": ..., "isolation": ...}``. GPUs are
    chosen by the core engine over a copy of the live state, one slice after the other, so
    the gang never over-commits a GPU; the placement group then reserves them atomically.
    Each bundle also reserves `cpus_per_bundle` CPUs; `bundle_options(i)` asks for as many
    (Ray's default of one CPU per actor would not fit a bundle without CPU). `via` as in
    `options`.
    """
    from ray.util.placement_group import placement_group as ray_placement_group

    pol = PlacementPolicy.parse(policy, "policy")
    strategy = pg_strategy(pol)
    requests = [build_request(**s) for s in slices]
    view = live_state()
    engine = Engine(view.state, pol, gpu_policy)
    decisions: list[Decision] = []
    allocations: list[Allocation] = []
    for i, req in enumerate(requests):
        try:
            decision = engine.place(f"gang-{i}", req)
        except NoFit as exc:
            raise NoFit(f"slice {i} of the gang does not fit: {exc}", exc.reasons) from exc
        decisions.append(decision)
        allocations.append(_allocation(decision, req, view.nodes[decision.node]))
    vias = [_via(via, view.nodes[d.node]) for d in decisions]
    bundles = [decision_resources(d) for d in decisions]
    for bundle, d, a, v in zip(bundles, decisions, allocations, vias, strict=True):
        if v == "resources" and d.core_per_gpu < 100:
            bundle[ISOLATION_PREFIX + a.isolation.value] = ISOLATION_AMOUNT
        if cpus_per_bundle:
            bundle["CPU"] = float(cpus_per_bundle)
    pg = ray_placement_group(bundles, strategy=strategy, name=name)
    tokens = [PENDING.add(_per_gpu(b), view.effective) for b in bundles]
    return SlicePlacementGroup(pg, decisions, allocations, tokens, vias, cpus_per_bundle)
