"""`kdtr kernels check`: build every kernel with nvcc (no GPU needed) and hold it to sm_120's limits.

For each architecture and each kernel: registers, spill stores/loads, stack frame and shared memory
(static, as ptxas reports it with -Xptxas -v, plus the dynamic shared memory the engine launches it with:
DYNAMIC_SMEM). A kernel fails the check on any spill, or when it would
not launch on sm_120 (the target, the smaller of our two GPUs): more than 99 KB shared memory per block
(sm_120 has 100 KB per SM and keeps 1 KB per block), more than 255 registers per thread, or more than
64 K registers for one block at its __launch_bounds__ thread count (1024 when it declares none). And in the
sources: every kernel entry's first statement is AFTER_PREVIOUS_GRID() (kernels/common.cuh): the engine's graphs
let a kernel's blocks start before the kernel it depends on has ended, so an entry without it could read its
inputs early.
"""
from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cuda_engine.build import ARCHS, KERNEL_DIR, NVCC_FLAGS, gencode, kernel_files, run_nvcc
from cuda_engine.ops import ATTN_DYNAMIC_SMEM

SM120_SMEM_PER_BLOCK = 99 * 1024
# kernels launched with dynamic shared memory (cuda_engine/ops.py asks for it over 48 KB): kernel -> bytes
DYNAMIC_SMEM = ATTN_DYNAMIC_SMEM
SM120_REGS_PER_SM = 64 * 1024
MAX_REGS_PER_THREAD = 255
MAX_THREADS_PER_BLOCK = 1024


@dataclass
class KernelUsage:
    arch: str
    file: str
    kernel: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    smem: int = 0
    threads: int = MAX_THREADS_PER_BLOCK     # from __launch_bounds__

    def problems(self) -> list[str]:
        where = f"{self.kernel} ({self.file}, {self.arch})"
        out = []
        if self.spill_stores or self.spill_loads:
            out.append(f"{where}: spills ({self.spill_stores} bytes stored, {self.spill_loads} bytes loaded)")
        if self.smem > SM120_SMEM_PER_BLOCK:
            out.append(f"{where}: {self.smem} bytes shared memory > sm_120's {SM120_SMEM_PER_BLOCK} per block")
        if self.registers > MAX_REGS_PER_THREAD:
            out.append(f"{where}: {self.registers} registers > {MAX_REGS_PER_THREAD} per thread")
        if self.registers * self.threads > SM120_REGS_PER_SM:
            out.append(f"{where}: {self.registers} registers x {self.threads} threads > {SM120_REGS_PER_SM} per SM")
        return out


def parse_ptxas(text: str, arch: str, file: str, threads: dict[str, int]) -> list[KernelUsage]:
    """KernelUsage per entry function in ptxas -v output."""
    rows, cur = {}, None
    for line in text.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            cur = rows.setdefault(m[1], KernelUsage(arch, file, m[1], threads=threads.get(m[1], MAX_THREADS_PER_BLOCK)))
        elif m := re.search(r"Function properties for (\w+)", line):
            cur = rows.get(m[1])                              # None for a device function (not launched)
        elif cur is None:
            continue
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            cur.stack, cur.spill_stores, cur.spill_loads = int(m[1]), int(m[2]), int(m[3])
        elif m := re.search(r"Used (\d+) registers", line):
            cur.registers = int(m[1])
            s = re.search(r"(\d+) bytes smem", line)
            cur.smem = int(s[1]) if s else 0
    return list(rows.values())


def launch_bounds(source: str, constants: dict[str, int]) -> dict[str, int]:
    """kernel name -> its __launch_bounds__ thread count (constants: #defines it may use)."""
    out = {}
    for m in re.finditer(r"__launch_bounds__\((\w+)(?:,\s*\w+)?\)\s*\n?\s*(\w+)\s*\(", source):
        arg = m[1]
        out[m[2]] = int(arg) if arg.isdigit() else constants[arg]
    return out


def header_constants() -> dict[str, int]:
    """The integer #defines of kernels/common.cuh, with BLOCK_THREADS evaluated."""
    text = (KERNEL_DIR / "common.cuh").read_text()
    c = {k: int(v) for k, v in re.findall(r"#define (\w+) (\d+)\b", text)}
    c["BLOCK_THREADS"] = c["WARP_SIZE"] * c["WARPS_PER_BLOCK"]
    return c


def kernel_usage(arch: str, files=None) -> list[KernelUsage]:
    """Compile each .cu for `arch` to a cubin and read ptxas's report."""
    constants = header_constants()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for f in files or kernel_files():
            f = Path(f)
            text = run_nvcc([*NVCC_FLAGS, *gencode([arch]), f"-I{KERNEL_DIR}", "-cubin", "-Xptxas", "-v",
                             "-o", str(Path(tmp) / (f.stem + ".cubin")), str(f)])
            rows += parse_ptxas(text, arch, f.name, launch_bounds(f.read_text(), constants))
    for r in rows:
        r.smem += DYNAMIC_SMEM.get(r.kernel, 0)
    return rows


ENTRY_FIRST_STATEMENT = "AFTER_PREVIOUS_GRID();"


def _blank_comments(source: str) -> str:
    """`source` with every comment's characters (newlines kept) replaced by spaces: the same length, so offsets
    still point into the source, and no word of a comment can start or end a match."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m[0]), source, flags=re.S)


def entries_without_the_wait(source: str, file: str) -> list[str]:
    """A problem per kernel definition (`__global__ ... {`, however spelled: extern "C" or not, a template, inside
    an extern "C" { } block) of `source` whose body does not begin with AFTER_PREVIOUS_GRID();. Whitespace before
    it is fine; a comment or any statement before it is not: it must be first. Comments are blanked before the
    search, so a comment that names __global__ neither counts as a kernel nor hides the next one."""
    code = _blank_comments(source)
    out = []
    for m in re.finditer(r"\b__global__\b([^{;]*)\{", code):
        name = re.search(r"(\w+)\s*\(", re.sub(r"__launch_bounds__\s*\([^)]*\)", "", m[1]))
        if not source[m.end():].lstrip().startswith(ENTRY_FIRST_STATEMENT):
            out.append(f"{name[1] if name else '?'} ({file}): its first statement is not {ENTRY_FIRST_STATEMENT} "
                       f"(kernels/common.cuh says why; a kernel without it may read its inputs before the kernel "
                       f"that writes them ends)")
    return out


def source_problems(files=None) -> list[str]:
    return [p for f in (files or kernel_files()) for p in entries_without_the_wait(Path(f).read_text(), Path(f).name)]


def check_kernels(archs=ARCHS, files=None) -> tuple[list[KernelUsage], list[str]]:
    """(usage of every kernel on every arch, problems); BuildError when nvcc fails."""
    rows = [r for arch in archs for r in kernel_usage(arch, files)]
    return rows, source_problems(files) + [p for r in rows for p in r.problems()]
