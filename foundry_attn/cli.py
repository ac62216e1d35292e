"""``foundry-attn``: doctor, tiny assets, benchmarks, conformance, the fleet view of event logs.

foundry-attn doctor [--json] [--attn-implementation auto] [--attn-fallback flash_attention_2,sdpa,eager]
[--attn-strict] [--model-config ./build/tiny/tiny-llama]   (with a config: each candidate's path, flat or rows)
foundry-attn assets build/tiny
foundry-attn bench padding|callbacks|compile|proof|events|train|trainer|guard --json [--device cuda] [--quick]
foundry-attn bench gpu --json [--quick] [--shape llama-3.2-1b] [--jsonl out.jsonl] [--layers 30] [--rounds 10]
    [--tiers a,b] [--memory-gb 24] [--device cpu]
foundry-attn bench layouts --json [--quick] [--rounds 3] [--device cuda]
foundry-attn bench step --json [--rounds 4]
foundry-attn bench host --json [--rounds 40] [--threads 1]
foundry-attn conformance [--markdown] [--family mistral] [--zoo | --padding-free]
foundry-attn events runs/ [--fell-back | --summary] [--kind K] [--run R] [--since 2026-11-22] [--json]
foundry-attn report runs/ -o report/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from foundry_attn import guard
from foundry_attn.attention.backends import FA2
from foundry_attn.bench import BENCHES
from foundry_attn.selection.capability import Capability
from foundry_attn.selection.policy import AUTO, DEFAULT_FALLBACK, AttentionUnavailableError, Decision


def doctor(args: argparse.Namespace) -> int:
    from foundry_attn.observe.flash_symbols import discover
    from foundry_attn.selection.capability import probe
    from foundry_attn.selection.decision import decide, resolve_compute_dtype
    from foundry_attn.selection.flash_compat import preflight
    from foundry_attn.selection.policy import choose

    cap = probe()
    fallback = [f.strip() for f in args.attn_fallback.split(",") if f.strip()]
    try:
        if args.model_config:
            decision = decide(
                args.model_config, args.attn_implementation, fallback, args.attn_strict, args.attn_compute_dtype, cap
            )
        else:
            decision = choose(
                args.attn_implementation,
                fallback,
                cap,
                resolve_compute_dtype(args.attn_compute_dtype, cap),
                strict=args.attn_strict,
            )
    except (AttentionUnavailableError, ValueError, OSError) as exc:  # OSError: no config at --model-config
        print(f"foundry-attn doctor: {exc}", file=sys.stderr)
        return 2
    tried = guard.check()
    report: dict[str, Any] = {
        "chosen": decision.chosen,
        "reason": decision.reason,
        "candidates": [
            {"name": c.name, "available": c.available, "reason": c.reason, "check": c.check, "warning": c.warning}
            for c in decision.candidates
        ],
        "environment": cap.as_dict(),
        "flash_kernel": flash_kernel(cap, decision),
        "flash_attn_import": {**tried.as_dict(), "reason": tried.reason, "fix": tried.fix, "run": tried.run},
        "preflight": [dataclasses.asdict(p) for p in preflight(cap)],
        "flash_symbols": {k: v for k, v in discover().as_dict().items() if k in ("found", "missing", "error")},
    }
    if args.model_config:
        candidate_paths(args.model_config, report["candidates"], cap)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    env = report["environment"]
    print(f"device: {env['device_name']} ({env['sm']}) on {env['host']}")
    installed = env["flash_attn_installed"]
    flash = env["flash_attn_version"] or (f"{installed} (does not import)" if installed else "not installed")
    print(
        f"torch {env['torch_version']}, transformers {env['transformers_version']}, flash-attn {flash}, "
        f"transformer-engine {env['transformer_engine_version'] or 'not installed'}"
    )
    print(f"flash_attention_2 would run: {report['flash_kernel']}")
    if not tried.imported and tried.installed:
        print(f"  {tried.run}")
    for problem in report["preflight"]:
        print(f"preflight: {problem['check']}: {problem['reason']} (fix: {problem['fix']})")
    found = ", ".join(f"{role}={name}" for role, name in report["flash_symbols"]["found"].items())
    print(f"transformers' flash helpers (upad_tracer): {found or 'none'}")
    for c in report["candidates"]:
        print(f"  {'ok ' if c['available'] else 'no '} {c['name']:<18} {c['reason']}")
        if c["warning"]:
            print(f"       warning: {c['warning']}")
        if c.get("path"):
            print(f"       path {c['path']}: {c['path_reason']}")
    print(f"chosen: {decision.chosen}")
    return 0


def candidate_paths(model_config: str, candidates: list[dict[str, Any]], cap: Capability) -> None:
    """For each candidate that runs here: the path it would get (``zoo.preview`` on a tiny config of the model's
    type, on this device), written into the candidate's dict."""
    from transformers import AutoConfig

    from foundry_attn.verify.zoo import preview

    model_type = AutoConfig.from_pretrained(model_config).model_type
    device = "cuda" if cap.cuda else "cpu"
    for c in candidates:
        if not c["available"]:
            continue
        try:
            state = preview(model_type, c["name"], device)
            c["path"], c["path_reason"] = state.path, f"{state.reason} (a tiny {model_type}; the run proves again)"
        except Exception as exc:  # a type the zoo cannot build here: say so, never guess
            c["path"], c["path_reason"] = "unknown", f"no tiny {model_type} to prove on: {type(exc).__name__}: {exc}"


def flash_kernel(cap: Capability, decision: Decision) -> str:
    """Which kernel ``flash_attention_2`` would really run here: the decision's answer where it weighed FA2
    (transformers 5.x may pick a hub kernel)."""
    fa2 = next((c for c in decision.candidates if c.name == FA2), None)
    if fa2 is not None and not fa2.available:
        return f"none (check '{fa2.check}' failed: {fa2.reason})"
    if cap.flash_attn_version:
        return f"flash-attn {cap.flash_attn_version}"
    if cap.hub_kernel and cap.hub_kernel_missing is None:
        return f"hub kernel {cap.hub_kernel} (transformers' stand-in for flash-attn, usable here)"
    hub = f"; hub kernel {cap.hub_kernel} not usable: {cap.hub_kernel_missing}" if cap.hub_kernel else ""
    return f"none ({cap.flash_attn_error or 'flash-attn is not installed'}{hub})"


def assets(args: argparse.Namespace) -> int:
    from foundry_attn.integrations.llm_foundry.assets import build_assets

    print(f"tiny assets written to {build_assets(args.out)}")
    return 0


def bench(args: argparse.Namespace) -> int:
    """One benchmark by the protocol of :mod:`foundry_attn.bench`: run, then the JSON or the summary; exit 1 when
    its exactness checks failed."""
    import importlib

    from foundry_attn.bench import summary

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    given = (
        ("layers", args.layers),
        ("rounds", args.rounds),
        ("tiers", args.tiers),
        ("memory_gb", args.memory_gb),
        ("shape", args.shape),
        ("jsonl", args.jsonl),
    )
    options = {k: v for k, v in given if v is not None}
    gpu = {"layers", "rounds", "tiers", "memory_gb", "shape", "jsonl"}
    takes = {"gpu": gpu, "layouts": {"rounds"}, "step": {"rounds"}, "host": {"rounds"}}.get(args.which, set())
    if set(options) - takes:
        raise SystemExit(
            f"foundry-attn bench {args.which}: --layers, --tiers, --memory-gb, --shape and --jsonl are options of "
            "bench gpu, --rounds of bench gpu, layouts, step and host"
        )
    module = importlib.import_module(f"foundry_attn.bench.{args.which}")
    result = module.run(quick=args.quick, device=args.device, **options)
    print(json.dumps(result, indent=2) if args.json else getattr(module, "summary", summary)(result))
    return 1 if result.get("correct") is False else 0


def conformance(args: argparse.Namespace) -> int:
    """Every (family, backend) cell, exact or refused; ``--markdown`` prints docs/conformance.md's table. ``--zoo``:
    every causal-LM type of this transformers, under ``auto`` and each backend (strict), and as a core user calls it
    (``attach(model, backend)``, not strict)."""
    if args.zoo:
        return zoo_conformance(args)
    if args.padding_free:
        return padding_free_conformance(args)
    from foundry_attn.verify.conformance import FAMILIES, run_all, table

    cells = run_all(tuple(args.family or FAMILIES))
    if args.markdown:
        print(table(cells))
    else:
        for c in cells:
            print(
                f"{c.family:9} {c.backend:18} {c.mode:5} {c.checkpointing:19} {c.status:8} "
                f"{c.detail or f'loss {c.loss_err:.1e}, grad {c.grad_err:.1e} (relative)'}"
            )
    return 1 if any(c.status == "WRONG" for c in cells) else 0


def padding_free_conformance(args: argparse.Namespace) -> int:
    """Every causal-LM type as a Trainer / TRL ``padding_free`` user meets it: stock, and attached."""
    import collections

    from foundry_attn.verify import zoo
    from foundry_attn.verify.sweep import LOSS_TOL, padding_free_cell, padding_free_table

    cells = [padding_free_cell(t) for t in (args.family or zoo.model_types())]
    leaks = sum(c.stock_err is not None and c.stock_err > LOSS_TOL for c in cells)
    ours = collections.Counter(f"exact {c.path}" if c.status == "exact" else c.status for c in cells)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(ours.items()))
    print(f"{len(cells)} model types: stock padding-free leaks in {leaks}; attached: {counts}\n")
    print(padding_free_table(cells))
    return 1 if any(c.status in ("WRONG", "crash") for c in cells) else 0


def zoo_conformance(args: argparse.Namespace) -> int:
    from foundry_attn.verify.sweep import run_zoo, zoo_counts, zoo_table

    cells = run_zoo(tuple(args.family) if args.family else None)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(zoo_counts(cells).items()))
    if args.markdown:
        print(f"{len({c.model_type for c in cells})} model types, {len(cells)} cells: {counts}\n")
        print(zoo_table(cells))
    else:
        for c in cells:
            numbers = f" (loss {c.loss_err:.1e}, grad {c.grad_err:.1e})" if c.loss_err is not None else ""
            print(f"{c.model_type:24} {c.requested:18} {c.status:12} {c.chosen:18} {c.path:5} {c.detail}{numbers}")
        print(counts)
    return 1 if any(c.status in ("WRONG", "crash", "over-refused") for c in cells) else 0


def events(args: argparse.Namespace) -> int:
    """``foundry-attn events PATH``: list events, ``--fell-back`` ranks, or the fleet ``--summary``."""
    from foundry_attn.observe import fleet
    from foundry_attn.observe.events import Skipped

    skipped = Skipped()
    try:
        paths = fleet.files(args.path)
        since = fleet.parse_time(args.since) if args.since else None
    except (fleet.EventsError, ValueError) as exc:
        print(f"foundry-attn events: {exc}", file=sys.stderr)
        return 2
    kind = "attn_impl" if (args.fell_back or args.summary) else args.kind
    stream = fleet.events(paths, kind, args.run, since, skipped)
    if args.fell_back or args.summary:
        decided = fleet.decisions(stream)
        result: Any = fleet.fell_back(decided) if args.fell_back else fleet.summary(decided)
        found = bool(decided)
    else:
        result = list(stream) if args.json else [fleet.one_line(e) for e in stream]
        found = bool(result)
    if not found and args.kind is None and args.run is None and since is None:  # nothing at all, not filtered out
        what = "attn_impl events (the model writes one per rank)" if kind else "events"
        why = f" ({fleet.report_skipped(skipped)}); is it JSONL?" if skipped.lines else " in it"
        print(f"foundry-attn events: {args.path}: no {what}{why}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    elif args.fell_back:
        print(fleet.table(result, fleet.FELL_BACK_COLUMNS) if result else "no rank fell back")
    elif args.summary:
        print(f"{result['fell_back']}/{result['ranks']} ranks fell back, in {result['runs']} run(s)")
        rows = [{"device": k, **v, "rate": f"{v['rate']:.0%}"} for k, v in result["by_device"].items()]
        print(fleet.table(rows, ("device", "ranks", "fell_back", "rate")))
        if result["by_reason"]:
            print(fleet.table([{"count": n, "reason": r} for r, n in result["by_reason"].items()], ("count", "reason")))
    else:
        print(fleet.table(result, ("time", "run", "launch", "rank", "kind", "what")))
    note = fleet.report_skipped(skipped)
    if note:
        print(f"foundry-attn events: {note}", file=sys.stderr)
    return 0


def report(args: argparse.Namespace) -> int:
    """``foundry-attn report PATH -o DIR``: report.html (images embedded) and its PNGs."""
    from foundry_attn.observe import fleet
    from foundry_attn.observe.report import build_report

    try:
        import matplotlib  # noqa: F401  # the report extra
    except ImportError:
        print("foundry-attn report: needs matplotlib: pip install 'foundry-attn[report]'", file=sys.stderr)
        return 2
    try:
        written = build_report(args.path, args.out)
    except fleet.EventsError as exc:
        print(f"foundry-attn report: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written['html']} ({len(written['figures'])} figures)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="foundry-attn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="which attention implementations can run here, and why not")
    p.add_argument("--json", action="store_true")
    p.add_argument("--attn-implementation", default=AUTO)
    p.add_argument("--attn-fallback", default=",".join(DEFAULT_FALLBACK))
    p.add_argument("--attn-strict", action="store_true")
    p.add_argument("--attn-compute-dtype", default="auto")
    p.add_argument("--model-config", help="a model folder or config.json path (head dim, class support)")
    p.set_defaults(func=doctor)
    p = sub.add_parser("assets", help="write the tiny offline assets the demo and tests use")
    p.add_argument("out", nargs="?", default="build/tiny")
    p.set_defaults(func=assets)
    p = sub.add_parser("bench", help="side-by-side benchmarks; prints ratios from one run")
    p.add_argument("which", choices=BENCHES)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="fewer steps (a smoke run, not for the README)")
    p.add_argument(
        "--device",
        default=None,
        help="padding, proof, compile, train: cpu (the default, even with a GPU present) or cuda[:N]; "
        "gpu: cuda[:N] (the default) or cpu (its plumbing on a tiny model, not a GPU number)",
    )
    p.add_argument("--layers", type=int, default=None, help="gpu: decoder layers (default 30; cpu: 2)")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="gpu: timed rounds per batch (default 10; --quick: 3); layouts: per cell (default 3); step: passes (4); "
        "host: steps (40)",
    )
    p.add_argument(
        "--tiers",
        default=None,
        help="gpu: only these tiers, comma-separated (padded_dense and sdpa_per_document always run)",
    )
    p.add_argument("--memory-gb", type=float, default=None, help="gpu: the equal-memory budget in GiB (default 24)")
    p.add_argument("--shape", default=None, help="gpu: the model's shapes, smollm2-135m (default) or llama-3.2-1b")
    p.add_argument("--jsonl", default=None, help="gpu: a file that gets each result as a JSON line when measured")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (a shared box: try 1)")
    p.set_defaults(func=bench)
    p = sub.add_parser("conformance", help="every model family x backend: exact against stock, or refused (why)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--family", action="append", help="only this family (repeatable; with --zoo: a model type)")
    p.add_argument("--zoo", action="store_true", help="every causal-LM type of this transformers (tiny configs)")
    p.add_argument(
        "--padding-free",
        action="store_true",
        help="every causal-LM type on one DataCollatorWithFlattening batch: stock, and attached (markdown)",
    )
    p.set_defaults(func=conformance)
    p = sub.add_parser("events", help="events of a run or a tree of runs: --fell-back ranks, --summary by device")
    p.add_argument("path", help="a run's events folder, a file, or a tree of runs")
    view = p.add_mutually_exclusive_group()
    view.add_argument("--fell-back", action="store_true", help="every rank that did not get what it requested")
    view.add_argument("--summary", action="store_true", help="fallback frequency by device class and by reason")
    p.add_argument("--kind", help="only events of this kind (attn_impl, attn_inspect, upad_trace, ...)")
    p.add_argument("--run", help="only this run")
    p.add_argument("--since", help="only events at or after this time (ISO date/time, UTC, or epoch seconds)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=events)
    p = sub.add_parser("report", help="a self-contained report.html (and PNGs) from a run or a tree of runs")
    p.add_argument("path", help="a run's events folder or a tree of runs")
    p.add_argument("-o", "--out", required=True, help="folder for report.html and the PNGs")
    p.set_defaults(func=report)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
