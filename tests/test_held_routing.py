"""Held routing: under a profile derived with routing held to the golden expert sets (bf16; fp32 on a
bundle made with `--routing-near-ties held`, tests/test_held_routing_fp32.py), the runner hands a live
engine that has `hold_routing` the golden set of every forward row on the golden stream
(conformance/verify/collect.py, HeldRouting); under the fp32 profile of a bundle made without it, it hands
nothing. A run dump cannot be held after the fact: its metadata `routing` says how its run chose, and the
verdict reports what it says.

The engine here is the float32 reference engine with a `hold_routing` that records what it was handed
and computes free (the reference's float32 routing equals the golden one on these bundles, so what it
computes is the same either way); the torch engine's own hold is tested in tests/test_torch_engine.py."""
import numpy as np
import pytest

from conformance.engines.reference_engine import ReferenceEngine
from conformance.exit_codes import ExitCode
from conformance.records import write_dump
from conformance.verify.runner import verify
from kdtr_format import open_kdtr


class RecordingEngine(ReferenceEngine):
    """The reference engine, recording each forward with the expert sets held for it."""

    def __init__(self):
        super().__init__()
        self.calls, self._held = [], None

    def hold_routing(self, ids):
        self._held = {l: np.array(v) for l, v in (ids or {}).items()}

    def _record(self, kind, ids, positions):
        self.calls.append((kind, np.asarray(ids).reshape(-1), np.asarray(positions).reshape(-1), self._held))
        self._held = None

    def prefill(self, ids, positions):
        self._record("prefill", ids, positions)
        return super().prefill(ids, positions)

    def decode(self, token, position):
        self._record("decode", [token], [position])
        return super().decode(token, position)

    def verify_tree(self, ids, positions, mask):
        self._record("verify", ids, positions)
        return super().verify_tree(ids, positions, mask)


@pytest.fixture(scope="module")
def held_run(small_bundle):
    e = RecordingEngine()
    return e, verify(small_bundle, engine=e, profile="bf16")


def golden_routing(f, i: int, phase: str) -> dict:
    cfg = f.metadata["model_config"]
    return {l: np.asarray(f[f"golden/p{i}/{phase}/L{l}/topk_ids"])
            for l in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])}


def prompt_of(f, prompt_ids) -> int:
    """The golden prompt a prefill ran (each forward after it, until the next prefill, is that prompt's)."""
    return next(i for i in range(len(f.metadata["position_offsets"]))
                if np.array_equal(f[f"golden/p{i}/prompt_ids"], prompt_ids))


def test_the_bf16_profile_holds_every_golden_stream_row_to_its_golden_set(held_run, small_bundle):
    e, v = held_run
    assert v.exit_code == ExitCode.OK
    assert v.info["routing"].startswith("held to the golden expert sets, as the profile was derived")
    held_tree_rows = free_tree_rows = 0
    with open_kdtr(small_bundle) as f:
        i = None                                                         # the prompt of the last prefill
        for kind, ids, positions, held in e.calls:
            if kind == "prefill":
                i = prompt_of(f, ids)
            P = len(f[f"golden/p{i}/prompt_ids"])
            steps = positions - f.metadata["position_offsets"][i] - P    # decode step each row feeds
            assert held is not None, (kind, positions)                   # every forward is handed its sets
            if kind == "prefill":
                assert all(np.array_equal(held[l], g) for l, g in golden_routing(f, i, "prefill").items())
                continue
            ar, tokens = golden_routing(f, i, "ar"), np.asarray(f[f"golden/p{i}/ar/tokens"])
            for l, g in ar.items():
                for r, s in enumerate(steps):
                    if (held[l][r] < 0).all():                           # the router decides this row
                        free_tree_rows += kind == "verify"
                        continue
                    # a held row feeds golden token s at decode step s's position, and holds step s's set
                    assert ids[r] == tokens[s] and np.array_equal(held[l][r], g[s]), (kind, l, r, s)
                    held_tree_rows += kind == "verify"
    assert held_tree_rows and free_tree_rows                             # trees hold their golden path only


def test_the_fp32_profile_holds_nothing(small_bundle):
    e = RecordingEngine()
    v = verify(small_bundle, engine=e)                                   # float32: the fp32 profile
    assert v.info["profile"] == "fp32" and v.exit_code == ExitCode.OK
    assert e.calls and all(held is None for *_, held in e.calls)
    assert v.info["routing"] == "free: the engine's own router chose every expert set"


def test_a_dump_reports_the_routing_its_metadata_records(small_bundle, reference_run, tmp_path):
    """A dump says how its run routed (metadata routing); without the key the verdict says it does not
    know, and notes that the bf16 profile was derived held. A value other than held/free is a bad file."""
    f, out = reference_run
    cases = {None: "not recorded: the dump's metadata does not say how its expert sets were chosen, but the "
                   "bf16 profile was derived with routing held",
             "free": "free: the run that wrote this dump let its router choose every expert set, but the bf16",
             "held": "held to the golden expert sets by the run that wrote this dump"}
    for routing, says in cases.items():
        path = str(tmp_path / f"{routing}.kdtr")
        write_dump(out, path, "reference", "float32", routing=routing)
        v = verify(small_bundle, dump=path, profile="bf16")
        assert v.info["routing"].startswith(says), v.info["routing"]
    write_dump(out, path, "reference", "float32", routing="sideways")
    v = verify(small_bundle, dump=path, profile="bf16")
    assert v.exit_code == ExitCode.INVALID_FILE
    assert "metadata routing 'sideways': must be \"held\" or \"free\", or left out" in v.checks[-1].message


class WithoutHold:
    """The reference engine without the optional `hold_routing` (an engine that cannot hold)."""

    def __init__(self):
        self._engine = ReferenceEngine()

    def __getattr__(self, name):
        if name == "hold_routing":
            raise AttributeError(name)
        return getattr(self._engine, name)


def test_an_engine_without_hold_routing_runs_free_under_bf16_and_is_reported_so(small_bundle):
    v = verify(small_bundle, engine=WithoutHold(), profile="bf16")
    assert v.info["routing"] == ("free: the engine's own router chose every expert set, but the bf16 profile "
                                 "was derived with routing held to the golden expert sets, so a near-tie expert "
                                 "flip also moves the taps after it; this engine has no hold_routing")
