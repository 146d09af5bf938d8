#!/usr/bin/env python3
"""Render a Grafana dashboard's panels from stored Prometheus scrapes, without
Grafana: each panel's own PromQL expressions are evaluated over the scrapes
and drawn with matplotlib, laid out by the panels' gridPos.

docs/dashboard.png is made by this script from real scrapes of a running
cluster (examples/grafana/scrape.py); it is not a Grafana screenshot.

    python examples/grafana/render.py --dashboard examples/grafana/loraserve.json \\
        --scrapes docs/dashboard-scrapes.json --out docs/dashboard.png

Only the PromQL the dashboard uses is implemented: a metric with label
matchers (=, !=, =~, !~), `rate` and `increase` over a range, `sum` with an
optional `by (...)`, and `/` between two vectors with equal label sets. An
instant selector takes each series' sample from its target's latest scrape
(no older than 5 minutes); a series that scrape lacks is stale, as in
Prometheus.
`rate` is the counter's increase (resets handled) between the first and last
samples in the range divided by their time apart, and `increase` is that rate
times the range: Prometheus also extrapolates to the range's edges, so the
values may differ from Grafana's by the share of one scrape interval.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from collections.abc import Mapping

LOOKBACK_S = 300.0
Labels = frozenset  # of (name, value) pairs
Vector = dict  # Labels -> float


class Store:
    """Samples by series, from scrapes [{"t", "job", "instance", "text"}]; the
    scrape's job and instance become labels, as Prometheus adds them."""

    def __init__(self, scrapes: list[Mapping]) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        self.series: dict[tuple[str, Labels], list[tuple[float, float]]] = defaultdict(list)
        self.scraped: dict[str, list[float]] = defaultdict(list)  # instance -> times
        for s in sorted(scrapes, key=lambda s: s["t"]):
            self.scraped[s["instance"]].append(float(s["t"]))
            for family in text_string_to_metric_families(s["text"]):
                for sample in family.samples:
                    labels = {**sample.labels, "job": s["job"], "instance": s["instance"]}
                    key = (sample.name, Labels(labels.items()))
                    self.series[key].append((float(s["t"]), float(sample.value)))

    def select(self, name: str, matchers: list[tuple[str, str, str]]):
        for (n, labels), points in self.series.items():
            if n == name and all(_match(dict(labels).get(k, ""), op, v)
                                 for k, op, v in matchers):
                yield labels, points


def _match(value: str, op: str, want: str) -> bool:
    return {"=": value == want, "!=": value != want,
            "=~": re.fullmatch(want, value) is not None,
            "!~": re.fullmatch(want, value) is None}[op]


_TOKEN = re.compile(r'\s*(?:(?P<num>\d+[smh])|(?P<id>[a-zA-Z_:][a-zA-Z0-9_:]*)'
                    r'|(?P<str>"(?:[^"\\]|\\.)*")|(?P<op>=~|!~|!=|[=(){}\[\],/]))')


def _tokens(expr: str) -> list[str]:
    out, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"unsupported PromQL at {expr[pos:]!r}")
        out.append(m.group(m.lastgroup))
        pos = m.end()
    return out


class Query:
    """One parsed expression; `at(store, t)` evaluates it at time t."""

    def __init__(self, expr: str) -> None:
        self.toks, self.i = _tokens(expr), 0
        self.tree = self._div()
        if self.i != len(self.toks):
            raise ValueError(f"unsupported PromQL: {expr!r}")

    def _peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def _take(self, want: str | None = None) -> str:
        tok = self._peek()
        if tok is None or (want is not None and tok != want):
            raise ValueError(f"expected {want!r}, got {tok!r}")
        self.i += 1
        return tok

    def _div(self):
        left = self._term()
        while self._peek() == "/":
            self._take("/")
            left = ("div", left, self._term())
        return left

    def _term(self):
        tok = self._take()
        if tok == "sum":
            by = None
            if self._peek() == "by":
                self._take("by")
                self._take("(")
                by = []
                while self._peek() != ")":
                    by.append(self._take())
                    if self._peek() == ",":
                        self._take(",")
                self._take(")")
            self._take("(")
            inner = self._div()
            self._take(")")
            return ("sum", by, inner)
        if tok in ("rate", "increase"):
            self._take("(")
            name, matchers = self._selector(self._take())
            self._take("[")
            window = _seconds(self._take())
            self._take("]")
            self._take(")")
            return (tok, name, matchers, window)
        return ("select", *self._selector(tok))

    def _selector(self, name: str):
        matchers = []
        if self._peek() == "{":
            self._take("{")
            while self._peek() != "}":
                key, op, value = self._take(), self._take(), self._take()
                matchers.append((key, op, json.loads(value)))
                if self._peek() == ",":
                    self._take(",")
            self._take("}")
        return name, matchers

    def at(self, store: Store, t: float) -> Vector:
        return _eval(self.tree, store, t)


def _seconds(d: str) -> float:
    return float(d[:-1]) * {"s": 1, "m": 60, "h": 3600}[d[-1]]


def _without_name(labels: Labels) -> Labels:
    return Labels((k, v) for k, v in labels if k != "__name__")


def _eval(node, store: Store, t: float) -> Vector:
    kind = node[0]
    if kind == "select":
        out = {}
        for labels, points in store.select(node[1], node[2]):
            # a series missing from its target's latest scrape is stale (gone)
            scraped = [ts for ts in store.scraped[dict(labels)["instance"]] if ts <= t]
            if not scraped or t - scraped[-1] >= LOOKBACK_S:
                continue
            seen = [v for ts, v in points if ts == scraped[-1]]
            if seen:
                out[_without_name(labels)] = seen[0]
        return out
    if kind in ("rate", "increase"):
        _, name, matchers, window = node
        out = {}
        for labels, points in store.select(name, matchers):
            inside = [(ts, v) for ts, v in points if t - window < ts <= t]
            if len(inside) < 2:
                continue
            pairs = zip(inside, inside[1:], strict=False)
            grown = sum(b - a if b >= a else b for (_, a), (_, b) in pairs)  # b < a: a reset
            rate = grown / (inside[-1][0] - inside[0][0])
            out[_without_name(labels)] = rate * window if kind == "increase" else rate
        return out
    if kind == "sum":
        _, by, inner = node
        out: Vector = defaultdict(float)
        for labels, v in _eval(inner, store, t).items():
            out[Labels((k, val) for k, val in labels if k in (by or ()))] += v
        return dict(out)
    if kind == "div":
        num, den = _eval(node[1], store, t), _eval(node[2], store, t)
        return {k: v / den[k] for k, v in num.items() if den.get(k)}
    raise ValueError(kind)


def _legend(fmt: str, labels: Labels) -> str:
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt) or str(d)


def render(dashboard: Mapping, scrapes: list[Mapping], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    store = Store(scrapes)
    # one point per scrape round, once its last target was read
    last = max(scrapes, key=lambda s: s["t"])["instance"]
    times = sorted(float(s["t"]) for s in scrapes if s["instance"] == last)
    t0 = times[0]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    fig = plt.figure(figsize=(24, height * 0.62))
    grid = fig.add_gridspec(height, 24, hspace=0.0, wspace=2.5)
    for r in rows:
        ax = fig.add_subplot(grid[r["gridPos"]["y"], :])
        ax.axis("off")
        ax.text(0.0, 0.0, r["title"], fontsize=14, weight="bold", transform=ax.transAxes)
    for p in panels:
        g = p["gridPos"]
        ax = fig.add_subplot(grid[g["y"] + 1:g["y"] + g["h"] - 1, g["x"]:g["x"] + g["w"]])
        series: dict[str, list[float]] = {}
        for target in p["targets"]:
            query = Query(target["expr"])
            values = [query.at(store, t) for t in times]
            for labels in sorted({k for v in values for k in v}, key=sorted):
                name = _legend(target.get("legendFormat", ""), labels)
                series[name] = [v.get(labels, float("nan")) for v in values]
        x = [t - t0 for t in times]
        stacked = p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
        names = sorted(series, key=lambda n: -max((v for v in series[n] if v == v),
                                                   default=0))
        if stacked and names:
            ax.stackplot(x, *[[0.0 if v != v else v for v in series[n]] for n in names],
                         labels=names)
        else:
            for n in names:
                ax.plot(x, series[n], label=n, marker=".")
        ax.set_title(p["title"], fontsize=11, loc="left")
        ax.set_xlabel("seconds since the first scrape", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if names:
            handles, labels = ax.get_legend_handles_labels()
            keep = 10  # the largest series; Grafana would list all
            more = f" (+{len(names) - keep} more)" if len(names) > keep else ""
            ax.legend(handles[:keep], labels[:keep], fontsize=6, loc="upper left",
                      framealpha=0.7, title=more or None, title_fontsize=6)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center")
    fig.suptitle(title, fontsize=12, y=0.995)
    fig.savefig(out, dpi=70, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dashboard", default="examples/grafana/loraserve.json")
    ap.add_argument("--scrapes", default="docs/dashboard-scrapes.json")
    ap.add_argument("--out", default="docs/dashboard.png")
    a = ap.parse_args()
    with open(a.dashboard) as f:
        dashboard = json.load(f)
    with open(a.scrapes) as f:
        recorded = json.load(f)
    scrapes = recorded["scrapes"]
    title = (f"{dashboard['title']} dashboard ({a.dashboard}), rendered by "
             f"examples/grafana/render.py from {len(scrapes)} real /metrics scrapes "
             f"({recorded['what']}, {recorded['date']}); not a Grafana screenshot")
    render(dashboard, scrapes, a.out, title)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
