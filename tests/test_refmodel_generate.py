"""Greedy AR generation with the cache equals greedy over full recomputes."""
import numpy as np

from refmodel.config import PRESETS
from refmodel.generate import greedy_generate
from refmodel.model import forward
from refmodel.weights import init_weights

TINY = PRESETS["tiny"]


def test_cached_greedy_equals_recompute_and_counts_forwards():
    W = init_weights(TINY, 0)
    prompt = [7]                                                          # a one-token prompt
    r = greedy_generate(TINY, W, prompt, 12)
    assert r.forwards == 12 and len(r.tokens) == 12 and r.logits.shape == (12, TINY.vocab_size)
    assert r.cache.length == len(prompt) + 11                             # the last token is not yet fed back
    seq = list(prompt)
    for i in range(12):
        logits, _ = forward(TINY, W, seq, np.arange(len(seq)))
        assert np.max(np.abs(logits[-1] - r.logits[i])) <= 1e-10
        seq.append(int(np.argmax(logits[-1])))
    assert seq[1:] == r.tokens
    top2 = np.sort(r.logits, axis=-1)[:, -2:]
    assert np.allclose(r.margins, top2[:, 1] - top2[:, 0], rtol=0, atol=0)
    absorbed = greedy_generate(TINY, W, prompt, 12, absorbed=True)
    assert absorbed.tokens == r.tokens


def test_collect_taps_per_forward():
    W = init_weights(TINY, 0)
    r = greedy_generate(TINY, W, [3, 4, 5], 4, collect_taps=True)
    assert len(r.taps) == 4
    assert r.taps[0]["L0/attn_in"].shape == (3, TINY.hidden_size)         # prefill
    assert r.taps[1]["logits"].shape == (1, TINY.vocab_size)              # one decode step
    assert np.array_equal(r.taps[2]["logits"][0], r.logits[2])
