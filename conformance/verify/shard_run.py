"""Starting a sharded torch run: one process per rank, torch.distributed over gloo (CPU), each rank driving
the bundle through conformance.verify.collect and writing its own rank dump (docs/run-dump.md §7).

`kdtr verify BUNDLE --engine torch --tp N [--ep M]` makes a ShardedTorchEngine; the runner calls its
`run`, which starts the W rank processes, waits for them and leaves `rank{r}.kdtr` in the output folder;
the runner then judges that folder exactly as `kdtr verify --dump-dir` judges one an external engine
wrote (conformance/verify/judge_ranks.py), so the two verdicts are the same.

The ranks are forked by one launcher process (`python -m conformance.verify.shard_run JOB`) that imported
torch once (this process never imports it): a torch import costs seconds of CPU, and W of them on a 2-core
machine cost more than the run. They meet through a rendezvous file (no network port) and each gives up
after RANK_TIMEOUT_S in one collective, so a rank that dies never leaves its peers waiting for ever.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

from conformance.shard_plan import ShardFault, ShardPlan
from kdtr_format import open_kdtr
from refmodel.config import ModelConfig

RANK_TIMEOUT_S = 120        # a collective waiting this long means a rank is gone or out of step
LAUNCH_TIMEOUT_S = 3600     # a whole sharded run; far above any bundle's (bench/bench_sharded.py)
_ROOT = Path(__file__).resolve().parents[2]    # the repository root the launcher imports from


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

    def __init__(self, tp: int = 1, ep: int = 1, fault: ShardFault | None = None, threads: int = 1):
        self.plan = ShardPlan(tp, ep)
        if fault is not None:
            fault.check(self.plan)
        self.fault, self.threads = fault, threads

    def describe(self) -> str:
        p = self.plan
        return (f"kdtr's sharded PyTorch DeepseekV3, float32, {p.world_size} rank process(es) over gloo: "
                f"attention {'tensor-parallel' if p.tp > 1 else 'replicated'}, MoE "
                f"{'expert-parallel' if p.ep > 1 else 'tensor-parallel' if p.tp > 1 else 'whole'}"
                + (f"; planted fault {self.fault}" if self.fault else ""))

    def run(self, bundle: str, folder: str) -> float:
        """Start the ranks on `bundle`, each writing rank{r}.kdtr into `folder`; returns the wall seconds.
        Raises ShardRunError when a rank fails (the others are stopped), ShardError before any starts when
        the bundle's model does not divide over the ranks."""
        with open_kdtr(bundle) as f:
            self.plan.check(ModelConfig.from_dict(f.metadata["model_config"]))
        t0 = time.perf_counter()
        job = {"bundle": os.fspath(bundle), "folder": os.fspath(folder), "tp": self.plan.tp, "ep": self.plan.ep,
               "fault": None if self.fault is None else asdict(self.fault), "threads": self.threads}
        path = [str(_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))        # the launcher imports this kdtr
        with tempfile.TemporaryDirectory(prefix="kdtr-ranks-") as tmp:
            job["tmp"] = tmp
            p = subprocess.Popen([sys.executable, "-m", "conformance.verify.shard_run", json.dumps(job)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                said, _ = p.communicate(timeout=LAUNCH_TIMEOUT_S)
            finally:
                if p.poll() is None:                                     # only the launcher started here
                    p.kill()
                    p.wait()
            if p.returncode:
                errors = sorted(Path(tmp).glob("rank*.error"))
                why = errors[0].read_text()[-2000:].strip() if errors else said[-2000:].strip()
                who = errors[0].stem if errors else "the rank launcher"
                raise ShardRunError(f"{who} of {self.plan.world_size} failed: {why}")
        return time.perf_counter() - t0


def _launch(job: dict) -> int:
    """The launcher process: import torch once, fork one child per rank (before any torch op, so the fork
    is safe), wait; when a rank fails, stop the others (the children forked here). Returns the exit code."""
    import torch  # noqa: F401 - imported once here, inherited by every rank

    from conformance.engines import torch_sharded  # noqa: F401
    from conformance.verify import collect  # noqa: F401

    plan = ShardPlan(job["tp"], job["ep"])
    fault = None if job["fault"] is None else ShardFault(**job["fault"])
    store = os.path.join(job["tmp"], "rendezvous")
    pids = {}
    for r in range(plan.world_size):
        pid = os.fork()
        if pid == 0:                                                     # the rank
            code = 0
            try:
                _rank(job["bundle"], job["folder"], r, plan, fault, store, job["threads"])
            except BaseException:  # noqa: BLE001 - everything a rank raises goes to its error file
                Path(job["tmp"], f"rank{r}.error").write_text(traceback.format_exc())
                code = 1
            os._exit(code)
        pids[pid] = r
    code = 0
    while pids:
        pid, status = os.wait()
        pids.pop(pid, None)
        if os.waitstatus_to_exitcode(status) != 0 and code == 0:
            code = 1
            for other in pids:                                           # its peers would wait in a collective
                os.kill(other, signal.SIGKILL)
    return code


def _rank(bundle, folder, rank, plan, fault, store, threads) -> None:
    import torch
    import torch.distributed as dist

    from conformance.engines.torch_sharded import RankEngine
    from conformance.precision import holds_routing, profile_taps
    from conformance.records import write_dump
    from conformance.verify.collect import collect
    from kdtr_format import open_kdtr

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=plan.world_size,
                            timeout=timedelta(seconds=RANK_TIMEOUT_S))
    try:
        with open_kdtr(bundle) as f:                                     # its checksums: verified by the runner
            e = RankEngine(plan, rank, fault)
            e.load(f)
            hold = holds_routing(f.metadata, "fp32")
            out = collect(e, f, None, hold, profile_taps(f.metadata, "fp32") if hold else None)
            info = {"world_size": plan.world_size, "tp": plan.tp, "ep": plan.ep, "backend": "gloo",
                    "torch": torch.__version__, "fault": None if fault is None else fault.__dict__}
            write_dump(out, str(rank_file(folder, rank)), "torch", "float32",
                       f.metadata.get("provenance", {}).get("command", ""), info,
                       routing="held" if hold else "free", shard=plan.metadata(e.cfg, rank))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(_launch(json.loads(sys.argv[1])))
