"""Stock transformers on every tiny config of foundry_attn.verify.zoo: does it build, train, and is one row per document
exact?

    python tests/verify/zoo_stock_report.py --json out.json [--types llama,mistral] [--jobs 2] [--timeout 120]

For each model type and each stock backend (eager, sdpa) the class supports, fp32 on the CPU, torch.manual_seed(0):

1. build (``config._attn_implementation`` set before construction) and one forward+backward with labels on [1, 12];
   whether the windows zoo set bite (widening them to 4096 changes the logits of that row);
2. "alone": documents of lengths (5, 11, 3, 9), each run alone, loss = summed next-token CE over all targets /
   total targets, gradients of every parameter;
3. "rows": the same documents one per row, right-padded to 11 with the pad id, a 2-D attention mask, no
   position_ids, the same loss over the real targets; compared with 2 (loss abs 1e-5, grads relative norm 1e-4),
   and again in eval mode where train mode differs.

Checks 2 and 3 take the loss from the logits, so a broken labels path (recorded) does not stop them. Where a forward
without attention_mask fails, an all-ones mask is passed (recorded); parameters the stock init leaves as
``torch.empty`` memory are found (construction runs with deterministic algorithms: NaN fill) and re-drawn.

A script, not a pytest test: a few minutes on 2 cores. Each type runs in a worker process with a time limit.
"""

from __future__ import annotations

import argparse
import copy
import inspect
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
WIDE = 4096
_WINDOWS = (
    *("sliding_window", "attention_chunk_size", "attention_window_size", "window_size", "local_attention"),
    *("local_attention_window_len", "sliding_window_size", "keep_window_size", "index_topk", "indexer_budget"),
)

# why stock rows differ from alone where it was measured (transformers 4.51.3 and 5.23)
KNOWN = {
    "cpmant": "ignores attention_mask: builds its own from input_ids != 0 assuming LEFT padding, and its 'context' "
    "attention is bidirectional",
    "prophetnet": "main-stream logits of a prefix depend on the row length (not on later tokens' content), ~1e-3, "
    "mask or not",
    "xlm-prophetnet": "as prophetnet",
    "phimoe": "5.x train mode: the sparsemixer router samples its experts (Gumbel noise, random Heun step), so no two "
    "calls agree; eval mode is exact",
    "moshi": "4.51: without attention_mask, eager is not causal and neither backend applies sliding_window; "
    "with one both do",
}


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
    return f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}"


def _is_config(value: Any) -> bool:
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def _special_ids(config: Any, vocab: int) -> set[int]:
    """Every token id the config (and its sub-configs) names that lies inside the vocabulary."""
    out: set[int] = set()
    todo = [config]
    while todo:
        c = todo.pop()
        for name, value in vars(c).items():
            if _is_config(value):
                todo.append(value)
            elif name.endswith(("_id", "_ids", "_index", "_idx")) or "token" in name:
                values = value if isinstance(value, (list, tuple)) else [value]
                out.update(v for v in values if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab)
    return out


def _text_config(model: Any) -> Any:
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def _vocab(model: Any) -> int:
    emb = model.get_input_embeddings()
    if hasattr(emb, "__getitem__"):  # Musicgen: one embedding per codebook
        emb = emb[0]
    text = _text_config(model)
    n = getattr(emb, "num_embeddings", None) or getattr(getattr(emb, "weight", None), "shape", [None])[0]
    n = n or text.vocab_size  # an adaptive embedding
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


def _run(model: Any, ids: Any, notes: dict[str, str], **kwargs: Any) -> Any:
    """model(input_ids=ids, **kwargs); without a mask, a failure is retried with an all-ones one (and noted)."""
    import torch

    if "attention_mask" not in inspect.signature(model.forward).parameters:
        kwargs.pop("attention_mask", None)  # causal rows need none
        notes["no_attention_mask_argument"] = "yes"
        return model(input_ids=ids, **kwargs)
    if "attention_mask" in kwargs:
        return model(input_ids=ids, **kwargs)
    if "no_mask_fails" in notes:
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    try:
        return model(input_ids=ids, **kwargs)
    except Exception as exc:
        try:
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        except Exception:
            raise exc from None
        notes["no_mask_fails"] = f"{_first_line(exc)} @ {_where(exc)}"
        return out


def _grads(model: Any) -> dict[str, Any]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _build(config: Any, model_class: Any, backend: str) -> Any:
    """Stock construction for ``backend`` (``zoo.build``: uninitialised parameters re-drawn)."""
    from foundry_attn.verify.zoo import build

    model = build(config, model_class, backend)
    if getattr(model.config, "_attn_implementation", backend) != backend:
        raise RuntimeError(f"asked {backend}, built {model.config._attn_implementation}")
    return model


def _widened(config: Any) -> tuple[Any, list[str]]:
    """A copy of config with every window/chunk/top-k equal to zoo.WINDOW widened (text configs only)."""
    from foundry_attn.verify.zoo import WINDOW

    config = copy.deepcopy(config)
    names: list[str] = []
    todo = [config]
    while todo:
        c = todo.pop()
        for name, value in list(vars(c).items()):
            if _is_config(value):
                if not name.startswith(("vision", "audio")):  # their windows change parameter shapes
                    todo.append(value)
            elif name in _WINDOWS and value == WINDOW:
                c.__dict__[name] = WIDE
                names.append(name)
    return config, names


def _window_bites(model_class: Any, backend: str, model: Any, ids: Any, notes: dict[str, str]) -> str:
    """'yes' if widening the windows changes the logits of the row, 'NO' if not, '-' without windows."""
    import torch

    wide, names = _widened(model.config)
    if not names:
        return "-"
    other = _build(wide, model_class, backend)
    try:
        other.load_state_dict(model.state_dict())
    except RuntimeError:
        return "n/a (widening changes parameter shapes)"
    bites = []
    for mask in ({}, {"attention_mask": torch.ones_like(ids)}):
        with torch.no_grad():
            torch.manual_seed(0)
            a = _logits(_run(model, ids, notes, **mask))
            torch.manual_seed(0)
            b = _logits(_run(other, ids, notes, **mask))
        bites.append(not torch.allclose(a, b, atol=1e-6))
    verdict = "yes" if all(bites) else "NO" if not any(bites) else "yes with a 2-D mask only" if bites[1] else "?"
    return f"{verdict} ({','.join(sorted(set(names)))})"


def _compare(model: Any, docs: list[Any], vocab: int, notes: dict[str, str]) -> dict[str, Any]:
    """Checks 2 and 3: each document alone, then one per row right-padded; loss and gradients compared."""
    import torch
    import torch.nn.functional as F

    targets = sum(len(d) - 1 for d in docs)
    model.zero_grad(set_to_none=True)
    alone = 0.0
    for d in docs:
        torch.manual_seed(0)
        logits = _logits(_run(model, d[None], notes))[0, :-1]
        part = F.cross_entropy(logits, d[1:], reduction="sum") / targets
        part.backward()
        alone += float(part)
    g_alone = _grads(model)
    model.zero_grad(set_to_none=True)

    pad = getattr(_text_config(model), "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    batch = torch.full((len(docs), max(LENGTHS)), pad, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for r, d in enumerate(docs):
        batch[r, : len(d)] = d
        mask[r, : len(d)] = 1
    torch.manual_seed(0)
    logits = _logits(_run(model, batch, notes, attention_mask=mask))
    rows = sum(F.cross_entropy(logits[r, : len(d) - 1], d[1:], reduction="sum") for r, d in enumerate(docs))
    rows = rows / targets
    rows.backward()
    g_rows = _grads(model)
    model.zero_grad(set_to_none=True)

    diff2 = ref2 = worst = 0.0
    worst_name = ""
    for n in sorted(set(g_alone) | set(g_rows)):
        a, b = g_alone.get(n), g_rows.get(n)
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        d2 = float((a - b).norm() ** 2)
        diff2 += d2
        ref2 += float(a.norm() ** 2)
        if d2 > 0 and d2**0.5 / max(float(a.norm()), 1e-12) > worst:
            worst, worst_name = d2**0.5 / max(float(a.norm()), 1e-12), n
    loss_err = abs(float(rows) - alone)
    grad_err = diff2**0.5 / max(ref2**0.5, 1e-30)
    return {
        "alone_loss": alone,
        "rows_loss": float(rows),
        "loss_err": loss_err,
        "grad_err": grad_err,
        "worst_param": worst_name,
        "worst_rel": worst,
        "exact": bool(loss_err <= LOSS_TOL and grad_err <= GRAD_TOL),
    }


def _check(config: Any, model_class: Any, backend: str) -> dict[str, Any]:
    """Every check of one (type, backend)."""
    import torch

    rec: dict[str, Any] = {"backend": backend, "built": False}
    start = time.perf_counter()
    stage = "build"
    notes: dict[str, str] = {}
    try:
        model = _build(config, model_class, backend)
        rec["built"] = True
        if model._zoo_uninitialised:
            rec["uninitialised"] = ", ".join(model._zoo_uninitialised)
        vocab = _vocab(model)
        avoid = _special_ids(model.config, vocab)
        stage = "train"
        ids = _documents(vocab, avoid, seed=1)[1][:12]
        ids = torch.cat([ids, ids])[:12][None]
        try:
            torch.manual_seed(0)
            labels = ids[..., None] if getattr(model.config, "num_codebooks", None) else ids  # Musicgen's layout
            out = _run(model, ids, notes, labels=labels)
            loss = out.loss if getattr(out, "loss", None) is not None else out[0]
            loss.backward()
            rec["train_loss"] = float(loss)
        except Exception as exc:  # the model's own labels path; the checks below use the logits
            rec["labels_crash"] = f"{_first_line(exc)} @ {_where(exc)}"
        model.zero_grad(set_to_none=True)
        stage = "bite"
        rec["window_bites"] = _window_bites(model_class, backend, model, ids, notes)
        stage = "alone/rows"
        docs = _documents(vocab, avoid)
        rec.update(_compare(model, docs, vocab, notes))
        if not rec["exact"]:
            stage = "eval"
            rec["exact_eval"] = _compare(model.eval(), docs, vocab, notes)["exact"]
    except _Timeout:
        raise
    except Exception as exc:
        rec["crash"] = f"{stage}: {_first_line(exc)} @ {_where(exc)}"
    rec.update(notes)
    rec["seconds"] = round(time.perf_counter() - start, 2)
    return rec


def _backend_supported(model_class: Any, backend: str) -> bool:
    if backend == "eager":
        return True
    flag = getattr(model_class, "_supports_sdpa", False)
    return bool(flag) if isinstance(flag, bool) else True  # a property (composite models): the build decides


def run_type(args: tuple[str, int]) -> dict[str, Any]:
    """Every check of one model type (in a worker process)."""
    model_type, timeout = args
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    from foundry_attn.verify import zoo

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
            if backend != "eager" and not b["built"] and "not support" in b.get("crash", ""):
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


def _status(rec: dict[str, Any]) -> str:
    if "unbuildable" in rec or "crash" in rec:
        return "unbuildable" if "unbuildable" in rec else rec["crash"]
    words = []
    for b in rec["backends"]:
        state = "exact" if b.get("exact") else "DIFF" if b.get("exact") is False else "CRASH"
        words.append(f"{b['backend']}:{'-' if b.get('unsupported') else state}")
    return " ".join(words)


def _listing(title: str, items: list[str]) -> list[str]:
    return [f"\n{title} ({len(items)}):", *(f"  {x}" for x in items)]


def summary(records: list[dict[str, Any]], wall: float) -> str:
    """The printed report."""
    import torch
    import transformers

    pairs = [(r, b) for r in records for b in r.get("backends", []) if not b.get("unsupported")]
    built = [r for r in records if any(b.get("built") for b in r.get("backends", []))]
    exact_types = [r for r in built if all(b.get("exact") for b in r["backends"] if not b.get("unsupported"))]
    wrong = [(r, b) for r, b in pairs if b.get("exact") is False]
    crash = [(r, b) for r, b in pairs if "crash" in b]
    lines = [
        f"transformers {transformers.__version__}, torch {torch.__version__}: {len(records)} types, {wall:.0f} s",
        f"types: {len(records)} | built: {len(built)} | every backend trains and rows == alone: {len(exact_types)} | "
        f"unbuildable: {sum('unbuildable' in r for r in records)} | zoo crash: {sum('crash' in r for r in records)}",
        f"(type, backend) pairs: {len(pairs)} | exact: {sum(bool(b.get('exact')) for _, b in pairs)} | "
        f"rows != alone: {len(wrong)} | crashed: {len(crash)}",
    ]
    lines += _listing("Unbuildable", [f"{r['type']}: {r['unbuildable']}" for r in records if "unbuildable" in r])
    lines += _listing(
        "Stock rows != alone",
        [
            f"{r['type']}/{b['backend']}: loss err {b['loss_err']:.1e}, grad err {b['grad_err']:.1e} "
            f"(worst {b['worst_param']}), eval exact: {b.get('exact_eval')}; {KNOWN.get(r['type'], '?')}"
            for r, b in wrong
        ],
    )
    lines += _listing(
        "Crashes",
        [f"{r['type']}: {r['crash']}" for r in records if "crash" in r]
        + [f"{r['type']}/{b['backend']}: {b['crash']}" for r, b in crash],
    )
    lines += _listing(
        "Labels path crashed (checks 2-3 ran on the logits)",
        [f"{r['type']}/{b['backend']}: {b['labels_crash']}" for r, b in pairs if "labels_crash" in b],
    )
    lines += _listing(
        "Parameters the stock init leaves as torch.empty memory (re-drawn N(0, 0.02) here)",
        [f"{r['type']}/{b['backend']}: {b['uninitialised']}" for r, b in pairs if "uninitialised" in b],
    )
    lines += _listing(
        "A forward without attention_mask fails (an all-ones mask was passed instead)",
        [f"{r['type']}/{b['backend']}: {b['no_mask_fails']}" for r, b in pairs if "no_mask_fails" in b],
    )
    lines += _listing(
        "No attention_mask argument (rows ran unmasked)",
        sorted({r["type"] for r, b in pairs if "no_attention_mask_argument" in b}),
    )
    lines += _listing(
        "Windows set to zoo.WINDOW that change nothing on a 12-token row",
        [f"{r['type']}/{b['backend']}: {b['window_bites']}" for r, b in pairs if b.get("window_bites", "")[:2] == "NO"],
    )
    lines += _listing(
        "Windows that bite only when a 2-D attention_mask is passed",
        [f"{r['type']}/{b['backend']}" for r, b in pairs if "mask only" in b.get("window_bites", "")],
    )
    bite = sorted({r["type"] for r, b in pairs if b.get("window_bites", "").startswith("yes")})
    lines.append(f"\nWindows that bite ({len(bite)} types): {' '.join(bite)}")
    slow = sorted(records, key=lambda r: -r["seconds"])[:5]
    lines.append("\nSlowest: " + ", ".join(f"{r['type']} {r['seconds']:.1f}s" for r in slow))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the report."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", help="write every record here")
    parser.add_argument("--types", help="comma-separated model types (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=120, help="seconds per type")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from foundry_attn.verify import zoo

    types = args.types.split(",") if args.types else zoo.model_types()
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    with mp.get_context("spawn").Pool(args.jobs, maxtasksperchild=25) as pool:
        for rec in pool.imap_unordered(run_type, [(t, args.timeout) for t in types]):
            records.append(rec)
            print(f"{rec['type']:28s} {rec['seconds']:6.1f}s {_status(rec)}", flush=True)
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
