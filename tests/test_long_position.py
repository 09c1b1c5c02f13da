"""The long-position prompt (docs/golden-bundles.md): `kdtr gen` records its offset, the runner drives
every engine at the bundle's positions, and its verdict is a named check of its own. An engine forming
RoPE angles in float32, or deriving positions from its cache length, fails there and only there; the
float64-angle reference passes."""
import numpy as np
import pytest

from conformance.engines.faults import FaultyEngine
from conformance.engines.reference_engine import ReferenceEngine
from conformance.exit_codes import ExitCode
from conformance.gen.bundle_model import LONG_POSITION_OFFSET
from conformance.gen.goldens import LONG_PROMPT_LENGTH
from conformance.verify.runner import verify
from kdtr_format import open_kdtr


def long_prompt_index(bundle) -> int:
    with open_kdtr(bundle) as f:
        offs = f.metadata["position_offsets"]
    assert offs.count(0) == len(offs) - 1, offs
    return next(i for i, o in enumerate(offs) if o)


def failing(v) -> list:
    return [c for c in v.checks if c.status in ("fail", "error")]


class CacheLengthPositions(ReferenceEngine):
    """An engine with the classic bug: it ignores the positions it is given and numbers tokens by its
    cache length (tree rows: cache length + depth). Exact on prompts that start at position 0."""
    name = "reference+cache_length_positions"

    def prefill(self, ids, positions):
        return self._forward(ids, self.cache.length + np.arange(len(ids)))

    def decode(self, token, position):
        return self._forward([token], [self.cache.length])

    def verify_tree(self, ids, positions, mask):
        positions = np.asarray(positions)
        return self._forward(ids, self.cache.length + positions - positions[0], mask)


def test_gen_records_the_long_position_prompt(small_bundle):
    i = long_prompt_index(small_bundle)
    with open_kdtr(small_bundle) as f:
        meta = f.metadata
        assert meta["position_offsets"][i] == LONG_POSITION_OFFSET >= 2**17
        assert len(f[f"golden/p{i}/prompt_ids"]) == LONG_PROMPT_LENGTH
        fig = meta["figures"]["long_position"]
        assert fig["prompt"] == i and fig["position_offset"] == LONG_POSITION_OFFSET
        assert fig["last_position"] < meta["model_config"]["max_position_embeddings"]
        assert f[f"golden/p{i}/ddtree/round_start"][0] == LONG_PROMPT_LENGTH      # starts are cache rows


@pytest.mark.parametrize("bundle", ["small_bundle", "small_int4_bundle"])
def test_float32_rope_angles_fail_the_long_position_prompt_only(bundle, request):
    path = request.getfixturevalue(bundle)
    i = long_prompt_index(path)
    v = verify(str(path), engine=FaultyEngine("rope_f32_angles"))
    bad = failing(v)
    assert v.exit_code == ExitCode.NUMERIC, [(c.name, c.message[:80]) for c in bad]
    assert bad and all(c.name.startswith(f"p{i}/") for c in bad), [c.name for c in bad]
    d = v.first_divergence
    assert (d.name, d.layer, d.tap, d.phase, d.cause) == (f"p{i}/prefill/L0/q", 0, "q", "prefill", "local")
    named = next(c for c in v.checks if c.name == f"p{i}/long_position")
    assert named.status == "fail"
    assert (f"the long-position prompt p{i} (positions {LONG_POSITION_OFFSET}..) fails" in named.message
            and "while every prompt at positions from 0 passes" in named.message
            and "forms RoPE angles in float32" in named.message), named.message


def test_the_float64_angle_reference_passes_it(small_bundle):
    i = long_prompt_index(small_bundle)
    v = verify(str(small_bundle), engine=ReferenceEngine())
    assert v.exit_code == ExitCode.OK, [(c.name, c.message[:80]) for c in failing(v)]
    assert next(c for c in v.checks if c.name == f"p{i}/long_position").status == "pass"


def test_positions_from_the_cache_length_get_a_named_failure(small_bundle):
    i = long_prompt_index(small_bundle)
    v = verify(str(small_bundle), engine=CacheLengthPositions())
    bad = failing(v)
    assert v.exit_code != ExitCode.OK and all(c.name.startswith(f"p{i}/") for c in bad), [c.name for c in bad]
    assert v.first_divergence.name == f"p{i}/prefill/L0/q"
    named = next(c for c in bad if c.name == f"p{i}/long_position")
    assert "derives them from its cache length" in named.message


def test_the_console_explains_the_divergence_and_shows_the_difference(small_bundle):
    """The console's first divergence: the first failing row apart from the worst element, golden and
    actual with the digits that tell them apart and their difference, and the long-position prompt's own
    explanation printed by default (not only with -v)."""
    import io

    from rich.console import Console

    from conformance.report.console import distinct_values, print_console

    assert distinct_values(-2.774123, -2.77398) == ("-2.7741", "-2.774")
    assert distinct_values(1.0, 1.0 + 2**-40) == ("1", "1.000000000001")            # 13 digits tell them apart
    assert distinct_values(3, 4) == ("3", "4")
    i = long_prompt_index(small_bundle)
    v = verify(str(small_bundle), engine=FaultyEngine("rope_f32_angles"))
    buf = io.StringIO()
    print_console(v, Console(file=buf, width=1000, color_system=None))
    lines = buf.getvalue().splitlines()
    d = v.first_divergence
    at = lines.index(next(line for line in lines if line.startswith("first divergence:")))
    assert lines[at] == f"first divergence: p{i}/prefill/L0/q (layer 0, tap q, prefill)"
    assert lines[at + 1] == f"  first failing row: token position {d.token_position}"
    g, a = distinct_values(d.golden, d.actual)
    assert g != a and lines[at + 2] == (f"  worst element {d.worst_index}: golden {g}, actual {a} "
                                        f"(actual - golden = {d.actual - d.golden:+.3g})")
    named = next(c for c in v.checks if c.name == f"p{i}/long_position")
    assert f"  p{i}/long_position: {named.message}" in lines
