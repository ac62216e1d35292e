#!/usr/bin/env bash
# Issue 62's measurements on a lent GPU box (torch and transformers only: no venv, no Composer, no flash-attn), from
# this source tree, in one call within the box's 600 s limit:
#
#     OUT=/some/dir bash scripts/gpu-run.sh                     # all three steps, in this order
#     OUT=/some/dir LIMIT_llama1b=500 bash scripts/gpu-run.sh llama1b   # one step again, with more time
#     BENCH_ARGS="--device cpu" bash scripts/gpu-run.sh         # the plumbing on a CPU (tiny model, not a GPU number)
#
# `python` (else `python3`, or $PYTHON) runs it. Writes under $OUT (default gpu-out/): env.txt (the card, torch,
# transformers), steps.tsv (each step's exit code and seconds; 124 = stopped at its limit), and per step its .log, the
# benches' .json and .jsonl (appended to: each run's lines begin with a "start" record). Each step has a limit of its
# own, so a slow one cannot starve the next, and the benches write each result as they measure it (--jsonl): a step
# stopped at its limit keeps what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
BENCH_ARGS=${BENCH_ARGS:-}
mkdir -p "$OUT"
export PYTHONPATH=.
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$PYTHON" -c "import sys, torch, transformers as t; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
t.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')" 2>&1
    nproc
} >"$OUT/env.txt"
[ -f "$OUT/steps.tsv" ] || printf 'step\trc\tseconds\n' >"$OUT/steps.tsv"

#: each step's default limit in seconds (LIMIT_<step> overrides): 550 s, with the kill grace and the start under the
#: box's 600 s a call
declare -A LIMIT=([smollm2]=270 [graphed-test]=120 [llama1b]=160)

# step NAME [--json] COMMAND...: runs it under its limit, its output to NAME.log (--json: its stdout to NAME.json), a
# line to steps.tsv
step() {
    local name=$1 log="$OUT/$1.log" var="LIMIT_${1//-/_}" limit start rc
    shift
    limit=${!var:-${LIMIT[$name]}}
    start=$(date +%s)
    if [ "$1" = --json ]; then
        shift
        timeout -s INT -k 10 "$limit" "$@" >"$OUT/$name.json" 2>"$log"
    else
        timeout -s INT -k 10 "$limit" "$@" >"$log" 2>&1
    fi
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" | tee -a "$OUT/steps.tsv"
}

bench() {  # bench NAME [ARGS...]: bench gpu --quick, its JSON to NAME.json and each result as measured to NAME.jsonl
    local name=$1
    shift
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    step "$name" --json "$PYTHON" -m foundry_attn.cli bench gpu --json --quick --jsonl "$OUT/$name.jsonl" "$@" $BENCH_ARGS
}

# shellcheck disable=SC2048  # the steps asked (default: all three), one word each
for one in ${*:-smollm2 graphed-test llama1b}; do
    case $one in
        # SmolLM2-135M's shapes, the seed's batch and no padding: every SmolLM2 target of issue 62 (<= 240 s)
        smollm2) bench smollm2 ;;
        # CUDA graphs recorded once per bucket, each step equal to the eager one (skipped without CUDA)
        graphed-test) step graphed-test "$PYTHON" -m pytest -q -p no:cacheprovider tests/path/test_execution_gpu.py ;;
        # Llama-3.2-1B's shapes: the default >= 5x padded dense at its best, eager >= 2.5x padded dense eager
        llama1b) bench llama1b --shape llama-3.2-1b ;;
        *) echo "unknown step $one: choose from smollm2, graphed-test, llama1b" >&2 && exit 2 ;;
    esac
done
