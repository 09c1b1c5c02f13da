"""What the cost-aware budget (refmodel/ddtree.py, docs/ddtree.md §3a) would gain over the best fixed budget,
projected from measured verify costs: the committed bundles' own drafters and targets (the NumPy reference),
each prompt's stream decoded with fixed budgets and with the cost-aware cut of a budget-32 tree, the rounds
priced with a verify-cost table (verify / AR step by rows; default: one K2.6 layer at 4096 cached rows on the
H200, docs/k26-scale.md).

    python bench/bench_budget_policy.py [--costs 1:1,2:1.54,5:2.34,9:3.42,17:6.1,33:10.54] [--draft-cost 0]
                                        [--tokens 32] [--json out.json] [BUNDLE ...]

Projected speedup = tokens / (sum over rounds of draft_cost + verify_cost(rows)), in AR steps (an AR step
costs 1 per token); the prefill, the lm_head and the tree builder are left out, as in docs/k26-scale.md. The
drafters of the committed bundles accept far more than a real drafter on real text, so the figures say how the
policy behaves on streams of known acceptance, not what K2.6 would reach.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BUNDLES = ["model_tiny", "model_int4_tiny", "model_edge", "model_shardable_int4"]
# verify / AR step of one K2.6 layer at 4096 cached rows, by rows (1 = the AR step): the H200 runs of stop 39
# (attention's GEMMs and the bf16 linear of 2 or more rows on the tensor cores; docs/k26-scale.md)
K26_4K = {1: 1.0, 2: 1.54, 5: 2.34, 9: 3.42, 17: 6.10, 33: 10.54}
K26_4K_TEXT = ",".join(f"{r}:{c:g}" for r, c in K26_4K.items())
FIXED = (1, 2, 4, 8, 16, 32)


def parse_costs(text: str) -> dict[int, float]:
    from refmodel.ddtree import parse_verify_costs

    try:
        return parse_verify_costs(text)
    except ValueError as e:
        sys.exit(f"--costs: {e}")


def run(path: str, costs: dict[int, float], draft_cost: float, n_tokens: int) -> dict:
    import numpy as np

    from kdtr_format import open_kdtr
    from refmodel.ddtree import generate, verify_cost_table
    from refmodel.drafter import read_drafter
    from refmodel.stored import read_model

    price = verify_cost_table(costs)
    with open_kdtr(path) as f:
        cfg, W = read_model(f)
        dcfg, DW = read_drafter(f)
        offsets = f.metadata.get("position_offsets", [0] * f.metadata["prompts"])
        prompts = [(np.array(f[f"golden/p{i}/prompt_ids"], np.int64), int(offsets[i]))
                   for i in range(f.metadata["prompts"])]
    rows = {}
    for name, budget, cost in [(f"b={b}", b, None) for b in FIXED] + [("cost-aware (cap 32)", 32, price)]:
        tokens = spent = rounds = nodes = 0
        for prompt, pos0 in prompts:
            res = generate(cfg, W, prompt, n_tokens, dcfg, DW, budget, pos0=pos0, verify_cost=cost,
                           draft_cost=draft_cost)
            tokens += len(res.tokens) - 1                    # the prefill's token is not a round's
            spent += sum(draft_cost + price(r.tree_size) for r in res.rounds)
            rounds += len(res.rounds)
            nodes += sum(r.tree_size - 1 for r in res.rounds)
        rows[name] = {"speedup": tokens / spent, "tokens_per_round": tokens / rounds, "rounds": rounds,
                      "mean_nodes": nodes / rounds}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="*", help="bundles (default: the committed ones)")
    ap.add_argument("--costs", default=K26_4K_TEXT, help="verify / AR step by rows, rows:cost,... (default: K2.6, 4K rows)")
    ap.add_argument("--draft-cost", type=float, default=0.0, help="cost of one drafter call, in AR steps")
    ap.add_argument("--tokens", type=int, default=32, help="tokens decoded per prompt")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    costs = parse_costs(a.costs)
    paths = a.bundles or [os.path.join(ROOT, "bundles", b + ".kdtr") for b in BUNDLES]
    out = {"costs": costs, "draft_cost": a.draft_cost, "tokens": a.tokens, "bundles": {}}
    for p in paths:
        rows = run(p, costs, a.draft_cost, a.tokens)
        out["bundles"][os.path.basename(p)] = rows
        best = max((r for r in rows if r.startswith("b=")), key=lambda r: rows[r]["speedup"])
        auto = rows["cost-aware (cap 32)"]
        print(f"{os.path.basename(p)}: best fixed {best} {rows[best]['speedup']:.2f}x; cost-aware "
              f"{auto['speedup']:.2f}x ({auto['mean_nodes']:.1f} nodes a round, {auto['tokens_per_round']:.2f} "
              f"tokens a round) = {auto['speedup'] / rows[best]['speedup']:.3f} x the best fixed budget")
        for r, v in rows.items():
            print(f"    {r:22s} {v['speedup']:.2f}x  {v['tokens_per_round']:.2f} tokens/round  "
                  f"{v['mean_nodes']:.1f} nodes/round  {v['rounds']} rounds")
    if a.json:
        from kdtr_format.paths import write_atomically
        write_atomically(a.json, lambda fh: fh.write(json.dumps(out, indent=1).encode()))


if __name__ == "__main__":
    main()
