"""Build the kernels with nvcc into one fatbin (sm_90 + sm_120 code), cached by a hash of the sources.

No GPU is needed to build: nvcc runs here and on CI. The GPU machine loads the cached fatbin with
`pycuda.driver.module_from_file`; when no fatbin matches the sources it builds one itself.
`engine_source_hash()` is the hash a GPU proof records (docs/cuda-engine.md): every source file under
cuda_engine/, so a change to a kernel or to the engine that was not re-proved on a GPU is visible.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
KERNEL_DIR = PACKAGE_DIR / "kernels"
ARCHS = ("sm_90", "sm_120")          # H200 (the GPU we run) and RTX PRO 6000 Blackwell (the target)
NVCC_FLAGS = ("-O3", "-std=c++17", "-lineinfo")
SOURCE_SUFFIXES = (".py", ".cu", ".cuh", ".sh")
CACHE_ENV = "KDTR_CUDA_CACHE"        # overrides the cache folder (default cuda_engine/.build)


class BuildError(RuntimeError):
    """nvcc is missing or a kernel did not compile; the message carries nvcc's own output."""


class NvccNotFound(BuildError):
    """No nvcc on PATH (nor in /usr/local/cuda/bin): nothing can be built here."""


def kernel_files() -> list[Path]:
    """The .cu files, one per op family, in name order (common.cuh is included by each)."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def engine_source_hash(root: Path = PACKAGE_DIR) -> str:
    """sha256 over (relative path, bytes) of every engine source under `root` (a cuda_engine folder)."""
    h = hashlib.sha256()
    root = Path(root).resolve()
    for p in _sources_under(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _sources_under(root: Path) -> list[Path]:
    """Every source under `root` (kernels, headers, Python, scripts); build output and caches excluded."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES and not any(
        part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts))


def kernel_hash(archs=ARCHS) -> str:
    """Cache key of the fatbin: kernel sources, flags and architectures."""
    h = hashlib.sha256(repr((NVCC_FLAGS, tuple(archs))).encode())
    for p in sorted(KERNEL_DIR.iterdir()):
        if p.suffix in (".cu", ".cuh"):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, PACKAGE_DIR / ".build"))


def nvcc_path() -> str:
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        raise NvccNotFound("nvcc not found on PATH (install the CUDA toolkit, or build the fatbin where nvcc is "
                         "and copy cuda_engine/.build along)")
    return nvcc


def gencode(archs) -> list[str]:
    return [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]


def build_fatbin(archs=ARCHS) -> Path:
    """Path of the fatbin for today's kernel sources, building it (once) if the cache lacks it."""
    out = cache_dir() / f"kdtr_kernels_{kernel_hash(archs)}.fatbin"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        umbrella = Path(tmp) / "kdtr_kernels.cu"       # one translation unit -> one module
        umbrella.write_text("".join(f'#include "{p.name}"\n' for p in kernel_files()))
        part = Path(tmp) / out.name
        run_nvcc([*NVCC_FLAGS, *gencode(archs), f"-I{KERNEL_DIR}", "-fatbin", "-o", str(part), str(umbrella)])
        shutil.move(str(part), out)                     # appears whole or not at all
    return out


def run_nvcc(args: list[str]) -> str:
    """nvcc's combined output; BuildError (with that output) if it fails."""
    proc = subprocess.run([nvcc_path(), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"nvcc failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc.stdout + proc.stderr
