"""Operator figures: the only package that knows Prometheus. It reads scheduler events and
snapshots; the core never imports it."""
