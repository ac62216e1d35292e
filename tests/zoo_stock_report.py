"""Stock transformers on every tiny config of foundry_attn.zoo: builds, trains, and one row per document == alone?

    python tests/zoo_stock_report.py --json out.json [--types llama,mistral] [--jobs 2] [--timeout 90]

For each model type and each of the stock backends eager and sdpa that the class supports, fp32 on the CPU:

1. build (``config._attn_implementation`` set before construction) and one forward+backward with labels on [1, 12];
2. "alone": documents of lengths (5, 11, 3, 9), each run alone, loss = summed next-token CE over all targets /
   total targets, gradients of every parameter;
3. "rows": the same documents one per row, right-padded to 11 with the pad id, a 2-D attention mask, no
   position_ids, the same loss over real targets only; compared with 2 (loss abs 1e-5, grads relative norm 1e-4).

A script, not a pytest test: it takes minutes. Each type runs in a worker process with a time limit.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
import warnings
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LENGTHS = (5, 11, 3, 9)
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
BACKENDS = ("eager", "sdpa")


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout("time limit")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {(text or [''])[0][:240]}"


def _where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in tb if "site-packages" in f.filename] or tb
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename.split('site-packages/')[-1]}:{f.lineno}"


def _special_ids(config: Any, vocab: int) -> set[int]:
    """Every token id the config (and its sub-configs) names that lies inside the vocabulary."""
    out: set[int] = set()
    todo = [config]
    while todo:
        c = todo.pop()
        for name, value in vars(c).items():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                todo.append(value)
                continue
            if not (name.endswith(("_id", "_ids", "_index", "_idx")) or "token" in name):
                continue
            values = value if isinstance(value, (list, tuple)) else [value]
            out.update(v for v in values if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab)
    return out


def _vocab(model: Any) -> int:
    emb = model.get_input_embeddings()
    if isinstance(emb, (list, tuple)) or hasattr(emb, "__getitem__"):  # Musicgen: one embedding per codebook
        emb = emb[0]
    n = getattr(emb, "num_embeddings", None) or emb.weight.shape[0]
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(min(n, getattr(text, "vocab_size", n) or n))


def _documents(vocab: int, avoid: set[int], seed: int = 0) -> list[Any]:
    import torch

    allowed = torch.tensor([i for i in range(1, vocab) if i not in avoid])
    gen = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(0, len(allowed), (n,), generator=gen)] for n in LENGTHS]


def _logits(out: Any) -> Any:
    logits = out.logits if hasattr(out, "logits") else out[0]
    if logits.dim() == 4:  # Musicgen: [batch, codebooks (1), seq, vocab]
        logits = logits.flatten(0, 1)
    return logits.float()


def _grads(model: Any) -> dict[str, Any]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _build(config: Any, model_class: Any, backend: str) -> Any:
    import torch

    config = copy.deepcopy(config)
    config._attn_implementation = backend
    torch.manual_seed(0)
    model = model_class(config)
    if getattr(model.config, "_attn_implementation", backend) != backend:
        raise RuntimeError(f"asked {backend}, built {model.config._attn_implementation}")
    return model.float().train()


_WINDOWS = ("sliding_window", "attention_chunk_size", "attention_window_size", "window_size", "local_attention")
_WINDOWS += ("local_attention_window_len", "sliding_window_size", "keep_window_size", "index_topk", "indexer_budget")


def _widened(config: Any) -> tuple[Any, list[str]]:
    """A copy of config with every window/chunk/top-k that equals zoo.WINDOW widened to 4096 (and sub-configs)."""
    from foundry_attn.zoo import WINDOW

    config = copy.deepcopy(config)
    names: list[str] = []
    todo = [config]
    while todo:
        c = todo.pop()
        for name, value in list(vars(c).items()):
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                if not name.startswith(("vision", "audio")):  # their windows change parameter shapes
                    todo.append(value)
            elif name in _WINDOWS and value == WINDOW:
                c.__dict__[name] = 4096
                names.append(name)
    return config, names


def _window_bites(config: Any, model_class: Any, backend: str, model: Any, ids: Any) -> str:
    """'yes' if widening the windows changes the logits of a 12-token row, 'NO' if not, '-' without windows."""
    import torch

    wide, names = _widened(model.config)
    if not names:
        return "-"
    other = _build(wide, model_class, backend)
    try:
        other.load_state_dict(model.state_dict())
    except RuntimeError:
        return "n/a (widening changes parameter shapes)"
    with torch.no_grad():
        torch.manual_seed(0)
        a = _logits(model(input_ids=ids))
        torch.manual_seed(0)
        b = _logits(other(input_ids=ids))
    return ("yes" if not torch.allclose(a, b, atol=1e-6) else "NO") + f" ({','.join(sorted(set(names)))})"


def _backend_supported(model_class: Any, backend: str) -> bool:
    if backend == "eager":
        return True
    flag = getattr(model_class, "_supports_sdpa", False)
    return bool(flag) if isinstance(flag, bool) else True  # a property: ask the build


def _check(config: Any, model_class: Any, backend: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    rec: dict[str, Any] = {"backend": backend}
    start = time.perf_counter()
    stage = "build"
    try:
        model = _build(config, model_class, backend)
        rec["built"] = True
        vocab = _vocab(model)
        avoid = _special_ids(model.config, vocab)
        stage = "train"
        ids = _documents(vocab, avoid, seed=1)[1][:12]
        ids = torch.cat([ids, ids])[:12][None]
        try:
            torch.manual_seed(0)
            out = model(input_ids=ids, labels=ids)
            loss = out.loss if getattr(out, "loss", None) is not None else out[0]
            loss.backward()
            rec["train_loss"] = float(loss)
        except Exception as exc:  # the model's own labels path; the checks below use the logits
            rec["labels_crash"] = f"{_first_line(exc)} @ {_where(exc)}"
        model.zero_grad(set_to_none=True)
        stage = "bite"
        rec["window_bites"] = _window_bites(config, model_class, backend, model, ids)

        docs = _documents(vocab, avoid)
        targets = sum(len(d) - 1 for d in docs)
        stage = "alone"
        rec.update(_compare(model, docs, targets, vocab))
        if not rec["exact"]:
            stage = "eval"
            model.eval()
            rec["exact_eval"] = _compare(model, docs, targets, vocab)["exact"]
            model.train()
    except _Timeout:
        raise
    except Exception as exc:
        rec["crash"] = f"{stage}: {_first_line(exc)} @ {_where(exc)}"
        rec.setdefault("built", False)
    rec["seconds"] = round(time.perf_counter() - start, 2)
    return rec


def _compare(model: Any, docs: list[Any], targets: int, vocab: int) -> dict[str, Any]:
    """Checks 2 and 3: each document alone, then one per row right-padded; loss and gradients compared."""
    import torch
    import torch.nn.functional as F

    if True:
        model.zero_grad(set_to_none=True)
        alone = 0.0
        for d in docs:
            torch.manual_seed(0)
            logits = _logits(model(input_ids=d[None]))[0, :-1]
            part = F.cross_entropy(logits, d[1:], reduction="sum") / targets
            part.backward()
            alone += float(part)
        g_alone = _grads(model)
        model.zero_grad(set_to_none=True)

        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        pad = getattr(text, "pad_token_id", None)
        pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
        width = max(LENGTHS)
        batch = torch.full((len(docs), width), pad, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for r, d in enumerate(docs):
            batch[r, : len(d)] = d
            mask[r, : len(d)] = 1
        torch.manual_seed(0)
        logits = _logits(model(input_ids=batch, attention_mask=mask))
        rows = (
            sum(F.cross_entropy(logits[r, : len(d) - 1], d[1:], reduction="sum") for r, d in enumerate(docs)) / targets
        )
        rows.backward()
        g_rows = _grads(model)
        names = sorted(set(g_alone) | set(g_rows))
        diff2 = ref2 = 0.0
        worst, worst_name = 0.0, ""
        for n in names:
            a = g_alone.get(n)
            b = g_rows.get(n)
            a = torch.zeros_like(b) if a is None else a
            b = torch.zeros_like(a) if b is None else b
            d2 = float((a - b).norm() ** 2)
            diff2 += d2
            ref2 += float(a.norm() ** 2)
            rel = d2**0.5 / max(float(a.norm()), 1e-12)
            if d2 > 0 and rel > worst:
                worst, worst_name = rel, n
        loss_err = abs(float(rows) - alone)
        grad_err = (diff2**0.5) / max(ref2**0.5, 1e-30)
        model.zero_grad(set_to_none=True)
        return dict(
            alone_loss=alone,
            rows_loss=float(rows),
            loss_err=loss_err,
            grad_err=grad_err,
            worst_param=worst_name,
            worst_rel=worst,
            exact=bool(loss_err <= LOSS_TOL and grad_err <= GRAD_TOL),
            grad_norm=ref2**0.5,
        )


def run_type(args: tuple[str, int]) -> dict[str, Any]:
    """Every check of one model type (in a worker process)."""
    model_type, timeout = args
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from foundry_attn import zoo

    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    start = time.perf_counter()
    rec: dict[str, Any] = {"type": model_type, "backends": []}
    try:
        t0 = time.perf_counter()
        config, model_class = zoo.tiny(model_type)
        rec["tiny_seconds"] = round(time.perf_counter() - t0, 3)
        rec["class"] = model_class.__name__
        for backend in BACKENDS:
            if not _backend_supported(model_class, backend):
                rec["backends"].append({"backend": backend, "unsupported": True})
                continue
            b = _check(config, model_class, backend)
            if backend != "eager" and not b.get("built") and "not support" in b.get("crash", ""):
                b = {"backend": backend, "unsupported": True, "why": b["crash"]}
            rec["backends"].append(b)
    except zoo.Unbuildable as exc:
        rec["unbuildable"] = str(exc)
    except _Timeout:
        rec["crash"] = f"timeout after {timeout} s"
    except Exception as exc:
        rec["crash"] = f"tiny: {_first_line(exc)} @ {_where(exc)}"
    finally:
        signal.alarm(0)
    rec["seconds"] = round(time.perf_counter() - start, 2)
    return rec


def summary(records: list[dict[str, Any]], wall: float) -> str:
    """The printed report."""
    import torch
    import transformers

    lines = [f"transformers {transformers.__version__}, torch {torch.__version__}: {len(records)} types, {wall:.0f} s"]
    unbuildable = [r for r in records if "unbuildable" in r]
    crashed_types = [r for r in records if "crash" in r]
    pairs = [(r, b) for r in records for b in r.get("backends", []) if not b.get("unsupported")]
    built = [r for r in records if any(b.get("built") for b in r.get("backends", []))]
    exact = [(r, b) for r, b in pairs if b.get("exact")]
    wrong = [(r, b) for r, b in pairs if b.get("exact") is False]
    crash = [(r, b) for r, b in pairs if "crash" in b]
    all_exact = [r for r in built if all(b.get("exact") for b in r["backends"] if not b.get("unsupported"))]
    lines.append(
        f"types: {len(records)} | built: {len(built)} | every backend trains and rows == alone: {len(all_exact)} | "
        f"unbuildable: {len(unbuildable)} | zoo/timeout crash: {len(crashed_types)}"
    )
    lines.append(
        f"(type, backend) pairs: {len(pairs)} | exact: {len(exact)} | rows != alone: {len(wrong)} | crashed: {len(crash)}"
    )
    lines.append("\nUnbuildable:")
    lines += [f"  {r['type']}: {r['unbuildable']}" for r in unbuildable]
    lines.append("\nStock rows != alone:")
    for r, b in wrong:
        lines.append(
            f"  {r['type']}/{b['backend']}: loss err {b['loss_err']:.2e}, grad err {b['grad_err']:.2e} "
            f"(worst {b['worst_param']} {b['worst_rel']:.1e}); eval mode exact: {b.get('exact_eval')}"
        )
    lines.append("\nCrashes:")
    lines += [f"  {r['type']}: {r['crash']}" for r in crashed_types]
    lines += [f"  {r['type']}/{b['backend']}: {b['crash']}" for r, b in crash]
    lines.append("\nLabels path crashed (checks 2-3 ran on the logits):")
    lines += [f"  {r['type']}/{b['backend']}: {b['labels_crash']}" for r, b in pairs if "labels_crash" in b]
    lines.append("\nWindows set to zoo.WINDOW that change nothing on a 12-token row:")
    lines += [f"  {r['type']}/{b['backend']}: {b['window_bites']}" for r, b in pairs if b.get("window_bites", "").startswith("NO")]
    bite = sorted({r["type"] for r, b in pairs if b.get("window_bites", "").startswith("yes")})
    lines.append(f"\nWindows that bite ({len(bite)} types): {' '.join(bite)}")
    slow = sorted(records, key=lambda r: -r["seconds"])[:5]
    lines.append("\nSlowest: " + ", ".join(f"{r['type']} {r['seconds']:.1f}s" for r in slow))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every record here")
    parser.add_argument("--types", help="comma-separated model types (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=120, help="seconds per type")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from foundry_attn import zoo

    types = args.types.split(",") if args.types else zoo.model_types()
    start = time.perf_counter()
    ctx = mp.get_context("spawn")
    records: list[dict[str, Any]] = []
    with ctx.Pool(args.jobs, maxtasksperchild=25) as pool:
        for rec in pool.imap_unordered(run_type, [(t, args.timeout) for t in types]):
            records.append(rec)
            status = (
                (rec.get("unbuildable") and "unbuildable")
                or rec.get("crash")
                or " ".join(
                    f"{b['backend']}:{'-' if b.get('unsupported') else 'exact' if b.get('exact') else 'DIFF' if b.get('exact') is False else 'CRASH'}"
                    for b in rec["backends"]
                )
            )
            print(f"{rec['type']:28s} {rec['seconds']:6.1f}s {status}", flush=True)
    records.sort(key=lambda r: r["type"])
    wall = time.perf_counter() - start
    print()
    print(summary(records, wall))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wall_seconds": wall, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
