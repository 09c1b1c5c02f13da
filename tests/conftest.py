"""Shared fixtures: small golden bundles made once per test session (untrained drafter, 2 prompts,
8 new tokens) so the conformance tests run the real generator and runner in seconds."""
import pytest

from conformance.gen.gen import GenSettings, apply_quant, generate_bundle, model_from_preset


def pytest_addoption(parser):
    parser.addoption("--k26-slice", action="store_true",
                     help="also run the k26_slice tests: make the real-shape K2.6 slice bundle (long; "
                          "bundles/MANIFEST.md)")


def pytest_collection_modifyitems(config, items):
    """k26_slice tests run only with --k26-slice: CI's `pytest -q` skips them (and says so)."""
    if config.getoption("--k26-slice"):
        return
    skip = pytest.mark.skip(reason="real-shape K2.6 slice: run with --k26-slice (tens of minutes, ~10 GB RAM)")
    for item in items:
        if "k26_slice" in item.keywords:
            item.add_marker(skip)


def _make(tmp_path_factory, quant: str):
    s = GenSettings(quant=quant, num_prompts=2, max_new_tokens=8, distill_steps=0, seed=0,
                    command=f"test fixture ({quant})")
    out = tmp_path_factory.mktemp(f"bundle_{quant}") / f"small_{quant}.kdtr"
    generate_bundle(apply_quant(model_from_preset(s), s), s, str(out))
    return out


@pytest.fixture(scope="session")
def shardable_bundle(tmp_path_factory):
    """A small golden bundle of the shardable preset (16 heads, 32 INT4 experts top-8 in 8 groups), no bf16
    profile: what the sharded-engine tests run TP and EP on (path)."""
    s = GenSettings(preset="shardable", quant="int4", num_prompts=2, max_new_tokens=8, distill_steps=0, seed=0,
                    bf16_profile=False, command="test fixture (shardable, int4)")
    out = tmp_path_factory.mktemp("bundle_shardable") / "small_shardable.kdtr"
    generate_bundle(apply_quant(model_from_preset(s), s), s, str(out))
    return out


@pytest.fixture(scope="session")
def small_bundle(tmp_path_factory):
    """A small FP32 golden bundle (path)."""
    return _make(tmp_path_factory, "fp32")


@pytest.fixture(scope="session")
def small_int4_bundle(tmp_path_factory):
    """A small INT4 (routed experts) golden bundle (path)."""
    return _make(tmp_path_factory, "int4")


@pytest.fixture(scope="module")
def reference_run(small_bundle):
    """(open small bundle, the reference engine's outputs on it): a correct run, collected once per module
    (module scope: tests may edit the outputs they are given)."""
    from conformance.engines.reference_engine import ReferenceEngine
    from conformance.verify.collect import collect
    from kdtr_format import open_kdtr

    with open_kdtr(small_bundle) as f:
        e = ReferenceEngine()
        e.load(f)
        yield f, collect(e, f)
