"""The `torch` engine: a PyTorch DeepseekV3 model on a bundle's own weights, driven through the Engine protocol.

By default the model is transformers' `DeepseekV3ForCausalLM` (eager attention, eager experts); with
`--module pkg.mod:Class` it is the user's own port. Either way the bundle's weights are loaded under their
HF names (INT4 experts dequantized by `kdtr_format.int4`, the layout truth), in float32 or bfloat16 (the
router gate and its bias stay float32, as transformers' `from_pretrained` keeps them), on the GPU when
torch sees one, else the CPU.

A user module must look like transformers' DeepseekV3ForCausalLM: the contract is docs/engine-api.md §5
(building it and loading its weights: conformance/engines/torch_port.py).

Taps come from forward hooks, under the names of docs/architecture.md:

    attn_in       input_layernorm output            attn_out     self_attn output
    resid_attn    post_attention_layernorm input    mlp_in       post_attention_layernorm output
    router_scores sigmoid(mlp.gate logits)          topk_ids, topk_weights   mlp.gate outputs
    mlp_out       mlp output                        resid_out    decoder layer output
    q             the query handed to the attention function (registered as an attention implementation)
    kv_latent, k_pe   the rows the forward appended to the cache (exactly what the cache holds)
    final_hidden  model.norm output                 logits       the model's output

transformers keeps the rotated RoPE dims de-interleaved ([evens ; odds], y = x[P]); the taps convert back to
the checkpoint's interleaved layout (x = y[argsort(P)]), and `run_layer` converts golden cache rows the
other way (docs/run-dump.md, "Layouts to match"). A port that keeps the interleaved layout declares
`kdtr_rope_layout = "interleaved"` and P is the identity. A tap the module does not expose is not reported and its
reason is kept in `unobserved`, which the runner shows on the skipped check.

Building the model (config, weights under HF names, a user module's class): conformance/engines/torch_port.py.

What kdtr does for the model, `done_by_kdtr` after `load` says (the verdict lists it as not judged,
conformance/verify/not_judged.py): decoding INT4 linears for a class without `kdtr_int4_packed = True`,
and compacting the cache after a DDTree verify when the cache (the class's `kdtr_cache_class`, default
transformers' DynamicCache) has no `compact(start, keep)` method of its own.

Legend: T tokens of a forward, S cache rows, D hidden, H heads, A = N + R query dims, N nope dims,
C kv_lora_rank, R qk_rope_head_dim, V vocab.
"""
from __future__ import annotations

import os

import numpy as np
import torch
from transformers import DynamicCache

from conformance.engines.protocol import compact_keep
from conformance.engines.torch_port import (DTYPES, TorchEngineError, build_model, int4_modules, port_class,
                                            rope_layout)
from kdtr_format import open_kdtr
from refmodel.config import ModelConfig
from refmodel.model import causal_mask, tap_names
from refmodel.stored import read_model


def _rope_order(R: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """(P, P^-1) for a port's RoPE layout: its rotated dims are y = x[P] of the checkpoint's interleaved x.
    transformers de-interleaves (P = evens, then odds); an interleaved port keeps x (P = identity)."""
    P = np.concatenate([np.arange(0, R, 2), np.arange(1, R, 2)]) if layout == "deinterleaved" else np.arange(R)
    return P, np.argsort(P)


class TorchEngine:
    """The Engine protocol (conformance/engines/protocol.py) over a PyTorch DeepseekV3 module, with teacher forcing (run_layer)."""
    name = "torch"
    supports_teacher_forcing = True

    def __init__(self, dtype: str = "float32", module: str | None = None, device: str | None = None):
        if dtype not in DTYPES:
            raise TorchEngineError(f"--dtype {dtype!r}: the torch engine runs float32 or bfloat16")
        self.dtype, self.module = dtype, module
        self.rope_layout, self.rope_declared = rope_layout(port_class(module))   # a bad --module fails here
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cpu" and not os.environ.get("OMP_NUM_THREADS"):   # one token at a time on small
            torch.set_num_threads(1)     # matrices: a user measured 14 s with one thread, 102 s with torch's default
        self.unobserved: dict[str, str] = {}                             # tap -> why it is not reported
        self.cfg: ModelConfig | None = None
        self.model = None
        self._taps: dict = {}
        self._held: dict = {}                                            # layer -> [T, K] ids for the next forward
        self.held_rows = 0                                               # rows that ran held, not own, experts
        self.done_by_kdtr: dict[str, str] = {}                           # step -> why (not_judged.py)

    def describe(self) -> str:
        rope = (f"RoPE {self.rope_layout}" if self.rope_declared or self.module is None else
                "RoPE deinterleaved (transformers'; the class declares no kdtr_rope_layout)")
        n = torch.get_num_threads()
        threads = f" ({n} thread{'s' * (n != 1)}; OMP_NUM_THREADS sets them)" if self.device == "cpu" else ""
        return f"{self.module or 'transformers DeepseekV3ForCausalLM'}, {self.dtype}, {self.device}{threads}, {rope}"

    def load(self, bundle) -> None:
        if isinstance(bundle, (str, os.PathLike)):
            with open_kdtr(bundle) as f:
                self.cfg, W = read_model(f)
        else:
            self.cfg, W = read_model(bundle)
        self.model = build_model(self.cfg, W, self.module, self.dtype, self.device)
        self.done_by_kdtr = self._kdtr_steps(len(int4_modules(W)))
        self.held_rows = 0
        self._P, self._inv = _rope_order(self.cfg.qk_rope_head_dim, self.rope_layout)
        self._hook()
        self.reset()

    def _kdtr_steps(self, n_int4: int) -> dict[str, str]:
        cls, steps = type(self.model), {}
        if n_int4 and getattr(cls, "kdtr_int4_packed", False) is not True:
            steps["int4_decode"] = (f"{cls.__name__} does not set kdtr_int4_packed = True, so kdtr dequantized "
                                    f"its {n_int4} INT4 linears before loading them (docs/engine-api.md)")
        if not callable(getattr(self._new_cache(), "compact", None)):
            steps["cache_compaction"] = (f"{cls.__name__}'s cache ({self._cache_class().__name__}) has no "
                                         f"compact(start, keep) method, so kdtr gathers its rows (docs/engine-api.md)")
        return steps

    def _cache_class(self) -> type:
        return getattr(type(self.model), "kdtr_cache_class", DynamicCache)

    def _new_cache(self):
        """An empty cache of the model's own class (docs/engine-api.md, "The cache")."""
        return self._cache_class()(config=self.model.config)

    def reset(self) -> None:
        self.cache = self._new_cache()

    # -- taps

    def _np(self, t: torch.Tensor) -> np.ndarray:
        """A float tensor as the protocol stores it: float32, or for a bfloat16 engine the raw bfloat16
        bits (uint16). (The router's scores stay float32, as it computes them: `_routing`.)"""
        t = t.detach()
        if self.dtype == "bfloat16":
            return t.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
        return t.float().cpu().numpy()

    def _put(self, key: str, t: torch.Tensor) -> None:
        self._taps[key] = self._np(t[0])                                 # batch row 0

    def _hook(self) -> None:
        """Forward hooks on the HF-named submodules; each writes its tap into self._taps."""
        mods = dict(self.model.named_modules())
        N = self.cfg.qk_nope_head_dim

        def out(key, pick=lambda o: o):
            return lambda m, args, o: self._put(key, pick(o))

        def attn_q(l):
            def record(q):                                               # [1, H, T, A], RoPE de-interleaved
                q = q.transpose(1, 2)                                    # -> [1, T, H, A]
                self._put(f"L{l}/q", torch.cat([q[..., :N], q[..., N:][..., self._inv]], dim=-1))
            return record

        def post_norm(l):                                                # its input is the residual
            def hook(m, args, o):                                        # stream after attention
                self._put(f"L{l}/resid_attn", args[0])
                self._put(f"L{l}/mlp_in", o)
            return hook

        for l in range(self.cfg.num_hidden_layers):
            p = f"model.layers.{l}."
            need = [p + s for s in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")]
            absent = [n for n in need if n not in mods]
            if absent:
                raise TorchEngineError(f"the module has no submodule {absent[0]!r}: a torch engine module "
                                       f"names its submodules as transformers' DeepseekV3ForCausalLM")
            mods[p + "input_layernorm"].register_forward_hook(out(f"L{l}/attn_in"))
            mods[p + "self_attn"].register_forward_hook(out(f"L{l}/attn_out", lambda o: o[0]))
            mods[p + "self_attn"]._kdtr_record_q = attn_q(l)
            mods[p + "post_attention_layernorm"].register_forward_hook(post_norm(l))
            if l >= self.cfg.first_k_dense_replace:
                if p + "mlp.gate" not in mods:
                    raise TorchEngineError(f"MoE layer {l} has no submodule {p}mlp.gate (the router)")
                mods[p + "mlp.gate"].register_forward_hook(lambda m, args, o, l=l: self._routing(l, m, o))
            mods[p + "mlp"].register_forward_hook(out(f"L{l}/mlp_out"))
            mods[p[:-1]].register_forward_hook(out(f"L{l}/resid_out", lambda o: o[0] if isinstance(o, tuple) else o))
        mods["model.norm"].register_forward_hook(out("final_hidden"))

    def _routing(self, l: int, gate, o):
        """transformers' router returns (logits, topk_weights, topk_ids); our scores are the sigmoid. The
        taps are the router's own decision; with routing held (hold_routing), a row whose held expert set
        differs from the router's runs the held experts, weighted from the router's own scores as the
        router weighs its choice (gathered, normalised when norm_topk_prob, scaled): the replaced output."""
        logits, weights, ids = o
        scores = torch.sigmoid(logits.float())                                             # [T, E]
        self._taps[f"L{l}/router_scores"] = scores.detach().cpu().numpy()  # float32 (docs/run-dump.md)
        self._taps[f"L{l}/topk_weights"] = self._np(weights)                               # [T, K]
        self._taps[f"L{l}/topk_ids"] = ids.detach().cpu().numpy().astype(np.int64)         # [T, K]
        held = self._held.get(l)
        if held is None:
            return None
        held = torch.as_tensor(np.array(held, np.int64), device=ids.device)                # [T, K], -1: own
        if tuple(held.shape) != tuple(ids.shape):
            raise TorchEngineError(f"hold_routing: layer {l} got held ids of shape {tuple(held.shape)} for a "
                                   f"forward routing {tuple(ids.shape)}")
        own_sets, held_sets = ids.sort(dim=-1).values, held.sort(dim=-1).values
        swap = (held >= 0).all(dim=-1) & (own_sets != held_sets).any(dim=-1)               # [T]
        if not bool(swap.any()):
            return None
        self.held_rows += int(swap.sum())
        w = scores.gather(1, held.clamp(min=0))
        if self.model.config.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = (w * self.model.config.routed_scaling_factor).to(weights.dtype)
        return logits, torch.where(swap[:, None], w, weights), torch.where(swap[:, None], held, ids)

    def _cache_taps(self, cache, layers, T: int) -> None:
        """kv_latent and k_pe: the T rows this forward appended to each layer's cache."""
        C, R = self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim
        for l in layers:
            keys, values = cache.layers[l].keys, cache.layers[l].values   # [1, 1, S, C], [1, 1, S, R]
            if keys.ndim != 4 or keys.shape[1] != 1 or keys.shape[-1] != C or values.shape[-1] != R:
                self.unobserved.update(dict.fromkeys(("kv_latent", "k_pe"), (
                    f"the module caches tensors of shape {tuple(keys.shape)} / {tuple(values.shape)}, not the "
                    f"MLA latent [1, 1, S, {C}] and rotated rope key [1, 1, S, {R}]")))
                return
            self._taps[f"L{l}/kv_latent"] = self._np(keys[0, 0, -T:])
            self._taps[f"L{l}/k_pe"] = self._np(values[0, 0, -T:, self._inv])

    def _ordered(self, layers, final: bool) -> dict:
        """The taps in execution order (docs/architecture.md); note the ones the module did not show."""
        keys = [f"L{l}/{t}" for l in layers for t in tap_names(self.cfg, l)] + (["final_hidden"] if final else [])
        for k in keys:
            if k not in self._taps and k.split("/")[-1] not in self.unobserved:
                self.unobserved[k.split("/")[-1]] = ("the module's attention does not call transformers' attention "
                                                     "interface, so the rotated query is not observable"
                                                     if k.endswith("/q") else "no hook saw it")
        return {k: self._taps[k] for k in keys if k in self._taps}

    # -- the protocol

    def _mask(self, mask: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(mask), dtype=DTYPES[self.dtype], device=self.device)[None, None]

    def hold_routing(self, ids: dict | None) -> None:
        """The expert sets the next forward runs ({layer: [T, K]}, -1 rows: the router decides;
        conformance/engines/protocol.py). The taps still report the router's own decision."""
        self._held = dict(ids or {})

    def _forward(self, ids, positions, mask) -> tuple[np.ndarray, dict]:
        ids = np.array(ids, np.int64).reshape(-1)          # a writable copy for torch
        T, S = len(ids), self.cache.get_seq_length()
        mask = causal_mask(T, S) if mask is None else mask               # [T, S + T] additive
        self._taps = {}
        try:
            with torch.no_grad():
                out = self.model(input_ids=torch.as_tensor(ids, device=self.device)[None],
                                 position_ids=torch.as_tensor(np.array(positions, np.int64), device=self.device)[None],
                                 attention_mask=self._mask(mask), cache=self.cache, use_cache=True)
        finally:
            self._held = {}                                              # held for one call only
        self._cache_taps(self.cache, range(self.cfg.num_hidden_layers), T)
        taps = self._ordered(range(self.cfg.num_hidden_layers), final=True)
        if not isinstance(getattr(out, "logits", None), torch.Tensor):
            raise TorchEngineError(f"{type(self.model).__name__}.forward returned a {type(out).__name__}, not an output "
                                   f"object with .logits [1, T, V] (return transformers' CausalLMOutputWithPast, "
                                   f"or any object with a `logits` attribute; docs/engine-api.md)")
        logits = self._np(out.logits[0])                                 # [T, V]
        taps["logits"] = logits
        return logits, taps

    def prefill(self, ids, positions):
        return self._forward(ids, positions, None)

    def decode(self, token, position):
        return self._forward([token], [position], None)

    def verify_tree(self, ids, positions, mask):
        return self._forward(ids, positions, mask)

    def compact(self, start, keep) -> None:
        """Rows start + keep[i] -> start + i in every layer, then truncate (KVCache.compact): through the
        cache's own `compact(start, keep)` (keep: int64 tensor on the model's device) when it has one,
        else by kdtr (listed in done_by_kdtr)."""
        keep = compact_keep(start, keep, self.cache.get_seq_length())
        if callable(getattr(self.cache, "compact", None)):
            self.cache.compact(int(start), torch.as_tensor(keep, device=self.device))
            return
        rows = torch.as_tensor(np.concatenate([np.arange(start), start + keep]), device=self.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, rows], layer.values[:, :, rows]

    def run_layer(self, layer: int, inputs: dict) -> dict:
        """Layer `layer` alone on golden inputs (hidden [T, D], positions [T], cache rows c_kv [S, C] and
        k_pe [S, R] in the checkpoint layout), on a cache of its own."""
        dt, dev = DTYPES[self.dtype], self.device
        h = torch.as_tensor(np.array(inputs["hidden"]), dtype=dt, device=dev)[None]            # [1, T, D]
        pos = torch.as_tensor(np.asarray(inputs["positions"], np.int64), device=dev)[None]     # [1, T]
        c_kv, k_pe = np.array(inputs["c_kv"]), np.array(inputs["k_pe"])                         # [S, C], [S, R]
        cache = self._new_cache()
        if len(c_kv):
            cache.update(torch.as_tensor(c_kv, dtype=dt, device=dev)[None, None],
                         torch.as_tensor(k_pe[:, self._P], dtype=dt, device=dev)[None, None], layer)  # port layout
        T, S = h.shape[1], len(c_kv)
        self._taps = {}
        inner = getattr(self.model, "model", None)
        if not callable(getattr(inner, "rotary_emb", None)):
            raise TorchEngineError(f"{type(self.model).__name__} has no model.rotary_emb: run_layer builds a layer's "
                                   f"position embeddings with it (rotary_emb(hidden, position_ids) -> (cos, sin), "
                                   f"as transformers' DeepseekV3RotaryEmbedding; docs/engine-api.md)")
        with torch.no_grad():
            pe = inner.rotary_emb(h, pos)
            try:
                inner.layers[layer](h, attention_mask=self._mask(causal_mask(T, S)), position_ids=pos,
                                    cache=cache, use_cache=True, position_embeddings=pe)
            except TypeError as e:
                raise TorchEngineError(f"model.layers[{layer}] does not take transformers' decoder-layer call "
                                       f"layer(hidden, attention_mask=, position_ids=, cache=, use_cache=, "
                                       f"position_embeddings=) ({e}; docs/engine-api.md)") from None
        self._cache_taps(cache, [layer], T)
        return self._ordered([layer], final=False)
