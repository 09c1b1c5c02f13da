"""Greedy autoregressive generation with the KV cache: prefill the prompt, then one token per forward."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from refmodel.config import ModelConfig
from refmodel.model import KVCache, forward, weights_dtype


@dataclass
class GenerateResult:
    tokens: list[int]                    # generated tokens only (prompt excluded)
    logits: np.ndarray                   # [max_new_tokens, V]: the logits each generated token was chosen from
    margins: np.ndarray                  # [max_new_tokens]: top-1 minus top-2 logit at each step
    forwards: int                        # target forwards (1 prefill + one per further token)
    taps: list[dict] = field(default_factory=list)  # per forward (prefill first), when collect_taps
    cache: KVCache | None = None         # holds prompt + all generated tokens but the last


def top2_margin(logits: np.ndarray) -> float:
    top = np.partition(logits, -2)[-2:]                                  # [V] -> [2] (unordered)
    return float(abs(top[1] - top[0]))


def prefill(cfg: ModelConfig, W: dict, prompt_ids, cache: KVCache, absorbed: bool = False,
            taps: dict | None = None, pos0: int = 0, forced_ids: dict | None = None) -> np.ndarray:
    """Run the prompt into the cache, cache row j at position pos0 + j (an empty cache: positions
    pos0..pos0+P-1); returns the last position's logits [V]. forced_ids: model.forward."""
    prompt_ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    rows = np.arange(cache.length, cache.length + len(prompt_ids))
    logits, _ = forward(cfg, W, prompt_ids, pos0 + rows, cache=cache, absorbed=absorbed, taps=taps,
                        forced_ids=forced_ids)
    return logits[-1]


def decode_one_token(cfg: ModelConfig, W: dict, token: int, cache: KVCache, absorbed: bool = False,
                     taps: dict | None = None, pos0: int = 0, forced_ids: dict | None = None) -> np.ndarray:
    """Append one token at position pos0 + cache.length; returns its logits [V]."""
    logits, _ = forward(cfg, W, [token], [pos0 + cache.length], cache=cache, absorbed=absorbed, taps=taps,
                        forced_ids=forced_ids)
    return logits[0]


def greedy_generate(cfg: ModelConfig, W: dict, prompt_ids, max_new_tokens: int, absorbed: bool = False,
                    collect_taps: bool = False, pos0: int = 0) -> GenerateResult:
    """Greedy decoding (argmax, ties to the lower id); stops by length only, never by token value.
    The prompt sits at positions pos0.. (cache row j at position pos0 + j)."""
    if len(prompt_ids) < 1 or max_new_tokens < 1:
        raise ValueError(f"greedy_generate: need a prompt of >= 1 token and max_new_tokens >= 1, got "
                         f"{len(prompt_ids)} and {max_new_tokens}")
    cache, taps = KVCache(cfg, weights_dtype(W)), []
    step_taps = {} if collect_taps else None
    logits = prefill(cfg, W, prompt_ids, cache, absorbed, step_taps, pos0)
    all_logits, tokens = [logits], [int(np.argmax(logits))]
    forwards = 1
    if collect_taps:
        taps.append(step_taps)
    while len(tokens) < max_new_tokens:
        step_taps = {} if collect_taps else None
        logits = decode_one_token(cfg, W, tokens[-1], cache, absorbed, step_taps, pos0)
        forwards += 1
        if collect_taps:
            taps.append(step_taps)
        all_logits.append(logits)
        tokens.append(int(np.argmax(logits)))
    logits = np.stack(all_logits)                                        # [n, V]
    margins = np.array([top2_margin(row) for row in logits])             # [n]
    return GenerateResult(tokens, logits, margins, forwards, taps, cache)
