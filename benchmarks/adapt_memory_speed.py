"""Memory and speed of one adaptation step: the torch-free runner vs torch eager, side by side.

What it measures, all in one invocation on the same reference CNN (``build_model("cnn")``,
8 input channels x 1024 time steps, 6 classes, ~103k parameters; the input shape of the
measurements in docs/ort_notes.md), batch 32, cross-entropy, AdamW (lr 1e-3, weight decay 0.01),
N CPU threads:

1. Resident memory after import, each in a fresh interpreter: the bare interpreter, the runner
   (``import edgeadapt.runtime``) with torch blocked by a ``sys.meta_path`` finder (a device
   without torch), the runner with torch importable, ``import torch``, and
   ``import torch, edgeadapt.export`` (the exporting side).
2. For each update policy (full / last layer / channel subset), the peak memory of an
   adaptation step as docs/design.md ("Measuring") defines it, twice: *total* (VmHWM, file-backed
   library code included) and *anonymous only* (RssAnon high-water mark, sampled about every
   millisecond by ``edgeadapt.memory.AnonPeakSampler``: what the step allocates, without code
   pages). A fresh process imports its engine (RSS read: *imported*), loads the model and the
   batch (RSS read: the *loaded baseline*; loaded - imported = what the engine allocated before
   the baseline), resets its high-water mark (``/proc/self/clear_refs``), runs one step and reads
   VmHWM and the sampled RssAnon peak; each figure is its peak - baseline. The same process then
   runs warm-up steps and measures a *steady* step the same way (delta still over the loaded
   baseline), then times ``--steps`` steps.
   Runner: ``Runner.load(bundle, device="cpu", threads=N)`` in a torch-blocked process.
   Torch eager: the same weights in eval mode (BatchNorm on running statistics, as the bundle's
   frozen BatchNorm), ``requires_grad`` only on the parameters the policy trains,
   ``torch.optim.AdamW`` with the bundle's hyper-parameters, ``torch.set_num_threads(N)``.
   For the channel-subset policy torch trains the *whole* weight tensors with a gradient mask
   (a hook zeroing the frozen output channels): its gradients and AdamW state cover the whole
   tensors, and weight decay still moves the frozen channels; the runner's bundle splits the
   tensors so that only the trained slice has gradients and optimizer state.
3. Steps per second: 1 / median step time over at least ``--steps`` steps and
   ``--min-time-s`` seconds after warm-up, in the same process, and the ratio runner / torch
   (quote the ratio, not the absolute speed: the machines are shared).

What each side allocates where: the runner opens its training session (ORT's gradient buffers
and AdamW state) inside the first step, torch allocates AdamW state in its first step and
gradients in every step; both load their parameters before the baseline ("before baseline"
columns). ONNX Runtime's CPU arena keeps the step's memory after the step (see "retained" in the
detail table); torch's first backward pages in tens of MB of library code, which counts in the
total but not in the anonymous figure.

Each engine and policy runs ``--repeats`` times in fresh processes, interleaved runner / torch,
so a burst of load from other tenants hits both sides. Memory figures are the median over the
rounds. Each worker also measures the share of the CPUs that *other* processes took while it
timed (from /proc/stat); speed figures are the median over rounds in which that share stayed
under 10%, and a policy without such a round for an engine gets up to ``--extra-rounds`` more
rounds; a figure with no clean round at all is printed but flagged "contended". All rounds are
kept in the JSON.

Every measurement runs in its own fresh subprocess (this script's ``--worker`` mode). Bundles
and the shared initial weights go to a temporary directory. Results: a Markdown table on stdout
and JSON at ``--out``. MB here means 2**20 bytes.

Usage::

    .venv/bin/python benchmarks/adapt_memory_speed.py            # defaults: 32 x 8 x 1024, 2 threads
    .venv/bin/python benchmarks/adapt_memory_speed.py --steps 20 --time-steps 256
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from edgeadapt.versions import cpu_jiffies, host_info  # noqa: E402  (stdlib only: safe before the torch blocker)

log = logging.getLogger("adapt_memory_speed")

MB = 2**20
N_CHANNELS, N_CLASSES, MODEL = 8, 6, "cnn"
# A round in which other processes used this share of the CPUs or more does not count for speed.
CONTENDED_SHARE = 0.10

# RssAnon is sampled this often while a measured step runs.
ANON_INTERVAL_S = 0.001

IMPORT_CASES = {
    # name: (block torch, statement)
    "bare interpreter": (False, "pass"),
    "edgeadapt.runtime, torch blocked": (True, "import edgeadapt.runtime"),
    "edgeadapt.runtime, torch importable": (False, "import edgeadapt.runtime"),
    "torch": (False, "import torch"),
    "torch + edgeadapt.export": (False, "import torch, edgeadapt.export"),
}

POLICY_LABELS = {
    "full": "full",
    "last_layer": "last layer (head)",
    "channels": "channel subset (head + 25% out-ch of blocks.2/3.conv)",
}


# ---------------------------------------------------------------------------------------------
# Worker side: stdlib + numpy only at module level, torch or the runner imported on demand.
# ---------------------------------------------------------------------------------------------


def _status_bytes() -> dict[str, int]:
    """VmRSS, VmHWM and RssAnon of this process, in bytes (edgeadapt.memory)."""
    from edgeadapt.memory import status_fields

    return status_fields("VmRSS", "VmHWM", "RssAnon")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS; True if the reset took effect."""
    from edgeadapt.memory import reset_peak_rss

    if not reset_peak_rss():
        return False
    s = _status_bytes()
    # Right after the reset the high-water mark equals the RSS, give or take a few pages.
    return s["VmHWM"] - s["VmRSS"] < 256 * 1024


def _measured_step(step, x, y) -> tuple[float, dict[str, int], int]:
    """Run ``step`` once with VmHWM reset before it and RssAnon sampled during it.

    Returns (loss, status after the step, sampled RssAnon peak).
    """
    from edgeadapt.memory import AnonPeakSampler

    with AnonPeakSampler(ANON_INTERVAL_S) as sampler:
        loss = step(x, y)
    return loss, _status_bytes(), sampler.peak_bytes


def _worker_import(spec: dict) -> dict:
    exec(spec["statement"], {})
    s = _status_bytes()
    return {"rss_bytes": s["VmRSS"], "hwm_bytes": s["VmHWM"], "torch_imported": "torch" in sys.modules}


def _runner_step_fn(spec: dict):
    from edgeadapt.runtime import Runner

    runner = Runner.load(spec["bundle"], device="cpu", threads=spec["threads"])
    return runner.train_step


def _torch_step_fn(spec: dict):
    import numpy as np
    import torch

    from edgeadapt.bundle import read_manifest
    from edgeadapt.models import build_model

    torch.set_num_threads(spec["threads"])
    manifest = read_manifest(spec["bundle"], verify=False)
    masks = np.load(Path(spec["bundle"]) / manifest.files["masks"])
    model = build_model(MODEL, N_CHANNELS, N_CLASSES, spec["time_steps"])
    model.load_state_dict(torch.load(spec["state_dict"], weights_only=True))
    model.eval()  # BatchNorm on running statistics, like the bundle's frozen BatchNorm
    params = dict(model.named_parameters())
    trained = []
    for e in manifest.parameters:
        p = params[e.name]
        p.requires_grad_(e.trainable_numel > 0)
        if not e.trainable_numel:
            continue
        trained.append(p)
        if e.mode == "channels":
            mask = torch.from_numpy(masks[e.name]).to(p.dtype).reshape(-1, *([1] * (p.dim() - 1)))
            p.register_hook(lambda g, m=mask: g * m)
    o = manifest.optimizer
    opt = torch.optim.AdamW(trained, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"],
                            weight_decay=o["weight_decay"])
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y, lr=None):
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        loss = loss_fn(model(xt), yt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)  # gradients do not outlive the step
        return float(loss)

    step.grad_numel = sum(p.numel() for p in trained)
    return step


def _worker_step(spec: dict) -> dict:
    import gc

    import numpy as np

    if spec["engine"] == "runner":  # imports first: "imported" excludes them from the engine's load
        import edgeadapt.runtime  # noqa: F401
    else:
        import edgeadapt.bundle  # noqa: F401
        import edgeadapt.models  # noqa: F401
        import torch  # noqa: F401
    rng = np.random.default_rng(spec["seed"])
    x = rng.standard_normal((spec["batch_size"], N_CHANNELS, spec["time_steps"]), dtype=np.float32)
    y = rng.integers(0, N_CLASSES, spec["batch_size"]).astype(np.int64)
    gc.collect()
    imported = _status_bytes()
    step = _runner_step_fn(spec) if spec["engine"] == "runner" else _torch_step_fn(spec)
    from edgeadapt.memory import trim_heap

    trim_heap()  # the measuring protocol (docs/design.md, "Measuring"): freed heap back before the baseline

    clear_refs_ok = _reset_peak()
    base = _status_bytes()
    loaded = base["VmRSS"]
    first_loss, after_first, first_anon = _measured_step(step, x, y)
    for _ in range(spec["warmup"] - 1):
        step(x, y)
    before_steady = _status_bytes()
    clear_refs_ok &= _reset_peak()
    rss_before_steady = _status_bytes()["VmRSS"]
    _, after_steady, steady_anon = _measured_step(step, x, y)
    times: list[float] = []
    busy0, own0 = cpu_jiffies()
    t_loop = time.perf_counter()
    while len(times) < spec["steps"] or sum(times) < spec["min_time_s"]:
        t0 = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
        if len(times) == spec["steps"]:
            fixed_loss = loss  # same step count for both engines, comparable across them
    wall_s = time.perf_counter() - t_loop
    busy1, own1 = cpu_jiffies()
    # CPU that other processes took while we timed, as a share of all CPUs: > ~0.1 means the
    # machine was not ours and the step times are inflated (OpenMP spin-waits make torch suffer
    # most: 2 threads on 2 busy cores can run 10-30x slower).
    foreign_cpu_share = max(0.0, (busy1 - busy0) - (own1 - own0)) / os.sysconf("SC_CLK_TCK") / (wall_s * os.cpu_count())
    end = _status_bytes()
    run_hwm = max(after_first["VmHWM"], before_steady["VmHWM"], end["VmHWM"])
    median_s = statistics.median(times)
    return {
        "engine": spec["engine"],
        "clear_refs_ok": clear_refs_ok,
        "torch_imported": "torch" in sys.modules,
        "imported_rss_bytes": imported["VmRSS"],
        "loaded_rss_bytes": loaded,
        "loaded_anon_bytes": base["RssAnon"],
        "before_baseline_bytes": loaded - imported["VmRSS"],
        "before_baseline_anon_bytes": base["RssAnon"] - imported["RssAnon"],
        "first_step_peak_bytes": after_first["VmHWM"] - loaded,
        "first_step_anon_peak_bytes": first_anon - base["RssAnon"],
        "steady_step_peak_bytes": after_steady["VmHWM"] - loaded,
        "steady_step_anon_peak_bytes": steady_anon - base["RssAnon"],
        "steady_step_transient_bytes": after_steady["VmHWM"] - rss_before_steady,
        "run_peak_bytes": run_hwm - loaded,
        "retained_after_run_bytes": end["VmRSS"] - loaded,
        "first_loss": first_loss,
        "last_loss": loss,
        "fixed_step_loss": fixed_loss,
        "fixed_step": spec["warmup"] + 1 + spec["steps"],
        "total_steps": spec["warmup"] + 1 + len(times),
        "step_times_s": times,
        "median_step_s": median_s,
        "steps_per_s": 1.0 / median_s,
        "foreign_cpu_share": foreign_cpu_share,
        "grad_numel": getattr(step, "grad_numel", None),
    }


def worker_main(spec: dict) -> None:
    if spec.get("block_torch"):
        from edgeadapt.harness.isolation import forbid_torch

        forbid_torch()
    result = _worker_import(spec) if spec["kind"] == "import" else _worker_step(spec)
    print("RESULT " + json.dumps(result))


# ---------------------------------------------------------------------------------------------
# Parent side: export bundles (needs torch), launch workers, print and save.
# ---------------------------------------------------------------------------------------------


def run_worker(spec: dict, timeout_s: float = 300) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, os.fspath(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {spec} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def make_policies():
    from edgeadapt.export import Rule, UpdatePolicy

    return {
        "full": UpdatePolicy.full(),
        "last_layer": UpdatePolicy.last_layer("head"),
        # BatchNorm of blocks 2/3 stays frozen: no rule matches blocks.*.bn, the default is frozen.
        "channels": UpdatePolicy(rules=(Rule("head", "full"),
                                        Rule("blocks.2.conv", "channels", ratio=0.25),
                                        Rule("blocks.3.conv", "channels", ratio=0.25))),
    }


def export_all(args, tmp: Path) -> tuple[dict, Path, int]:
    import torch

    from edgeadapt.export import OptimizerConfig, export_bundle
    from edgeadapt.harness.pretrained_like import as_if_pretrained
    from edgeadapt.models import build_model, count_parameters

    torch.manual_seed(0)
    model = as_if_pretrained(build_model(MODEL, N_CHANNELS, N_CLASSES, args.time_steps))
    state_path = tmp / "model_state.pt"
    torch.save(model.state_dict(), state_path)
    example = torch.randn(args.batch_size, N_CHANNELS, args.time_steps)
    bundles = {}
    for name, policy in make_policies().items():
        manifest = export_bundle(model, example, tmp / f"bundle-{name}", policy=policy, loss="cross_entropy",
                                 optimizer=OptimizerConfig("adamw", lr=1e-3, weight_decay=0.01))
        bundles[name] = {"dir": tmp / f"bundle-{name}", "trainable_numel": manifest.trainable_numel,
                         "policy": policy.to_dict()}
        log.info("exported %s: %d of %d elements train", name, manifest.trainable_numel, manifest.total_numel)
    return bundles, state_path, count_parameters(model)


def mb(b: float) -> str:
    return f"{b / MB:.1f}"


def summarise(rounds: list[dict]) -> dict:
    """One engine and policy over the repeated rounds.

    Memory: the median over all rounds (each a fresh process; memory does not depend on load).
    Speed: the median over the *clean* rounds, those in which other processes took less than
    ``CONTENDED_SHARE`` of the CPUs; if no round was clean, over all rounds, flagged
    ``contended``. Losses: round 1.
    """
    first = rounds[0]
    out = {k: first[k] for k in ("engine", "grad_numel", "first_loss", "fixed_step_loss", "fixed_step")}
    out["clear_refs_ok"] = all(r["clear_refs_ok"] for r in rounds)
    out["torch_imported"] = any(r["torch_imported"] for r in rounds)
    for k in first:
        if k.endswith("_bytes"):
            out[k] = int(statistics.median(r[k] for r in rounds))
    clean = [r for r in rounds if r["foreign_cpu_share"] < CONTENDED_SHARE]
    out["contended"] = not clean
    out["clean_rounds"] = len(clean)
    out["steps_per_s"] = statistics.median(r["steps_per_s"] for r in (clean or rounds))
    out["rounds"] = rounds
    return out


def report(res: dict) -> str:
    cfg = res["config"]
    out = [
        f"Reference CNN ({cfg['model']}, {cfg['total_numel']} parameters), batch {cfg['batch_size']} x "
        f"{cfg['n_channels']} ch x {cfg['time_steps']} steps, cross-entropy, AdamW, {cfg['threads']} threads; "
        f">= {cfg['repeats']} interleaved fresh-process rounds per engine and policy: memory = median over rounds, "
        f"steps/s = median over uncontended rounds of 1 / median step time (>= {cfg['steps']} steps and "
        f">= {cfg['min_time_s']:g} s after {cfg['warmup']} warm-up); MB = 2**20 bytes.",
        f"Load average (1 min) {res['host']['loadavg_at_start'][0]:.2f} at start, "
        f"{res['host']['loadavg_at_end'][0]:.2f} at end, on {res['host']['cpu_count']} CPUs"
        + (" -- the machine was busy before this run; steps/s are unreliable, rerun when idle"
           if res["host"]["loadavg_at_start"][0] > 0.5 * (res["host"]["cpu_count"] or 1) else "") + ".",
        "",
        "RSS after import (fresh interpreter each):",
    ]
    for name, r in res["imports"].items():
        note = " (torch got imported)" if r["torch_imported"] and "torch" not in name.split(",")[0] else ""
        out.append(f"  {name:38s} {mb(r['rss_bytes']):>7s} MB{note}")
    out += [
        "",
        "Peak memory of one adaptation step over the same fresh process with model and batch loaded, no step "
        "run: total = VmHWM - VmRSS (file-backed library code included), anon = sampled RssAnon peak - RssAnon "
        "(what the step allocated). First step: includes the runner's training-session opening (ORT gradient "
        "buffers + AdamW state) and torch's AdamW state creation and first-use code pages:",
        "",
        "| policy | trained elements | runner first step MB total / anon | torch first step MB total / anon "
        "| runner steady step total / anon | torch steady step total / anon | runner steps/s | torch steps/s "
        "| speed ratio (runner/torch) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in res["policies"].items():
        r, t = p["runner"], p["torch"]
        elems = f"{p['trainable_numel']}"
        if t["grad_numel"] != p["trainable_numel"]:
            elems += f" (torch: {t['grad_numel']} masked)"
        flag = " (contended!)" if r["contended"] or t["contended"] else ""
        out.append(f"| {POLICY_LABELS[name]} | {elems} | {mb(r['first_step_peak_bytes'])} / "
                   f"{mb(r['first_step_anon_peak_bytes'])} | {mb(t['first_step_peak_bytes'])} / "
                   f"{mb(t['first_step_anon_peak_bytes'])} | {mb(r['steady_step_peak_bytes'])} / "
                   f"{mb(r['steady_step_anon_peak_bytes'])} | {mb(t['steady_step_peak_bytes'])} / "
                   f"{mb(t['steady_step_anon_peak_bytes'])} | {r['steps_per_s']:.1f} | {t['steps_per_s']:.1f} | "
                   f"{r['steps_per_s'] / t['steps_per_s']:.2f}{flag} |")
    out += [
        "",
        "Allocated before the baseline (loading the model after the engine's imports; MB total / anon), and the "
        "loaded RSS:",
        "",
        "| policy | runner before baseline | torch before baseline | runner loaded RSS | torch loaded RSS |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, p in res["policies"].items():
        r, t = p["runner"], p["torch"]
        out.append(f"| {name} | {mb(r['before_baseline_bytes'])} / {mb(r['before_baseline_anon_bytes'])} | "
                   f"{mb(t['before_baseline_bytes'])} / {mb(t['before_baseline_anon_bytes'])} | "
                   f"{mb(r['loaded_rss_bytes'])} | {mb(t['loaded_rss_bytes'])} |")
    out += [
        "",
        "Detail (MB; deltas over the loaded baseline unless noted):",
        "",
        "| policy | engine | loaded RSS | first step | steady step | steady transient* | whole run | retained | "
        "loss at step 1 | loss at step K |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in res["policies"].items():
        for eng in ("runner", "torch"):
            r = p[eng]
            out.append(f"| {name} | {eng} | {mb(r['loaded_rss_bytes'])} | {mb(r['first_step_peak_bytes'])} | "
                       f"{mb(r['steady_step_peak_bytes'])} | {mb(r['steady_step_transient_bytes'])} | "
                       f"{mb(r['run_peak_bytes'])} | {mb(r['retained_after_run_bytes'])} | "
                       f"{r['first_loss']:.5f} | {r['fixed_step_loss']:.5f} |")
    out.append("* steady transient: VmHWM of the steady step over the RSS just before it (memory the "
               "allocator already holds is not counted).")
    k = next(iter(res["policies"].values()))["runner"]["fixed_step"]
    out.append(f"K = {k} (warm-up + steady + --steps timed steps, same batch each step; round 1).")
    ok = all(p[e]["clear_refs_ok"] for p in res["policies"].values() for e in ("runner", "torch"))
    leaked = [n for n, p in res["policies"].items() if p["runner"]["torch_imported"]]
    out.append(f"clear_refs peak reset worked in every worker: {ok}; torch imported by a runner worker: "
               f"{leaked or 'no'}")
    out.append(f"steps/s per round (share of the CPUs other processes took; rounds >= {CONTENDED_SHARE:g} "
               "are left out of the speed figures when a clean round exists):")
    for n, p in res["policies"].items():
        cells = [f"{e} " + ", ".join(f"{r['steps_per_s']:.1f} ({r['foreign_cpu_share']:.2f})" for r in p[e]["rounds"])
                 for e in ("runner", "torch")]
        out.append(f"  {n:10s} " + " | ".join(cells))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="timed steps per engine and policy (default 30)")
    ap.add_argument("--min-time-s", type=float, default=1.0,
                    help="keep timing past --steps until this many seconds of steps (default 1.0)")
    ap.add_argument("--warmup", type=int, default=3, help="steps before the steady/timed ones, >= 1 (default 3)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="fresh-process rounds per engine and policy, interleaved (default 3)")
    ap.add_argument("--extra-rounds", type=int, default=3,
                    help="more rounds, at most, for policies whose speed had no uncontended round (default 3)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--time-steps", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for ORT and torch (default 2)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "adapt_memory_speed.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(json.loads(args.worker))
        return 0
    if min(args.steps, args.warmup, args.repeats) < 1 or args.extra_rounds < 0:
        ap.error("--steps, --warmup and --repeats must be >= 1, --extra-rounds >= 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    t_start = time.perf_counter()
    load_start = list(os.getloadavg())

    imports = {}
    for name, (block, stmt) in IMPORT_CASES.items():
        imports[name] = run_worker({"kind": "import", "block_torch": block, "statement": stmt})
        log.info("import %-38s RSS %s MB", name, mb(imports[name]["rss_bytes"]))

    policies: dict = {}
    with tempfile.TemporaryDirectory(prefix="adapt_memory_speed-") as tmp:
        bundles, state_path, total_numel = export_all(args, Path(tmp))
        rounds: dict = {name: {"runner": [], "torch": []} for name in bundles}

        def run_round(rnd: int, names) -> None:
            for name in names:
                for engine in ("runner", "torch"):
                    spec = {"kind": "step", "engine": engine, "block_torch": engine == "runner",
                            "bundle": os.fspath(bundles[name]["dir"]), "state_dict": os.fspath(state_path),
                            "batch_size": args.batch_size, "time_steps": args.time_steps,
                            "threads": args.threads, "warmup": args.warmup, "steps": args.steps,
                            "min_time_s": args.min_time_s, "seed": 0}
                    r = run_worker(spec)
                    rounds[name][engine].append(r)
                    log.info("round %d %-10s %-6s first-step peak %s MB, %.1f steps/s, others took %.0f%% CPU",
                             rnd, name, engine, mb(r["first_step_peak_bytes"]), r["steps_per_s"],
                             100 * r["foreign_cpu_share"])

        def lacks_clean(name: str) -> bool:
            return any(all(r["foreign_cpu_share"] >= CONTENDED_SHARE for r in rounds[name][e])
                       for e in ("runner", "torch"))

        # Interleaved rounds (runner, torch, runner, torch, ...): a burst of load on the shared
        # machine then hits both engines rather than one policy-engine pair. Policies left
        # without a clean round for an engine get up to --extra-rounds more.
        for rnd in range(1, args.repeats + 1):
            run_round(rnd, list(bundles))
        for rnd in range(args.repeats + 1, args.repeats + args.extra_rounds + 1):
            todo = [n for n in bundles if lacks_clean(n)]
            if not todo:
                break
            log.info("extra round %d for %s: the machine was busy", rnd, todo)
            run_round(rnd, todo)
        for name, b in bundles.items():
            policies[name] = {"trainable_numel": b["trainable_numel"], "policy": b["policy"],
                              **{e: summarise(rounds[name][e]) for e in ("runner", "torch")}}

    res = {
        "benchmark": "adapt_memory_speed",
        "config": {"model": MODEL, "n_channels": N_CHANNELS, "n_classes": N_CLASSES, "total_numel": total_numel,
                   "batch_size": args.batch_size, "time_steps": args.time_steps, "threads": args.threads,
                   "steps": args.steps, "min_time_s": args.min_time_s, "warmup": args.warmup, "repeats": args.repeats,
                   "extra_rounds": args.extra_rounds, "contended_share": CONTENDED_SHARE, "loss": "cross_entropy",
                   "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01}, "runner_device": "cpu"},
        "host": {"platform": platform.platform(), "cpu_count": os.cpu_count(), **host_info(),
                 "loadavg_at_start": load_start, "loadavg_at_end": list(os.getloadavg()),
                 "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS",
                                                    "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_")
                         if k in os.environ}},
        "command": " ".join([os.path.relpath(sys.executable, REPO) if sys.executable.startswith(os.fspath(REPO))
                             else sys.executable, *sys.argv]),
        "imports": imports,
        "policies": policies,
        "wall_s": None,
    }
    text = report(res)
    print(text)
    res["wall_s"] = time.perf_counter() - t_start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    log.info("wrote %s in %.0f s", args.out, res["wall_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
