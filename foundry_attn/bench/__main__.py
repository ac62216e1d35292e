"""``python -m foundry_attn.bench WHICH ...`` = ``foundry-attn bench WHICH ...``, for a source tree with no entry point
installed (a bare GPU box: ``PYTHONPATH=. python -m foundry_attn.bench gpu --json``). torch and transformers only."""

from __future__ import annotations

import sys

from foundry_attn.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
