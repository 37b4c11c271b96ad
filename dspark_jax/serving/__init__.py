"""Serving: the engine thread over the shared `Scheduler`, the OpenAI-compatible HTTP app, Prometheus
metrics, the model pair of the entry points (its flags, its loading) and the acceptance card."""
