"""Real flash-attn and TransformerEngine installs for the tests, as GPU pools have them, made on this CPU box.

The releases come from PyPI (sha256 checked) into ``build/real-installs/`` once; each install is a folder for
``PYTHONPATH`` (``pip install --target``), so the venv itself never changes:

- :func:`flash_attn`: the real flash-attn sdist's Python files, no CUDA build (``FLASH_ATTENTION_SKIP_CUDA_BUILD``):
  ``import flash_attn`` fails on ``flash_attn_2_cuda`` as on a node whose build is missing. ``abi=True`` adds a
  compiled ``flash_attn_2_cuda`` that needs a c10 symbol this torch does not export (the stand-in for an extension
  built against another torch: ``undefined symbol: _ZN3c10...``).
- :func:`gpu_node`: a ``sitecustomize`` that makes transformers 4.51's ``is_flash_attn_2_available()`` answer as on
  a CUDA node (from the metadata alone), so transformers imports flash_attn as it does on a GPU.
- :func:`transformer_engine`: the real ``transformer-engine`` wheel (its metadata and Python sources).

The demo never fetches anything; a test that needs a release skips, saying why, where PyPI cannot be reached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO

CACHE = REPO / "build" / "real-installs"
PYPI = "https://pypi.org/pypi/{name}/json"
#: c10::Error's constructor as a build with the pre-C++11 string ABI names it: no torch 2.x exports it
MISSING_C10_SYMBOL = "_ZN3c105ErrorC2ENS_14SourceLocationESs"
ABI_EXTENSION = f"""/* flash_attn_2_cuda as if built against another torch: it needs a c10 symbol this one lacks. */
extern void {MISSING_C10_SYMBOL}(void);
void *PyInit_flash_attn_2_cuda(void) {{ {MISSING_C10_SYMBOL}(); return 0; }}
"""
GPU_NODE = '''"""Test stand-in: transformers' is_flash_attn_2_available() answers as on a CUDA node."""
import importlib.metadata
import sys


class _GpuNode:
    def find_spec(self, name, path=None, target=None):
        if name != "transformers.utils.import_utils":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            from packaging import version

            def is_flash_attn_2_available():  # 4.51's answer with torch.cuda.is_available() True
                if not module._is_package_available("flash_attn"):
                    return False
                return version.parse(importlib.metadata.version("flash_attn")) >= version.parse("2.1.0")

            module.is_flash_attn_2_available = is_flash_attn_2_available

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _GpuNode())
'''


def _fetch(name: str, version: str, packagetype: str) -> Path:
    """The release file of ``name==version`` (``sdist`` or ``bdist_wheel``), downloaded once and checked."""
    index = PYPI.format(name=name)
    try:
        with urllib.request.urlopen(index, timeout=60) as response:
            files = json.load(response)["releases"][version]
        [entry] = [f for f in files if f["packagetype"] == packagetype]
        target = CACHE / "files" / entry["filename"]
        if target.exists() and hashlib.sha256(target.read_bytes()).hexdigest() == entry["digests"]["sha256"]:
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(urllib.parse.urljoin(index, entry["url"]), timeout=300) as response:
            data = response.read()
    except (urllib.error.URLError, TimeoutError) as exc:
        pytest.skip(f"cannot fetch {name}=={version} from PyPI: {exc}")
    if hashlib.sha256(data).hexdigest() != entry["digests"]["sha256"]:
        raise AssertionError(f"{entry['filename']}: sha256 does not match PyPI's")
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(target)  # whole or not at all, whichever test worker writes it
    return target


def _pip_target(source: Path, folder: Path, env: dict[str, str] | None = None) -> Path:
    """``pip install --no-deps --target`` into ``folder``, made whole or not at all."""
    if folder.exists():
        return folder
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(tmp)]
    proc = subprocess.run([*cmd, str(source)], env={**os.environ, **(env or {})}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _settled(tmp, folder)


def _settled(tmp: Path, folder: Path) -> Path:
    """``tmp`` renamed to ``folder``; where another test worker made ``folder`` meanwhile, theirs stands."""
    try:
        tmp.rename(folder)
    except OSError:
        if not folder.exists():
            raise
        shutil.rmtree(tmp)
    return folder


def flash_attn(version: str, abi: bool = False) -> Path:
    """A folder with the real flash-attn ``version`` installed as Python files (no CUDA extension); ``abi``: with a
    compiled ``flash_attn_2_cuda`` built, as it were, against another torch."""
    sdist = _fetch("flash-attn", version, "sdist")
    CACHE.mkdir(parents=True, exist_ok=True)
    build = {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE", "FLASH_ATTENTION_FORCE_BUILD": "TRUE"}
    plain = _pip_target(sdist, CACHE / f"flash-attn-{version}", build)
    if not abi:
        return plain
    folder = CACHE / f"flash-attn-{version}-abi"
    if not folder.exists():
        tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=f".{folder.name}-"))
        shutil.copytree(plain, tmp, dirs_exist_ok=True)
        source = tmp / "flash_attn_2_cuda.c"
        source.write_text(ABI_EXTENSION)
        out = tmp / f"flash_attn_2_cuda{sysconfig.get_config_var('EXT_SUFFIX')}"
        subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
        _settled(tmp, folder)
    return folder


def gpu_node(tmp_path: Path) -> Path:
    """A folder whose ``sitecustomize`` makes transformers answer ``is_flash_attn_2_available()`` as on CUDA."""
    folder = tmp_path / "gpu-node"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(GPU_NODE)
    return folder


def transformer_engine(version: str) -> Path:
    """A folder with the real ``transformer-engine`` ``version`` wheel installed (metadata and Python sources)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    return _pip_target(_fetch("transformer-engine", version, "bdist_wheel"), CACHE / f"transformer-engine-{version}")


def env_with(*folders: Path, **extra: str) -> dict[str, str]:
    """This process's environment with ``folders`` first on ``PYTHONPATH``, offline, CPU only."""
    path = os.pathsep.join([*map(str, folders), *filter(None, [os.environ.get("PYTHONPATH")])])
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return {**os.environ, **offline, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path, **extra}
