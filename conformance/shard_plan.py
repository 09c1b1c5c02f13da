"""How a sharded engine splits its records over ranks (docs/run-dump.md §7), and putting them back.

A sharded run writes one run dump per rank, `rank{r}.kdtr`, with metadata `shard`: the rank, the world
size and, per layer tap (`L{l}/{tap}`, also `final_hidden`, `logits`), how that rank's records of the tap
hold it. Four splits:

    replicated   every rank holds the whole record (the default for a tap the plan does not list)
    heads        axis 1 of `q` [T, H, A]: this rank's heads [start, stop), contiguous, rank after rank
    experts      the last axis of `router_scores` [T, E]: this rank's experts [start, stop)
    rows         axis 0, the tokens of each forward split as numpy.array_split splits them (the first
                 T % W ranks one row more): a prefill's P rows over the ranks; a decode step's single
                 row on rank 0, so rank 0 holds every decode step's row and the others none

The plan kdtr's own sharded engine uses (ShardPlan) is one such plan; the judge reads any plan whose
shards tile their axis in rank order (`reassemble`), so an external engine may shard otherwise.

Legend: T tokens of a forward, H heads, A = qk_nope_head_dim + qk_rope_head_dim, E n_routed_experts,
W world size, P prompt length.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refmodel.config import ModelConfig

SHARD_SCHEMA = "kdtr-shard/1"
# Planted sharding faults of kdtr's sharded torch engine, for the tests (conformance/engines/torch_sharded.py).
SHARD_FAULTS = ("no_allreduce", "head_stride", "expert_wrong_rank", "combine_twice", "shared_every_rank")
SPLITS = ("replicated", "heads", "experts", "rows")
_AXIS = {"heads": 1, "experts": -1, "rows": 0}


class ShardError(ValueError):
    """Rank dumps or a sharding plan that do not fit together (the message names the rank and record)."""


def rows_of(T: int, W: int, rank: int) -> tuple[int, int]:
    """Rows [lo, hi) of a T-row forward that `rank` holds under the `rows` split (numpy.array_split)."""
    base, extra = divmod(T, W)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


@dataclass(frozen=True)
class ShardPlan:
    """kdtr's sharded torch engine (conformance/engines/torch_sharded.py) over W = max(tp, ep) ranks: attention
    tensor-parallel when tp = W (heads contiguous per rank, an all-reduce after o_proj), replicated when
    tp = 1; MoE layers expert-parallel when ep = W (experts contiguous per rank; each rank owns the rows
    `rows_of` gives it, dispatches their (token, expert) pairs by all-to-all and combines what comes
    back), else tensor-parallel over the expert width when tp = W (an all-reduce after the MoE). The lm_head
    is vocabulary-parallel with an all-gather, so every rank holds the same logits."""
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        W = self.world_size
        for name, v in (("tp", self.tp), ("ep", self.ep)):
            if not isinstance(v, int) or v < 1 or v not in (1, W):
                raise ShardError(f"--{name} {v}: --tp and --ep are each 1 or the world size (the larger of the "
                                 f"two); with both above 1 they must be equal (TP and EP on the same ranks)")

    @property
    def world_size(self) -> int:
        return max(self.tp, self.ep)

    def check(self, cfg: ModelConfig) -> None:
        """The model divides over the ranks as this plan splits it, or a ShardError naming the field."""
        W, need = self.world_size, [("vocab_size", cfg.vocab_size)]
        if self.tp > 1:
            need += [("num_attention_heads", cfg.num_attention_heads), ("intermediate_size", cfg.intermediate_size)]
            if self.ep == 1:
                need += [("moe_intermediate_size", cfg.moe_intermediate_size)]
        if self.ep > 1:
            need += [("n_routed_experts", cfg.n_routed_experts)]
        for name, v in need:
            if v % W:
                raise ShardError(f"{name} = {v} does not divide over {W} ranks (--tp {self.tp} --ep {self.ep}): "
                                 f"use a bundle whose model shards that way (kdtr gen --preset shardable)")

    def heads(self, cfg: ModelConfig, rank: int) -> tuple[int, int]:
        n = cfg.num_attention_heads // self.tp
        return (rank * n, (rank + 1) * n) if self.tp > 1 else (0, cfg.num_attention_heads)

    def experts(self, cfg: ModelConfig, rank: int) -> tuple[int, int]:
        n = cfg.n_routed_experts // self.ep
        return (rank * n, (rank + 1) * n) if self.ep > 1 else (0, cfg.n_routed_experts)

    def records(self, cfg: ModelConfig, rank: int) -> dict:
        """{tap path: split entry} for every tap this plan does not replicate."""
        rec = {}
        for l in range(cfg.num_hidden_layers):
            if self.tp > 1:
                lo, hi = self.heads(cfg, rank)
                rec[f"L{l}/q"] = {"split": "heads", "start": lo, "stop": hi}
            if self.ep > 1 and l >= cfg.first_k_dense_replace:
                lo, hi = self.experts(cfg, rank)
                rec[f"L{l}/router_scores"] = {"split": "experts", "start": lo, "stop": hi}
                rec[f"L{l}/mlp_out"] = {"split": "rows"}
        return rec

    def metadata(self, cfg: ModelConfig, rank: int) -> dict:
        """The run dump's metadata `shard` for `rank`."""
        return {"schema": SHARD_SCHEMA, "rank": rank, "world_size": self.world_size, "tp": self.tp,
                "ep": self.ep, "default": "replicated", "records": self.records(cfg, rank)}


@dataclass(frozen=True)
class ShardFault:
    """A planted sharding fault: its name (SHARD_FAULTS) and where (conformance/engines/torch_sharded.py)."""
    name: str
    layer: int | None = None
    rank: int | None = None
    expert: int | None = None

    def at(self, name: str, layer: int | None = None) -> bool:
        return self.name == name and (self.layer is None or layer is None or self.layer == layer)

    def check(self, plan: ShardPlan) -> None:
        """A fault this plan cannot show is a usage error, never a silent pass."""
        if self.name not in SHARD_FAULTS:
            raise ShardError(f"unknown sharding fault {self.name!r}; choose one of {', '.join(SHARD_FAULTS)}")
        need = {"no_allreduce": ("--tp > 1", plan.tp > 1), "head_stride": ("--tp > 1", plan.tp > 1),
                "expert_wrong_rank": ("--ep > 1", plan.ep > 1), "combine_twice": ("--ep > 1", plan.ep > 1),
                "shared_every_rank": ("--tp > 1 with --ep 1", plan.tp > 1 and plan.ep == 1)}[self.name]
        if not need[1]:
            raise ShardError(f"fault {self.name} needs {need[0]}")


# ---------------------------------------------------------------- reading rank dumps back

def tap_path(name: str) -> str | None:
    """The plan key of a run-dump record name: p0/prefill/L3/q -> L3/q, p0/prefill/logits -> logits;
    None for records no plan splits (ar/logits, tokens, DDTree records)."""
    parts = name.split("/")
    if len(parts) == 4 and parts[1] in ("prefill", "ar") and parts[2].startswith("L"):
        return f"{parts[2]}/{parts[3]}"
    if len(parts) == 3 and parts[1] == "prefill" and parts[2] in ("final_hidden", "logits"):
        return parts[2]
    return None


def check_metadata(metas: list[dict]) -> list[str]:
    """Problems of the ranks' `shard` metadata (metas[r] from rank{r}.kdtr), one line each."""
    problems = []
    W = len(metas)
    for r, m in enumerate(metas):
        if not isinstance(m, dict) or m.get("schema") != SHARD_SCHEMA:
            problems.append(f"rank{r}.kdtr: metadata shard.schema must be {SHARD_SCHEMA!r} (docs/run-dump.md §7)")
            continue
        if m.get("rank") != r or m.get("world_size") != W:
            problems.append(f"rank{r}.kdtr: metadata shard says rank {m.get('rank')!r} of world size "
                            f"{m.get('world_size')!r}, but the directory holds rank0..rank{W - 1}")
        recs = m.get("records", {})
        if not isinstance(recs, dict):
            problems.append(f"rank{r}.kdtr: metadata shard.records must be an object")
            continue
        for path, e in recs.items():
            if not isinstance(e, dict) or e.get("split") not in SPLITS:
                problems.append(f"rank{r}.kdtr: shard.records[{path!r}].split must be one of {', '.join(SPLITS)}")
    if problems:
        return problems
    paths = set().union(*(m["records"] for m in metas))
    for path in sorted(paths):
        kinds = {metas[r]["records"].get(path, {"split": "replicated"})["split"] for r in range(W)}
        if len(kinds) > 1:
            problems.append(f"shard.records[{path!r}]: the ranks disagree on its split ({sorted(kinds)})")
    return problems


def pieces_layout(metas: list[dict], path: str, name: str, size: int) -> list[tuple[int, int]] | str:
    """[(lo, hi)] along the split axis per rank for record `name` of tap `path` whose whole has `size`
    entries on that axis, or the problem (shards that do not tile the axis in rank order)."""
    e0 = metas[0]["records"][path]
    W = len(metas)
    if e0["split"] == "rows":
        if name.split("/")[1] == "ar":                                   # one row per decode forward: rank 0's
            return [(0, size)] + [(size, size)] * (W - 1)
        return [rows_of(size, W, r) for r in range(W)]
    spans, at = [], 0
    for r, m in enumerate(metas):
        e = m["records"][path]
        lo, hi = e.get("start"), e.get("stop")
        if not (isinstance(lo, int) and isinstance(hi, int) and lo == at and hi >= lo):
            return (f"shard.records[{path!r}]: rank {r} holds {e0['split']} [{lo}, {hi}), but the ranks' "
                    f"shards must tile [0, {size}) in rank order (this one must start at {at})")
        spans.append((lo, hi))
        at = hi
    if at != size:
        return f"shard.records[{path!r}]: the ranks' {e0['split']} shards end at {at}, the record has {size}"
    return spans


def reassemble(f, outs: list[dict], metas: list[dict]) -> tuple[list[dict], dict, list[str]]:
    """Rank r's view of the run for each r: its own copy of every replicated record and the whole of every
    split record (its pieces put back in rank order); `spans` {record: [(lo, hi) per rank], axis}; and
    the problems (each naming the rank and the record). `f`: the open bundle (a split record's size on
    its axis is its golden's)."""
    problems, W = [], len(outs)
    views: list[dict] = [{} for _ in range(W)]
    spans: dict = {}
    names = list(dict.fromkeys(n for o in outs for n in o))
    for name in names:
        path = tap_path(name)
        split = metas[0]["records"].get(path, {"split": "replicated"})["split"] if path else "replicated"
        have = [r for r in range(W) if name in outs[r]]
        if len(have) != W:
            problems.append(f"{name}: in rank(s) {have} only; every rank writes every record it has a "
                            f"shard of (a replicated record: its copy)")
            continue
        if split == "replicated":
            for r in range(W):
                views[r][name] = outs[r][name]
            continue
        g = f.get("golden/" + name) if ("golden/" + name) in f else None
        if g is None:
            continue                                                     # no golden: ignored, as in a dump
        axis = _AXIS[split] % g.ndim
        layout = pieces_layout(metas, path, name, g.shape[axis])
        if isinstance(layout, str):
            problems.append(layout)
            continue
        bad = [f"rank {r} holds shape {tuple(np.shape(outs[r][name]))}, expected {_piece_shape(g.shape, axis, lo, hi)}"
               for r, (lo, hi) in enumerate(layout)
               if tuple(np.shape(outs[r][name])) != _piece_shape(g.shape, axis, lo, hi)]
        if bad:
            problems.append(f"{name} ({split} split): " + "; ".join(bad))
            continue
        whole = np.concatenate([np.asarray(outs[r][name]) for r in range(W)], axis=axis)
        for r in range(W):
            views[r][name] = whole
        spans[name] = (layout, axis)
    return views, spans, problems


def _piece_shape(shape, axis: int, lo: int, hi: int) -> tuple:
    return tuple(hi - lo if a == axis else n for a, n in enumerate(shape))


def ranks_holding(bad: np.ndarray, layout: list[tuple[int, int]], axis: int) -> list[int]:
    """The ranks whose pieces (layout along `axis`) contain a True of the elementwise mask `bad`."""
    moved = np.moveaxis(np.asarray(bad), axis, 0)
    return [r for r, (lo, hi) in enumerate(layout) if hi > lo and bool(moved[lo:hi].any())]
