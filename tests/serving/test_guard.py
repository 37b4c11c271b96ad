"""The HTTP guard in front of the app, called in-process: Host names, cross-origin requests, CORS
preflight, and one count per request whatever its outcome."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from dspark_jax.serving.guard import Guard, host_name


def test_host_name_drops_the_port():
    assert [host_name(h) for h in ("LocalHost:8000", "127.0.0.1", "[::1]:8000", "::1", "example.com")] == \
        ["localhost", "127.0.0.1", "::1", "::1", "example.com"]


def test_hosts_origins_and_counts():
    counted = []
    inner = Starlette(routes=[Route("/x", lambda request: PlainTextResponse("ok"), methods=["GET", "POST"])])
    app = Guard(inner, count=lambda path, status: counted.append((path, status)), allowed_hosts=["localhost"],
                allowed_origins=["http://ok.example"])
    client = TestClient(app, base_url="http://localhost:8000")
    assert client.get("/x").text == "ok"
    bad = client.get("/x", headers={"host": "evil.example"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_host"
    foreign = client.get("/x", headers={"origin": "http://evil.example"})
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "origin_not_allowed"
    allowed = client.get("/x", headers={"origin": "http://ok.example"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://ok.example"
    pre = client.options("/x", headers={"origin": "http://ok.example", "access-control-request-method": "POST"})
    assert pre.status_code == 204 and "POST" in pre.headers["access-control-allow-methods"]
    assert counted == [("/x", 200), ("/x", 400), ("/x", 403), ("/x", 200), ("/x", 204)]
