"""qgpu core: the slice model, units, placement engine, allocation ledger, config and CLI.

The core imports no adapter (``enforcement``, ``qgpu_ray``, ``qgpu_dask``, ``k8s_bridge``);
adapters import the core.
"""

__version__ = "0.1.0"
