"""Weights kept as stored (float32, bfloat16 bits, INT4 `.qw`/`.sc`), upcast one tensor per access.

`StoredWeights` is the weight mapping the refmodel reads (`W[name]`, HF names, INT4 linears under their
dense `<m>.weight` name): every lookup returns a fresh array in the mapping's compute dtype, made from
the stored bytes (a bfloat16 tensor widened, an INT4 linear dequantized exactly, q * scale), and
forgotten after the matmul that asked for it. So the float64 oracle never holds the model in float64:
memory is the stored model (memory-mapped when read from a .kdtr file) plus the largest single tensor
upcast. The values are exactly those of `refmodel.quant.dequantize_model` (then cast), so a forward on
a StoredWeights is bit-identical to the same forward on the dense dict: the same float64 (or float32)
values go into the same NumPy calls (tests/test_stored_weights.py checks it on the tiny bundles).

    W64 = StoredWeights.from_kdtr(f)            # an open bundle or model file, float64 compute
    W32 = W64.astype(np.float32)                # the same stored bytes, float32 compute
    logits, _ = forward(cfg, W64, ids, positions)

`generate_stored` draws a preset's golden weights (refmodel.weights, same RNG order) tensor by tensor and
stores each one at once (bfloat16 or float32; INT4 for the quantized linears), so a real-shape slice is
never whole in float64 either.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Callable, Iterator

import numpy as np

from kdtr_format.bf16 import bf16_bits, bf16_to_float32
from kdtr_format.int4 import dequantize_w4a16, quantize_w4a16, scale_bits
from refmodel.config import ModelConfig
from refmodel.quant import is_quantized
from refmodel.weights import iter_weights

DENSE_STORAGE = ("float32", "bfloat16")


class Mapped:
    """A tensor inside a file (a checkpoint shard), memory-mapped only while one lookup reads it: the pages
    it touches leave the process when the lookup's map is dropped, so reading a checkpoint tensor by tensor
    never accumulates the checkpoint in memory. `as_dtype`: widen on load (a float16 tensor read as
    float32)."""

    def __init__(self, path: str, dtype, shape: tuple, offset: int, as_dtype=None):
        self.path, self.offset, self.shape = path, int(offset), tuple(int(d) for d in shape)
        self.file_dtype = np.dtype(dtype)
        self.dtype = np.dtype(as_dtype) if as_dtype is not None else self.file_dtype
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize

    def load(self) -> np.ndarray:
        if self.size == 0:
            return np.zeros(self.shape, self.dtype)
        a = np.memmap(self.path, dtype=self.file_dtype, mode="r", offset=self.offset, shape=self.shape)
        return a if self.dtype == self.file_dtype else a.astype(self.dtype)


def _array(a):
    """The stored array behind a StoredWeights entry (a Mapped one mapped now)."""
    return a.load() if isinstance(a, Mapped) else a


class StoredWeights(MutableMapping):
    """name -> weight in `dtype`, computed per access from the stored tensors (module docstring).

    dense:   name -> (array, bf16): float32/float64 values, or raw bfloat16 bits (uint16) when bf16.
    int4:    `<m>.weight` -> (qw int32 [out, in/8], sc [out, in/g] float or bf16 bits, (out, in)).
    order:   the dense names in the order dequantize_model would give them (each INT4 weight where its
             .qw is); `stored_tensors` writes them back in the same order.
    transform: applied to each upcast tensor (name, array) -> array, e.g. the bf16 profile's views.
    watch: called with each name a lookup upcasts (progress through the layers of a forward).
    Arrays may be `Mapped` (a checkpoint's tensors): mapped per lookup, never held.
    """

    def __init__(self, dense: dict, int4: dict, order: list, dtype=np.float64,
                 transform: Callable | None = None, overrides: dict | None = None,
                 watch: Callable | None = None):
        self._dense, self._int4, self._order = dense, int4, order
        self.dtype = np.dtype(dtype)
        self._transform = transform
        self._overrides = dict(overrides or {})
        self.watch = watch

    # -- construction --

    @classmethod
    def from_arrays(cls, W: dict, dtype=np.float64, bf16: frozenset = frozenset()) -> "StoredWeights":
        """From a stored-form dict (float arrays, `<m>.qw` int32 + `<m>.sc` scales); names in `bf16` hold
        raw bfloat16 bits. Arrays are referenced, not copied."""
        dense, int4, order = {}, {}, []
        for name, v in W.items():
            if name.endswith(".sc"):
                if name[:-3] + ".qw" not in W:
                    raise ValueError(f"StoredWeights: scale tensor {name} has no packed weights {name[:-3]}.qw")
                continue
            if name.endswith(".qw"):
                module = name[:-3]
                if module + ".sc" not in W:
                    raise ValueError(f"StoredWeights: packed weights {name} have no scales {module}.sc")
                int4[module + ".weight"] = (v, W[module + ".sc"], (v.shape[0], v.shape[1] * 8))
                order.append(module + ".weight")
            else:
                dense[name] = (v, name in bf16)
                order.append(name)
        return cls(dense, int4, order, dtype)

    @classmethod
    def from_kdtr(cls, f, dtype=np.float64, skip: tuple = ("golden/", "drafter.")) -> "StoredWeights":
        """The model tensors of an open .kdtr file as zero-copy memory-mapped views (they keep the mapping
        alive after the file is closed). Names starting with `skip` are left out."""
        W, bf16 = {}, set()
        for n in f.names:
            if n.startswith(skip):
                continue
            W[n] = f[n]                                          # raw view: bf16 as uint16, INT4 as int32
            if f.info(n).dtype == "bfloat16":
                bf16.add(n)
        return cls.from_arrays(W, dtype, frozenset(bf16))

    def astype(self, dtype) -> "StoredWeights":
        """The same stored tensors computed in another dtype (no copy); overrides are cast too."""
        over = {k: np.asarray(v).astype(dtype) for k, v in self._overrides.items()}
        return StoredWeights(self._dense, self._int4, self._order, dtype, self._transform, over, self.watch)

    def with_transform(self, transform: Callable) -> "StoredWeights":
        """A view whose every tensor is transform(name, upcast array) (the bf16 profile's precision)."""
        return StoredWeights(self._dense, self._int4, self._order, self.dtype, transform, self._overrides,
                             self.watch)

    @property
    def mapped(self) -> bool:
        """True when the tensors are read from files per lookup (a checkpoint): never upcast whole."""
        return any(isinstance(a, Mapped) for a, _ in self._dense.values())

    # -- the mapping --

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._overrides:
            return self._overrides[name]
        return self._finish(name, self._upcast(name, None))

    def rows(self, name: str, ids) -> np.ndarray:
        """W[name][ids] upcasting only those rows (the embedding lookup)."""
        if name in self._overrides:
            return self._overrides[name][ids]
        return self._finish(name, self._upcast(name, np.asarray(ids)))

    def _upcast(self, name: str, ids) -> np.ndarray:
        if self.watch is not None:
            self.watch(name)
        if name in self._dense:
            a, bf16 = self._dense[name]
            a = _array(a)
            a = a if ids is None else a[ids]
            if bf16:
                return bf16_to_float32(a).astype(self.dtype, copy=False)   # fresh array already
            return np.asarray(a).astype(self.dtype)                         # always a fresh copy
        if name in self._int4:
            qw, sc, shape = self._int4[name]
            qw, sc = _array(qw), _array(sc)
            # q * scale is exact in float32 (4 x 8 significant bits): the values dequantize_model gives in
            # float64, at half the memory traffic; then widened
            w = dequantize_w4a16(qw, sc, shape, dtype=np.float32)
            w = w if ids is None else w[ids]
            return w.astype(self.dtype, copy=False)
        raise KeyError(name)

    def _finish(self, name: str, a: np.ndarray) -> np.ndarray:
        return a if self._transform is None else self._transform(name, a)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        """Replace one tensor (fault injection: `W[k] *= x`, `W.update(...)`); held in memory, the stored
        bytes are untouched."""
        if name not in self:
            raise KeyError(f"StoredWeights: no tensor {name!r} to replace")
        self._overrides[name] = value

    def __delitem__(self, name: str) -> None:
        """Drop a replacement (the stored tensor shows again); stored tensors themselves stay."""
        if name not in self._overrides:
            raise KeyError(f"StoredWeights: {name!r} is not a replaced tensor; stored tensors cannot be deleted")
        del self._overrides[name]

    def __contains__(self, name) -> bool:
        return name in self._dense or name in self._int4

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def upcast_nbytes(self) -> int:
        """Bytes the whole model would take upcast to `dtype` (computed from the stored shapes)."""
        n = sum(a.size for a, _ in self._dense.values()) + sum(o * i for _, _, (o, i) in self._int4.values())
        return int(n) * self.dtype.itemsize

    # -- what is stored --

    def stored_names(self) -> list[str]:
        """The stored tensor names (`<m>.qw`, `<m>.sc` for INT4 linears), in order."""
        out = []
        for n in self._order:
            out += [n[: -len(".weight")] + ".qw", n[: -len(".weight")] + ".sc"] if n in self._int4 else [n]
        return out

    def is_int4(self) -> bool:
        return bool(self._int4)

    def stored_items(self) -> Iterator[tuple[str, np.ndarray, str | None]]:
        """(stored name, raw array, "bfloat16" for raw bf16 bits else None), in stored order."""
        for n in self._order:
            if n in self._int4:
                qw, sc, _ = self._int4[n]
                m = n[: -len(".weight")]
                yield m + ".qw", _array(qw), None
                yield m + ".sc", _array(sc), "bfloat16" if sc.dtype == np.uint16 else None
            else:
                a, bf16 = self._dense[n]
                yield n, _array(a), "bfloat16" if bf16 else None

    def stored_bytes(self) -> int:
        arrays = [a for a, _ in self._dense.values()] + [x for qw, sc, _ in self._int4.values() for x in (qw, sc)]
        return sum(int(a.nbytes) for a in arrays)


# ---------------------------------------------------------------- generating stored weights

def generate_stored(cfg: ModelConfig, seed: int, dense: str = "float32", int4_scope: str | None = None,
                    group_size: int = 32, alpha: float = 1.0, progress=None) -> StoredWeights:
    """The golden weights of refmodel.weights.init_weights(cfg, seed, alpha), drawn in the same order,
    each stored as soon as it is drawn: the linears of `int4_scope` as INT4 W4A16 (scales as bfloat16
    bits), every other tensor as `dense` ("float32": rounded once, as _f32 does; "bfloat16": rounded to
    nearest even from float64, kept as raw bits). progress(done, total) after each tensor."""
    if dense not in DENSE_STORAGE:
        raise ValueError(f"generate_stored: dense storage {dense!r}: choose one of {', '.join(DENSE_STORAGE)}")
    W, bf16 = {}, set()
    for i, total, name, w in iter_weights(cfg, seed, alpha):
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if int4_scope is not None and module is not None and is_quantized(module, int4_scope):
            qw, sc = quantize_w4a16(w, group_size)
            W[module + ".qw"], W[module + ".sc"] = qw, scale_bits(sc)
        elif dense == "bfloat16":
            W[name] = _bf16_bits_by_rows(w)
            bf16.add(name)
        else:
            W[name] = w.astype(np.float32)
        if progress is not None:
            progress(i + 1, total)
    return StoredWeights.from_arrays(W, np.float64, frozenset(bf16))


def _bf16_bits_by_rows(w: np.ndarray, rows: int = 1024) -> np.ndarray:
    """bf16_bits(w) (one rounding from float64) a block of rows at a time: the rounding's temporaries
    stay small (an 18432 x 7168 dense MLP weight would otherwise need ~5 GB of them)."""
    out = np.empty(w.shape, np.uint16)
    for r in range(0, w.shape[0], rows):
        out[r:r + rows] = bf16_bits(w[r:r + rows])
    return out


def available_memory() -> int | None:
    """Bytes of memory available now (Linux MemAvailable), None where the system does not say."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


UNKNOWN_MEMORY_BUDGET = 1 << 30     # bytes upcast_if_fits may use where the system does not say what is free


def upcast_if_fits(W: StoredWeights, copies: float = 1.5, share: float = 0.6):
    """W upcast once into a plain dict when `copies` x its upcast size (1.5: the float64 model plus a
    float32 copy of it) fits in `share` of the memory available now (UNKNOWN_MEMORY_BUDGET where the system
    does not say); else W itself, upcast per matmul.
    The values are the same either way (module docstring), so a generator's bytes do not depend on which
    machine took which path; only its time and memory do. A mapped W (a checkpoint) is never upcast whole:
    its INT4 experts are dequantized only when a forward routes to them."""
    if W.mapped:
        return W
    avail = available_memory()
    budget = share * avail if avail is not None else UNKNOWN_MEMORY_BUDGET
    return dict(W.items()) if copies * W.upcast_nbytes() <= budget else W
