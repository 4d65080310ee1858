"""qgpu's test suite (unit, integration, per-adapter suites, fakes, real-GPU tests)."""
