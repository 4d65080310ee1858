"""Ray adapter: node resource provider, SDK (options/remote/placement groups), Serve helpers.

Imports the core ``qgpu`` package; the core never imports this one.
"""
