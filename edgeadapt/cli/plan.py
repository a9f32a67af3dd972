"""``edgeadapt plan BUNDLE``: the memory plan a bundle carries, and how the device keeps it.

Prints what trains, the cut (the frozen prefix run once as inference, its features cached),
batch and micro-batch, which saved activations are kept or recomputed, and the predicted peak
of a whole ``Runner.adapt`` call per phase (see docs/ for the cost model). ``--measure`` runs an
adapt call of the planned size (``n_windows`` synthetic windows, one epoch, the planned batch)
in a fresh process where torch cannot be imported and prints the measured peak over the loaded
runner next to the prediction, twice: total resident memory (VmHWM delta) and anonymous memory
only (sampled RssAnon). ``--png`` draws the predicted phases and the measured timeline
(matplotlib, imported only then). A report for more windows than the bundle's budget allows
(even with the micro-batch chosen again, as an adapt call would) says so and exits 2 with the
error that adapt call would give.

Torch-free: the sched planner, the bundle format and (for ``--measure``) the runner.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from ..units import format_bytes

__all__ = ["plan_report", "format_report", "over_budget_error", "measure_adapt", "label_free_report",
           "format_label_free", "measure_label_free", "draw_timeline", "cmd_plan", "add_plan_parser"]


# ---- the report ---------------------------------------------------------------------------
def _load(bundle_dir: str | os.PathLike):
    from ..bundle import BundleError, read_manifest
    from ..sched.ir import Graph
    from ..sched.plan import Plan

    manifest = read_manifest(bundle_dir, verify=True)
    if manifest.plan is None or manifest.graph is None:
        raise BundleError(
            f"{bundle_dir} carries no memory plan (it was exported before plans were recorded); "
            "re-export it with this edgeadapt (edgeadapt export ... [--memory-budget 512KiB])")
    try:
        return manifest, Plan.from_dict(manifest.plan), Graph.from_dict(manifest.graph)
    except (KeyError, TypeError, ValueError) as e:
        raise BundleError(f"{bundle_dir}: the manifest's plan or graph is malformed ({e}); "
                          "re-export the bundle") from None


def plan_report(bundle_dir: str | os.PathLike, *, n_windows: int | None = None,
                batch_windows: int | None = None) -> dict[str, Any]:
    """What ``edgeadapt plan`` prints, as a JSON-able dict.

    Args:
        bundle_dir: the bundle.
        n_windows, batch_windows: report the plan for another window count or batch (the
            prediction is made again; the stored one is for the exported plan).

    The report holds ``within_budget`` (``None`` without a budget or a prediction): a plan
    predicted over the bundle's budget gets its micro-batch chosen again, as an adapt call does
    (:mod:`edgeadapt.runtime.call_plan`; ``replanned``); ``False`` when even that is over, with
    ``need_bytes``, the smallest budget that would fit (an adapt call over that many windows is
    refused before any work).

    Raises:
        BundleError: not a bundle, damaged, or a bundle exported without a plan.
    """
    manifest, plan, graph = _load(bundle_dir)
    if n_windows or batch_windows:
        from dataclasses import replace

        batch = batch_windows or plan.batch_windows
        plan = replace(plan, n_windows=n_windows or plan.n_windows, batch_windows=batch,
                       micro_batch_windows=min(plan.micro_batch_windows, batch), predicted=None)
    entries = {e.name: e for e in manifest.parameters}
    trains = [{"name": p.name, "mode": p.mode.value, "tier": p.tier.value,
               "channels": None if p.channels is None else len(p.channels),
               "trainable_numel": entries[p.name].trainable_numel if p.name in entries else None}
              for p in plan.trained]
    cut = None
    if plan.cut >= 0:
        op = graph.ops[plan.cut]
        cut = {"index": plan.cut, "op": op.name, "module": op.module, "features_bytes_per_window": op.output_bytes,
               "feature_cache_bytes": op.output_bytes * plan.n_windows if plan.cache_features else 0,
               "prefix_model": manifest.files.get("prefix_model")}
    recomputed = list(plan.recomputed)
    stored = plan.predicted
    cost = None
    fit = {"within_budget": None, "replanned": False, "need_bytes": None}
    try:
        from ..sched import CostModel, predict

        cost = CostModel.bounding(manifest.backends)  # the constants the bundle was planned with
        repredicted = predict(graph, plan, cost).to_dict()
        if plan.budget_bytes is not None:
            plan, repredicted, fit = _fit_budget(graph, plan, cost, repredicted, manifest.batch_statistics)
        expected = {e: predict(graph, plan, CostModel.expected(e)).peak_bytes for e in manifest.backends}
    except ImportError:  # a planner without predict(): report what the exporter stored
        repredicted = expected = None
    try:
        from ..sched.verify import timeline

        events = [[e.phase, e.where, e.total_bytes] for e in timeline(graph, plan, cost)]
    except ImportError:
        events = None
    return {
        "bundle": str(bundle_dir),
        "graph": graph.name, "n_ops": len(graph.ops),
        "trains": trains,
        "trainable_numel": manifest.trainable_numel, "total_numel": manifest.total_numel,
        "optimizer": plan.optimizer,
        "cut": cut, "cache_features": plan.cache_features,
        "batch_windows": plan.batch_windows, "micro_batch_windows": plan.micro_batch_windows,
        "n_windows": plan.n_windows,
        "recompute": recomputed,
        "keep": [n for n, a in plan.activations if a.value == "keep"],
        "budget_bytes": plan.budget_bytes,
        "predicted": None if stored is None else stored.to_dict(),
        "predicted_now": repredicted,
        "expected_bytes": expected,
        "predicted_timeline": events,
        "policy": plan.policy,
        **fit,
    }


def _fit_budget(graph, plan, cost, peak: dict, fixed: bool) -> tuple[Any, dict, dict]:
    """``plan`` and its ``peak`` as an adapt call runs them under the plan's budget
    (:class:`~edgeadapt.runtime.call_plan.CallPlan`): over the budget, the micro-batch is chosen
    again (:func:`edgeadapt.sched.replan`), unless batch statistics fix it (``fixed``); with the
    report's ``within_budget``, ``replanned`` and ``need_bytes``."""
    from ..sched import NoFeasiblePlan, predict, replan

    if peak["peak_bytes"] <= plan.budget_bytes:
        return plan, peak, {"within_budget": True, "replanned": False, "need_bytes": None}
    need = peak["peak_bytes"]
    if not fixed:
        try:
            again = replan(graph, plan, plan.n_windows, cost=cost)
            return again, predict(graph, again, cost).to_dict(), {"within_budget": True, "replanned": True,
                                                                  "need_bytes": None}
        except NoFeasiblePlan as e:
            need = e.need_bytes
    return plan, peak, {"within_budget": False, "replanned": False, "need_bytes": need}


def over_budget_error(r: dict[str, Any]):
    """The :class:`~edgeadapt.sched.BudgetExceeded` an adapt call of report ``r``'s size would
    raise (``r["within_budget"]`` is False), with the fix."""
    from ..sched import BudgetExceeded

    return BudgetExceeded(
        r["need_bytes"], r["budget_bytes"], r["predicted_now"]["where"],
        detail=f"an adapt call over {r['n_windows']} windows would be refused before any work; adapt on fewer "
               "windows, or re-export with a --memory-budget of at least that")


def _phase_lines(peak: dict) -> list[str]:
    phases = peak.get("phases_bytes", {})
    width = max((len(k) for k in phases), default=0)
    return [f"  {name:<{width}}  {format_bytes(v):>11}" + ("   <- peak" if v == peak["peak_bytes"] else "")
            for name, v in phases.items()]


def format_report(r: dict[str, Any], measured: dict[str, Any] | None = None) -> str:
    """The human-readable form of :func:`plan_report` (and of :func:`measure_adapt`'s figures)."""
    out = [f"bundle       {r['bundle']}  ({r['graph']}, {r['n_ops']} ops)"]
    pct = 100.0 * r["trainable_numel"] / max(1, r["total_numel"])
    out.append(f"trains       {r['trainable_numel']:,} of {r['total_numel']:,} elements ({pct:.2f}%), "
               f"optimizer {r['optimizer']}")
    for t in r["trains"]:
        what = f"{t['mode']}" + (f" ({t['channels']} channels)" if t["channels"] else "")
        n = f"{t['trainable_numel']:,}" if t["trainable_numel"] is not None else "?"
        out.append(f"  {t['name']:<40} {what:<22} {n:>10}")
    c = r["cut"]
    if c is None:
        out.append("cut          none: the first op trains (no frozen prefix)")
    else:
        how = (f"prefix runs once per adapt call as inference ({c['prefix_model']}); feature cache "
               f"{format_bytes(c['feature_cache_bytes'])}" if r["cache_features"] else
               "prefix runs inside every training step (features not cached)")
        out.append(f"cut          after op {c['index']} {c['op']!r} ({c['module'] or 'root'}), "
                   f"{format_bytes(c['features_bytes_per_window'])}/window; {how}")
    out.append(f"batch        {r['batch_windows']} windows per step, micro-batches of {r['micro_batch_windows']}; "
               f"planned for {r['n_windows']} adaptation windows")
    rec = r["recompute"]
    out.append(f"activations  recompute {len(rec)}" + (f" ({', '.join(rec[:6])}{', ...' if len(rec) > 6 else ''})"
                                                       if rec else "") + ", keep the rest")
    budget = "none" if r["budget_bytes"] is None else format_bytes(r["budget_bytes"])
    peak = r["predicted_now"] or r["predicted"]
    if peak is None:
        out.append(f"budget       {budget}; no prediction recorded")
    else:
        out.append(f"budget       {budget}; predicted peak of a whole adapt call {format_bytes(peak['peak_bytes'])} "
                   f"at {peak['where']} (the bound the budget is checked against)")
        if r.get("expected_bytes"):
            per = ", ".join(f"{format_bytes(v)} on {e}" for e, v in r["expected_bytes"].items())
            out.append(f"expected     {per} (point estimate of the same peak per engine; a process may "
                       "measure more or less)")
        if r.get("replanned"):
            out.append(f"             over the budget with the plan's micro-batch: chosen again for "
                       f"{r['n_windows']} windows, as adapt does")
        if r.get("within_budget") is False:
            out.append(f"OVER BUDGET  an adapt call over {r['n_windows']} windows needs at least "
                       f"{format_bytes(r['need_bytes'])}, {format_bytes(r['need_bytes'] - r['budget_bytes'])} over "
                       f"the budget: it would be refused; adapt on fewer windows or re-export with a larger budget")
        out.append("predicted peak per phase (everything alive at that point):")
        out.extend(_phase_lines(peak))
    if measured is not None:
        out.append(f"measured     adapt over {measured['n_windows']} windows, 1 epoch, "
                   f"batch {measured['batch_windows']}, "
                   f"{measured['steps']} steps, fresh torch-free process as a user has it (edgeadapt.measure), "
                   f"device {measured['device']}")
        pred = peak["peak_bytes"] if peak else None
        expected = (r.get("expected_bytes") or {}).get(measured.get("backend"))
        for label, key in (("total (VmHWM delta)", "call_peak_bytes"), ("anonymous (RssAnon)", "call_peak_anon_bytes")):
            v = measured[key]
            ratio = (f"  ({v / pred:.2f}x predicted" + (f", {v / expected:.2f}x expected" if expected else "") + ")"
                     if pred else "")
            out.append(f"  {label:<22} {format_bytes(v):>11}{ratio}")
        out.append(f"  {'predicted':<22} {format_bytes(pred) if pred else '-':>11}")
        if expected:
            out.append(f"  {'expected':<22} {format_bytes(expected):>11}")
    return "\n".join(out)


# ---- measuring ------------------------------------------------------------------------------
def measure_adapt(bundle_dir: str | os.PathLike, *, n_windows: int | None = None, batch_windows: int | None = None,
                  device: str = "cpu", threads: int | None = 1, seed: int = 0,
                  timeout_s: float = 600) -> dict[str, Any]:
    """One adapt call of the planned size (one epoch) measured by the project's measuring
    protocol (:mod:`edgeadapt.measure`): a fresh torch-free process as a user has it (bundle
    loaded, progress bar on, nothing warmed up; freed heap returned to the OS before the
    baseline, so the figure is what the call itself allocates, the bound a budget holds), the
    whole call's peaks over the process just before it: ``call_peak_bytes`` (VmHWM) and
    ``call_peak_anon_bytes`` (sampled RssAnon, a lower bound), plus ``timeline`` rows
    ``[seconds, VmRSS - baseline, RssAnon - baseline]``.

    Raises:
        RuntimeError: the job failed; the message carries its stderr.
    """
    from ..measure import MeasureSpec, measure_in_fresh_process

    _, plan, _ = _load(bundle_dir)
    spec = MeasureSpec(bundle=os.fspath(bundle_dir), n_windows=n_windows or plan.n_windows,
                       batch_windows=batch_windows or plan.batch_windows, device=device, threads=threads,
                       seed=seed, trim_heap=True, timeline=True)
    return measure_in_fresh_process(spec, timeout_s=timeout_s)


# ---- the label-free call ------------------------------------------------------------------------
def label_free_report(bundle_dir: str | os.PathLike, *, n_windows: int | None = None) -> dict[str, Any]:
    """How ``Runner.adapt_unlabeled`` (the recommended settings) runs on ``n_windows`` windows
    (default: the plan's) under the bundle's budget: :meth:`UnlabeledAdapter.plan
    <edgeadapt.runtime.unlabeled.UnlabeledAdapter.plan>` of the engine that would run it.

    Raises:
        BudgetExceeded: not even the smallest passes fit the budget (what the call would raise).
    """
    from ..runtime import Runner
    from ..runtime.unlabeled import UnlabeledAdapter, UnlabeledSettings, held_back_windows

    _, plan, _ = _load(bundle_dir)
    n = n_windows or plan.n_windows
    settings = UnlabeledSettings()
    runner = Runner.load(bundle_dir, device="cpu", threads=1)
    return {"bundle": str(bundle_dir), "engine": runner.backend, "n_windows": n,
            **UnlabeledAdapter(runner, settings, gate_rows=held_back_windows(settings, n)).plan(n)}


def format_label_free(r: dict[str, Any], measured: dict[str, Any] | None = None) -> str:
    """The human-readable form of :func:`label_free_report` (and of its measurement)."""
    budget = "none" if r["budget_bytes"] is None else format_bytes(r["budget_bytes"])
    held_back = (f"{r['gate_windows']} held back for the gate at a time, every window once" if r.get("cross_fit")
                 else f"{r['gate_windows']} held back for the gate")
    out = [f"label-free   adapt_unlabeled over {r['n_windows']} windows ({held_back}), engine {r['engine']}, "
           f"budget {budget}",
           f"  stages     {', '.join(r['stages']) or 'none'}",
           *(f"  skipped    {s}" for s in r["skipped"]),
           f"  passes     {r['pass_windows']} windows per inference pass"
           + (f", {r['stats_windows']} per statistics pass" if r["stats_windows"] else "")
           + (f", {r['entropy_step_windows']} per entropy step" if r["entropy_step_windows"] else ""),
           f"  held       {format_bytes(r['held_bytes'])} (source copies, sums, the gate's windows)"]
    peak = r["predicted"]
    if peak is not None:
        out.append(f"  predicted  {format_bytes(peak['peak_bytes'])} at {peak['where']} (the bound a budget is "
                   "checked against)")
        out.extend(_phase_lines(peak))
    if measured is not None:
        out.append("  measured   fresh torch-free process as a user has it (edgeadapt.measure)")
        for label, key in (("total (VmHWM delta)", "call_peak_bytes"), ("anonymous (RssAnon)", "call_peak_anon_bytes")):
            v = measured[key]
            ratio = f"  ({v / peak['peak_bytes']:.2f}x predicted)" if peak else ""
            out.append(f"    {label:<22} {format_bytes(v):>11}{ratio}")
    return "\n".join(out)


def measure_label_free(bundle_dir: str | os.PathLike, *, n_windows: int, device: str = "cpu",
                       threads: int | None = 1, timeout_s: float = 600) -> dict[str, Any]:
    """One ``adapt_unlabeled`` call (recommended settings) on ``n_windows`` seeded synthetic
    windows, measured as :func:`measure_adapt` measures ``adapt``."""
    from ..measure import MeasureSpec, measure_in_fresh_process

    spec = MeasureSpec(bundle=os.fspath(bundle_dir), n_windows=n_windows, device=device, threads=threads,
                       trim_heap=True, timeline=True, method="unlabeled")
    return measure_in_fresh_process(spec, timeout_s=timeout_s)


# ---- the timeline picture ----------------------------------------------------------------------
def draw_timeline(report: dict[str, Any], measured: dict[str, Any] | None, path: str | os.PathLike) -> Path:
    """Draw the predicted peak per phase and (if given) the measured timeline to a PNG.

    Raises:
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--png needs matplotlib, which this install lacks: pip install matplotlib "
                          "(or drop --png)") from None
    from ..atomic import atomic_path

    peak = report["predicted_now"] or report["predicted"]
    kib = 1024.0
    fig, axes = plt.subplots(1, 2 if measured else 1, figsize=(11 if measured else 6, 4), squeeze=False)
    ax = axes[0][0]
    events = report.get("predicted_timeline")
    if events:
        values = [e[2] / kib for e in events]
        ax.step(range(len(values) + 1), values + values[-1:], where="post", color="tab:blue", label="predicted")
        starts = [i for i, e in enumerate(events) if i == 0 or events[i - 1][0] != e[0]]
        ax.set_xticks([i + 0.5 for i in starts], [events[i][0] for i in starts], rotation=30)
        ax.set_xlabel("simulated events of one adapt call")
    elif peak:
        names = list(peak["phases_bytes"])
        values = [peak["phases_bytes"][n] / kib for n in names]
        ax.step(range(len(names) + 1), values + values[-1:], where="post", color="tab:blue", label="predicted")
        ax.set_xticks([i + 0.5 for i in range(len(names))], names, rotation=30)
    if report["budget_bytes"]:
        ax.axhline(report["budget_bytes"] / kib, color="tab:red", ls="--", label="budget")
    ax.set_ylabel("KiB above the loaded runner")
    ax.set_title("predicted, per phase of one adapt call")
    ax.legend(loc="lower right")
    if measured:
        ax2 = axes[0][1]
        rows = measured["timeline"]
        t = [r[0] for r in rows]
        ax2.plot(t, [r[1] / kib for r in rows], color="tab:gray", label="measured total (VmRSS)")
        ax2.plot(t, [r[2] / kib for r in rows], color="tab:green", label="measured anonymous (RssAnon)")
        if peak:
            ax2.axhline(peak["peak_bytes"] / kib, color="tab:blue", ls=":", label="predicted peak")
        if report["budget_bytes"]:
            ax2.axhline(report["budget_bytes"] / kib, color="tab:red", ls="--", label="budget")
        ax2.set_xlabel("seconds into the adapt call")
        ax2.set_title(f"measured: {measured['n_windows']} windows, batch {measured['batch_windows']}")
        ax2.legend(loc="lower right", fontsize=8)
        top = max([ax.get_ylim()[1], *(max(r[1], r[2]) / kib for r in rows)]) * 1.05
        for a in (ax, ax2):
            a.set_ylim(min(0.0, *(min(r[1], r[2]) / kib for r in rows)), top)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


# ---- command line -------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    """``edgeadapt plan``: print the plan; optionally measure and draw."""
    if args.unlabeled:
        return _plan_label_free(args)
    report = plan_report(args.bundle, n_windows=args.n_windows, batch_windows=args.batch_windows)
    measured = None
    if report["within_budget"] is False:  # the report, then the error (exit 2) an adapt call would give
        print(json.dumps({**report, "measured": None}, indent=2) if args.json else format_report(report))
        raise over_budget_error(report)
    if args.measure:
        measured = measure_adapt(args.bundle, n_windows=args.n_windows, batch_windows=args.batch_windows,
                                 device=args.device, threads=args.threads)
    if args.json:
        print(json.dumps({**report, "measured": measured}, indent=2))
    else:
        print(format_report(report, measured))
    if args.png:
        try:
            path = draw_timeline(report, measured, args.png)
        except ImportError as e:
            raise RuntimeError(str(e)) from None  # one clear line from the CLI
        if not args.json:
            print(f"wrote {path}")
    return 0


def _plan_label_free(args: argparse.Namespace) -> int:
    if args.png or args.batch_windows:
        raise ValueError("--unlabeled plans the label-free call: --png and --batch-windows apply to adapt only")
    report = label_free_report(args.bundle, n_windows=args.n_windows)
    measured = None
    if args.measure:
        measured = measure_label_free(args.bundle, n_windows=report["n_windows"], device=args.device,
                                      threads=args.threads)
    print(json.dumps({**report, "measured": measured}, indent=2) if args.json else format_label_free(report, measured))
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``edgeadapt plan`` on the CLI's subparsers."""
    p = sub.add_parser("plan", help="the bundle's memory plan: what trains, cut, micro-batch, predicted peak",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("bundle")
    p.add_argument("--measure", action="store_true",
                   help="run an adapt call of the planned size in a fresh torch-free process and print "
                        "measured peaks (total and anonymous) next to the prediction")
    p.add_argument("--png", metavar="PATH", help="draw the predicted and measured memory timeline (needs matplotlib)")
    p.add_argument("--n-windows", type=int, default=None,
                   help="adaptation windows to predict (and --measure) for (default: the plan's)")
    p.add_argument("--batch-windows", type=int, default=None,
                   help="windows per step to predict (and --measure) for (default: the plan's)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="cpu", help="device for --measure")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads for --measure (default 1)")
    p.add_argument("--unlabeled", action="store_true",
                   help="the label-free call instead (adapt_unlabeled, recommended settings): stages, windows per "
                        "pass within the budget, predicted peak (and, with --measure, measured)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)
    return p
