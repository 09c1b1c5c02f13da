"""`kdtr bench engine` and `kdtr verify --engine cuda` on a machine without pycuda: a clear message and
exit 6 (engine error), never a traceback. Skipped where pycuda is installed."""
import importlib.util

import pytest
from click.testing import CliRunner

from cli.main import main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda is installed here")


def test_bench_engine_without_pycuda_says_why():
    r = CliRunner().invoke(main, ["bench", "engine", "bundles/model_tiny.kdtr", "--steps", "3"])
    assert r.exit_code == 6, r.output
    assert "kdtr bench engine: pycuda is not installed" in r.output and "pip install -e '.[cuda]'" in r.output
    assert "Traceback" not in r.output


def test_bench_w4a16_without_a_gpu_says_why():
    r = CliRunner().invoke(main, ["bench", "w4a16", "--batches", "1", "--no-moe"])
    assert r.exit_code == 6, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kdtr bench w4a16: ") and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("batches", ["0", "1,x", ""])
def test_bench_w4a16_names_a_bad_batch_list(batches):
    r = CliRunner().invoke(main, ["bench", "w4a16", "--batches", batches])
    assert r.exit_code == 2 and "--batches" in r.output and repr(batches) in r.output, r.output


def test_cuda_engine_load_without_pycuda_raises_the_engine_error():
    from cuda_engine.device import CudaEngineError
    from cuda_engine.engine import CudaEngine

    with pytest.raises(CudaEngineError, match=r"pycuda is not installed .*; install it with pip install -e '\.\[cuda\]'"):
        CudaEngine().load("bundles/model_tiny.kdtr")


def test_unknown_w4a16_mode_is_named():
    from cuda_engine.device import CudaEngineError
    from cuda_engine.engine import CudaEngine

    with pytest.raises(CudaEngineError, match=r"w4a16 mode 'turbo': choose one of fast, plain, dense \(--w4a16\)"):
        CudaEngine(w4a16="turbo")


def test_w4a16_option_is_for_the_cuda_engine_only():
    from click.testing import CliRunner

    from cli.main import main

    r = CliRunner().invoke(main, ["verify", "bundles/model_int4_tiny.kdtr", "--engine", "reference", "--w4a16", "plain"])
    assert r.exit_code == 2 and "--w4a16 applies to --engine cuda (or auto) only, not to --engine reference" in r.output


@pytest.mark.parametrize("args,option", [(["w4a16", "--reps", "0"], "--reps"), (["w4a16", "--reps", "-3"], "--reps"),
                                         (["engine", "--steps", "0"], "--steps"),
                                         (["ddtree", "--tokens", "0"], "--tokens"),
                                         (["ddtree", "--repeats", "0"], "--repeats")])
def test_bench_counts_below_one_are_usage_errors(args, option):
    """Every bench time is divided by a count (replays, steps, runs): 0 would divide by zero on the GPU,
    so it is refused on the command line, naming the option, before anything runs (no GPU needed)."""
    r = CliRunner().invoke(main, ["bench", *args])
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}'" in r.output and "is not in the range 1<=x<=" in r.output, r.output
    assert "Traceback" not in r.output
