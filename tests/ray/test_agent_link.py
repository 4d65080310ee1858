"""Ray slices are recorded by their node's qgpu agent (status, metrics, watchdog) and
released there when their worker is gone."""

from __future__ import annotations

import qgpu_ray
from tests.ray.conftest import ray, wait_until
from tests.ray.workloads import SliceProbe


def agent_slices(cluster):
    out = {}
    for node in cluster.nodes:
        for s in node.agent.client.slices().slices:
            out[s.slice_id] = (node.name, s)
    return out


def test_sdk_and_plain_slices_are_recorded_and_released(cluster, _clean):
    sdk = SliceProbe.options(
        **qgpu_ray.options(core=25, memory=6, isolation="bs", num_cpus=0)
    ).remote()
    plain = SliceProbe.options(num_cpus=0, resources={"qgpu-core": 35, "qgpu-memory": 5}).remote()
    env_form = SliceProbe.options(
        **qgpu_ray.options(core=10, memory=2, via="runtime_env", num_cpus=0)
    ).remote()
    _clean.extend([sdk, plain, env_form])
    sdk_env = ray.get(sdk.env.remote(), timeout=60)
    out = ray.get(plain.cuda.remote(), timeout=60)
    assert out["init"] == 0, out.get("bind_error")
    plain_env = out["env"]
    # the SDK actor allocates memory through the interposer; the agent reports it
    assert ray.get(sdk.cuda.remote(), timeout=60)["init"] == 0

    recorded = wait_until(
        lambda: (
            lambda s: (
                s if {sdk_env["QGPU_SLICE_ID"], plain_env["QGPU_SLICE_ID"]} <= set(s) else None
            )
        )(agent_slices(cluster))
    )
    _, s = recorded[sdk_env["QGPU_SLICE_ID"]]
    assert (s.core, s.memory_gib, s.isolation) == (25, 6, "burst-share")
    assert s.device_uuid == sdk_env["CUDA_VISIBLE_DEVICES"]
    assert s.owner.kind == "pid" and s.owner.meta["path"] == "sdk-resources"  # via="auto"
    _, p = recorded[plain_env["QGPU_SLICE_ID"]]
    assert (p.core, p.memory_gib) == (35, 5)
    assert p.owner.meta["path"] == "plain"
    # the runtime_env form arrives bound; its actor is recorded at its first CUDA call
    out = ray.get(env_form.cuda.remote(), timeout=60)
    assert out["init"] == 0, out.get("bind_error")
    slice_id = out["env"]["QGPU_SLICE_ID"]
    _, r = wait_until(lambda: agent_slices(cluster).get(slice_id))
    assert (r.core, r.memory_gib, r.owner.meta["path"]) == (10, 2, "sdk")

    for a in (sdk, plain, env_form):
        ray.kill(a)
    _clean.clear()
    gone = {sdk_env["QGPU_SLICE_ID"], plain_env["QGPU_SLICE_ID"], slice_id}
    wait_until(lambda: not gone & set(agent_slices(cluster)), timeout=30)
