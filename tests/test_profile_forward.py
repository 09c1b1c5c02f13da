"""bench/profile_forward.py without a GPU: its arguments are checked before any device work (usage errors exit 2,
naming the value), and without PyCUDA it says so and exits 6 (engine error). Its GPU half runs on the device."""
import importlib.util

import pytest

from bench.profile_forward import _Timed, main


@pytest.mark.parametrize("argv,named", [(["--reps", "0"], "--reps 0"), (["no/such.kdtr"], "no/such.kdtr")])
def test_bad_arguments_exit_2_naming_the_value(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_the_timing_proxy_passes_everything_else_through():
    class Fn:
        num_regs = 40

        def prepare(self, sig):
            return sig

    t = _Timed(Fn(), "k", [])
    assert t.num_regs == 40 and t.prepare("PPi") == "PPi"


@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda is installed: the GPU half would run")
def test_without_pycuda_it_says_so_and_exits_6(capsys):
    assert main(["bundles/model_tiny.kdtr"]) == 6
    assert "pycuda is not installed" in capsys.readouterr().err
