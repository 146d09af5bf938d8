"""examples/grafana: the dashboard queries only metrics the plugin and the
router export, and render.py evaluates its PromQL correctly."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DASHBOARD = os.path.join(ROOT, "examples", "grafana", "loraserve.json")
SCRAPES = os.path.join(ROOT, "docs", "dashboard-scrapes.json")
SOURCES = [os.path.join(ROOT, "src", "vllm_loraserve", *p)
           for p in (("frontend", "metrics.py"), ("cluster", "router.py"))]
SUFFIXES = {"Counter": ("_total",), "PromCounter": ("_total",), "Gauge": ("",),
            "Histogram": ("_sum", "_count", "_bucket")}


def _render():
    spec = importlib.util.spec_from_file_location(
        "grafana_render", os.path.join(ROOT, "examples", "grafana", "render.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _render()


def _dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def _exported() -> set[str]:
    names = set()
    for path in SOURCES:
        with open(path) as f:
            text = f.read()
        for kind, name in re.findall(r"\b(Counter|PromCounter|Gauge|Histogram)\(\s*\"(\w+)\"",
                                     text):
            names |= {name + s for s in SUFFIXES[kind]}
    return names


def _queried(node) -> set[str]:
    kind = node[0]
    if kind in ("select", "rate", "increase"):
        return {node[1]}
    if kind == "sum":
        return _queried(node[2])
    return _queried(node[1]) | _queried(node[2])


def _panels() -> list[dict]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def test_dashboard_is_valid_grafana_json():
    d = _dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
    for p in _panels():
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def test_every_queried_metric_is_exported_by_the_plugin_or_the_router():
    exported = _exported()
    assert "loraserve_adapter_requests_total" in exported  # the scan finds counters
    assert "loraserve_router_placement_phi" in exported  # and the router's gauges
    queried = set()
    for p in _panels():
        for t in p["targets"]:
            queried |= _queried(render.Query(t["expr"]).tree)
    assert queried - exported == set()
    # the dashboard covers what the issue asks for
    for name in ("loraserve_adapter_requests_total", "loraserve_adapters",
                 "loraserve_adapter_loads_total", "loraserve_router_placement_phi",
                 "loraserve_router_migrations_total", "loraserve_router_requests_total"):
        assert name in queried


def _scrape(t: float, job: str, instance: str, lines: list[str]) -> dict:
    return {"t": t, "job": job, "instance": instance, "text": "\n".join(lines) + "\n"}


def test_promql_subset_evaluates_like_prometheus():
    head = ["# TYPE loraserve_adapter_requests counter",
            "# TYPE loraserve_adapter_load_seconds histogram"]
    scrapes = []
    for t, (a, b, c) in enumerate([(0, 0, 5), (10, 20, 8), (30, 20, 2), (60, 20, 5)]):
        # engine-1's counter for adapter x resets between t=20 and t=30 (8 -> 2)
        scrapes.append(_scrape(t * 10.0, "engine", "engine-0", head + [
            f'loraserve_adapter_requests_total{{adapter="x",finished_reason="stop"}} {a}',
            f'loraserve_adapter_requests_total{{adapter="y",finished_reason="stop"}} {b}',
            f'loraserve_adapter_load_seconds_sum{{tier="gpu"}} {a / 10}',
            f'loraserve_adapter_load_seconds_count{{tier="gpu"}} {a}']))
        scrapes.append(_scrape(t * 10.0 + 1, "engine", "engine-1", head + [
            f'loraserve_adapter_requests_total{{adapter="x",finished_reason="stop"}} {c}']))
    store = render.Store(scrapes)
    key = render.Labels

    def at(expr, t=31.0):
        return render.Query(expr).at(store, t)

    x0 = {("adapter", "x"), ("finished_reason", "stop"), ("job", "engine"),
          ("instance", "engine-0")}
    assert at("rate(loraserve_adapter_requests_total[1m])")[key(x0)] == pytest.approx(2.0)
    # the reset: 5 -> 8 -> 2 -> 5 grew by 3 + 2 + 3 over 30 s
    per_adapter = at("sum by (adapter) (rate(loraserve_adapter_requests_total[1m]))")
    assert per_adapter == {key({("adapter", "x")}): pytest.approx(2.0 + 8 / 30),
                           key({("adapter", "y")}): pytest.approx(20 / 30)}
    assert at('sum(increase(loraserve_adapter_requests_total{adapter=~"x|z",'
              'instance!="engine-1"}[1m]))') == {key(): pytest.approx(120.0)}
    assert at("sum by (tier) (rate(loraserve_adapter_load_seconds_sum[1m])) / "
              "sum by (tier) (rate(loraserve_adapter_load_seconds_count[1m]))") == {
        key({("tier", "gpu")}): pytest.approx(0.1)}
    # an instant selector takes the latest sample at or before t
    assert at('loraserve_adapter_requests_total{adapter="y"}', t=15.0) == {
        key({("adapter", "y"), ("finished_reason", "stop"), ("job", "engine"),
             ("instance", "engine-0")}): 20.0}
    assert at("rate(loraserve_adapter_requests_total[1m])", t=0.5) == {}  # one sample
    # a series its target's latest scrape lacks is stale: y is gone from engine-0 at t=40
    scrapes.append(_scrape(40.0, "engine", "engine-0", head + [
        'loraserve_adapter_requests_total{adapter="x",finished_reason="stop"} 70']))
    store = render.Store(scrapes)
    assert {dict(k)["adapter"] for k in at("loraserve_adapter_requests_total", t=41.0)} == {"x"}
    with pytest.raises(ValueError, match="unsupported PromQL"):
        render.Query("topk(3, loraserve_adapters)")


def test_every_panel_has_data_in_the_recorded_scrapes(tmp_path):
    """docs/dashboard.png's source: real scrapes in which every panel's
    queries find series, rendered by the same code."""
    with open(SCRAPES) as f:
        recorded = json.load(f)
    scrapes = recorded["scrapes"]
    assert {s["job"] for s in scrapes} == {"router", "engine"}
    store = render.Store(scrapes)
    times = sorted({s["t"] for s in scrapes})
    for p in _panels():
        found = any(render.Query(t["expr"]).at(store, when)
                    for t in p["targets"] for when in times)
        assert found, p["title"]
    out = tmp_path / "dashboard.png"
    render.render(_dashboard(), scrapes, str(out), "test")
    assert out.stat().st_size > 10_000
