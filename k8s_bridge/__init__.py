"""Kubernetes adapter: device plugin (gRPC v1beta1), scheduler extender, mutating webhook.

Imports the core ``qgpu`` package; the core never imports this one.
"""
