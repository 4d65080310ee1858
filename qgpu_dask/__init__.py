"""Dask adapter: slice-per-worker clusters and worker/nanny plugins.

Imports the core ``qgpu`` package; the core never imports this one.
"""
