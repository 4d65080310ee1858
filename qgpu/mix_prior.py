"""The request-mix prior: what frag assumes about the request mix before it has seen it.

Owns `MixPrior` (request shapes with weights, and how many arrivals the prior is worth),
the built-in default, the prior derived from a node pool, reading a mix file, and the one
setting every entry point reads: the environment variable ``QGPU_MIX_PRIOR``
(`configured_prior`). ``qgpu plan``, the node agent, the scheduler extender and the Ray SDK
all make their policies through `qgpu.placement.make_policy`, so they all start from the
same prior; their ``--mix-prior`` flags set that variable (`use_prior`).

frag (`qgpu.frag`) learns the mix from the requests it sees; before it has seen a whole-GPU
request it would value an empty GPU at nothing and spread shares over every card. The prior
is counted as `strength` arrivals spread over its shapes (a Dirichlet prior, in effect):
after as many real arrivals the two weigh the same, and the prior fades as more arrive.

Values of ``QGPU_MIX_PRIOR``:
- unset or ``default``: `DEFAULT_PRIOR`, single whole GPUs, worth 4 arrivals (shares are
  learnt from the requests; a prior with share sizes or 2-8 GPU requests placed worse than
  binpack more often on random small clusters, and spread the README example's first
  shares onto the small-memory node: see docs/placement.md);
- ``pool``: the shapes the node pool was built for: single GPUs and a whole node for every
  node size of the cluster (`pool_prior`);
- ``none``: no prior (frag learns from what it sees only);
- anything else: the path of a YAML or JSON mix file, ``{strength: 16, shapes: [{core: 50,
  memory: 20, weight: 3}, {core: 100, weight: 5}]}`` (or the list of shapes alone).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

from qgpu.errors import RuleViolation, first_violation
from qgpu.model import WHOLE_GPU_CORE, NodeInventory, SliceRequest
from qgpu.units import parse_memory_gib

PRIOR_ENV = "QGPU_MIX_PRIOR"
_T = TypeVar("_T")
DEFAULT_STRENGTH = 4.0


def _shape_fields(value: Any) -> Any:
    """Check a shape's slice fields with the slice model's own rules (`SliceRequest`)."""
    if not isinstance(value, Mapping):
        return value
    raw = {k: v for k, v in value.items() if k != "weight"}
    if "core" in raw and raw.get("memory", raw.get("memory_gib")) is None:
        # memory is optional in a prior (see PriorShape): checked with the least legal
        # value (2 GiB, for a share split over 2 GPUs)
        raw.setdefault("memory", 2)
    try:
        SliceRequest.model_validate(raw)
    except ValidationError as exc:
        raise first_violation(exc) from exc
    return value


class PriorShape(BaseModel):
    """One request shape of the prior and its weight (relative to the other shapes).

    ``core``, ``memory``, ``model``, ``cpu_milli`` and ``host_memory_mib`` follow the slice
    request's rules; unlike a request, a share may leave ``memory`` out (then GPU memory
    does not limit how many copies of it fit)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    core: int
    memory: int | None = Field(default=None, alias="memory_gib")
    model: str | None = None
    cpu_milli: int = Field(default=0, ge=0)
    host_memory_mib: int = Field(default=0, ge=0)
    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)

    def request(self) -> SliceRequest:
        """The shape as a slice request (a share without memory asks for 0 GiB: none)."""
        return SliceRequest.model_construct(
            core=self.core,
            memory_gib=self.memory,
            model=self.model,
            cpu_milli=self.cpu_milli,
            host_memory_mib=self.host_memory_mib,
        )


Shape = Annotated[PriorShape, BeforeValidator(_shape_fields)]
_SHAPE: TypeAdapter[PriorShape] = TypeAdapter(Shape)


class MixPrior(BaseModel):
    """Request shapes with weights, counted as `strength` arrivals in all."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strength: float = Field(default=DEFAULT_STRENGTH, gt=0, le=1e6, allow_inf_nan=False)
    shapes: list[Shape] = Field(min_length=1)

    def counts(self) -> list[tuple[PriorShape, int]]:
        """Each shape with the arrivals it counts as: `strength` split by weight, rounded
        to whole arrivals (frag's scores stay sums of integers), at least 1."""
        total = sum(s.weight for s in self.shapes)
        return [(s, max(1, round(self.strength * s.weight / total))) for s in self.shapes]


DEFAULT_PRIOR = MixPrior(strength=4, shapes=[PriorShape(core=WHOLE_GPU_CORE)])

PriorSetting = MixPrior | Literal["pool"] | None


def pool_prior(nodes: Iterable[NodeInventory]) -> MixPrior:
    """The shapes a node pool was built for: `DEFAULT_PRIOR`'s shapes (single GPUs), and
    one whole node of every node size (GPU count) in the pool."""
    sizes = sorted({len(n.gpus) for n in nodes if len(n.gpus) > 1})
    keep = [s for s in DEFAULT_PRIOR.shapes if s.core <= WHOLE_GPU_CORE]
    whole = [PriorShape(core=WHOLE_GPU_CORE * n, weight=1) for n in sizes]
    return MixPrior(strength=DEFAULT_PRIOR.strength, shapes=keep + whole)


def parse_prior(value: Any, where: str = "mix prior") -> MixPrior:
    """A mix prior from plain data (a mapping, or the list of shapes alone); a broken rule
    raises `RuleViolation` naming the field, the value and the rule."""
    if isinstance(value, MixPrior):
        return value
    if isinstance(value, list):
        value = {"shapes": value}
    if not isinstance(value, Mapping):
        raise RuleViolation(where, value, "must be a mapping {strength, shapes} or a list")
    shapes = value.get("shapes")
    if isinstance(shapes, list):
        value = dict(value)
        value["shapes"] = [_shape(s, f"{where}.shapes[{i}]") for i, s in enumerate(shapes)]
    return _validated(MixPrior.model_validate, value, where)


def _shape(shape: Any, where: str) -> PriorShape:
    """One shape of a prior, checked alone so that a broken rule names its index."""
    return _validated(_SHAPE.validate_python, _with_memory(shape, where), where)


def _validated(validate: Callable[[Any], _T], value: Any, where: str) -> _T:
    """`validate(value)`, a broken rule raised as RuleViolation with `where` before its field."""
    try:
        return validate(value)
    except ValidationError as exc:
        v = first_violation(exc)
        raise RuleViolation(f"{where}.{v.field}", v.value, v.rule) from exc


def _with_memory(shape: Any, where: str) -> Any:
    """A shape's ``memory`` as whole GiB (``8Gi``, ``8192Mi``: the slice model's parser)."""
    if not isinstance(shape, Mapping):
        raise RuleViolation(where, shape, "must be a mapping such as {core: 50, weight: 2}")
    memory = shape.get("memory", shape.get("memory_gib"))
    if memory is None:
        return shape
    shape = {k: v for k, v in shape.items() if k not in ("memory", "memory_gib")}
    shape["memory"] = parse_memory_gib(memory, f"{where}.memory")
    return shape


def load_prior(path: str | Path) -> MixPrior:
    """Read a YAML or JSON mix file (see the module docstring)."""
    from qgpu.plan import load_document  # the one reader of YAML/JSON input files

    return parse_prior(load_document(path), str(path))


def prior_setting(value: str | None) -> PriorSetting:
    """What a ``QGPU_MIX_PRIOR`` value (or ``--mix-prior`` flag) means; RuleViolation
    naming the setting when the value or its file is bad."""
    text = (value or "").strip()
    if text in ("", "default"):
        return DEFAULT_PRIOR
    if text == "none":
        return None
    if text == "pool":
        return "pool"
    if not Path(text).is_file():
        raise RuleViolation(
            PRIOR_ENV, value, "must be default, pool, none or the path of a YAML/JSON mix file"
        )
    return _cached_file(text, os.stat(text).st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _cached_file(path: str, _mtime_ns: int) -> MixPrior:
    return load_prior(path)


def configured_prior() -> PriorSetting:
    """The prior every entry point starts frag from: ``QGPU_MIX_PRIOR`` (`prior_setting`)."""
    return prior_setting(os.environ.get(PRIOR_ENV))


def use_prior(value: str | None) -> None:
    """Make `value` (a ``--mix-prior`` flag) the configured prior of this process and the
    processes it starts; checked first, so a bad value fails here with a clear message."""
    if value is None:
        return
    try:
        prior_setting(value)
    except RuleViolation as exc:
        if exc.field != PRIOR_ENV:
            raise  # a broken rule inside the mix file: it names the file and the field
        raise RuleViolation("--mix-prior", exc.value, exc.rule) from exc
    os.environ[PRIOR_ENV] = value


def add_prior_option(parser: Any) -> None:
    """The ``--mix-prior`` flag of a command that places slices (call `use_prior` with it)."""
    parser.add_argument(
        "--mix-prior",
        metavar="PRIOR",
        help=f"frag's request-mix prior: default, pool, none or a YAML/JSON mix file "
        f"(sets {PRIOR_ENV}; default: {PRIOR_ENV}, else default)",
    )


def resolve_prior(setting: PriorSetting, nodes: Iterable[NodeInventory]) -> MixPrior | None:
    """The prior for a cluster of `nodes` (``pool`` depends on them)."""
    if setting == "pool":
        return pool_prior(nodes)
    return setting


__all__ = [
    "DEFAULT_PRIOR",
    "PRIOR_ENV",
    "MixPrior",
    "PriorSetting",
    "PriorShape",
    "add_prior_option",
    "configured_prior",
    "load_prior",
    "parse_prior",
    "pool_prior",
    "prior_setting",
    "resolve_prior",
    "use_prior",
]
