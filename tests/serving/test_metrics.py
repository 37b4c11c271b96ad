"""The Prometheus text the /metrics endpoint serves: counters, histograms and scrape-time gauges."""

from __future__ import annotations

from dspark_jax.serving.metrics import Metrics


def test_counters_histograms_and_gauges_render_as_prometheus_text():
    m = Metrics(prefix="t")
    m.counter("requests", "Requests.")
    m.histogram("latency_seconds", "Latency.", buckets=(0.1, 1.0))
    m.gauge("running", "Running.", lambda: 3)
    m.inc("requests", path="/v1/chat")
    m.inc("requests", 2, path="/v1/chat")
    m.observe("latency_seconds", 0.05)
    m.observe("latency_seconds", 0.5)
    assert m.value("requests", path="/v1/chat") == 3
    text = m.render()
    assert "# TYPE t_requests_total counter" in text
    assert 't_requests_total{path="/v1/chat"} 3' in text
    assert 't_latency_seconds_bucket{le="0.1"} 1' in text and 't_latency_seconds_bucket{le="+Inf"} 2' in text
    assert "t_latency_seconds_count 2" in text and "t_running 3" in text
