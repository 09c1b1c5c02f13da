"""bench/bench_attention.py without a GPU: its arguments are checked before any device work (usage errors exit
2, naming the value), and without PyCUDA it says so and exits 6 (engine error). Its GPU half runs on the device
(docs/cuda-engine.md, "Stop 42")."""
import importlib.util

import pytest

from bench.bench_attention import _ints, main


def test_lists_of_positive_integers():
    assert _ints("1,5, 9", "--tokens") == [1, 5, 9]
    for bad in ("", "0,1", "a", "-3"):
        with pytest.raises(ValueError, match="--tokens"):
            _ints(bad, "--tokens")


@pytest.mark.parametrize("argv,named", [(["--tokens", "0"], "--tokens '0'"), (["--cached", "x"], "--cached 'x'"),
                                         (["--reps", "0"], "--reps 0"), (["--ab", "no/such.kdtr"], "no/such.kdtr")])
def test_bad_arguments_exit_2_naming_the_value(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda is installed: the GPU half would run")
def test_without_pycuda_it_says_so_and_exits_6(capsys):
    assert main(["--tokens", "1"]) == 6
    assert "pycuda is not installed" in capsys.readouterr().err
