"""`kdtr bench engine`: the CUDA engine's decode latency per token (cuda_engine.bench does the work);
`kdtr bench ddtree`: DDTree vs AR on it (cuda_engine.bench_ddtree); `kdtr bench w4a16`: the W4A16 kernels."""
from __future__ import annotations

import json
import sys

import click

from cli.outputs import check_output, fail_write
from conformance.exit_codes import ExitCode
from cuda_engine.engine import W4A16_MODES
from kdtr_format.paths import write_atomically


def _write_json(path: str, r: dict, command: str) -> None:
    """A benchmark's `--json` report, written atomically; an unwritable path is one line and exit 2."""
    try:
        write_atomically(path, lambda fh: fh.write(json.dumps(r, indent=1).encode("utf-8")), stream_ok=True)
    except OSError as e:
        fail_write(e, command)


@click.group("bench")
def bench_cmd() -> None:
    """Benchmarks that need a GPU."""


@bench_cmd.command("engine")
@click.argument("bundle", default="bundles/model_tiny.kdtr", type=click.Path(exists=True, dir_okay=False))
@click.option("--steps", default=200, show_default=True, type=click.IntRange(1, 100_000),
              help="Timed decode steps per variant (times are per step: at least 1).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the numbers here.")
@click.option("--w4a16", type=click.Choice(W4A16_MODES), default="fast", show_default=True,
              help="INT4 expert kernels of an INT4 bundle (docs/cuda-engine.md).")
def engine_cmd(bundle, steps, json_path, w4a16) -> None:
    """Decode latency per token (AR, batch 1): prepared launches vs the captured CUDA graph (with the engine's
    programmatic kernel -> kernel edges, KDTR_GRAPH_EDGES, and the same step with plain edges), launches per
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
               f"{r['prepared_vs_graph']:.2f}x faster than prepared; "
               f"{r['graph_programmatic_edges']} programmatic edges, {r['graph_edges']})")
    click.echo(f"decode, graph, plain edges: {r['us_per_token_graph_plain_edges']:7.1f} us/token "
               f"(floor {r['floor_us_per_step_graph_plain_edges']:.1f}; "
               f"{r['plain_edges_vs_graph']:.2f}x the engine's graph's time)")
    click.echo(f"graphs and prepared generate the same tokens: {r['same_tokens_graph_and_prepared']}")
    if json_path:
        _write_json(json_path, r, "kdtr bench engine")


@bench_cmd.command("ddtree")
@click.argument("bundles", nargs=-1, type=click.Path(exists=True, dir_okay=False))
@click.option("--tokens", default=128, show_default=True, type=click.IntRange(1, 4096),
              help="Greedy tokens generated per prompt.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 100),
              help="Timed runs per prompt and variant; the best counts.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the numbers here.")
@click.option("--k26", is_flag=True, help="Instead: random-weight K2.6 layers at true dims, verify vs AR per tree "
              "budget and the projected speedup (docs/k26-scale.md); BUNDLES give the tree shapes and acceptance "
              "(default: every committed bundle with a distilled drafter: not the slices).")
@click.option("--k26-quick", is_flag=True, help="With --k26: fewer budgets (1, 4, 8, 16, 32, 64).")
@click.option("--k26-share", default=0.5, show_default=True, type=click.FloatRange(0, 1),
              help="With --k26: the correlated-routing model's share (a node keeps each parent expert w.p.).")
@click.option("--k26-draft", default=0.0, show_default=True, type=click.FloatRange(0),
              help="With --k26: the drafter's and builder's time per round, in AR steps, in the projection.")
@click.option("--k26-time-budget", default=90.0, show_default=True, type=click.FloatRange(1),
              help="With --k26: seconds of device work after which the measurements left are skipped.")
@click.option("--k26-dense", default="bf16", show_default=True, type=click.Choice(["bf16", "float32"]),
              help="With --k26: the dense weights on the device as K2.6 stores them (bf16, the engine's default "
                   "for a bf16 checkpoint) or widened to float32.")
@click.option("--no-device", is_flag=True, help="With --k26: only the host half (shapes, routing, acceptance).")
def ddtree_cmd(bundles, tokens, repeats, json_path, k26, k26_quick, k26_share, k26_draft, k26_time_budget,
               k26_dense, no_device) -> None:
    """DDTree vs AR on the CUDA engine, one run, one device: tokens/s of each over every golden prompt of
    each bundle (default: bundles/model_tiny.kdtr and bundles/model_int4_tiny.kdtr), the wall-clock speedup,
    target forwards per token and their ratio, and where a DDTree round's time goes (draft, build, verify,
    walk, compact, host syncs). AR is the decode step as a CUDA graph replayed back to back.
    With --k26: what a tree verify costs through K2.6's 384 experts (docs/k26-scale.md)."""
    check_output(json_path, "--json", stream_ok=True)
    if k26:
        _k26(bundles, json_path, k26_quick, k26_share, k26_draft, k26_time_budget, no_device, k26_dense)
        return
    bundles = bundles or ("bundles/model_tiny.kdtr", "bundles/model_int4_tiny.kdtr")
    from cuda_engine.device import CudaEngineError

    try:
        from cuda_engine.bench_ddtree import ddtree_speed

        r = ddtree_speed(bundles, tokens, repeats,
                         progress=lambda b, k, n: click.echo(f"  {b}: prompt {k}/{n}", err=True))
    except CudaEngineError as e:
        click.echo(f"kdtr bench ddtree: {e}", err=True)
        sys.exit(int(ExitCode.ENGINE_ERROR))
    click.echo(f"{r['device']} (cc {r['compute_capability']}, driver {r['driver']}), {tokens} tokens per prompt, "
               f"best of {repeats}")
    for b in r["bundles"]:
        click.echo(f"{b['bundle']} (budget {b['budget']}, {len(b['prompts'])} prompts):")
        click.echo(f"  AR (CUDA graph) {b['ar_tokens_per_s']:9.0f} tokens/s   DDTree {b['ddtree_tokens_per_s']:9.0f} "
                   f"tokens/s   speedup {b['speedup']:.2f}x")
        click.echo(f"  DDTree with the host tree builder {b['ddtree_host_builder_tokens_per_s']:9.0f} tokens/s   "
                   f"speedup {b['speedup_host_builder']:.2f}x")
        click.echo(f"  target forwards per token: AR {b['ar_target_forwards_per_token']:.3f}, DDTree "
                   f"{b['ddtree_target_forwards_per_token']:.3f} (ratio {b['target_forward_ratio']:.2f}; speedup / "
                   f"ratio {b['speedup_vs_forward_ratio']:.2f}); {b['tokens_per_round']:.2f} tokens per round")
        click.echo(f"  per token: AR {b['ar_us_per_token']:.1f} us, DDTree {b['ddtree_us_per_token']:.1f} us; "
                   f"speedup without the prompt's forward {b['speedup_after_prefill']:.2f}x")
        if b["round_gpu_us"]:
            click.echo("  a round on the device (us, events): " + ", ".join(f"{k} {v:.0f}"
                                                                         for k, v in b["round_gpu_us"].items()))
        split = ", ".join(f"{k} {v:.0f}" for k, v in b["round_us"].items())
        click.echo(f"  a round (us, synchronised per phase): {split}; {b['host_syncs_per_round']:.1f} host syncs")
        ca = b["cost_aware"]
        click.echo(f"  cost-aware budget (prices measured here): {ca['tokens_per_s']:9.0f} tokens/s   speedup "
                   f"{ca['speedup']:.2f}x ({ca['vs_fixed']:.2f}x the fixed budget's); {ca['nodes_per_round']:.1f} "
                   f"nodes per round, {ca['target_forwards_per_token']:.3f} target forwards per token")
        if ca["price_us"]:
            p = ca["price_us"]
            click.echo("    its price (us): draft " + f"{p['draft']:.0f}, verify by rows " +
                       ", ".join(f"{r}: {c:.0f}" for r, c in p["verify"].items()))
        click.echo(f"  DDTree streams (fixed and cost-aware) == AR stream on every prompt: {b['all_streams_equal_ar']}")
    if json_path:
        _write_json(json_path, r, "kdtr bench ddtree")
    if not all(b["all_streams_equal_ar"] for b in r["bundles"]):
        click.echo("kdtr bench ddtree: the DDTree stream differs from the AR stream", err=True)
        sys.exit(int(ExitCode.ENGINE_ERROR))


def _k26_report():
    """bench.k26_ddtree_report's (run, table). bench/ lies beside the installed packages in a clone of the
    repository but is not itself installed, and the `kdtr` script does not put the working directory on the
    import path: so the clone's root (the folder above cli/) is added where bench/ is found there."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "bench", "k26_ddtree_report.py")) and root not in sys.path:
        sys.path.insert(0, root)
    from bench.k26_ddtree_report import run, table

    return run, table


def _is_slice(path: str) -> bool:
    """A slice bundle (its metadata records `slice`: docs/golden-bundles.md): its drafter is untrained, so its
    acceptance is no drafter's and the K2.6 bench's default bundles leave it out."""
    from kdtr_format import open_kdtr

    with open_kdtr(path) as f:
        return "slice" in f.metadata


def _k26(bundles, json_path, quick, share, draft, time_budget, no_device, dense: str = "bf16") -> None:
    """`kdtr bench ddtree --k26`: bench/k26_ddtree_report.run, its tables, its JSON (rewritten after each layer
    and context of the device run, so a run cut short keeps what ran); exit 6 when the device part did not run
    or measured nothing."""
    import glob

    try:
        run, table = _k26_report()
    except ImportError as e:
        click.echo(f"kdtr bench ddtree --k26: {e}: it needs the repository's bench/ folder (not installed with the "
                   f"package): run it from a clone of the repository", err=True)
        sys.exit(int(ExitCode.ENGINE_ERROR))
    bundles = bundles or tuple(b for b in sorted(glob.glob("bundles/*.kdtr")) if not _is_slice(b))
    save = (lambda r: _write_json(json_path, r, "kdtr bench ddtree")) if json_path else None
    r = run(bundles, quick, share, draft, time_budget_s=time_budget, progress=lambda m: click.echo(m, err=True),
            checkpoint=save, device=not no_device, dense=dense)
    click.echo(table(r))
    if save:
        save(r)
    if r["gpu_error"] and not no_device:
        click.echo(f"kdtr bench ddtree --k26: the device part did not run: {r['gpu_error']}", err=True)
        sys.exit(int(ExitCode.ENGINE_ERROR))
    if not no_device and not r["summary"]:
        click.echo("kdtr bench ddtree --k26: no device measurement succeeded (the errors are in the JSON)", err=True)
        sys.exit(int(ExitCode.ENGINE_ERROR))


@bench_cmd.command("w4a16")
@click.option("--batches", default="1,2,4,8,16,32,64", show_default=True,
              help="Tokens per launch, comma-separated (1..64 run in one launch each).")
@click.option("--reps", default=20, show_default=True, type=click.IntRange(1, 100_000),
              help="Graph replays per measurement (times are per replay: at least 1).")
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
        _write_json(json_path, r, "kdtr bench w4a16")
