"""Statistics of the HTTP benchmark (`http.py`): ratios within a repeat, the sustainable rate, the figure.

- A ratio compares the two servers in the same repeat of the same (load, rate), so both sides
  saw the same machine; the summary is the median of those ratios with their min-max range.
- A run fails the latency bound when its mean normalized latency is above `bound` s/token (the
  paper's Figure 12 plots the mean) or when any of its requests failed (an error, or an output
  length other than the one asked for).
- The sustainable rate of one server in one repeat is the highest swept rate at which that rate
  and every lower one pass, interpolated linearly between the last passing and the first failing
  rate where the first failure is on latency (a failure by failed requests is not interpolated).
  It is censored "above" when no swept rate failed (the value is a lower bound) and "below" when
  the lowest rate already failed (the value is 0).
"""

from __future__ import annotations

import statistics

PEERS = ("mlx_lm", "vllm_mlx")  # mlx_lm's ratios keep the plain names; another peer's carry its name
LABELS = {"mlxpaged": "mlxpaged", "mlx_lm": "mlx_lm.server", "vllm_mlx": "vllm-mlx"}


def servers_of(rows: list[dict]) -> list[str]:
    """mlxpaged, then each peer that ran in `rows`."""
    present = {r["server"] for r in rows}
    return ["mlxpaged"] + [p for p in PEERS if p in present]


def _suffix(peer: str) -> str:
    return "" if peer == "mlx_lm" else f"_{peer}"


def passes(row: dict, bound: float) -> bool:
    lat = row["norm_latency_mean"]
    return row["failed"] == 0 and lat is not None and lat <= bound


def meets(rows: list[dict], server: str, bound: float) -> bool:
    """Whether `server` passed `bound` in the median repeat of these rows (one load and rate)."""
    rs = [r for r in rows if r["server"] == server]
    return bool(rs) and sum(passes(r, bound) for r in rs) * 2 > len(rs)


def sustainable_rate(points: list[tuple[float, float | None, int]], bound: float) -> tuple[float, str | None]:
    """(rate, censoring) from (rate, mean normalized latency, failed requests) points of one server."""
    points = sorted(points)
    last_ok = None
    for rate, lat, failed in points:
        if failed == 0 and lat is not None and lat <= bound:
            last_ok = (rate, lat)
            continue
        if last_ok is None:
            return 0.0, "below"
        if failed:
            return last_ok[0], None
        r0, l0 = last_ok
        return r0 + (bound - l0) / (lat - l0) * (rate - r0), None
    return (last_ok[0], "above") if last_ok else (0.0, "below")


def spread(values: list[float]) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "values": vals}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def per_rate(rows: list[dict]) -> list[dict]:
    """One entry per (load, rate): each server's figures by repeat, and the ratios formed within
    each repeat (peer / mlxpaged for latency, so > 1 favours mlxpaged; RSS the same way), for each
    peer that ran (`ratio_norm_latency_mean` for mlx_lm, `ratio_norm_latency_mean_vllm_mlx`...)."""
    out = []
    servers = servers_of(rows)
    for load, rate in sorted({(r["load"], r["rate"]) for r in rows}, key=lambda k: (k[0], k[1])):
        here = [r for r in rows if r["load"] == load and r["rate"] == rate]
        by = {(r["server"], r["repeat"]): r for r in here}
        reps = sorted({r["repeat"] for r in here})
        entry = {"load": load, "rate": rate, "repeats": len(reps)}
        for s in servers:
            rs = [r for r in here if r["server"] == s]
            for f in (
                "norm_latency_mean",
                "norm_latency_median",
                "ttft_ms_median",
                "itl_ms_median",
                "req_per_s",
                "idle_rss_mb",
                "peak_rss_mb",
                "after_rss_mb",
            ):
                entry[f"{s}_{f}"] = spread([r[f] for r in rs])
            entry[f"{s}_failed"] = sum(r["failed"] for r in rs)
        for peer in servers[1:]:
            pairs = [(by[("mlxpaged", k)], by[(peer, k)]) for k in reps if ("mlxpaged", k) in by and (peer, k) in by]
            x = _suffix(peer)
            entry[f"lengths_equal{x}"] = [p["output_tokens"] == q["output_tokens"] for p, q in pairs]
            for f in ("norm_latency_mean", "norm_latency_median"):
                entry[f"ratio_{f}{x}"] = spread([_ratio(q[f], p[f]) for p, q in pairs])
            entry[f"ratio_peak_rss{x}"] = spread([_ratio(q["peak_rss_mb"], p["peak_rss_mb"]) for p, q in pairs])
        out.append(entry)
    return out


def sustainable(rows: list[dict], load: str, bound: float) -> dict:
    """Each server's sustainable rate per repeat, and mlxpaged / each peer formed within each
    repeat (`ratio` for mlx_lm, `ratio_vllm_mlx`...)."""
    out = {"per_repeat": []}
    servers = servers_of(rows)
    for k in sorted({r["repeat"] for r in rows if r["load"] == load}):
        rep = {"repeat": k}
        for s in servers:
            pts = [
                (r["rate"], r["norm_latency_mean"], r["failed"])
                for r in rows
                if r["load"] == load and r["repeat"] == k and r["server"] == s
            ]
            rep[s], rep[f"{s}_censored"] = sustainable_rate(pts, bound)
        for peer in servers[1:]:
            a, b = rep["mlxpaged"], rep[peer]
            rep[f"ratio{_suffix(peer)}"] = a / b if b else None  # undefined when the peer failed even the lowest rate
        out["per_repeat"].append(rep)
    for s in servers:
        out[s] = spread([r[s] for r in out["per_repeat"]])
    for peer in servers[1:]:
        out[f"ratio{_suffix(peer)}"] = spread([r[f"ratio{_suffix(peer)}"] for r in out["per_repeat"]])
    return out


def _fmt(s: dict | None, digits: int = 2) -> str:
    return "n/a" if s is None else f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def sustainable_line(load: str, s: dict) -> str:
    """One load's sustainable rates and ratios (`sustainable`'s result), with any censoring."""
    servers = [x for x in ("mlxpaged",) + PEERS if x in s]
    cens = sorted({f"{k}: {r[k + '_censored']}" for r in s["per_repeat"] for k in servers if r[k + "_censored"]})
    rates = ", ".join(f"{k} {_fmt(s[k])}" for k in servers)
    ratios = ", ".join(f"mlxpaged/{p} {_fmt(s['ratio' + _suffix(p)])}" for p in servers[1:])
    return f"{load:>8}: sustainable rate {rates} req/s, ratio {ratios}" + (
        f"  (censored {', '.join(cens)})" if cens else ""
    )


def report(rows: list[dict], loads: list[str], bound: float, echo=print) -> dict:
    rates = per_rate(rows)
    peers = servers_of(rows)[1:]
    echo(f"\nmedian (min-max) over repeats; ratios peer/mlxpaged formed within each repeat; bound {bound} s/token")
    for e in rates:
        for peer in peers:
            x = _suffix(peer)
            echo(
                f"{e['load']:>8} rate {e['rate']:5.2f}: mean norm latency mlxpaged "
                f"{_fmt(e['mlxpaged_norm_latency_mean'], 3)}"
                f", {peer} {_fmt(e[f'{peer}_norm_latency_mean'], 3)}, ratio {_fmt(e[f'ratio_norm_latency_mean{x}'])}; "
                f"median ratio {_fmt(e[f'ratio_norm_latency_median{x}'])}; peak RSS mlxpaged "
                f"{_fmt(e['mlxpaged_peak_rss_mb'], 0)}"
                f" MB, {peer} {_fmt(e[f'{peer}_peak_rss_mb'], 0)} MB; equal lengths {all(e[f'lengths_equal{x}'])}"
            )
    sus = {}
    for load in loads:
        sus[load] = sustainable(rows, load, bound)
        echo(sustainable_line(load, sus[load]))
    return {"per_rate": rates, "sustainable": sus}


def write_figure(path, rates: list[dict], loads: list[str], bound: float):
    """The paper's Figure 12 layout: one panel per load, mean normalized latency against request
    rate, both servers on each panel (medians with min-max bars over repeats)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(loads), figsize=(4.2 * len(loads), 3.6), squeeze=False)
    for ax, load in zip(axes[0], loads):
        es = sorted((e for e in rates if e["load"] == load), key=lambda e: e["rate"])
        for s, style in (("mlxpaged", "-o"), ("mlx_lm", "--s"), ("vllm_mlx", ":^")):
            pts = [(e["rate"], e[f"{s}_norm_latency_mean"]) for e in es if e.get(f"{s}_norm_latency_mean")]
            if not pts:
                continue
            x = [p[0] for p in pts]
            y = [p[1]["median"] for p in pts]
            err = [[p[1]["median"] - p[1]["min"] for p in pts], [p[1]["max"] - p[1]["median"] for p in pts]]
            ax.errorbar(x, y, yerr=err, fmt=style, capsize=3, label=LABELS[s])
        ax.axhline(bound, color="grey", lw=0.8, ls=":")
        ax.set_title(load)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


# Fields of a run's result that the merge recomputes or keeps per source.
_PER_RUN = (
    "kind",
    "model",
    "provenance",
    "rows",
    "per_rate",
    "sustainable",
    "sustainable_by_bound",
    "rates",
    "loads",
    "extend",
    "system_prompt_tokens",
    "num_requests",
    "sources",
    "merged_from",
)
# Settings that must agree for runs to be merged into one result (loads, rates and request counts may differ).
MERGE_SAME = ("max_prompt", "max_output", "trace", "repeats", "bound_s_per_token", "mlxpaged_args")


def _sources(doc: dict) -> list[dict]:
    """Where a result's rows come from: one entry for a run, its own list for an earlier merge."""
    if "sources" in doc:
        return doc["sources"]
    return [
        {
            "command": doc["provenance"]["command"],
            "git_at_start": doc["git_at_start"],
            "loads": list(dict.fromkeys(r["load"] for r in doc["rows"])),
            "rates": doc["rates"],
            "extend": doc.get("extend"),
            "num_requests": doc["num_requests"],
        }
    ]


def merge(docs: list[dict], bounds: tuple[float, ...] = ()) -> dict:
    """One result from several runs of `bench serve` (one per load, or more rates of a load, or an
    earlier merge plus new runs): the rows concatenated and the statistics recomputed from them;
    `sustainable_by_bound` adds each load's sustainable rates at the other latency `bounds`
    (s/token), since one bound can sit below or above a whole load's curve (the runs' own bound
    stays the headline). Raises ValueError when the runs' settings differ, when two runs measured
    the same (load, rate), when one load ran with two request counts (its points would not be one
    curve), or when a run started from a dirty tree or another commit."""
    if not docs:
        raise ValueError("nothing to merge")
    for f in MERGE_SAME:
        if len({repr(d.get(f)) for d in docs}) > 1:
            raise ValueError(f"{f} differs between the runs: {[d.get(f) for d in docs]}")
    sources = [s for d in docs for s in _sources(d)]
    starts = [s.get("git_at_start") or {} for s in sources]
    if any(s.get("dirty") is not False for s in starts) or len({s.get("commit") for s in starts}) > 1:
        raise ValueError(f"every run must start from the same clean commit: {starts}")
    seen: set = set()
    for d in docs:
        cases = {(r["load"], r["rate"]) for r in d["rows"]}
        if cases & seen:
            raise ValueError(f"(load, rate) {sorted(cases & seen)} measured by more than one run")
        seen |= cases
    requests: dict[str, int] = {}
    for s in sources:
        for load in s["loads"]:
            if requests.setdefault(load, s["num_requests"]) != s["num_requests"]:
                raise ValueError(f"{load} ran with {requests[load]} and {s['num_requests']} requests per run")
    loads = list(dict.fromkeys(load for s in sources for load in s["loads"]))
    rows = [r for d in docs for r in d["rows"]]
    bound = docs[0]["bound_s_per_token"]
    settings = {k: v for k, v in docs[0].items() if k not in _PER_RUN}
    sys_tokens = {d.get("system_prompt_tokens") for d in docs} - {None}
    rates = sorted({r["rate"] for r in rows})
    return {
        **settings,
        "loads": loads,
        "rates": rates,
        "system_prompt_tokens": sys_tokens.pop() if sys_tokens else None,
        "sources": sources,
        "rows": rows,
        **report(rows, loads, bound, echo=lambda s: None),
        "sustainable_by_bound": {f"{b:g}": {ld: sustainable(rows, ld, b) for ld in loads} for b in bounds},
    }
