"""The tiled copy of bf16 weights that the mma linear kernels read (cuda_engine.ops.tile_bf16, kernels/linear.cu).
CPU only: every weight keeps its bits and lands where the kernel's address arithmetic looks for it; the GPU tests
(test_cuda_kernels.py, test_linear_mma_bf16 and the few-rows bits test) run the kernels over these copies."""
import numpy as np
import pytest

from cuda_engine.ops import LMMA_TILE, tile_bf16


def kernel_reads(Wt: np.ndarray, O: int, I: int) -> np.ndarray:
    """The [O, I] matrix as lmma_load sees it: lane (g, c) of m tile m, at step s, half h, reads the 8 bf16 at
    flat m * steps * 512 + s * 512 + h * 256 + lane * 8 and takes them as row 16 m + 8 h + g, k 32 s + 8 c .. + 7
    (linear.cu's comment). Written here from that comment, not from tile_bf16."""
    flat = Wt.reshape(-1)
    tiles, steps = -(-O // 16), -(-I // 32)
    out = np.full((tiles * 16, steps * 32), 0xFFFF, np.uint16)          # any place never read stays 0xFFFF
    for m in range(tiles):
        for s in range(steps):
            for h in range(2):
                for lane in range(32):
                    g, c = divmod(lane, 4)
                    at = m * steps * 512 + s * 512 + h * 256 + lane * 8
                    out[16 * m + 8 * h + g, 32 * s + 8 * c: 32 * s + 8 * c + 8] = flat[at: at + 8]
    return out


@pytest.mark.parametrize("O,I", [(1, 1), (17, 37), (16, 32), (33, 100), (48, 64)])
def test_every_weight_is_where_the_kernel_reads_it(O, I):
    rng = np.random.default_rng(O * I)
    W = rng.integers(1, 0xFFFF, (O, I), dtype=np.uint16)               # no zero: padding tells itself apart
    Wt = tile_bf16(W)
    assert Wt.dtype == np.uint16 and Wt.shape == (-(-O // 16), -(-I // 32)) + LMMA_TILE
    seen = kernel_reads(Wt, O, I)
    np.testing.assert_array_equal(seen[:O, :I], W)
    assert not seen[O:].any() and not seen[:, I:].any()               # the padding is zeros, and nothing is unread


def test_a_batch_is_tiled_matrix_by_matrix():
    rng = np.random.default_rng(3)
    W = rng.integers(0, 0xFFFF, (3, 20, 40), dtype=np.uint16)
    Wt = tile_bf16(W)
    assert Wt.shape == (3, 2, 2, 16, 32)
    for b in range(3):
        np.testing.assert_array_equal(Wt[b], tile_bf16(W[b]))


@pytest.mark.parametrize("W", [np.zeros((4, 4), np.float32), np.zeros(8, np.uint16)])
def test_anything_but_bf16_bits_of_a_matrix_is_refused(W):
    with pytest.raises(ValueError, match="tile_bf16"):
        tile_bf16(W)


def test_a_view_is_refused_before_anything_is_tiled():
    """Ops.tiled keeps the copy on the buffer; a view (a sub-array of another allocation) would be tiled again on
    every call, so it is refused with an error that names the fix. A view is made here without a GPU: a DevBuf
    given a pointer allocates nothing."""
    from types import SimpleNamespace

    from cuda_engine.device import CudaEngineError, DevBuf
    from cuda_engine.ops import Ops

    view = DevBuf((4, 32), np.uint16, ptr=4096, owner=None)
    assert not view.owns
    with pytest.raises(CudaEngineError, match="its own DevBuf"):
        Ops.tiled(SimpleNamespace(capturing=False), view)


@pytest.mark.parametrize("given,named", [("sideways", "edges="), (None, "KDTR_GRAPH_EDGES")])
def test_a_bad_graph_edge_mode_names_where_it_came_from(monkeypatch, given, named):
    from cuda_engine import graph
    from cuda_engine.device import CudaEngineError

    monkeypatch.setattr(graph, "GRAPH_EDGES", "sideways")
    with pytest.raises(CudaEngineError, match=named):
        graph.capture(None, lambda: None, edges=given)
