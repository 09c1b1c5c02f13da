"""Peak memory and time of `kdtr gen --from-checkpoint DIR --layers N`, against the weights it touched.

Claim under test (docs/golden-bundles.md, "Goldens from a checkpoint"): the gen's peak memory is bounded by
one layer's touched weights in float64 plus the caches, never by the checkpoint. The gen runs in a fresh child
process (the same library calls as the CLI: conformance.gen.from_checkpoint.model_from_checkpoint, then
generate_bundle) whose weight mapping records every tensor a forward upcasts. It reports:

- peak_rss_bytes: VmHWM of the child (memory-mapped file pages included), reset just before the gen;
- touched_layer_float64_bytes: per layer, the float64 size of every weight any forward of the gen read in
  that layer (attention, norms, router, shared expert, the routed experts some prompt was routed to: the
  union over every forward, so at least what one forward holds); "head": the final norm and lm_head;
- largest_touched_float64_bytes: the largest of those; model_float64_bytes: the whole truncated model in
  float64 (what a whole upcast would hold); checkpoint_bytes: the shards on disk.

    python bench/bench_gen_checkpoint.py CKPT --layers 3 --out /tmp/b.kdtr [--synth PRESET:LAYERS:EXPERTS] \\
        [-- gen options: --num-prompts 1 --max-new-tokens 4 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(ckpt: str, layers: int, out: str, gen_args: list[str]) -> None:
    """The gen in this fresh process; prints its figures as one JSON line."""
    import conformance.gen.gen as gen
    from cli.gen_cmd import gen_cmd
    from conformance.gen.from_checkpoint import model_from_checkpoint
    from conformance.gen.gen import GenSettings, apply_quant, generate_bundle
    from refmodel.truncate import layer_of

    gen.CORES_PER_JOB = 1 << 30     # every prompt in this process: VmHWM and the record see every forward

    ctx = gen_cmd.make_context("gen", ["--from-checkpoint", ckpt, "--layers", str(layers), "--out", out, *gen_args])
    p = ctx.params
    s = GenSettings(quant=p["quant"], seed=p["seed"], num_prompts=p["num_prompts"],
                    max_new_tokens=p["max_new_tokens"], budget=p["budget"], distill_steps=p["distill_steps"],
                    long_position=p["long_position"], bf16_profile=p["bf16_profile"] is not False, layers=layers,
                    routing_near_ties=p["routing_near_ties"] or "held", command="bench_gen_checkpoint")
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")                                     # VmHWM := the current RSS
        reset = True
    except OSError:
        reset = False
    base = _status_kib("VmRSS") * 1024
    t0 = time.perf_counter()
    m = model_from_checkpoint(ckpt, s)
    touched: dict[str, set] = {}

    def watch(name: str) -> None:
        l = layer_of(name)
        if name != "model.embed_tokens.weight":              # the embedding is read by rows only
            touched.setdefault("head" if l is None else str(l), set()).add(name)

    m.W.watch = watch
    generate_bundle(apply_quant(m, s), s, out)
    seconds = time.perf_counter() - t0
    shapes = {n: int(a) for n, a in _sizes(m.cfg).items()}
    per_layer = {k: 8 * sum(shapes[n] for n in names) for k, names in sorted(touched.items())}
    ckpt_bytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    print(json.dumps({"peak_rss_bytes": _status_kib("VmHWM") * 1024, "baseline_rss_bytes": base, "hwm_reset": reset,
                      "seconds": seconds, "touched_layer_float64_bytes": per_layer,
                      "largest_touched_float64_bytes": max(per_layer.values()),
                      "touched_experts": {k: sum(".experts." in n for n in v) // 3 for k, v in touched.items()},
                      "model_float64_bytes": m.W.upcast_nbytes(), "stored_bytes": m.W.stored_bytes(),
                      "checkpoint_bytes": ckpt_bytes, "bundle_bytes": os.path.getsize(out),
                      "n_routed_experts": m.cfg.n_routed_experts, "layers": layers}))


def _sizes(cfg) -> dict:
    import numpy as np

    from refmodel.weights import expected_shapes
    return {n: np.prod(s, dtype=np.int64) for n, s in expected_shapes(cfg).items()}


def main() -> None:
    argv = sys.argv[1:]
    gen_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--synth", help="first write a synthetic checkpoint: PRESET:LAYERS:EXPERTS[:HIDDEN:WIDTH]")
    ap.add_argument("--jobs", type=int, default=1, help="processes writing the synthetic checkpoint")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.ckpt, a.layers, a.out, gen_args)
    if a.synth:
        synth(a.ckpt, a.synth, a.jobs)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), a.ckpt, "--layers", str(a.layers), "--out",
                           a.out, "--child", "--", *gen_args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the gen failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    print(proc.stdout.strip().splitlines()[-1])


def synth(root: str, spec: str, jobs: int) -> None:
    import dataclasses

    from bench.synth_checkpoint import write_checkpoint
    from refmodel.config import PRESETS
    preset, L, E, *dims = spec.split(":")
    change = dict(num_hidden_layers=int(L), n_routed_experts=int(E))
    if dims:
        change.update(hidden_size=int(dims[0]), moe_intermediate_size=int(dims[1]))
    write_checkpoint(root, dataclasses.replace(PRESETS[preset], **change), shard_bytes=64 << 20, jobs=jobs)


if __name__ == "__main__":
    main()
