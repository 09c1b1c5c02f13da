"""How good a distilled `tiny` drafter is, without writing a bundle: the AR / DDTree target-forward ratio
on the golden prompts of the FP32 and INT4 bundles and on held-out prompts, the accepted-depth histogram,
full-depth rounds, and the per-offset accuracy of the drafter's top-1 against the target's stream (next to
the "permutation oracle": perm^k(bonus), the target construction's own rule, which no drafter may read but
which bounds what a per-token lookup can reach).

    python bench/bench_drafter.py [--steps N] [--set field=value ...] [--corpus-cache PATH]

`--set` overrides a DistillSettings field (e.g. `--set gamma=10 --set sequences=480`); `--mlp I` changes the
drafter's intermediate_size. The corpus (the target's greedy streams) can be cached between runs. Training
runs in this process with the machine's own math kernels, not pinned as `kdtr gen` pins them
(refmodel/pinned.py): its drafter is the bundle's in distribution, not bit for bit. The INT4 figures use
the committed INT4 bundle's prompts (its first random prompt was redrawn: bundles/MANIFEST.md).

Measurements it made: refmodel/distill.py (DistillSettings) and bundles/MANIFEST.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np
import torch

from conformance.gen.bundle_model import _bf16_round
from conformance.gen.goldens import random_prompt
from refmodel import ddtree
from refmodel.config import PRESETS
from refmodel.ddtree import ddtree_generate
from refmodel.distill import DistillSettings, make_corpus
from refmodel.distill_torch import train
from refmodel.drafter import DrafterConfig, drafter_preset
from refmodel.quant import dequantize_model, quantize_model
from refmodel.weights import init_weights, permutation

HELD_OUT_SEED = 1        # prompts of another seed: the drafter never saw them (nor the golden ones)


def evaluate(cfg, W, dcfg, DW, prompts, n=64, budget=32):
    """Forward ratio; depth histogram; full-depth and off-spine rounds (a rank >= 1 node accepted); per offset,
    the top-1 accuracy of the drafter's spine (its rank-0 path in the tree: a spine the budget cut short
    counts as a miss) and the drafter's mean top-1 probability (the tree scores a path by the sum of its
    rows' log-probabilities, so deep rows that are right but unsure keep the spine out of the budget)."""
    ar = dd = 0
    depths, hits, tries, runs = [], np.zeros(dcfg.block_size - 1), np.zeros(dcfg.block_size - 1), []
    top1_prob = []                                  # per drafter call: each row's largest softmax probability
    draft_logits = ddtree.draft_logits

    def recording(*a):
        q = draft_logits(*a)                                                        # [B-1, V]
        e = np.exp(q - q.max(-1, keepdims=True))
        top1_prob.append(e.max(-1) / e.sum(-1))
        return q
    ddtree.draft_logits = recording                 # ddtree_generate looks it up at call time
    try:
        for p in prompts:
            runs.append(ddtree_generate(cfg, W, dcfg, DW, p, n, budget=budget))
    finally:
        ddtree.draft_logits = draft_logits
    for p, r in zip(prompts, runs):
        ar += n
        dd += r.counters.target_forwards
        depths += [x.accepted_depth for x in r.rounds]
        stream = list(p) + list(r.tokens)
        for x in r.rounds:                          # the spine: rank-0 children from the root down
            node, spine = 0, []
            while True:
                kids = [j + 1 for j in range(len(x.tree_tokens)) if x.parents[j + 1] == node and x.ranks[j] == 0]
                if not kids:
                    break
                node = kids[0]
                spine.append(int(x.tree_tokens[node - 1]))
            for k in range(1, dcfg.block_size):
                if x.start + k < len(stream):
                    tries[k - 1] += 1
                    hits[k - 1] += k <= len(spine) and spine[k - 1] == stream[x.start + k]
    off_spine = sum(int(any(x.ranks[i - 1] > 0 for i in x.accepted[1:])) for r in runs for x in r.rounds)
    return {"ratio": round(ar / dd, 3), "hist": np.bincount(depths, minlength=16).tolist(),
            "full_depth": int(np.sum(np.array(depths) == dcfg.block_size - 1)), "off_spine": off_spine,
            "spine_acc": np.round(hits / np.maximum(tries, 1), 2).tolist(),
            "top1_prob": np.round(np.mean(top1_prob, axis=0), 2).tolist()}


def perm_oracle_accuracy(cfg, W, prompts, seed, n=64, L=15):
    """Per offset k: how often perm^k(x_t) equals x_{t+k} on the target's own greedy streams."""
    from refmodel.generate import greedy_generate
    perm = permutation(cfg, seed)
    hit, tot = np.zeros(L), np.zeros(L)
    for p in prompts:
        s = list(p) + greedy_generate(cfg, W, p, n).tokens
        for t in range(len(p), len(s) - 1):
            x = s[t]
            for k in range(1, min(L, len(s) - 1 - t) + 1):
                x = perm[x] if x < len(perm) else -1
                hit[k - 1] += x == s[t + k]
                tot[k - 1] += 1
    return np.round(hit / np.maximum(tot, 1), 2).tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--mlp", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--corpus-cache", default=None)
    ap.add_argument("--held-out", type=int, default=8)
    ap.add_argument("--oracle", action="store_true")
    ap.add_argument("--save", default=None, help="write the bf16-rounded drafter weights here (.npz)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg, seed = PRESETS["tiny"], 0
    W = {k: v.astype(np.float32).astype(np.float64) for k, v in init_weights(cfg, seed).items()}
    dcfg = drafter_preset("tiny")
    if args.mlp or args.layers:
        dcfg = DrafterConfig(**{**dcfg.to_dict(), **({"intermediate_size": args.mlp} if args.mlp else {}),
                                **({"num_hidden_layers": args.layers} if args.layers else {})})
    over = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        over[k] = json.loads(v)
        if isinstance(over[k], list):
            over[k] = tuple(over[k])
    s = dataclasses.replace(DistillSettings(), **over)
    if args.steps:
        s = dataclasses.replace(s, steps=args.steps)
    t0 = time.perf_counter()
    cache = args.corpus_cache
    if cache and os.path.exists(cache):
        z = np.load(cache)
        ids, feats, plens = z["ids"], z["feats"], z["plens"]
    else:
        ids, feats, plens = make_corpus(cfg, W, dcfg, seed, s)
        if cache:
            np.savez(cache, ids=ids, feats=feats, plens=plens)
    t1 = time.perf_counter()
    torch.manual_seed(seed)
    losses = []
    DW = train(cfg, W, dcfg, seed, s, ids, feats, plens, lambda st, d, t, loss: losses.append(loss))
    t2 = time.perf_counter()
    DW = {k: v.astype(np.float64) for k, v in _bf16_round(DW).items()}
    if args.save:
        np.savez(args.save, **DW)
    golden = [random_prompt(cfg, seed, i, 0) for i in range(4)]
    held = [random_prompt(cfg, HELD_OUT_SEED, i, 0) for i in range(args.held_out)]
    W4 = dequantize_model(quantize_model(W, cfg, "experts"))
    golden4 = [np.array([394])] + golden[1:]          # the INT4 bundle's first prompt was redrawn
    res = {"settings": over, "steps": s.steps, "mlp": dcfg.intermediate_size, "layers": dcfg.num_hidden_layers,
           "final_loss": round(float(np.mean(losses[-50:])), 4), "corpus_s": round(t1 - t0, 1), "train_s": round(t2 - t1, 1),
           "fp32": evaluate(cfg, W, dcfg, DW, golden), "int4": evaluate(cfg, W4, dcfg, DW, golden4),
           "held_out": evaluate(cfg, W, dcfg, DW, held)}
    if args.oracle:
        res["perm_oracle_acc"] = perm_oracle_accuracy(cfg, W, golden, seed)
    res["eval_s"] = round(time.perf_counter() - t2, 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
