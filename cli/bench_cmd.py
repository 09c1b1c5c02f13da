"""`kdtr bench engine`: the CUDA engine's decode latency per token (cuda_engine.bench does the work)."""
from __future__ import annotations

import json
import sys

import click

from cli.outputs import check_output, fail_write
from conformance.exit_codes import ExitCode
from kdtr_format.paths import write_atomically


@click.group("bench")
def bench_cmd() -> None:
    """Benchmarks that need a GPU."""


@bench_cmd.command("engine")
@click.argument("bundle", default="bundles/model_tiny.kdtr", type=click.Path(exists=True, dir_okay=False))
@click.option("--steps", default=200, show_default=True, help="Timed decode steps per variant.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the numbers here.")
def engine_cmd(bundle, steps, json_path) -> None:
    """Decode latency per token (AR, batch 1): prepared launches vs the captured CUDA graph, launches per
    step, and the launch floor (the same number of one-thread kernels) measured in the same run."""
    check_output(json_path, "--json", stream_ok=True)      # before the run, not after it
    from cuda_engine.device import CudaEngineError

    try:
        from cuda_engine.bench import decode_latency

        r = decode_latency(bundle, steps)
    except CudaEngineError as e:
        click.echo(f"kdtr bench engine: {e}", err=True)
        sys.exit(int(ExitCode.ENGINE_ERROR))
    click.echo(f"{r['device']} (cc {r['compute_capability']}, driver {r['driver']}, CUDA {r['cuda_driver_api']}), "
               f"{bundle}, {steps} steps")
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
