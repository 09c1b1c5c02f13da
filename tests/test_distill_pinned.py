"""Distillation gives the same bits on every x86-64 CPU with AVX2: its math libraries are pinned to the
AVX2 code paths in a fresh process (refmodel/pinned.py). A CPU without AVX-512 is emulated by allowing MKL
only AVX2 (MKL_ENABLE_INSTRUCTIONS); unpinned, that alone changed the weights after 30 steps on an
AVX-512 machine (measured), pinned it must not."""
import numpy as np
import pytest

pytest.importorskip("torch")

from refmodel.distill import DistillSettings, distill_drafter
from refmodel.pinned import PINNED_ENV, is_pinned, run_pinned
from refmodel.weights import init_weights
from test_ddtree_verify import MICRO, MICRO_DRAFTER

SMALL = DistillSettings(sequences=8, batch_gen=4, prompt_len=(1, 4), seq_len=24, batch=4, anchors=2)


def _distill():
    return distill_drafter(MICRO, init_weights(MICRO, 1), MICRO_DRAFTER, seed=3, steps=30, settings=SMALL)


def _unpinned(progress=None):
    """_distill in a process that skips the pin (it looks pinned already) but inherits the test's env."""
    return _distill()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_distillation_bits_do_not_depend_on_the_cpu_instruction_set(monkeypatch):
    import multiprocessing as mp
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    native = _distill()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")                # an AVX2-only CPU, as MKL sees it
    avx2_only = _distill()
    # The control: unpinned, do the two instruction sets differ on this CPU at all? (They do on AVX-512
    # machines; on an AVX2-only CPU both runs take the same path and the comparison proves nothing.)
    monkeypatch.setenv("KDTR_PINNED_MATH", "1")
    with mp.get_context("spawn").Pool(1) as pool:
        unpinned_avx2 = pool.apply(_unpinned)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    with mp.get_context("spawn").Pool(1) as pool:
        unpinned_native = pool.apply(_unpinned)
    if _same(unpinned_native, unpinned_avx2):
        pytest.skip("this CPU's native MKL path is the AVX2 one: pinned and unpinned cannot be told apart here")
    for k in native:
        assert np.array_equal(native[k], avx2_only[k]), f"{k} differs between instruction sets"


def _child_env():
    import os
    return is_pinned(), {k: os.environ.get(k) for k in PINNED_ENV}


def _echo(x, progress=None):
    progress("stage", 1, 1, None)
    return _child_env(), x


def test_run_pinned_sets_the_env_in_the_child_only_and_forwards_progress():
    seen = []
    (pinned, env), x = run_pinned(_echo, 7, progress=lambda *p: seen.append(p))
    assert pinned and env == PINNED_ENV and x == 7
    assert seen == [("stage", 1, 1, None)]
    assert not is_pinned()


def _boom(progress=None):
    raise ValueError("bad settings: steps = -1")


def test_run_pinned_reraises_the_child_error():
    with pytest.raises(ValueError, match="bad settings: steps = -1"):
        run_pinned(_boom)
