"""The Ray internals qgpu relies on: `qgpu_ray.compat.check` against the installed Ray.

Each hook is removed in turn (monkeypatched) and `check` must fail naming it; the
behaviour of the hooks on a real cluster is checked in test_numgpus.py
(``test_ray_still_honours_the_hooks``).
"""

from __future__ import annotations

import pytest
import ray

from qgpu_ray import compat


def test_the_installed_ray_has_every_hook():
    compat.check()
    assert compat.ray_version_tested(), (
        f"Ray {ray.__version__} is not in compat.TESTED_RAY_VERSIONS "
        f"{compat.TESTED_RAY_VERSIONS}: run tests/ray and update docs/ray.md"
    )


def _drop_setup_hook(mp):
    import ray._private.ray_constants as constants

    mp.setattr(constants, "WORKER_PROCESS_SETUP_HOOK_ENV_VAR", "RENAMED", raising=False)


def _drop_jemalloc(mp):
    import ray._private.services as services

    mp.delattr(services, "RAY_JEMALLOC_LIB_PATH")


def _drop_lookup(mp):
    import ray._private.worker as worker

    mp.delattr(worker.Worker, compat.ACCELERATOR_LOOKUP)


def _drop_available(mp):
    import ray._private.state as state

    mp.delattr(state, "available_resources_per_node")


def _drop_ld_preload(mp):
    real = compat._read
    mp.setattr(compat, "_read", lambda p: real(p).replace(compat.RAY_LD_PRELOAD_ENV, "X"))


@pytest.mark.parametrize(
    ("drop", "variable"),
    [
        (_drop_setup_hook, compat.RAY_SETUP_HOOK_ENV),
        (_drop_jemalloc, compat.RAY_JEMALLOC_ENV),
        (_drop_ld_preload, compat.RAY_LD_PRELOAD_ENV),
        (_drop_lookup, compat.ACCELERATOR_LOOKUP),
        (_drop_available, "available_resources_per_node"),
    ],
)
def test_a_missing_hook_fails_loudly_naming_it(monkeypatch, drop, variable):
    drop(monkeypatch)
    with pytest.raises(compat.RayInternalsChanged) as err:
        compat.check()
    text = str(err.value)
    assert variable in text and ray.__version__ in text and "docs/ray.md" in text
    assert "\n" not in text
