"""``foundry-attn``: doctor, tiny assets, benchmarks.

    foundry-attn doctor [--json] [--attn-implementation auto] [--attn-fallback flash_attention_2,sdpa,eager]
                        [--attn-strict] [--model-config ./build/tiny/tiny-llama]
    foundry-attn assets build/tiny
    foundry-attn bench padding --json [--device cuda] [--threads 1]
    foundry-attn bench callbacks --json
    foundry-attn conformance [--markdown] [--family mistral]
"""

from __future__ import annotations

import argparse
import json
import sys

from foundry_attn.policy import AUTO, DEFAULT_FALLBACK, AttentionUnavailableError


def doctor(args: argparse.Namespace) -> int:
    from foundry_attn.capability import probe
    from foundry_attn.loading import decide, resolve_compute_dtype
    from foundry_attn.policy import choose

    cap = probe()
    fallback = [f.strip() for f in args.attn_fallback.split(",") if f.strip()]
    try:
        if args.model_config:
            decision = decide(args.model_config, args.attn_implementation, fallback, args.attn_strict,
                              args.attn_compute_dtype, cap)
        else:
            decision = choose(args.attn_implementation, fallback, cap,
                              resolve_compute_dtype(args.attn_compute_dtype, cap), strict=args.attn_strict)
    except (AttentionUnavailableError, ValueError) as exc:
        print(f"foundry-attn doctor: {exc}", file=sys.stderr)
        return 2
    report = {
        "chosen": decision.chosen,
        "reason": decision.reason,
        "candidates": [{"name": c.name, "available": c.available, "reason": c.reason} for c in decision.candidates],
        "environment": cap.as_dict(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    env = report["environment"]
    print(f"device: {env['device_name']} ({env['sm']}) on {env['host']}")
    print(f"torch {env['torch_version']}, transformers {env['transformers_version']}, "
          f"flash-attn {env['flash_attn_version'] or 'not importable'}, "
          f"transformer-engine {env['transformer_engine_version'] or 'not installed'}")
    for c in report["candidates"]:
        print(f"  {'ok ' if c['available'] else 'no '} {c['name']:<18} {c['reason']}")
    print(f"chosen: {decision.chosen}")
    return 0


def assets(args: argparse.Namespace) -> int:
    from foundry_attn.foundry.assets import build_assets

    print(f"tiny assets written to {build_assets(args.out)}")
    return 0


def bench(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.which == "padding":
        from foundry_attn.bench.padding import run

        result = run(quick=args.quick, device=args.device)
    elif args.which == "compile":
        from foundry_attn.bench.compile import WORKLOADS, run

        result = run(device=args.device, layouts=12 if args.quick else 50, models=("tiny",) if args.quick else
                     tuple(WORKLOADS))
    elif args.which == "isolation":
        from foundry_attn.bench.isolation import MODELS, run

        result = run(device=args.device, repeats=1 if args.quick else 3, models=("tiny",) if args.quick else
                     tuple(MODELS))
    else:
        from foundry_attn.bench.callbacks import run

        result = run(quick=args.quick)
    print(json.dumps(result, indent=2) if args.json else result)
    return 0


def conformance(args: argparse.Namespace) -> int:
    """Every (family, backend) cell, exact or refused; ``--markdown`` prints the README table."""
    from foundry_attn.conformance import FAMILIES, run_all, table

    cells = run_all(tuple(args.family or FAMILIES))
    if args.markdown:
        print(table(cells))
    else:
        for c in cells:
            print(f"{c.family:9} {c.backend:18} {c.mode:5} {c.checkpointing:19} {c.status:8} "
                  f"{c.detail or f'loss {c.loss_err:.1e}, grad {c.grad_err:.1e} (relative)'}")
    return 1 if any(c.status == "WRONG" for c in cells) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="foundry-attn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("which", choices=("padding", "callbacks", "isolation", "compile"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="fewer steps (a smoke run, not for the README)")
    p.add_argument("--device", default=None, help="padding, isolation, compile: cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (a shared box: try 1)")
    p.set_defaults(func=bench)
    p = sub.add_parser("conformance", help="every model family x backend: exact against stock, or refused (why)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--family", action="append", help="only this family (repeatable)")
    p.set_defaults(func=conformance)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
