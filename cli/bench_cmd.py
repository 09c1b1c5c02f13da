"""`kdtr bench engine`: the CUDA engine's decode latency per token (cuda_engine.bench does the work)."""
from __future__ import annotations

import json
import sys

import click

from cli.outputs import check_output, fail_write
from conformance.exit_codes import ExitCode
from cuda_engine.engine import W4A16_MODES
from kdtr_format.paths import write_atomically


@click.group("bench")
def bench_cmd() -> None:
    """Benchmarks that need a GPU."""


@bench_cmd.command("engine")
@click.argument("bundle", default="bundles/model_tiny.kdtr", type=click.Path(exists=True, dir_okay=False))
@click.option("--steps", default=200, show_default=True, help="Timed decode steps per variant.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the numbers here.")
@click.option("--w4a16", type=click.Choice(W4A16_MODES), default="fast", show_default=True,
              help="INT4 expert kernels of an INT4 bundle (docs/cuda-engine.md).")
def engine_cmd(bundle, steps, json_path, w4a16) -> None:
    """Decode latency per token (AR, batch 1): prepared launches vs the captured CUDA graph, launches per
    step, and the launch floor (the same number of one-thread kernels) measured in the same run."""
    check_output(json_path, "--json", stream_ok=True)      # before the run, not after it
    from cuda_engine.device import CudaEngineError

    try:
        from cuda_engine.bench import decode_latency

        r = decode_latency(bundle, steps, w4a16=w4a16)
    except CudaEngineError as e:
        click.echo(f"kdtr bench engine: {e}", err=True)
        sys.exit(int(ExitCode.ENGINE_ERROR))
    click.echo(f"{r['device']} (cc {r['compute_capability']}, driver {r['driver']}, CUDA {r['cuda_driver_api']}), "
               f"{bundle}, {steps} steps, w4a16 {w4a16}")
    click.echo(f"launches per decode step: {r['launches_per_step']}")
    click.echo(f"decode, prepared launches: {r['us_per_token_prepared']:8.1f} us/token "
               f"(floor {r['floor_us_per_step_prepared']:.1f})")
    click.echo(f"decode, CUDA graph:        {r['us_per_token_graph']:8.1f} us/token "
               f"(floor {r['floor_us_per_step_graph']:.1f}; {r['graph_vs_floor']:.2f}x floor, "
               f"{r['prepared_vs_graph']:.2f}x faster than prepared)")
    click.echo(f"graph and prepared generate the same tokens: {r['same_tokens_graph_and_prepared']}")
    if json_path:
        try:
            write_atomically(json_path, lambda fh: fh.write(json.dumps(r, indent=1).encode("utf-8")),
                             stream_ok=True)
        except OSError as e:
            fail_write(e, "kdtr bench engine")


@bench_cmd.command("w4a16")
@click.option("--batches", default="1,2,4,8,16,32,64", show_default=True,
              help="Tokens per launch, comma-separated (1..64 run in one launch each).")
@click.option("--reps", default=20, show_default=True, help="Graph replays per measurement.")
@click.option("--no-moe", is_flag=True, help="Skip the one-token K2.6 MoE layer (it holds ~9.5 GB of INT4 experts).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the numbers here.")
def w4a16_cmd(batches, reps, no_moe, json_path) -> None:
    """The fast W4A16 kernel at the K2.6 expert shapes (7168->2048, 2048->7168, fused gate+up 7168->4096),
    per batch: time, GB/s, and the ratio to a copy kernel reading the same bytes (the floor), to torch's
    bf16 matmul (cuBLAS) and to torch's INT4 tinygemm, all measured in this run, cold cache, CUDA graphs;
    then one whole K2.6 MoE layer for one token (384 INT4 experts, top-8 + shared). docs/cuda-engine.md."""
    check_output(json_path, "--json", stream_ok=True)
    try:
        bs = tuple(int(b) for b in batches.split(","))
    except ValueError:
        raise click.BadParameter(f"{batches!r}: give comma-separated integers, e.g. 1,16", param_hint="--batches") \
            from None
    if not bs or min(bs) < 1:
        raise click.BadParameter(f"{batches!r}: batches must be >= 1", param_hint="--batches")
    from cuda_engine.device import CudaEngineError

    try:
        from cuda_engine.bench_w4a16 import run, table

        r = run(bs, reps, moe=not no_moe, progress=lambda m: click.echo(m, err=True))
    except CudaEngineError as e:
        click.echo(f"kdtr bench w4a16: {e}", err=True)
        sys.exit(int(ExitCode.ENGINE_ERROR))
    click.echo(table(r))
    if json_path:
        try:
            write_atomically(json_path, lambda fh: fh.write(json.dumps(r, indent=1).encode("utf-8")),
                             stream_ok=True)
        except OSError as e:
            fail_write(e, "kdtr bench w4a16")
