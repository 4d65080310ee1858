"""Ray Serve inference on GPU slices: two replicas of a small classifier, 30 % / 4 GiB each.

The model is built locally (a two-layer numpy MLP trained at start-up on a synthetic
three-class problem, so nothing is downloaded). Each replica asks for its slice with plain
Ray resources (``ray_actor_options={"resources": {"qgpu-core": 30, "qgpu-memory": 4}}``)
and is bound to a GPU of its node before CUDA starts. On simulated GPUs the replica's "GPU
work" goes through the simulated driver and the interposer: the weights are copied into a
device allocation (counted against the slice's memory cap) and each batch occupies the
device for a time proportional to its size (gated by the slice's compute cap).

Run: ``.venv/bin/python examples/ray_serve_inference.py`` (simulated GPUs unless NVML is
present): it sends a few requests, prints which slice answered each, and shuts down. With
``--keep-serving`` it then keeps the service up until Ctrl-C, so you can query it yourself:
``curl -X POST localhost:8000/classify -d '{"features": [[0.1, 2.0]]}'``.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import threading
import time
from typing import Any

import numpy as np

SLICE = {"qgpu-core": 30, "qgpu-memory": 4}
NS_PER_SAMPLE = 200_000  # simulated device time of one sample's forward pass


def train_model(seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-16-3 MLP trained by gradient descent on three Gaussian blobs."""
    rng = np.random.default_rng(seed)
    centres = np.array([[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])
    x = np.concatenate([rng.normal(c, 0.5, size=(200, 2)) for c in centres])
    y = np.repeat(np.arange(3), 200)
    w1 = rng.normal(0, 0.5, (2, 16))
    b1 = np.zeros(16)
    w2 = rng.normal(0, 0.5, (16, 3))
    b2 = np.zeros(3)
    onehot = np.eye(3)[y]
    for _ in range(300):
        h = np.tanh(x @ w1 + b1)
        logits = h @ w2 + b2
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        g = (p - onehot) / len(x)
        gw2, gb2 = h.T @ g, g.sum(axis=0)
        gh = (g @ w2.T) * (1 - h**2)
        gw1, gb1 = x.T @ gh, gh.sum(axis=0)
        for param, grad in ((w1, gw1), (b1, gb1), (w2, gw2), (b2, gb2)):
            param -= 0.5 * grad
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}


def predict(model: dict[str, np.ndarray], features: np.ndarray) -> np.ndarray:
    h = np.tanh(features @ model["w1"] + model["b1"])
    return np.argmax(h @ model["w2"] + model["b2"], axis=1)


class Classifier:
    """One Serve replica: the model in host memory, its weights in the slice's GPU memory."""

    def __init__(self) -> None:
        import os

        from enforcement import simcuda

        self.model = train_model()
        self.driver = simcuda.Driver()
        self.driver.init()  # first cuInit: the slice's caps apply (bound when Ray started it)
        self.driver.context(0)
        nbytes = sum(a.nbytes for a in self.model.values())
        self.weights = self.driver.mem_alloc(max(nbytes, 1 << 20))
        self.device = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.slice_id = os.environ.get("QGPU_SLICE_ID", "")
        self.stream = self.driver.stream()

    async def __call__(self, request: Any) -> dict[str, Any]:
        body = await request.json()
        features = np.asarray(body["features"], dtype=float).reshape(-1, 2)
        self.driver.launch_busy(NS_PER_SAMPLE * len(features), self.stream)
        self.driver.stream_synchronize(self.stream)
        return {
            "classes": predict(self.model, features).tolist(),
            "device": self.device,
            "slice": self.slice_id,
        }


def deploy(port: int, replicas: int = 2) -> str:
    """Deploy the classifier on slices behind Serve's HTTP proxy; returns the URL."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deployment = serve.deployment(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": 0, "resources": dict(SLICE)},
    )(Classifier)
    serve.run(deployment.bind(), route_prefix="/classify", name="classifier")
    return f"http://127.0.0.1:{port}/classify"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def query(url: str, samples: list[list[float]], timeout: float = 30.0) -> dict[str, Any]:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.post(url, json={"features": samples}, timeout=10)
            r.raise_for_status()
            return r.json()
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def wait_for_stop() -> None:
    """Block until Ctrl-C (SIGINT) or SIGTERM, then return so that the caller cleans up."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("stopping", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sim", default=None, help="simulated GPUs, e.g. 2xH100-80GB")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--requests", type=int, default=8, help="requests to send (default: 8)")
    ap.add_argument(
        "--keep-serving",
        action="store_true",
        help="after the requests, keep serving until Ctrl-C (default: shut down)",
    )
    args = ap.parse_args()

    from ray import serve

    import qgpu_ray

    cluster = qgpu_ray.init_local(sim=args.sim)
    try:
        url = deploy(args.port)
        seen = set()
        for i in range(args.requests):
            out = query(url, [[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])
            seen.add((out["device"], out["slice"]))
            where = f"slice {out['slice']} on {out['device']}"
            print(f"request {i}: classes {out['classes']} from {where}")
        print(json.dumps({"replicas_seen": len(seen)}))
        if args.keep_serving:
            print(
                f"serving on {url} until Ctrl-C; try: curl -X POST {url} "
                """-d '{"features": [[0.1, 2.0]]}'""",
                flush=True,
            )
            wait_for_stop()
        serve.shutdown()
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
