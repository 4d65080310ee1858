"""Node-side enforcement: GPU discovery, the CUDA driver interposer, the simulated driver,
the node agent and the MPS backend.

Imports the core ``qgpu`` package; the core never imports this one.
"""
