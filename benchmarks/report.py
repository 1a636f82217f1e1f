"""The report of compare_ddp.py: raw step times to medians, ratios, bounds; JSON, markdown, plots.

Each mode of compare_ddp.py (the plain comparison, ``--compile``, ``--zero``, ``--overlap``,
``--sweep``, the memory runs) is one entry of ``MODES``: its headline table per regime, its
section, its plot. The report states measurements; limits to check them against come from a
file (``check_limits``). To write a results file's report again (its summary recomputed, next
to it)::

    python benchmarks/report.py benchmarks/results/<stem>.json [--limits FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from collections.abc import Callable
from typing import Any

MIB = 2**20


# ---- statistics -----------------------------------------------------------------------------


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def variant_rows(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant: median and p90 in ms over the timed steps, and its facts."""
    rows = []
    for name, v in raw["variants"].items():
        ts = [t * 1e3 for t in v["times_s"]]
        row = {k: v[k] for k in v if k != "times_s"}
        row.update(name=name, n=len(ts), median_ms=statistics.median(ts), p90_ms=_quantile(ts, 0.9))
        rows.append(row)
    return rows


def _bucket_of(name: str) -> float | None:
    return float(name.split("@")[1].split("+")[0]) if "@" in name else None


def _best(rows: dict[str, dict], kind: str) -> str:
    """The fastest non-compiled variant of ``kind`` over bucket sizes, its default included."""
    candidates = [r for n, r in rows.items() if n.split("@")[0] == kind and "compile" not in n]
    return min(candidates, key=lambda r: r["median_ms"])["name"]


def _block_medians(raw: dict[str, Any], name: str) -> dict[int, float]:
    """A variant's median step time in each round it played."""
    v, block = raw["variants"][name], raw["block"]
    ts = v["times_s"]
    return {
        r: statistics.median(ts[k * block : (k + 1) * block]) for k, r in enumerate(v["rounds"])
    }


def paired_ratio(raw: dict[str, Any], a: str, b: str) -> float:
    """Median over the rounds both played of a's block median / b's: cancels slow load drift."""
    ma, mb = _block_medians(raw, a), _block_medians(raw, b)
    return statistics.median(ma[r] / mb[r] for r in sorted(ma.keys() & mb.keys()))


def _ratios(raw: dict[str, Any], med: dict[str, float], best: dict[str, str], bound: float) -> dict:
    pairs = {
        "fddp/ddp": ("fddp", "ddp"),
        "fddp/ddp_best": ("fddp", best["ddp"]),
        "fddp_best/ddp_best": (best["fddp"], best["ddp"]),
        "local/fddp": ("local", "fddp"),
        "fddp+compile/ddp+compile": ("fddp+compile", "ddp+compile"),
        "fddp+zero/fddp": ("fddp+zero", "fddp"),
        "fddp+zero/ddp+zero": ("fddp+zero", "ddp+zero"),
        "fddp+overlap/fddp": ("fddp+overlap", "fddp"),
        "fddp+overlap/ddp": ("fddp+overlap", "ddp"),
    }
    if any(n.startswith("fddp@") for n in med):  # swept: fddp's default cap against its best
        pairs["fddp/fddp_best"] = ("fddp", best["fddp"])
    out: dict[str, float] = {}
    for key, (a, b) in pairs.items():
        if a in med and b in med:
            out[key] = med[a] / med[b]
            out[key + " (paired)"] = paired_ratio(raw, a, b)
    out["fddp/bound"] = med["fddp"] / bound
    out["ddp/bound"] = med["ddp"] / bound
    return out


def _sweep_table(raw: dict[str, Any], rows: dict[str, dict]) -> dict[str, dict[str, float]]:
    sweep: dict[str, dict[str, float]] = {}
    for n, r in rows.items():
        kind = n.split("@")[0]
        if kind in ("fddp", "ddp") and "compile" not in n:
            mb = _bucket_of(n) or (25.0 if kind == "ddp" else None)  # DDP's default is 25 MiB
            if mb is not None:
                sweep.setdefault(f"{mb:g}", {})[kind] = r["median_ms"]
    for mb, v in sweep.items():
        if "fddp" in v and "ddp" in v:
            v["fddp/ddp"] = v["fddp"] / v["ddp"]
            ddp = "ddp" if mb == "25" else f"ddp@{mb}"
            v["fddp/ddp (paired)"] = paired_ratio(raw, f"fddp@{mb}", ddp)
    return dict(sorted(sweep.items(), key=lambda kv: float(kv[0])))


def _workload_summary(raw: dict[str, Any]) -> dict[str, Any]:
    rows = {r["name"]: r for r in variant_rows(raw)}
    med = {n: r["median_ms"] for n, r in rows.items()}
    best = {kind: _best(rows, kind) for kind in ("ddp", "fddp")}
    comm = med["allreduce"]
    bound = max(med["local"], med["forward"] + comm)
    return {
        "params": raw["params"],
        "per_rank": raw.get("per_rank"),
        "rows": rows,
        "ddp_best": best["ddp"],
        "fddp_best": best["fddp"],
        "bound": {
            "compute_ms": med["local"],
            "forward_ms": med["forward"],
            "comm_ms": comm,
            "bound_ms": bound,
        },
        "ratios": _ratios(raw, med, best, bound),
        "sweep": _sweep_table(raw, rows),
        "parity": raw.get("parity", {}),
        "parity_share": raw.get("parity_share", {}),
        "wall_s": raw.get("wall_s"),
    }


def _memory_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """Per workload and variant, the largest value over ranks of each memory figure."""
    out: dict[str, Any] = {}
    for wl, per_variant in raw.items():
        out[wl] = {}
        for name, m in per_variant.items():
            ranks = m["ranks"]
            keys = [k for k in ranks[0] if k.endswith("_bytes")]
            row = {k: max(r[k] for r in ranks) for k in keys}
            row["above_base_bytes"] = max(
                r["rss_step_peak_bytes"] - r["rss_base_bytes"] for r in ranks
            )
            row["first_call_s"] = max(r["first_call_s"] for r in ranks)
            row["capture_s"] = ranks[0]["info"].get("capture_s")
            out[wl][name] = row
        if "fddp" in out[wl] and "ddp" in out[wl]:
            f, d = out[wl]["fddp"], out[wl]["ddp"]
            key = "cuda_step_peak_bytes" if "cuda_step_peak_bytes" in d else "rss_step_peak_bytes"
            out[wl]["fddp/ddp"] = f[key] / d[key]
            out[wl]["fddp/ddp above base"] = f["above_base_bytes"] / d["above_base_bytes"]
    return out


def memory_line(raw: dict[str, Any]) -> str:
    r = raw["ranks"][0]
    return (
        f"step peak RSS {r['rss_step_peak_bytes'] / MIB:.0f} MiB, process peak "
        f"{r['rss_process_peak_bytes'] / MIB:.0f} MiB, first call {r['first_call_s']:.2f} s"
    )


def summarize(
    meta: dict[str, Any],
    regimes: dict[str, Any],
    memory: dict[str, Any],
    notes: list[str],
    config: dict[str, Any],
) -> dict[str, Any]:
    for regime in regimes.values():
        regime["summary"] = {wl: _workload_summary(raw) for wl, raw in regime["workloads"].items()}
    return {
        "meta": meta,
        "config": config,
        "regimes": regimes,
        "memory": _memory_summary(memory),
        "memory_raw": memory,
        "notes": notes,
    }


# ---- limits: a check of the summary against a file of limits --------------------------------


def check_limits(results: dict[str, Any], limits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each limit ``{"at": [key, ...], "max": x}`` against every value of the summary at that
    path (``"*"`` stands for every key at its level); a path that matches nothing is listed with
    value None.

    >>> limits = [{"at": ["memory", "*", "fddp/ddp"], "max": 1.1}]
    >>> check_limits({"memory": {"mlp": {"fddp/ddp": 0.9}, "gpt": {}}}, limits)
    [{'at': ['memory', 'mlp', 'fddp/ddp'], 'value': 0.9, 'max': 1.1}]
    """

    def find(tree: Any, at: list[str], path: list[str]) -> list[tuple[list[str], float]]:
        if not at:
            return [(path, tree)] if isinstance(tree, (int, float)) else []
        if not isinstance(tree, dict):
            return []
        keys = list(tree) if at[0] == "*" else [at[0]] if at[0] in tree else []
        return [hit for k in keys for hit in find(tree[k], at[1:], [*path, k])]

    return [
        {"at": path, "value": value, "max": limit["max"]}
        for limit in limits
        for path, value in find(results, limit["at"], []) or [(limit["at"], None)]
    ]


def _limits_section(results: dict[str, Any], path: str) -> str:
    with open(path) as f:
        spec = json.load(f)
    rows = []
    for c in check_limits(results, spec["limits"]):
        value, limit = c["value"], f"<= {c['max']:.2f}"
        if value is None:
            rows.append([" ".join(c["at"]), "—", limit, "not measured"])
        else:
            rows.append(
                [
                    " ".join(c["at"]),
                    f"{value:.2f}",
                    limit,
                    "met" if value <= c["max"] else "NOT met",
                ]
            )
    intro = f"From `{path}`" + (f": {spec['source']}" if "source" in spec else "") + "."
    return _section("Limits", intro, _table(["measured at", "value", "limit", ""], rows))


# ---- markdown: shared helpers ---------------------------------------------------------------

REGIME_TITLES = {"loopback": "Loopback (CPU-bound)", "link": "Emulated link (network-bound)"}

Cell = Callable[[dict[str, Any]], str]  # a workload's summary -> one cell of its row


def _table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table; "" without rows."""
    if not rows:
        return ""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _join(*parts: str) -> str:
    """The parts that are not empty, as paragraphs."""
    return "\n\n".join(p for p in parts if p)


def _section(title: str, *parts: str, level: str = "##") -> str:
    """A heading over the parts that are not empty; "" when all are."""
    return _join(f"{level} {title}", *parts) if any(parts) else ""


def _regime_title(name: str, regime: dict[str, Any]) -> str:
    title = REGIME_TITLES.get(name, name)
    return f"{title}, {regime['rate']}" if "rate" in regime else title


def _med(variant: str) -> Cell:
    return lambda s: f"{s['rows'][variant]['median_ms']:.1f}"


def _best_of(kind: str) -> Cell:
    def cell(s: dict[str, Any]) -> str:
        name = s[f"{kind}_best"]
        return f"{s['rows'][name]['median_ms']:.1f} ({_mb_label(name)})"

    return cell


def _ratio(key: str) -> Cell:
    return lambda s: f"{s['ratios'][key]:.2f}"


def _ratio_paired(key: str) -> Cell:
    return lambda s: f"{s['ratios'][key]:.2f} (paired {s['ratios'][key + ' (paired)']:.2f})"


def _mb_label(name: str) -> str:
    mb = _bucket_of(name)
    if mb is not None:
        return f"{mb:g} MiB"
    return "default" if name.startswith("fddp") else "25 MiB"


def _size(nbytes: int) -> str:
    return f"{nbytes / MIB:.2f} MiB" if nbytes >= MIB / 100 else f"{nbytes / 1024:.1f} KiB"


def _fmt_bytes(sizes: list[int] | None) -> str:
    """The bytes of each all-reduce in launch order; long lists as a count, total and largest."""
    if not sizes:
        return "—"
    if len(sizes) <= 6:
        return " + ".join(_size(s) for s in sizes)
    return f"{len(sizes)} all-reduces, {_size(sum(sizes))} in all, largest {_size(max(sizes))}"


def _workloads(results: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(regime, workload, summary) for every workload of every regime."""
    return [
        (name, wl, s)
        for name, regime in results["regimes"].items()
        for wl, s in regime["summary"].items()
    ]


@dataclasses.dataclass(frozen=True)
class Table:
    """A headline table of one regime: a row per workload that ran every variant in ``needs``;
    ``title`` may name ``{regime}``."""

    title: str
    needs: tuple[str, ...]
    columns: dict[str, Cell]

    def render(self, name: str, regime: dict[str, Any]) -> str:
        rows = [
            [wl, *(cell(s) for cell in self.columns.values())]
            for wl, s in regime["summary"].items()
            if all(v in s["rows"] for v in self.needs)
        ]
        title = self.title.format(regime=_regime_title(name, regime))
        return title + "\n\n" + _table(["workload", *self.columns], rows) if rows else ""


# ---- markdown: the plain comparison ---------------------------------------------------------

COMPARISON = Table(
    "**{regime}** — median ms per step, ratios of medians",
    ("fddp", "ddp", "local"),
    {
        "local": _med("local"),
        "fddp (default)": _med("fddp"),
        "fddp best": _best_of("fddp"),
        "DDP (default)": _med("ddp"),
        "DDP best": _best_of("ddp"),
        "fddp/DDP": _ratio("fddp/ddp"),
        "fddp/DDP best": _ratio("fddp/ddp_best"),
        "fddp best/DDP best": _ratio("fddp_best/ddp_best"),
        "local/fddp": _ratio("local/fddp"),
        "lower bound": lambda s: f"{s['bound']['bound_ms']:.1f}",
        "fddp/bound": _ratio("fddp/bound"),
    },
)

CPU_SHARE = (
    "CPU share: CPU seconds / wall seconds of the timed steps on the slower rank (1 thread per "
    "rank, so about 100 % for local training on an idle machine; lower means other processes "
    "took the core, or, for the distributed variants, time spent waiting on the network)."
)
PAIRED = (
    "Ratios: of medians = median of a / median of b (the headline); paired = median over the "
    "rounds both played of (a's block median / b's block median), which cancels slow drift "
    "in the machine's load but not short bursts."
)
PARITY = (
    "Largest |parameter difference| from DDP-default after the same steps on the same data "
    "(same init, same AdamW math), over all fddp variants and over the other DDP variants. "
    "Every bucket size gives bit-identical parameters (an all-reduce of two summands is "
    "exact); what differs is fddp's functional step (torch.func gradients, fddp.optim) from "
    "eager autograd and torch.optim at rounding level, which Adam turns into steps of up to "
    "±lr wherever a gradient is near zero, hence up to about lr x steps on the BatchNorm CNN."
)


def _regime_details(name: str, regime: dict[str, Any]) -> str:
    summary = regime["summary"]
    head = ["workload", "variant", "median ms", "p90 ms", "steps", "CPU share", "first call s"]
    variants = [
        [
            wl,
            vname,
            f"{r['median_ms']:.1f}",
            f"{r['p90_ms']:.1f}",
            str(r["n"]),
            f"{min(r['cpu_share']):.0%}" if "cpu_share" in r else "—",
            f"{r['first_call_s']:.2f}",
            _fmt_bytes(r.get("allreduce_bytes")),
        ]
        for wl, s in summary.items()
        for vname, r in s["rows"].items()
    ]
    bound_keys = ("compute_ms", "forward_ms", "comm_ms", "bound_ms")
    bounds = [[wl, *(f"{s['bound'][k]:.1f}" for k in bound_keys)] for wl, s in summary.items()]
    ratios = [
        [wl, key, f"{q[key]:.3f}", f"{q[key + ' (paired)']:.3f}"]
        for wl, s in summary.items()
        for q in [s["ratios"]]
        for key in q
        if key + " (paired)" in q
    ]
    bound_head = ["workload", "compute (local)", "forward", "all-reduce of all grads", "bound"]
    return _join(
        f"### {_regime_title(name, regime)}: every variant",
        CPU_SHARE,
        _table([*head, "all-reduces"], variants),
        "Lower bound, ms: max(compute, forward + communication)",
        _table(bound_head, bounds),
        PAIRED,
        _table(["workload", "ratio", "of medians", "paired by round"], ratios),
    )


def _comparison(results: dict[str, Any]) -> str:
    """Every variant, the lower bounds and ratios of each regime, and parity with DDP."""
    parity = []
    for name, wl, s in _workloads(results):
        by_kind: dict[str, list[float]] = {}
        for v, diff in s["parity"].items():
            by_kind.setdefault(v.split("@")[0], []).append(diff)
        parity.append([name, wl, *(f"{max(diffs):.2e}" for diffs in by_kind.values())])
    regimes = [_regime_details(name, regime) for name, regime in results["regimes"].items()]
    parity_head = ["regime", "workload", "fddp variants", "DDP variants"]
    parity_table = _table(parity_head, parity)
    return _section(
        "Details", *regimes, parity_table and _section("Parity", PARITY, parity_table, level="###")
    )


# ---- markdown: --compile, --zero, --overlap (headline tables) -------------------------------


def _first_calls(s: dict[str, Any]) -> str:
    f, d = s["rows"]["fddp+compile"], s["rows"]["ddp+compile"]
    return f"{f['first_call_s']:.1f} / {d['first_call_s']:.1f}"


def _state_mb(s: dict[str, Any]) -> str:
    state = [s["rows"][n]["state_bytes"] for n in ("fddp", "fddp+zero", "ddp", "ddp+zero")]
    return " / ".join(", ".join(f"{b / 1e6:.1f}" for b in per_rank) for per_rank in state)


def _bitwise(s: dict[str, Any]) -> str:
    bitwise = s["parity"].get("fddp+overlap == fddp (bitwise)")
    return "—" if bitwise is None else ("yes" if bitwise else "NO")


COMPILE = Table(
    "With Inductor, median ms per step",
    ("fddp+compile", "ddp+compile"),
    {
        "fddp compile=True": _med("fddp+compile"),
        "DDP + torch.compile": _med("ddp+compile"),
        "ratio": _ratio("fddp+compile/ddp+compile"),
        "first calls s": _first_calls,
    },
)

ZERO = Table(
    "Sharded optimizer state (ZeRO-1), median ms per step",
    ("fddp+zero", "ddp+zero"),
    {
        "fddp": _med("fddp"),
        "fddp + shard_state": _med("fddp+zero"),
        "ratio": _ratio_paired("fddp+zero/fddp"),
        "DDP + ZeroRedundancyOptimizer": _med("ddp+zero"),
        "fddp+zero/DDP+zero": _ratio("fddp+zero/ddp+zero"),
        "optimizer state per rank, MB: fddp / +zero / DDP / +zero": _state_mb,
    },
)

OVERLAP = Table(
    "Overlap across steps (`overlap_steps=True`), median ms per step; each block ends by "
    "completing what its last step left in flight, timed into that step",
    ("fddp+overlap",),
    {
        "fddp": _med("fddp"),
        "fddp overlap_steps=True": _med("fddp+overlap"),
        "ratio": _ratio_paired("fddp+overlap/fddp"),
        "/DDP": _ratio("fddp+overlap/ddp"),
        "bitwise": _bitwise,
    },
)


# ---- markdown: --sweep ----------------------------------------------------------------------


def _sweep(results: dict[str, Any]) -> str:
    """fddp and DDP at each bucket cap, and the cap fddp's default chose with its reasons."""
    rows, caps = [], []
    for name, wl, s in _workloads(results):
        swept = s["sweep"] if len(s["sweep"]) >= 2 else {}
        for mb, v in swept.items():
            f, d = v.get("fddp"), v.get("ddp")
            ratios = [f"{v[k]:.2f}" if k in v else "—" for k in ("fddp/ddp", "fddp/ddp (paired)")]
            rows.append([name, wl, mb, f"{f:.1f}" if f else "—", f"{d:.1f}" if d else "—", *ratios])
        plan = s["rows"].get("fddp", {}).get("plan") or ""
        line = next((x for x in plan.splitlines() if x.startswith("bucket cap")), None)
        if line:
            cap, _, why = line.partition(", ")
            caps.append([name, wl, cap.removeprefix("bucket cap "), why])
    head = ["regime", "workload", "bucket MiB", "fddp ms", "DDP ms", "fddp/DDP", "paired"]
    return _join(
        _section("Bucket-size sweep (median ms per step)", _table(head, rows)),
        _section(
            "The default bucket cap (fddp's cost model, per regime)",
            _table(["regime", "workload", "cap", "why"], caps),
        ),
    )


# ---- markdown: memory -----------------------------------------------------------------------

MEMORY = (
    "Step peak: VmHWM over a few steps after the first call and warm-up (reset through "
    "/proc/self/clear_refs), largest over ranks; base: RSS after imports and process-group "
    "setup, before the model is built; process peak: ru_maxrss, the first call included."
)


def _memory(results: dict[str, Any]) -> str:
    mib = ("step peak", "above base", "base", "process peak")
    keys = ("rss_step_peak_bytes", "above_base_bytes", "rss_base_bytes", "rss_process_peak_bytes")
    head = ["workload", "variant", *(f"{h} (MiB)" for h in mib), "first call s"]
    rows = []
    for wl, per in results["memory"].items():
        for name, m in per.items():
            if not isinstance(m, dict):
                continue
            ratio = ""
            if name == "fddp" and "fddp/ddp" in per:
                ratio = f"{per['fddp/ddp']:.2f} ({per['fddp/ddp above base']:.2f})"
            sizes = [f"{m[k] / MIB:.0f}" for k in keys]
            rows.append([wl, name, *sizes, f"{m['first_call_s']:.2f}", ratio])
    table = _table([*head, "fddp/DDP (above base)"], rows)
    return table and _section("Peak memory (each variant alone in fresh ranks)", MEMORY, table)


# ---- the modes and the whole report ---------------------------------------------------------

PLOT_VARIANTS = ("local", "fddp", "ddp", "ddp best", "fddp+compile", "ddp+compile")


@dataclasses.dataclass(frozen=True)
class Mode:
    """What one mode of compare_ddp.py adds to the report: a headline table per regime, a
    section of the details, a plot ``<stem>_<name>.png`` (``plot`` returns whether it drew)."""

    name: str
    headline: Table | None = None
    section: Callable[[dict[str, Any]], str] | None = None
    plot: Callable[[dict[str, Any], str], bool] | None = None


def _plot_compare(results: dict[str, Any], path: str) -> bool:
    plt = _pyplot()
    regimes = list(results["regimes"].items())
    workloads = list(regimes[0][1]["summary"])
    fig, axes = plt.subplots(
        len(regimes),
        len(workloads),
        squeeze=False,
        figsize=(4.2 * len(workloads), 3.4 * len(regimes)),
    )
    for i, (rname, regime) in enumerate(regimes):
        for j, wl in enumerate(workloads):
            s = regime["summary"][wl]
            names = [v for v in PLOT_VARIANTS if v in s["rows"] or v == "ddp best"]
            rows = [s["rows"][s["ddp_best"] if v == "ddp best" else v] for v in names]
            med = [r["median_ms"] for r in rows]
            err = [[0] * len(rows), [r["p90_ms"] - r["median_ms"] for r in rows]]
            labels = [
                f"DDP best\n({_mb_label(s['ddp_best'])})" if v == "ddp best" else v for v in names
            ]
            ax = axes[i][j]
            ax.bar(
                labels,
                med,
                yerr=err,
                capsize=3,
                color=["#999", "#1f77b4", "#d62728", "#ff9896", "#aec7e8", "#f7b6d2"][: len(med)],
            )
            ax.axhline(s["bound"]["bound_ms"], ls="--", color="k", lw=1, label="lower bound")
            ax.set_title(f"{wl} — {_regime_title(rname, regime)}", fontsize=9)
            ax.set_ylabel("ms per step (median, p90 whisker)", fontsize=8)
            ax.tick_params(axis="x", labelsize=7, labelrotation=30)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_sweep(results: dict[str, Any], path: str) -> bool:
    if not results["config"]["sweep"]:
        return False
    plt = _pyplot()
    regimes = list(results["regimes"].items())
    workloads = list(regimes[0][1]["summary"])
    fig, axes = plt.subplots(1, len(workloads), squeeze=False, figsize=(4.2 * len(workloads), 3.4))
    styles = {"loopback": "-", "link": "--"}
    for j, wl in enumerate(workloads):
        ax = axes[0][j]
        for rname, regime in regimes:
            sweep = regime["summary"][wl]["sweep"]
            for kind, color in (("fddp", "#1f77b4"), ("ddp", "#d62728")):
                pts = [(float(mb), v[kind]) for mb, v in sweep.items() if kind in v]
                ax.plot(
                    *zip(*pts),
                    styles.get(rname, ":"),
                    marker="o",
                    color=color,
                    label=f"{kind}, {rname}",
                )
        ax.set_xscale("log")
        ax.set_xlabel("bucket cap (MiB)")
        ax.set_ylabel("median ms per step")
        ax.set_title(wl)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, imported only when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


MODES = (
    Mode("compare", headline=COMPARISON, section=_comparison, plot=_plot_compare),
    Mode("compile", headline=COMPILE),
    Mode("zero", headline=ZERO),
    Mode("overlap", headline=OVERLAP),
    Mode("sweep", section=_sweep, plot=_plot_sweep),
    Mode("memory", section=_memory),
)


def headline(results: dict[str, Any]) -> str:
    """Per regime, each mode's table: medians in ms and the ratios, one row per workload."""
    return _join(
        *(
            m.headline.render(name, regime)
            for name, regime in results["regimes"].items()
            for m in MODES
            if m.headline
        )
    )


def markdown(results: dict[str, Any], images: list[str], limits: str | None = None) -> str:
    """The whole report: the run, the headline, each mode's section, fddp's plans and the notes;
    with ``limits`` (a JSON file) also the check against them."""
    meta, cfg = results["meta"], results["config"]
    intro = (
        f"torch {meta['torch']}, fddp {meta['fddp']} (commit {meta['fddp_commit']}, "
        f"{meta['fddp_uncommitted_files']} uncommitted files under fddp/), Python {meta['python']}"
        f"; {meta['cpu']}, {meta['cores']} cores, kernel {meta['kernel']}"
        + (f", GPUs {meta['gpus']}" if meta["gpus"] else "")
        + f"; {meta['world_size']} {meta['backend']} ranks, {meta['threads_per_rank']} thread(s)"
        f" each. Load average at start {_load(meta['loadavg_start'])}, at end "
        f"{_load(meta['loadavg_end'])}; the whole run took {meta['duration_s'] / 60:.1f} min."
    )
    config = (
        f"Config: `{_command(cfg)}` — {cfg['steps']} timed steps per variant in interleaved "
        f"blocks of {cfg['block']} (each round starting one variant later), after a first call "
        f"and {cfg['warmup']} interleaved warm-up steps. Per step, the slowest rank's time."
    )
    figures = "\n".join(f"![{os.path.splitext(i)[0]}]({i})" for i in images)
    return (
        _join(
            f"# fddp vs DDP — {meta['date']}",
            intro,
            config,
            _section("Headline", headline(results), figures),
            _limits_section(results, limits) if limits else "",
            *(m.section(results) for m in MODES if m.section),
            _plans(results),
            _notes(results),
        )
        + "\n"
    )


def _load(avg: list[float] | tuple[float, ...]) -> str:
    return "/".join(f"{a:.1f}" for a in avg)


def _command(cfg: dict[str, Any]) -> str:
    flags = [f"--workloads {cfg['workloads']}", f"--steps {cfg['steps']}"]
    flags += ["--sweep"] if cfg["sweep"] else []
    flags += [f"--link {cfg['link']}"] if cfg["link"] else []
    flags += ["--compile"] if cfg["compile"] else []
    flags += ["--zero"] if cfg.get("zero") else []
    flags += ["--overlap"] if cfg.get("overlap") else []
    flags += [f"--block {cfg['block']}"] if cfg.get("block", 2) != 2 else []
    flags += [f"--warmup {cfg['warmup']}"] if cfg.get("warmup", 3) != 3 else []
    flags += ["--no-loopback"] if cfg["no_loopback"] else []
    flags += ["--no-memory"] if cfg.get("no_memory") else []
    return "python benchmarks/compare_ddp.py " + " ".join(flags)


def _plans(results: dict[str, Any]) -> str:
    """fddp's compiled plans (its default buckets) in the first regime."""
    regime = next(iter(results["regimes"].values()), {"summary": {}})
    plans = [
        f"{wl}:\n\n```\n{s['rows']['fddp']['plan']}\n```"
        for wl, s in regime["summary"].items()
        if s["rows"]["fddp"].get("plan")
    ]
    return _section("fddp schedules (its default buckets)", *plans)


def _notes(results: dict[str, Any]) -> str:
    lines = [f"- {n}" for n in results["notes"]]
    link = results["regimes"].get("link")
    if link and "qdisc" in link:
        lines.append("- The emulated link's qdisc after the run (`tc -s qdisc show dev lo`):")
        lines += ["", "```", link["qdisc"], "```"]
    return _section("Notes", "\n".join(lines)) if lines else ""


# ---- files ----------------------------------------------------------------------------------


def rerender(path: str, limits: str | None = None) -> list[str]:
    """Recompute the summary of a results JSON and write its report again, next to it."""
    with open(path) as f:
        old = json.load(f)
    regimes = {
        name: {k: v for k, v in r.items() if k != "summary"} for name, r in old["regimes"].items()
    }
    results = summarize(old["meta"], regimes, old["memory_raw"], old["notes"], old["config"])
    out_dir = os.path.dirname(path) or "."
    return write(results, out_dir, old["config"]["tag"], limits=limits)


def write(
    results: dict[str, Any], out_dir: str, tag: str, plot: bool = True, limits: str | None = None
) -> list[str]:
    """Write ``<stem>.json``, ``<stem>.md`` and each mode's PNG; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    regimes = "+".join(results["regimes"]) or "none"
    stamp = results["meta"]["date"].replace(":", "").replace("-", "")
    stem = f"{stamp}_{results['meta']['backend']}_{regimes}" + (f"_{tag}" if tag else "")
    images = []
    for m in MODES if plot and results["regimes"] else ():
        if m.plot and m.plot(results, os.path.join(out_dir, f"{stem}_{m.name}.png")):
            images.append(f"{stem}_{m.name}.png")
    paths = [os.path.join(out_dir, f"{stem}.{ext}") for ext in ("json", "md")]
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(results, images, limits))
    return paths + [os.path.join(out_dir, i) for i in images]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Write a results file's report again, next to it.")
    p.add_argument("results", help="benchmarks/results/<stem>.json")
    p.add_argument("--limits", help='JSON: {"limits": [{"at": [key, ...], "max": x}, ...]}')
    args = p.parse_args()
    for written in rerender(args.results, args.limits):
        print(written)
