"""`kdtr kernels check`: build every CUDA kernel with nvcc and check spills and sm_120 limits (no GPU)."""
from __future__ import annotations

import sys

import click

from conformance.exit_codes import ExitCode
from cuda_engine.build import ARCHS, BuildError, NvccNotFound
from cuda_engine.check import check_kernels


@click.group("kernels")
def kernels_cmd() -> None:
    """The CUDA engine's kernels (cuda_engine/kernels/*.cu)."""


@kernels_cmd.command("check")
@click.option("--arch", "archs", multiple=True, type=click.Choice(list(ARCHS)),
              help="Architecture(s) to build for (repeatable); default: all of " + ", ".join(ARCHS) + ".")
def check_cmd(archs) -> None:
    """Build every kernel with nvcc and print registers, spills and shared memory per kernel. Exit 0 when
    every kernel builds within the limits; 6 (engine error) on any spill, any sm_120 limit exceeded (99 KB
    shared memory per block, 64 K registers per block) or a kernel that does not compile; 2 (usage) when
    nvcc is not installed, so the check cannot run here."""
    try:
        rows, problems = check_kernels(archs or ARCHS)
    except BuildError as e:
        click.echo(f"kdtr kernels check: {e}", err=True)
        sys.exit(int(ExitCode.USAGE if isinstance(e, NvccNotFound) else ExitCode.ENGINE_ERROR))
    click.echo(f"{'arch':7} {'file':15} {'kernel':24} {'regs':>4} {'threads':>7} {'spill st/ld':>11} "
               f"{'stack':>5} {'smem':>6}")
    for r in rows:
        click.echo(f"{r.arch:7} {r.file:15} {r.kernel:24} {r.registers:4d} {r.threads:7d} "
                   f"{r.spill_stores:5d}/{r.spill_loads:<5d} {r.stack:5d} {r.smem:6d}")
    for p in problems:
        click.echo(f"FAIL {p}", err=True)
    click.echo(f"{len(rows)} kernel builds, {len(problems)} problem(s)")
    sys.exit(int(ExitCode.ENGINE_ERROR if problems else ExitCode.OK))
