"""`kdtr gen`: build a golden bundle (schema: docs/golden-bundles.md).

A bundle holds the model (weights as stored, float32 or INT4 `.qw`/`.sc`), the drafter, the prompts and
what a correct engine must produce for them: every prefill tap, the greedy AR stream with its logits and
decode-step taps, and the DDTree rounds, for ordinary prompts (positions from 0) and one long-position
prompt (positions from `long_position`). The goldens are the float64 reference run on exactly the stored
weights; each tap's tolerance is derived from a float32 run of the same reference on the same weights and
tokens, and a prompt whose greedy margins are not far above that noise, or whose float32 run already
picks other experts, is rejected: a correct fp32 engine can then never flip a golden decision.

Three modules: conformance.gen.bundle_model (where the model comes from), conformance.gen.goldens (golden runs,
prompts, tolerances) and this one (which prompts, the redraw loop, the bundle's records and metadata).
"""
from __future__ import annotations

import multiprocessing
import os
import platform
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Callable

import numpy as np

# The CLI, the tests and conformance.gen.bf16_profile take the model sources and golden runs from here too.
from conformance.gen.bundle_model import (LONG_POSITION_OFFSET, GenError, GenSettings, Model, _f32,  # noqa: F401
                                          apply_quant, as_stored, default_drafter, model_from_kdtr,
                                          model_from_preset, quant_of)
from conformance.gen.goldens import (AR_TAPS, LONG_NEW_TOKENS, MAX_REDRAWS, PromptGoldens,  # noqa: F401
                                 long_position_default, long_position_extent, baseline_errors, check_decisive, check_prompt, decisive_atols,
                                 golden_for_prompt, long_prompt, manifest, random_prompt,
                                 routing_near_tie_count, run_reference)
from conformance.gen.bf16_profile import bf16_profile
from conformance.gen.from_checkpoint import model_from_checkpoint  # noqa: F401 - the CLI takes it from here
from conformance.records import BUNDLE_SCHEMA, offsets, ragged
from kdtr_format import Tensor, write_kdtr
from kdtr_format.bf16 import bf16_bits, is_bf16
from refmodel.config import PRESETS  # noqa: F401 - tests pick the preset config through this module
from refmodel.model import tap_names
from refmodel.stored import StoredWeights, upcast_if_fits

ROUTING_NEAR_TIES = ("forbid", "held")
LONG_POSITION_RULE = ("default: min(196608, max_position_embeddings - (prompt length + stream length + block "
                      "size)), 0 (none) when not positive; --long-position P: P, which must fit")   # kdtr gen --routing-near-ties (docs/conformance.md, section 3a)


# ---------------------------------------------------------------- the bundle's records

# ---------------------------------------------------------------- the bundle

def ddtree_tensors(dd) -> dict:
    """Per-round DDTree records as ragged tensors with offsets (docs/golden-bundles.md)."""
    R = dd.rounds
    return {
        "ddtree/tokens": np.asarray(dd.tokens, np.int64),
        "ddtree/round_start": np.array([r.start for r in R], np.int64),
        "ddtree/round_bonus": np.array([r.bonus for r in R], np.int64),
        "ddtree/round_accepted_depth": np.array([r.accepted_depth for r in R], np.int64),
        "ddtree/tree_offsets": offsets([r.tree_size for r in R]),            # rows of round r: [o[r], o[r+1])
        "ddtree/tree_tokens": ragged([[-1] + list(r.tree_tokens) for r in R]),   # row 0 of a round = root (-1 here)
        "ddtree/tree_parents": ragged([r.parents for r in R]),
        "ddtree/tree_depths": ragged([[0] + list(r.depths) for r in R]),
        "ddtree/tree_ranks": ragged([[0] + list(r.ranks) for r in R]),
        "ddtree/verify_argmax": ragged([r.verify_argmax for r in R]),
        "ddtree/accepted_offsets": offsets([len(r.accepted) for r in R]),
        "ddtree/accepted": ragged([r.accepted for r in R]),
        "ddtree/counters": np.array([dd.counters.target_forwards, dd.counters.drafter_forwards], np.int64),
    }


def _store(name: str, v: np.ndarray):
    if v.dtype.kind == "f":
        return v.astype(np.float32)     # goldens stored float32: rounding <= 0.5 ULP, below every floor
    return v


def bundle_tensors(m: Model, pgs: list[PromptGoldens]):
    """Yields (name, array) in the bundle's fixed order: weights, drafter, then goldens per prompt."""
    yield from _weight_tensors(m.W)
    for k, v in m.DW.items():
        yield k, Tensor(_bf16_bits(v), dtype="bfloat16")
    for i, pg in enumerate(pgs):
        p = f"golden/p{i}/"
        yield p + "prompt_ids", pg.prompt
        yield p + "ar/tokens", pg.tokens
        yield p + "ar/margins", pg.margins
        for k, v in pg.g64.items():
            yield p + k, _store(k, v)
        for k, v in ddtree_tensors(pg.ddtree).items():
            yield p + k, v


def _weight_tensors(W):
    """The target's weights as stored: INT4 `.qw` packed, scales and any bfloat16 tensor (a slice's
    StoredWeights keeps raw bits) as bfloat16, everything else float32."""
    items = W.stored_items() if isinstance(W, StoredWeights) else ((k, v, None) for k, v in W.items())
    for k, v, dtype in items:
        if k.endswith(".qw"):
            yield k, Tensor(v, int4_shape=(v.shape[0], v.shape[1] * 8))
        elif dtype == "bfloat16":
            yield k, Tensor(v, dtype="bfloat16")                         # raw bits already
        elif k.endswith(".sc"):
            yield k, Tensor(_bf16_bits(v), dtype="bfloat16")            # K2.6 stores the scales bf16
        else:
            yield k, v


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    if not is_bf16(x):
        raise GenError("bfloat16 tensors (INT4 scales, drafter) must be exactly bfloat16-representable")
    return bf16_bits(x)


def figures(pgs: list[PromptGoldens], L: int) -> dict:
    """Summary figures over the ordinary prompts (positions from 0); the long-position prompt's own under
    "long_position" (its stream is shorter, so it would skew the ratio). L: the draft depth (block - 1)."""
    main = [pg for pg in pgs if pg.pos0 == 0]
    ar = sum(len(pg.tokens) for pg in main)                            # 1 prefill + n-1 decodes per prompt
    dd = sum(pg.ddtree.counters.target_forwards for pg in main)
    depths = np.concatenate([[r.accepted_depth for r in pg.ddtree.rounds] for pg in main])
    off_spine = sum(_off_spine(r) for pg in main for r in pg.ddtree.rounds)
    fig = {
        "ar_target_forwards": ar, "ddtree_target_forwards": dd,
        "drafter_forwards": sum(pg.ddtree.counters.drafter_forwards for pg in main),
        "forward_ratio": round(ar / dd, 4),
        "mean_tokens_per_round": round(float(np.mean(depths + 1)), 4),
        "accepted_depth_histogram": np.bincount(depths, minlength=L + 1).tolist(),
        "full_depth_rounds": int(np.sum(depths == L)),
        "off_spine_rounds": off_spine,
        "min_margin": float(min(pg.margins.min() for pg in pgs)),
        "min_routing_gap": float(min(pg.routing_gap for pg in pgs)),
        "rounds": int(depths.size),
    }
    for i, pg in enumerate(pgs):
        if pg.pos0:
            R = pg.ddtree.rounds
            last = max([len(pg.prompt) + len(pg.tokens) - 2] + [r.start + int(max(r.depths, default=0)) for r in R])
            fig["long_position"] = {"prompt": i, "position_offset": pg.pos0, "prompt_length": len(pg.prompt),
                                    "tokens": len(pg.tokens), "rounds": len(R),
                                    "ddtree_target_forwards": pg.ddtree.counters.target_forwards,
                                    "accepted_depth_histogram": np.bincount([r.accepted_depth for r in R],
                                                                            minlength=L + 1).tolist(),
                                    "last_position": int(pg.pos0 + last)}           # the largest position run
    return fig


def _off_spine(r) -> int:
    """1 when the round accepted a node of draft rank >= 1 (it left the drafter's top-1 spine)."""
    return int(any(r.ranks[i - 1] > 0 for i in r.accepted[1:]))


# ---------------------------------------------------------------- prompts and the redraw loop

@dataclass
class Slot:
    """One golden prompt to be: how to draw candidate `d` (None: an explicit prompt, never redrawn),
    its greedy stream length and its first position."""
    prompt: np.ndarray
    candidate: Callable[[int], np.ndarray] | None
    n: int
    pos0: int


def plan_prompts(m: Model, s: GenSettings) -> list[Slot]:
    """The ordinary prompts (explicit, or random of lengths 1, 5, 10, ...) at positions from 0, then the
    long-position prompt (random, at s.long_position) unless s.long_position is 0."""
    if s.max_new_tokens < 2:
        raise GenError(f"--max-new-tokens {s.max_new_tokens}: need at least 2 (one prefill, one decode)")
    if s.prompts:
        slots = [Slot(check_prompt(m.cfg, p), None, s.max_new_tokens, 0) for p in s.prompts]
    else:
        slots = [Slot(random_prompt(m.cfg, s.seed, i, 0), lambda d, i=i: random_prompt(m.cfg, s.seed, i, d),
                      s.max_new_tokens, 0) for i in range(s.num_prompts)]
    pos0, _ = long_position(m, s)
    if pos0:
        n = min(LONG_NEW_TOKENS, s.max_new_tokens)
        slots.append(Slot(long_prompt(m.cfg, s.seed, 0), lambda d: long_prompt(m.cfg, s.seed, d), n, pos0))
    return slots


def long_position(m: Model, s: GenSettings) -> tuple[int, str]:
    """(the long-position prompt's first position, how it was chosen): --long-position as given, which must
    fit the model's context, else long_position_default."""
    n = min(LONG_NEW_TOKENS, s.max_new_tokens)
    if s.long_position is None:
        return long_position_default(m.cfg, n, m.dcfg.block_size, LONG_POSITION_OFFSET), "default"
    last = s.long_position + long_position_extent(n, m.dcfg.block_size)
    if s.long_position < 0 or (s.long_position and last > m.cfg.max_position_embeddings):
        raise GenError(f"--long-position {s.long_position}: the long-position prompt's positions must lie in "
                       f"[0, max_position_embeddings = {m.cfg.max_position_embeddings}) up to its last tree "
                       f"row ({last}); pass a smaller offset, 0 for no long-position prompt, or leave the option "
                       f"out for the largest that fits")
    return s.long_position, "--long-position"


def decisive_goldens(m: Model, W64: dict, s: GenSettings, slots: list[Slot], progress=None):
    """Goldens for every slot; a random prompt that fails check_decisive is redrawn (the tolerances depend
    on the whole prompt set: judge, redraw, repeat), an explicit one is an error. W64: the model's weights
    in float64 (as_stored: upcast per matmul; upcast once here where memory allows). Returns (goldens,
    manifest)."""
    held = routing_held(s)
    if isinstance(W64, StoredWeights):       # the whole model in float64 once, where memory allows (same values)
        W64 = upcast_if_fits(W64)
    runs = _GoldenRuns(m, W64, s.budget, held, progress)
    pgs = runs.many([(i, sl.prompt, sl.n, sl.pos0) for i, sl in enumerate(slots)])
    draws = [0] * len(pgs)
    while True:
        man = manifest(pgs, quant_of(m), held)
        rejected = [(i, why) for i, pg in enumerate(pgs) if (why := check_decisive(pg, *decisive_atols(man), held))]
        if not rejected:
            return pgs, man
        if any(slots[i].candidate is None or draws[i] + 1 >= MAX_REDRAWS for i, _ in rejected):
            raise GenError("; ".join(f"prompt {i} ({pgs[i].prompt.tolist()[:8]}...) rejected: {why}"
                                     for i, why in rejected) + ". Choose other prompts or another --seed.")
        for i, why in rejected:          # a random prompt that is not decisive is redrawn (and said so)
            draws[i] += 1
            if progress:
                progress(f"redraw p{i}: {why[:60]}", 1, 1, None)
        redo = runs.many([(i, slots[i].candidate(draws[i]), slots[i].n, slots[i].pos0) for i, _ in rejected])
        for (i, _), pg in zip(rejected, redo):
            pgs[i] = pg


CORES_PER_JOB = 4       # a golden run is mostly one core (einsum) with BLAS bursts: leave them room
_FORKED: tuple | None = None    # (model, W64, W32, budget, held) for worker processes: inherited by fork


class _GoldenRuns:
    """The golden runs of many prompts: in this process, or, where the model was upcast once (a plain dict,
    shared copy-on-write) and the machine has CORES_PER_JOB cores per prompt, one forked worker per prompt.
    Each prompt's run is the same computation either way, so the bytes do not depend on the choice."""

    def __init__(self, m: Model, W64, budget: int, held: bool, progress=None):
        self.m, self.W64, self.budget, self.held, self.progress = m, W64, budget, held, progress
        self.W32 = _f32(W64)                 # one float32 copy (a view computed per access when W64 is stored)

    def jobs(self, n: int) -> int:
        # a plain dict is shared copy-on-write; a mapped checkpoint is read by each worker from the files
        shared = isinstance(self.W64, dict) or getattr(self.W64, "mapped", False)
        if n < 2 or not shared or "fork" not in multiprocessing.get_all_start_methods():
            return 1
        return max(1, min(n, (os.cpu_count() or 1) // CORES_PER_JOB))

    def many(self, items: list[tuple]) -> list[PromptGoldens]:
        """items: (index, prompt, new tokens, first position) -> their goldens, in order."""
        jobs, out = self.jobs(len(items)), [None] * len(items)
        if jobs == 1:
            for k, (i, prompt, n, pos0) in enumerate(items):
                tick = None if self.progress is None else (
                    lambda phase, done, total, i=i: self.progress(f"p{i} {phase}", done, total, None))
                out[k] = golden_for_prompt(self.m, self.W64, prompt, n, self.budget, pos0, tick,
                                           hold_routing=self.held, W32=self.W32)
                self._done(k + 1, len(items))
            return out
        global _FORKED
        _FORKED = (self.m, self.W64, self.W32, self.budget, self.held)
        pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
        try:
            futures = {pool.submit(_golden_job, item): k for k, item in enumerate(items)}
            for done, fut in enumerate(as_completed(futures), 1):
                k = futures[fut]
                try:
                    out[k] = fut.result()
                except (BrokenProcessPool, MemoryError) as e:     # a worker killed (out of memory) or failed
                    raise GenError(f"the golden run of prompt {items[k][0]} in a worker process failed "
                                   f"({type(e).__name__}: {e}); {jobs} prompts ran at once: free memory, or "
                                   f"run on a machine with fewer cores per prompt (CORES_PER_JOB = "
                                   f"{CORES_PER_JOB})") from e
                self._done(done, len(items))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)   # the queued prompts never start; no waiting
            raise
        finally:
            _FORKED = None
        pool.shutdown(wait=True)
        return out

    def _done(self, done: int, total: int):
        if self.progress:
            self.progress("goldens", done, total, None)


def _golden_job(item: tuple) -> PromptGoldens:
    # The parent's progress display may have held its console lock when this process forked: write to the
    # plain streams, never through it.
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    m, W64, W32, budget, held = _FORKED
    for W in (W64, W32):                     # a mapped model's layer bar reports to the parent's display
        if getattr(W, "watch", None) is not None:
            W.watch = None
    i, prompt, n, pos0 = item
    return golden_for_prompt(m, W64, prompt, n, budget, pos0, None, hold_routing=held, W32=W32)


def routing_held(s: GenSettings) -> bool:
    if s.routing_near_ties not in ROUTING_NEAR_TIES:
        raise GenError(f"routing near-ties {s.routing_near_ties!r}: choose one of {', '.join(ROUTING_NEAR_TIES)}")
    return s.routing_near_ties == "held"


# ---------------------------------------------------------------- the bundle

def generate_bundle(m: Model, s: GenSettings, out: str, progress=None) -> dict:
    """Goldens for every prompt, rejection of undecisive prompts, tolerance manifest, atomic write.
    Returns the summary figures (also stored in the metadata)."""
    W64 = as_stored(m.W)                     # float64 per tensor as a matmul reads it, never the whole model
    pgs, man = decisive_goldens(m, W64, s, plan_prompts(m, s), progress)
    # Precision profiles beyond fp32 (conformance/gen/bf16_profile.py): same prompts, same rule, other dtypes.
    man["profiles"] = {}
    if s.bf16_profile:
        if progress:
            progress("bf16 profile", 0, 1, None)
        man["profiles"]["bf16"] = bf16_profile(m.cfg, W64, [(pg.prompt, pg.tokens, pg.g64, pg.pos0) for pg in pgs],
                                               quant_of(m))
        if progress:
            progress("bf16 profile", 1, 1, None)
    fig = figures(pgs, m.dcfg.block_size - 1)
    if routing_held(s):      # how many golden routing decisions are near-ties, left to the near-tie rules
        fig["routing_near_ties"] = routing_near_tie_count(m.cfg, W64, pgs, decisive_atols(man)[1])
    meta = {
        "schema": BUNDLE_SCHEMA,
        "model_config": m.cfg.to_dict(),
        "drafter_config": m.dcfg.to_dict(),
        "quantization": m.meta.get("quantization", {"method": "none", "weights": "float32"}),
        "ddtree": {"block_size": m.dcfg.block_size, "budget": s.budget, "topk": None,
                   "mask_token_id": m.dcfg.mask_token_id, "target_layer_ids": m.dcfg.target_layer_ids},
        "taps": {"prefill": {str(l): tap_names(m.cfg, l) for l in range(m.cfg.num_hidden_layers)},
                 "prefill_final": ["final_hidden", "logits"], "ar": list(AR_TAPS)},
        "prompts": len(pgs), "max_new_tokens": s.max_new_tokens,
        "position_offsets": [int(pg.pos0) for pg in pgs],
        "long_position": dict(zip(("offset", "chosen_by"), long_position(m, s)), rule=LONG_POSITION_RULE),
        "tolerances": man,
        "figures": fig,
        "provenance": {"generator": f"kdtr {_version()}", "command": s.command, "seed": s.seed,
                       "numpy": np.__version__, "python": platform.python_version()},
        **{k: v for k, v in m.meta.items() if k != "quantization"},
    }
    write_kdtr(out, bundle_tensors(m, pgs), meta)
    return meta["figures"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kdtr")
    except PackageNotFoundError:
        return "0+unknown"
