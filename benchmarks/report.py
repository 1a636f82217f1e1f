"""The report of compare_ddp.py: raw step times to medians, ratios, bounds; JSON, markdown, plots.

To write a results file's report again (its summary recomputed, next to it)::

    python benchmarks/report.py benchmarks/results/<stem>.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
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


LINK_TARGETS = {"mlp": 0.60, "gpt": 0.95, "cnn": 0.85}  # fddp/DDP default behind the link


def _targets(regimes: dict[str, Any], memory: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it is met."""
    checks = []

    def check(what: str, value: float | None, limit: float) -> None:
        if value is not None:
            checks.append({"target": what, "value": value, "limit": limit, "met": value <= limit})

    for wl, s in regimes.get("loopback", {}).get("summary", {}).items():
        check(f"loopback {wl}: fddp/DDP", s["ratios"]["fddp/ddp"], 1.00)
        check(f"loopback {wl}: fddp/DDP-best", s["ratios"]["fddp/ddp_best"], 1.00)
    for wl, s in regimes.get("link", {}).get("summary", {}).items():
        if wl in LINK_TARGETS:
            check(f"link {wl}: fddp/DDP-default", s["ratios"]["fddp/ddp"], LINK_TARGETS[wl])
        check(f"link {wl}: fddp/lower bound", s["ratios"]["fddp/bound"], 1.10)
    for name, regime in regimes.items():
        for wl, s in regime.get("summary", {}).items():
            if len(s["sweep"]) >= 2:
                best, raw = s["fddp_best"], regime["workloads"][wl]
                paired = paired_ratio(raw, "fddp", best) if best != "fddp" else 1.0
                check(f"{name} {wl}: fddp default cap/fddp best swept cap (paired)", paired, 1.03)
    for wl, m in memory.items():
        check(f"memory {wl}: fddp/DDP step peak RSS", m.get("fddp/ddp"), 1.10)
        check(f"memory {wl}: fddp/DDP step peak above base", m.get("fddp/ddp above base"), 1.10)
    if "mlp" in memory and "fddp" in memory["mlp"]:
        check("mlp: first call (capture) s", memory["mlp"]["fddp"]["first_call_s"], 3.0)
    return checks


def summarize(
    meta: dict[str, Any],
    regimes: dict[str, Any],
    memory: dict[str, Any],
    notes: list[str],
    config: dict[str, Any],
) -> dict[str, Any]:
    for regime in regimes.values():
        regime["summary"] = {wl: _workload_summary(raw) for wl, raw in regime["workloads"].items()}
    mem = _memory_summary(memory)
    return {
        "meta": meta,
        "config": config,
        "regimes": regimes,
        "memory": mem,
        "memory_raw": memory,
        "targets": _targets(regimes, mem),
        "notes": notes,
    }


# ---- markdown -------------------------------------------------------------------------------

REGIME_TITLES = {"loopback": "Loopback (CPU-bound)", "link": "Emulated link (network-bound)"}


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _regime_title(name: str, regime: dict[str, Any]) -> str:
    title = REGIME_TITLES.get(name, name)
    return f"{title}, {regime['rate']}" if "rate" in regime else title


def headline(results: dict[str, Any]) -> str:
    """Per regime: medians in ms and the ratios, one row per workload."""
    parts = []
    head = ["workload", "local", "fddp (default)", "fddp best", "DDP (default)", "DDP best"]
    head += ["fddp/DDP", "fddp/DDP best", "fddp best/DDP best", "local/fddp", "lower bound"]
    head += ["fddp/bound"]
    for name, regime in results["regimes"].items():
        rows = []
        for wl, s in regime["summary"].items():
            r, q = s["rows"], s["ratios"]
            fb, db = r[s["fddp_best"]], r[s["ddp_best"]]
            rows.append(
                [
                    wl,
                    f"{r['local']['median_ms']:.1f}",
                    f"{r['fddp']['median_ms']:.1f}",
                    f"{fb['median_ms']:.1f} ({_mb_label(s['fddp_best'])})",
                    f"{r['ddp']['median_ms']:.1f}",
                    f"{db['median_ms']:.1f} ({_mb_label(s['ddp_best'])})",
                    f"{q['fddp/ddp']:.2f}",
                    f"{q['fddp/ddp_best']:.2f}",
                    f"{q['fddp_best/ddp_best']:.2f}",
                    f"{q['local/fddp']:.2f}",
                    f"{s['bound']['bound_ms']:.1f}",
                    f"{q['fddp/bound']:.2f}",
                ]
            )
        title = f"**{_regime_title(name, regime)}** — median ms per step, ratios of medians"
        parts.append(title + "\n\n" + _table(head, rows))
        tables = (_compile_table(regime), _zero_table(regime), _overlap_table(regime))
        parts += [t for t in tables if t]
    return "\n\n".join(parts)


def _compile_table(regime: dict[str, Any]) -> str:
    head = ["workload", "fddp compile=True", "DDP + torch.compile", "ratio", "first calls s"]
    rows = []
    for wl, s in regime["summary"].items():
        r = s["rows"]
        if "fddp+compile" not in r or "ddp+compile" not in r:
            continue
        f, d = r["fddp+compile"], r["ddp+compile"]
        rows.append(
            [
                wl,
                f"{f['median_ms']:.1f}",
                f"{d['median_ms']:.1f}",
                f"{s['ratios']['fddp+compile/ddp+compile']:.2f}",
                f"{f['first_call_s']:.1f} / {d['first_call_s']:.1f}",
            ]
        )
    return "With Inductor, median ms per step\n\n" + _table(head, rows) if rows else ""


def _zero_table(regime: dict[str, Any]) -> str:
    head = ["workload", "fddp", "fddp + shard_state", "ratio", "DDP + ZeroRedundancyOptimizer"]
    head += ["fddp+zero/DDP+zero", "optimizer state per rank, MB: fddp / +zero / DDP / +zero"]
    rows = []
    for wl, s in regime["summary"].items():
        r, q = s["rows"], s["ratios"]
        if "fddp+zero" not in r or "ddp+zero" not in r:
            continue
        state = [r[n]["state_bytes"] for n in ("fddp", "fddp+zero", "ddp", "ddp+zero")]
        rows.append(
            [
                wl,
                f"{r['fddp']['median_ms']:.1f}",
                f"{r['fddp+zero']['median_ms']:.1f}",
                f"{q['fddp+zero/fddp']:.2f} (paired {q['fddp+zero/fddp (paired)']:.2f})",
                f"{r['ddp+zero']['median_ms']:.1f}",
                f"{q['fddp+zero/ddp+zero']:.2f}",
                " / ".join(", ".join(f"{b / 1e6:.1f}" for b in per_rank) for per_rank in state),
            ]
        )
    title = "Sharded optimizer state (ZeRO-1), median ms per step"
    return title + "\n\n" + _table(head, rows) if rows else ""


def _overlap_table(regime: dict[str, Any]) -> str:
    head = ["workload", "fddp", "fddp overlap_steps=True", "ratio", "/DDP", "bitwise"]
    rows = []
    for wl, s in regime["summary"].items():
        r, q = s["rows"], s["ratios"]
        if "fddp+overlap" not in r:
            continue
        bitwise = s["parity"].get("fddp+overlap == fddp (bitwise)")
        rows.append(
            [
                wl,
                f"{r['fddp']['median_ms']:.1f}",
                f"{r['fddp+overlap']['median_ms']:.1f}",
                f"{q['fddp+overlap/fddp']:.2f} (paired {q['fddp+overlap/fddp (paired)']:.2f})",
                f"{q['fddp+overlap/ddp']:.2f}",
                "—" if bitwise is None else ("yes" if bitwise else "NO"),
            ]
        )
    title = (
        "Overlap across steps (`overlap_steps=True`), median ms per step; each block ends by "
        "completing what its last step left in flight, timed into that step"
    )
    return title + "\n\n" + _table(head, rows) if rows else ""


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


def _details(name: str, regime: dict[str, Any]) -> str:
    parts = [f"### {_regime_title(name, regime)}: every variant"]
    parts.append(
        "CPU share: CPU seconds / wall seconds of the timed steps on the slower rank (1 thread per "
        "rank, so about 100 % for local training on an idle machine; lower means other processes "
        "took the core, or, for the distributed variants, time spent waiting on the network)."
    )
    head = ["workload", "variant", "median ms", "p90 ms", "steps", "CPU share", "first call s"]
    head.append("all-reduces")
    rows = []
    for wl, s in regime["summary"].items():
        for vname, r in s["rows"].items():
            rows.append(
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
            )
    parts.append(_table(head, rows))
    head = ["workload", "compute (local)", "forward", "all-reduce of all grads", "bound"]
    rows = [
        [wl, *(f"{s['bound'][k]:.1f}" for k in ("compute_ms", "forward_ms", "comm_ms", "bound_ms"))]
        for wl, s in regime["summary"].items()
    ]
    parts.append("Lower bound, ms: max(compute, forward + communication)\n\n" + _table(head, rows))
    head = ["workload", "ratio", "of medians", "paired by round"]
    rows = [
        [wl, key, f"{q[key]:.3f}", f"{q[key + ' (paired)']:.3f}"]
        for wl, s in regime["summary"].items()
        for q in [s["ratios"]]
        for key in q
        if key + " (paired)" in q
    ]
    parts.append(
        "Ratios: of medians = median of a / median of b (the headline); paired = median over the "
        "rounds both played of (a's block median / b's block median), which cancels slow drift "
        "in the machine's load but not short bursts.\n\n" + _table(head, rows)
    )
    return "\n\n".join(parts)


def _sweep(results: dict[str, Any]) -> str:
    head = ["regime", "workload", "bucket MiB", "fddp ms", "DDP ms", "fddp/DDP", "paired"]
    rows = []
    for name, regime in results["regimes"].items():
        for wl, s in regime["summary"].items():
            if len(s["sweep"]) < 2:
                continue
            for mb, v in s["sweep"].items():
                f, d = v.get("fddp"), v.get("ddp")
                ratios = [
                    f"{v[k]:.2f}" if k in v else "—" for k in ("fddp/ddp", "fddp/ddp (paired)")
                ]
                rows.append(
                    [name, wl, mb, f"{f:.1f}" if f else "—", f"{d:.1f}" if d else "—", *ratios]
                )
    return _table(head, rows) if rows else "(no sweep in this run: pass --sweep)"


def _memory_table(mem: dict[str, Any]) -> str:
    mib = ("step peak", "above base", "base", "process peak")
    head = ["workload", "variant", *(f"{h} (MiB)" for h in mib)]
    head += ["first call s", "fddp/DDP (above base)"]
    keys = ("rss_step_peak_bytes", "above_base_bytes", "rss_base_bytes", "rss_process_peak_bytes")
    rows = []
    for wl, per in mem.items():
        for name, m in per.items():
            if not isinstance(m, dict):
                continue
            ratio = ""
            if name == "fddp" and "fddp/ddp" in per:
                ratio = f"{per['fddp/ddp']:.2f} ({per['fddp/ddp above base']:.2f})"
            sizes = [f"{m[k] / MIB:.0f}" for k in keys]
            rows.append([wl, name, *sizes, f"{m['first_call_s']:.2f}", ratio])
    if not rows:
        return "(memory not measured: --no-memory)"
    return (
        "Step peak: VmHWM over a few steps after the first call and warm-up (reset through "
        "/proc/self/clear_refs), largest over ranks; base: RSS after imports and process-group "
        "setup, before the model is built; process peak: ru_maxrss, the first call included.\n\n"
        + _table(head, rows)
    )


def _targets_table(results: dict[str, Any]) -> str:
    rows = [
        [t["target"], f"{t['value']:.2f}", f"<= {t['limit']:.2f}", "met" if t["met"] else "NOT met"]
        for t in results["targets"]
    ]
    return _table(["target", "measured", "limit", ""], rows)


def markdown(results: dict[str, Any], images: list[str]) -> str:
    meta, cfg = results["meta"], results["config"]
    lines = [
        f"# fddp vs DDP — {meta['date']}",
        "",
        f"torch {meta['torch']}, fddp {meta['fddp']} (commit {meta['fddp_commit']}, "
        f"{meta['fddp_uncommitted_files']} uncommitted files under fddp/), Python {meta['python']}"
        f"; {meta['cpu']}, {meta['cores']} cores, kernel {meta['kernel']}"
        + (f", GPUs {meta['gpus']}" if meta["gpus"] else "")
        + f"; {meta['world_size']} {meta['backend']} ranks, {meta['threads_per_rank']} thread(s)"
        f" each. Load average at start {_load(meta['loadavg_start'])}, at end "
        f"{_load(meta['loadavg_end'])}; the whole run took {meta['duration_s'] / 60:.1f} min.",
        "",
        f"Config: `{_command(cfg)}` — {cfg['steps']} timed steps per variant in interleaved "
        f"blocks of {cfg['block']} (each round starting one variant later), after a first call "
        f"and {cfg['warmup']} interleaved warm-up steps. Per step, the slowest rank's time.",
        "",
        "## Headline",
        "",
        headline(results),
        "",
        *[f"![{os.path.splitext(i)[0]}]({i})" for i in images],
        "",
        "## Targets",
        "",
        _targets_table(results),
        "",
        "## Details",
        "",
    ]
    for name, regime in results["regimes"].items():
        lines += [_details(name, regime), ""]
    lines += ["## Bucket-size sweep (median ms per step)", "", _sweep(results), ""]
    caps = _default_caps(results)
    if caps:
        lines += ["## The default bucket cap (fddp's cost model, per regime)", "", caps, ""]
    lines += [
        "## Peak memory (each variant alone in fresh ranks)",
        "",
        _memory_table(results["memory"]),
        "",
    ]
    lines += _parity_lines(results) + _plans(results) + _notes(results)
    return "\n".join(lines) + "\n"


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
    return "python benchmarks/compare_ddp.py " + " ".join(flags)


def _parity_lines(results: dict[str, Any]) -> list[str]:
    rows = []
    for name, regime in results["regimes"].items():
        for wl, s in regime["summary"].items():
            by_kind: dict[str, list[float]] = {}
            for v, diff in s["parity"].items():
                by_kind.setdefault(v.split("@")[0], []).append(diff)
            rows.append(
                [name, wl, *(f"{max(by_kind[k]):.2e}" if k in by_kind else "—" for k in by_kind)]
            )
    if not rows:
        return []
    return [
        "## Parity",
        "",
        "Largest |parameter difference| from DDP-default after the same steps on the same data "
        "(same init, same AdamW math), over all fddp variants and over the other DDP variants. "
        "Every bucket size gives bit-identical parameters (an all-reduce of two summands is "
        "exact); what differs is fddp's functional step (torch.func gradients, fddp.optim) from "
        "eager autograd and torch.optim at rounding level, which Adam turns into steps of up to "
        "±lr wherever a gradient is near zero, hence up to about lr x steps on the BatchNorm CNN.",
        "",
        _table(["regime", "workload", "fddp variants", "DDP variants"], rows),
        "",
    ]


def _default_caps(results: dict[str, Any]) -> str:
    """The bucket cap fddp's default chose in each regime, with the cost model's reasons."""
    rows = []
    for name, regime in results["regimes"].items():
        for wl, s in regime["summary"].items():
            plan = s["rows"].get("fddp", {}).get("plan") or ""
            line = next((x for x in plan.splitlines() if x.startswith("bucket cap")), None)
            if line:
                cap, _, why = line.partition(", ")
                rows.append([name, wl, cap.removeprefix("bucket cap "), why])
    return _table(["regime", "workload", "cap", "why"], rows) if rows else ""


def _plans(results: dict[str, Any]) -> list[str]:
    regime = next(iter(results["regimes"].values()), None)
    if regime is None:
        return []
    lines = ["## fddp schedules (its default buckets)", ""]
    for wl, s in regime["summary"].items():
        plan = s["rows"]["fddp"].get("plan")
        if plan:
            lines += [f"{wl}:", "", "```", plan, "```", ""]
    return lines


def _notes(results: dict[str, Any]) -> list[str]:
    lines = [f"- {n}" for n in results["notes"]]
    link = results["regimes"].get("link")
    if link and "qdisc" in link:
        lines.append("- The emulated link's qdisc after the run (`tc -s qdisc show dev lo`):")
        lines += ["", "```", link["qdisc"], "```"]
    return ["## Notes", "", *lines, ""] if lines else []


# ---- plots ----------------------------------------------------------------------------------

PLOT_VARIANTS = ("local", "fddp", "ddp", "ddp best", "fddp+compile", "ddp+compile")


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, imported only when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_compare(results: dict[str, Any], path: str) -> None:
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


# ---- files ----------------------------------------------------------------------------------


def rerender(path: str) -> list[str]:
    """Recompute the summary of a results JSON and write its report again, next to it."""
    with open(path) as f:
        old = json.load(f)
    regimes = {
        name: {k: v for k, v in r.items() if k != "summary"} for name, r in old["regimes"].items()
    }
    results = summarize(old["meta"], regimes, old["memory_raw"], old["notes"], old["config"])
    return write(results, os.path.dirname(path), old["config"]["tag"])


def write(results: dict[str, Any], out_dir: str, tag: str, plot: bool = True) -> list[str]:
    """Write ``<stem>.json``, ``<stem>.md`` and the PNGs; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    regimes = "+".join(results["regimes"]) or "none"
    stamp = results["meta"]["date"].replace(":", "").replace("-", "")
    stem = f"{stamp}_{results['meta']['backend']}_{regimes}" + (f"_{tag}" if tag else "")
    images = []
    if plot and results["regimes"]:
        _plot_compare(results, os.path.join(out_dir, f"{stem}_compare.png"))
        images.append(f"{stem}_compare.png")
        if _plot_sweep(results, os.path.join(out_dir, f"{stem}_sweep.png")):
            images.append(f"{stem}_sweep.png")
    paths = [os.path.join(out_dir, f"{stem}.{ext}") for ext in ("json", "md")]
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(results, images))
    return paths + [os.path.join(out_dir, i) for i in images]


if __name__ == "__main__":
    for written in rerender(sys.argv[1]):
        print(written)
