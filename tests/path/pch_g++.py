#!/usr/bin/env python3
"""g++ for inductor's C++ kernels in ``test_the_default_inductor_step_is_exact``, with the header every kernel
includes compiled once: torch 2.7's ``cpp_prefix.h`` (170,000 lines once preprocessed, about 3.4 s of each kernel's
compile). GCC reads a precompiled header found beside the one included (``HEADER.gch``), made here from the first
kernel's own flags; torch 2.8's inductor does the same itself (``cpp_cache_precompile_headers``). Every other call
(``--version``, a kernel whose header is already compiled) runs g++ as it is.

    with torch._inductor.config.patch({"cpp.cxx": (None, str(Path(__file__).with_name("pch_g++.py")))}): ...
"""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

GXX = "g++"


def precompiled(header: Path, args: list[str]) -> None:
    """``header.gch`` made with the kernel's flags (less its source, output and link flags); atomic, so two
    compiles at once each find a whole one or none."""
    flags, rest = [], iter(args)
    for arg in rest:
        if arg == "-o":
            next(rest, None)  # the kernel's .so
        elif not (arg.endswith(".cpp") or arg == "-shared" or arg.startswith(("-l", "-L"))):
            flags.append(arg)
    tmp = header.with_name(f"{header.name}.gch.{os.getpid()}")
    made = subprocess.run([GXX, "-x", "c++-header", str(header), *flags, "-o", str(tmp)], capture_output=True)
    if made.returncode == 0:
        os.replace(tmp, header.with_name(f"{header.name}.gch"))
    else:  # no precompiled header: the kernel compiles as before
        tmp.unlink(missing_ok=True)


def main(args: list[str]) -> NoReturn:
    sources = [a for a in args if a.endswith(".cpp")]
    if len(sources) == 1:
        first = Path(sources[0]).read_text().lstrip().split("\n", 1)[0]  # inductor's kernels open on their header
        found = re.fullmatch(r'#include "(/.+\.h)"', first)
        if found and not Path(found[1] + ".gch").exists():
            precompiled(Path(found[1]), args)
    os.execvp(GXX, [GXX, *args])  # g++ takes the process


if __name__ == "__main__":
    main(sys.argv[1:])
