"""bench/profile_forward.py without a GPU: its arguments are checked before any device work (usage errors exit 2,
naming the value), and without PyCUDA it says so and exits 6 (engine error). Its GPU half runs on the device."""
import importlib.util

import pytest

from bench.profile_forward import _Recorded, main


@pytest.mark.parametrize("argv,named", [(["--reps", "0"], "--reps 0"), (["no/such.kdtr"], "no/such.kdtr"),
                                         (["--k26-only", "bundles/model_tiny.kdtr"], "bundles/model_tiny.kdtr")])
def test_bad_arguments_exit_2_naming_the_value(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_the_timing_proxy_passes_everything_else_through():
    class Fn:
        num_regs = 40

        def prepare(self, sig):
            return sig

    log = []
    t = _Recorded(Fn(), "k", log)
    assert t.num_regs == 40 and t.prepare("PPi") == "PPi" and log == []


@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda is installed: the GPU half would run")
def test_without_pycuda_it_says_so_and_exits_6(capsys):
    assert main(["bundles/model_tiny.kdtr"]) == 6
    assert "pycuda is not installed" in capsys.readouterr().err


def test_a_missing_default_bundle_names_the_flag_that_needs_none(monkeypatch, capsys):
    import bench.profile_forward as pf

    monkeypatch.setattr(pf, "TINY", ["no/such/tiny.kdtr"])
    with pytest.raises(SystemExit) as e:
        main(["--k26"])
    assert e.value.code == 2 and "--k26-only" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("pycuda") is not None, reason="pycuda is installed: the GPU half would run")
def test_k26_only_reads_no_bundle(monkeypatch, capsys):
    """--k26-only gets past the bundle checks with no bundle in the tree, to the device work (here: no PyCUDA)."""
    import bench.profile_forward as pf

    monkeypatch.setattr(pf, "TINY", ["no/such/tiny.kdtr"])
    assert main(["--k26-only"]) == 6
    assert "pycuda is not installed" in capsys.readouterr().err


@pytest.mark.cuda
def test_it_profiles_a_tiny_bundle_on_the_gpu(tmp_path):
    """One pass on the GPU machine: every case names kernels, each launch's time is positive, the per-launch list
    (--launches) has every launch and adds up to the kernels' sum, and the graph's time is there."""
    import json

    from cuda_oracle import gpu_ops

    gpu_ops()                                                   # skips without pycuda / a device
    out = tmp_path / "p.json"
    assert main(["bundles/model_tiny.kdtr", "--reps", "2", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [c["label"].split(": ")[1].split(" (")[0] for c in cases] == ["decode step", "verify forward",
                                                                         "drafter block", "tree builder"]
    for c in cases:
        assert c["kernels"] and all(n >= 1 and us > 0 for n, us in c["kernels"].values()), c["label"]
        assert c["kernels_us"] > 0 and c["graph_us"] > 0 and c["launches"] == sum(n for n, _ in c["kernels"].values())
        assert len(c["each"]) == c["launches"] and sum(us for _, _, us in c["each"]) == pytest.approx(c["kernels_us"])
