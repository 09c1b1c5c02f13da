"""Starting a sharded torch run: one process per rank, torch.distributed over gloo (CPU), each rank driving
the bundle through conformance.verify.collect and writing its own rank dump (docs/run-dump.md §7).

`kdtr verify BUNDLE --engine torch --tp N [--ep M]` makes a ShardedTorchEngine; the runner calls its
`run`, which starts the W rank processes (`python -m conformance.verify.shard_run --rank r ...`, rendezvous
through a file, no network port), waits for them and leaves `rank{r}.kdtr` in the output folder; the
runner then judges that folder exactly as `kdtr verify --dump-dir` judges one an external engine wrote
(conformance/verify/judge_ranks.py), so the two verdicts are the same.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from conformance.shard_plan import ShardError, ShardPlan

RANK_TIMEOUT_S = 120        # a collective waiting this long means a rank is gone or out of step
_ROOT = Path(__file__).resolve().parent.parent   # the repository root the rank processes import from


class ShardRunError(RuntimeError):
    """A rank process failed (the message names the rank and ends with its error)."""


def rank_file(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.kdtr"


class ShardedTorchEngine:
    """`--engine torch --tp N --ep M`: kdtr's sharded PyTorch DeepseekV3 (conformance/engines/torch_sharded.py),
    float32, one process per rank. Not an in-process Engine: `run` makes the rank dumps the runner judges."""
    name = "torch"
    dtype = "float32"
    sharded = True

    def __init__(self, tp: int = 1, ep: int = 1, fault=None, threads: int = 1):
        from conformance.engines.torch_sharded import check_fault

        self.plan = ShardPlan(tp, ep)
        check_fault(fault, self.plan)
        self.fault, self.threads = fault, threads

    def describe(self) -> str:
        p = self.plan
        return (f"kdtr's sharded PyTorch DeepseekV3, float32, {p.world_size} rank process(es) over gloo: "
                f"attention {'tensor-parallel' if p.tp > 1 else 'replicated'}, MoE "
                f"{'expert-parallel' if p.ep > 1 else 'tensor-parallel' if p.tp > 1 else 'whole'}"
                + (f"; planted fault {self.fault}" if self.fault else ""))

    def run(self, bundle: str, folder: str) -> float:
        """Start the ranks on `bundle`, each writing rank{r}.kdtr into `folder`; returns the wall seconds.
        Raises ShardRunError when a rank fails (the others are stopped)."""
        W, t0 = self.plan.world_size, time.perf_counter()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
                   OMP_NUM_THREADS=str(self.threads))
        with tempfile.TemporaryDirectory(prefix="kdtr-ranks-") as tmp:
            store = os.path.join(tmp, "rendezvous")
            procs, logs = [], []
            for r in range(W):
                log = open(os.path.join(tmp, f"rank{r}.log"), "w+")
                cmd = [sys.executable, "-m", "conformance.verify.shard_run", "--bundle", os.fspath(bundle), "--out",
                       os.fspath(folder), "--rank", str(r), "--tp", str(self.plan.tp), "--ep", str(self.plan.ep),
                       "--store", store, "--threads", str(self.threads)]
                if self.fault is not None:
                    cmd += ["--fault", self.fault.name] + [a for k in ("layer", "rank", "expert")
                                                           if getattr(self.fault, k) is not None
                                                           for a in (f"--fault-{k}", str(getattr(self.fault, k)))]
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
                logs.append(log)
            try:
                failed = _wait(procs)
                if failed is not None:
                    logs[failed].seek(0)
                    tail = logs[failed].read()[-2000:].strip()
                    raise ShardRunError(f"rank {failed} of {W} failed (exit {procs[failed].returncode}): {tail}")
            finally:
                for p in procs:                                          # only the processes started here
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                for log in logs:
                    log.close()
        return time.perf_counter() - t0


def _wait(procs) -> int | None:
    """Wait for every rank; the first that exits non-zero (its peers then block in a collective) ends
    the wait. Returns its index, or None when all succeeded."""
    while True:
        codes = [p.poll() for p in procs]
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            return bad[0]
        if all(c == 0 for c in codes):
            return None
        time.sleep(0.05)


def _rank_main(argv=None) -> None:
    """One rank: join the group, load the shard, drive the bundle, write rank{r}.kdtr."""
    ap = argparse.ArgumentParser(prog="python -m conformance.verify.shard_run", description=_rank_main.__doc__)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--store", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fault")
    ap.add_argument("--fault-layer", type=int)
    ap.add_argument("--fault-rank", type=int)
    ap.add_argument("--fault-expert", type=int)
    a = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from conformance.verify.collect import collect
    from conformance.precision import holds_routing, profile_taps
    from conformance.records import write_dump
    from conformance.engines.torch_sharded import RankEngine, ShardFault
    from kdtr_format import open_kdtr

    torch.set_num_threads(a.threads)
    plan = ShardPlan(a.tp, a.ep)
    fault = None if a.fault is None else ShardFault(a.fault, a.fault_layer, a.fault_rank, a.fault_expert)
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=plan.world_size,
                            timeout=timedelta(seconds=RANK_TIMEOUT_S))
    try:
        with open_kdtr(a.bundle) as f:                                   # its checksums: verified by the runner
            e = RankEngine(plan, a.rank, fault)
            e.load(f)
            hold = holds_routing(f.metadata, "fp32")
            out = collect(e, f, None, hold, profile_taps(f.metadata, "fp32") if hold else None)
            info = {"world_size": plan.world_size, "tp": plan.tp, "ep": plan.ep, "backend": "gloo",
                    "torch": torch.__version__, "fault": None if fault is None else fault.__dict__}
            write_dump(out, str(rank_file(a.out, a.rank)), "torch", "float32",
                       f.metadata.get("provenance", {}).get("command", ""), info,
                       routing="held" if hold else "free", shard=plan.metadata(e.cfg, a.rank))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        _rank_main()
    except ShardError as err:
        sys.exit(f"kdtr sharded rank: {err}")
