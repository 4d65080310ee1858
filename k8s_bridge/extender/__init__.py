"""Scheduler extender: filter, prioritize and bind over HTTP for kube-scheduler."""
