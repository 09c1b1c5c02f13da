"""`kdtr gen`: goldens equal transformers on an imported checkpoint, bytes are deterministic, undecisive
prompts are rejected, and the bundle's records are self-consistent (DDTree == AR, a tolerance per tap)."""
import hashlib

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import conformance.gen.gen as gen
import conformance.gen.goldens as goldens
from cli.main import main
from conformance.gen.gen import GenSettings, apply_quant, generate_bundle, model_from_preset
from conformance.records import numeric_keys
from hf_oracle import hf_logits, hf_model
from kdtr_format import open_kdtr
from refmodel.config import PRESETS, ModelConfig
from test_import_checkpoint import CFG, build_checkpoint


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_gen_from_checkpoint_prefill_logits_equal_transformers(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    deq = build_checkpoint(str(root), wrapper=True, shape_dtype=torch.int32)   # K2.6 layout, INT4 experts
    out = tmp_path / "b.kdtr"
    prompt = [3, 17, 42, 9, 100, 5, 77]
    r = CliRunner().invoke(main, ["gen", "--from-checkpoint", str(root), "--quant", "int4", "--prompt-ids",
                                  ",".join(map(str, prompt)), "--max-new-tokens", "4", "--distill-steps", "0",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    with open_kdtr(out, verify=True) as f:
        assert ModelConfig.from_dict(f.metadata["model_config"]) == CFG
        ours = np.array(f["golden/p0/prefill/logits"], dtype=np.float64)
    theirs = hf_logits(hf_model(CFG, deq, torch.float64), prompt)
    diff = np.abs(ours - theirs).max()
    print(f"\ngen --from-checkpoint: prefill logits vs transformers (float64, dequantized): {diff:.3e}")
    assert diff <= 1e-4


def test_same_settings_give_the_same_bytes(small_bundle, tmp_path):
    s = GenSettings(quant="fp32", num_prompts=2, max_new_tokens=8, distill_steps=0, seed=0,
                    command="test fixture (fp32)")                    # exactly the fixture's settings
    out = tmp_path / "again.kdtr"
    generate_bundle(apply_quant(model_from_preset(s), s), s, str(out))
    assert sha(out) == sha(small_bundle)


@pytest.mark.parametrize("bundle", ["small_bundle", "small_int4_bundle"])
def test_bundle_records_are_consistent(bundle, request):
    with open_kdtr(request.getfixturevalue(bundle), verify=True) as f:
        meta = f.metadata
        cfg = ModelConfig.from_dict(meta["model_config"])
        man = meta["tolerances"]["taps"]
        atol = lambda k: man[k]["multiplier"] * man[k]["baseline_max_abs"] + man[k]["abs_floor"]  # noqa: E731
        for i in range(meta["prompts"]):
            g = f"golden/p{i}/"
            assert np.array_equal(f[g + "ddtree/tokens"], f[g + "ar/tokens"])
            assert np.array_equal(f[g + "ar/tokens"], np.argmax(f[g + "ar/logits"], axis=-1))
            assert f[g + "ar/margins"].min() >= goldens.MARGIN_SAFETY * max(atol("prefill/logits"), atol("ar/logits"))
            for key in numeric_keys(cfg, set(meta["taps"]["ar"])):
                assert g + key in f, key
                assert key in man, key
        assert meta["figures"]["ddtree_target_forwards"] <= meta["figures"]["ar_target_forwards"]
        if "int4" in bundle:
            assert meta["quantization"]["bits"] == 4
            assert any(f.info(n).int4_shape for n in f.names)


def test_undecisive_prompt_is_rejected(monkeypatch, tmp_path):
    monkeypatch.setattr(goldens, "MARGIN_SAFETY", 1e9)                  # no margin can be that decisive
    r = CliRunner().invoke(main, ["gen", "--prompt-ids", "5,6,7", "--max-new-tokens", "3",
                                  "--distill-steps", "0", "--out", str(tmp_path / "x.kdtr")])
    assert r.exit_code == 2
    assert "prompt 0 ([5, 6, 7]...) rejected: greedy step" in r.output
    assert not (tmp_path / "x.kdtr").exists()


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "5,x"], "write prompts as comma-separated ids"),
    (["--prompt-ids", "1,,2"], "'1,,2': an empty id or prompt"),
    (["--prompt-ids", "1;;2"], "'1;;2': an empty id or prompt"),
    (["--prompt-ids", "1,2,"], "'1,2,': an empty id or prompt"),
    (["--prompt-ids", "1;-2"], "'-2' is not a token id"),
    (["--preset", "huge"], f"unknown preset 'huge'; choose one of {sorted(PRESETS)}"),
    (["--prompt-ids", "399"], "prompt token 399 is outside [0, 399)"),
    (["--preset", "k26"], "cannot be generated whole"),
    (["--long-position", "262140"], "--long-position 262140: the long-position prompt's positions must lie in "
                                    "[0, max_position_embeddings = 262144)"),
])
def test_bad_gen_options_are_clear(args, message, tmp_path):
    r = CliRunner().invoke(main, ["gen", "--distill-steps", "0", "--max-new-tokens", "2", *args,
                                  "--out", str(tmp_path / "x.kdtr")])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output


def test_float32_reference_stays_float32():
    """The same-precision baseline must really be float32: no silent upcast anywhere in the forward."""
    from refmodel.config import PRESETS
    from refmodel.model import KVCache, forward
    from refmodel.weights import init_weights
    cfg = PRESETS["tiny"]
    W32 = {k: v.astype(np.float32) for k, v in init_weights(cfg, 0).items()}
    taps, cache = {}, KVCache(cfg, np.float32)
    logits, hiddens = forward(cfg, W32, [1, 2, 3], [0, 1, 2], cache, taps=taps)
    assert logits.dtype == np.float32 and all(h.dtype == np.float32 for h in hiddens)
    assert {v.dtype for k, v in taps.items() if not k.endswith("topk_ids")} == {np.dtype(np.float32)}
    assert cache.c_kv[0].dtype == np.float32


def test_undecisive_random_prompt_is_redrawn(monkeypatch, tmp_path):
    """A random prompt that fails the decisiveness rules is replaced by the next candidate of its length."""
    cfg = gen.PRESETS["tiny"]
    first_p1 = gen.random_prompt(cfg, 0, 1, 0)
    real = gen.check_decisive
    monkeypatch.setattr(gen, "check_decisive", lambda pg, *a: "planted" if np.array_equal(pg.prompt, first_p1)
                        else real(pg, *a))
    s = GenSettings(num_prompts=2, max_new_tokens=4, distill_steps=0, seed=0)
    out = tmp_path / "b.kdtr"
    generate_bundle(apply_quant(model_from_preset(s), s), s, str(out))
    with open_kdtr(out) as f:
        assert np.array_equal(f["golden/p1/prompt_ids"], gen.random_prompt(cfg, 0, 1, 1))
        assert np.array_equal(f["golden/p0/prompt_ids"], gen.random_prompt(cfg, 0, 0, 0))


def test_gen_without_torch_says_how_to_install_it(monkeypatch, tmp_path):
    import sys
    monkeypatch.setitem(sys.modules, "torch", None)                  # `import torch` now fails, as uninstalled
    monkeypatch.delitem(sys.modules, "refmodel.distill", raising=False)
    r = CliRunner().invoke(main, ["gen", "--prompt-ids", "5", "--max-new-tokens", "2", "--distill-steps", "1",
                                  "--out", str(tmp_path / "x.kdtr")])
    assert r.exit_code == 2, r.output
    assert "distilling the drafter needs torch, which is not installed here: pip install torch==2.13.0" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "x.kdtr").exists()
    r = CliRunner().invoke(main, ["gen", "--prompt-ids", "5", "--max-new-tokens", "2", "--distill-steps", "0",
                                  "--out", str(tmp_path / "x.kdtr")])
    assert r.exit_code == 0, r.output                                  # an untrained drafter needs no torch


def test_distill_without_torch_says_how_to_install_it(monkeypatch, tmp_path):
    """kdtr distill looks for torch before it starts its worker (only the worker imports torch): one line, the
    install command, exit 2, the model file untouched."""
    import sys
    monkeypatch.setitem(sys.modules, "torch", None)                  # as if uninstalled
    model = tmp_path / "m.kdtr"
    model.write_bytes(b"not read: torch is looked for first")
    r = CliRunner().invoke(main, ["distill", str(model), "--steps", "1"])
    assert r.exit_code == 2, r.output
    assert "kdtr distill needs torch, which is not installed here; pip install torch==2.13.0" in r.output
    assert "Traceback" not in r.output and model.read_bytes() == b"not read: torch is looked for first"


def test_verify_needs_no_torch(small_bundle, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch", None)                  # as if uninstalled (README's main job)
    r = CliRunner().invoke(main, ["verify", str(small_bundle), "--engine", "reference"])
    assert r.exit_code == 0, r.output


def test_gen_from_an_int4_model_keeps_its_quantization(small_int4_bundle, tmp_path):
    out = tmp_path / "again.kdtr"
    r = CliRunner().invoke(main, ["gen", "--model", str(small_int4_bundle), "--prompt-ids", "5",
                                  "--max-new-tokens", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    with open_kdtr(out) as f, open_kdtr(small_int4_bundle) as src:
        assert f.metadata["quantization"] == src.metadata["quantization"]
        assert f.metadata["tolerances"]["multiplier"] == src.metadata["tolerances"]["multiplier"]
        qw = [n for n in src.names if n.endswith(".qw")]
        assert qw and all(f.info(n).checksum == src.info(n).checksum for n in qw)
    r = CliRunner().invoke(main, ["gen", "--model", str(small_int4_bundle), "--quant", "fp32", "--prompt-ids",
                                  "5", "--max-new-tokens", "2", "--out", str(tmp_path / "y.kdtr")])
    assert r.exit_code == 2 and "the model is INT4 already" in r.output


def test_a_missing_manifest_entry_is_an_error_not_a_zero_tolerance(small_bundle):
    with open_kdtr(small_bundle) as f:
        man = f.metadata["tolerances"]
    assert goldens.atol(man, "prefill/L0/q") == pytest.approx(
        man["taps"]["prefill/L0/q"]["multiplier"] * man["taps"]["prefill/L0/q"]["baseline_max_abs"]
        + man["taps"]["prefill/L0/q"]["abs_floor"], rel=1e-12)
    with pytest.raises(KeyError, match="tolerance manifest has no entry 'prefill/L0/nope'"):
        goldens.atol(man, "prefill/L0/nope")

