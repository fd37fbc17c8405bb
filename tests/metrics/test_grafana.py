"""The Grafana dashboard only queries metrics the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from tests.factories import Running

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "packserve-dashboard.json"
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def test_every_dashboard_query_uses_exported_metrics(fake: Running) -> None:
    dashboard = json.loads(DASHBOARD.read_text("utf-8"))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 9
    used = {m for e in exprs for m in re.findall(r"\bpackserve_[a-z_]+", e)}
    with httpx.Client(base_url=fake.url) as c:
        c.post("/v1/completions", json={"model": "gen", "prompt": "a b"}).raise_for_status()
        text = c.get("/metrics").text
    exported = set(re.findall(r"^# TYPE (packserve_[a-z_]+) (\w+)", text, re.M))
    names = {n for n, _ in exported}
    names |= {n + s for n, kind in exported for s in SUFFIXES
              if (kind == "histogram" and s != "_total") or (kind == "counter" and s == "_total")}
    assert used <= names, f"dashboard queries metrics the server does not export: {used - names}"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("p95", "headroom", "events", "cost"):
        assert topic in titles
