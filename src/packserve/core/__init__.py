"""The scheduler core: residency, eviction policy, quotas.

Imports no backend, web framework or metrics library."""
