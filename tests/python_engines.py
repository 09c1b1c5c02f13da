"""Engines for `--engine python --module`: the skeleton of examples/numpy_engine.py with one thing changed."""
import numpy as np

from examples.numpy_engine import NumpyEngine


class AttnScaleFault(NumpyEngine):
    """THE BUG: layer 2's attention output 1% too large, in every forward and in run_layer."""

    def _attention(self, l, *args):
        a = super()._attention(l, *args)
        return a * np.float32(1.01) if l == 2 else a


class BrokenRunLayer(AttnScaleFault):
    """The same bug, and a run_layer that cannot run (as a port without rotary_emb)."""

    def run_layer(self, layer, inputs):
        raise AttributeError("'BrokenRunLayer' object has no attribute 'rotary_emb'")


class TupleRunLayer(AttnScaleFault):
    """The same bug, and a run_layer that returns (taps, cache) instead of the taps."""

    def run_layer(self, layer, inputs):
        return super().run_layer(layer, inputs), None


class NeedsArguments(NumpyEngine):
    def __init__(self, path):
        self.path = path


class NoDecode:
    name, dtype, supports_teacher_forcing = "half", "float32", False

    def load(self, bundle): ...
    def reset(self): ...
    def prefill(self, ids, positions): ...
    def verify_tree(self, ids, positions, mask): ...
    def compact(self, start, keep): ...
