"""The qgpu node agent: one per node, it owns the node's GPUs and slices.

Modules: `config` (settings), `models` (the HTTP API's pydantic models), `limits` (per-slice
limits files and workload environment), `service` (the agent's state and operations over
the core ledger), `app` (FastAPI routes), `server` (unix socket / loopback TCP serving),
`client` (Python client), `reconcile` (owner liveness), `metrics` (Prometheus), `watchdog`
(over-cap and unowned GPU processes), `mps` (NVIDIA MPS backend), `cli` (``qgpu agent``,
``qgpu status``). See docs/agent.md.
"""
