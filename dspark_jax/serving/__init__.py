"""Serving: the engine thread over the shared `Batcher`, the OpenAI-compatible HTTP app, Prometheus
metrics, model resolution for the entry points, and the acceptance benchmark."""
