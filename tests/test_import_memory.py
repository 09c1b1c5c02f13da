"""`kdtr import` memory bound: peak RSS over a multi-shard import stays within the largest tensor plus the
writer's buffers, far below the checkpoint (runs bench/bench_import.py --small in a fresh process)."""
import json
import os
import subprocess
import sys

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_peak_rss_is_bounded_by_the_largest_tensor():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_import.py"), "--shards", "4",
                           "--small", "--json"], cwd=REPO, capture_output=True, text=True, check=True)
    f = json.loads(proc.stdout.strip().splitlines()[-1])
    peak, largest, total = f["peak_above_baseline_bytes"], f["largest_tensor_bytes"], f["total_bytes"]
    print(f"\nimport of {f['shards']} shards ({total / MiB:.1f} MiB, largest tensor {largest / MiB:.1f} MiB): "
          f"peak RSS {peak / MiB:.1f} MiB above the pre-import baseline (VmHWM reset: {f['hwm_reset']})")
    assert f["shards"] == 4 and total > 6 * largest
    # Budget: the mapped pages of one tensor + 8 MiB of writer buffers / allocator slack (measured 1.03x).
    assert peak <= largest + 8 * MiB, f"peak {peak / MiB:.1f} MiB for largest tensor {largest / MiB:.1f} MiB"
