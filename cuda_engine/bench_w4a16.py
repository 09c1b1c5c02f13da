"""`kdtr bench w4a16`: the fast W4A16 kernel against the memory floor and torch's kernels, in one run on one GPU.

Per K2.6 expert shape (7168 -> 2048, 2048 -> 7168, fused gate+up 7168 -> 2 x 2048) and batch (1 .. 64 tokens):
  fast fp32   w4a16_mma, FP32-faithful (int8 digits at one token, three bf16 terms from two), the engine's mode;
  fast bf16   w4a16_mma with one bf16 term (Marlin's numerics);
  floor       stream_read_kernel reading the same bytes (packed weights + scales) once: a copy kernel's floor;
  cuBLAS bf16 torch.nn.functional.linear on bf16 weights of the same shape (bf16 activations);
  tinygemm    torch._weight_int4pack_mm (INT4, group 32, bf16 activations) where this torch has it.
Then one K2.6 MoE layer for one token: 384 routed INT4 experts + the shared expert (held in INT4 here too),
top-8: the fused gate+up launch, the fused down launch and the combine, as the engine's decode step runs them.
And the MoE layer of a forward over T = 16 and 33 tokens (random top-8 routing of 384 experts, the shared
expert left out): the grouped path (the work list, the grouped gate+up, the grouped down) and the one-pair-per-z
path on the same routing, against the copy floor of the distinct experts' bytes.

Cold cache: every timed launch reads its own copy of the weights, and the copies of one measurement
together exceed 4 x the L2 size, so no launch finds its weights in L2. CUDA graphs: each measurement is one
captured graph of launches over the copies, replayed; time = replay time / launches (CUDA events). The
weights are random bits (timing does not depend on values) with scales set to 1.0.
"""
from __future__ import annotations

import math
import re

import numpy as np

from cuda_engine.device import CudaEngineError, DevBuf, device_info, driver, driver_device

SHAPES = (("7168->2048", 7168, 2048, 0), ("2048->7168", 2048, 7168, 0), ("7168->4096 gate+up", 7168, 2048, 1))
BATCHES = (1, 2, 4, 8, 16, 32, 64)
GROUPED_T = (16, 33)                # the grouped MoE layer's forwards (tokens)
BF16_ONE_PAIR = 0x3F803F80          # two bf16 1.0 scales in one int32 word
MOE = {"experts": 384, "top_k": 8, "hidden": 7168, "width": 2048}


def _torch():
    try:
        import torch
    except ImportError as e:
        raise CudaEngineError(f"the benchmark compares against torch's kernels: torch is not importable ({e})") \
            from None
    if not torch.cuda.is_available():
        raise CudaEngineError("torch sees no CUDA device")
    return torch


def _packed_copies(torch, n: int, Nb: int, G: int):
    """n copies of random packed weights [n, Nb, G, 144] (scales 1.0) as a torch int32 tensor."""
    t = torch.randint(-2**31, 2**31 - 1, (n, Nb, G, 144), dtype=torch.int32, device="cuda")
    t[..., 128:] = BF16_ONE_PAIR
    return t


def _view(t, shape, dtype) -> DevBuf:
    return DevBuf(shape, dtype, ptr=int(t.data_ptr()), owner=t)


def _graph_us(ops, record, launches: int, reps: int) -> float:
    """Microseconds per launch of a captured graph of `launches` launches, replayed `reps` times."""
    from cuda_engine.graph import capture

    drv = driver()
    g = capture(ops, record)
    for _ in range(3):
        g.launch(ops.stream)
    start, end = drv.Event(), drv.Event()
    start.record(ops.stream)
    for _ in range(reps):
        g.launch(ops.stream)
    end.record(ops.stream)
    end.synchronize()
    g.destroy()
    return end.time_since(start) * 1000.0 / (reps * launches)


def _torch_graph_us(torch, fn, launches: int, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()                                                   # warm-up (workspace, autotuning) outside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / (reps * launches)


def _copies(nbytes: int, l2: int) -> int:
    return max(2, math.ceil(4 * l2 / nbytes))


def run(batches=BATCHES, reps: int = 20, moe: bool = True, progress=print, grouped=GROUPED_T) -> dict:
    torch = _torch()
    torch.cuda.init()
    drv = driver()                                             # pycuda on the primary context torch uses too
    from cuda_engine.ops import Ops

    ops = Ops()
    l2 = driver_device().get_attribute(drv.device_attribute.L2_CACHE_SIZE)
    sink = DevBuf.from_array(np.zeros(4, np.int32))
    rows = []
    for name, K, N, mode in SHAPES:
        Nr = N * (2 if mode else 1)                            # weight rows (gate+up: both)
        Nb, G = (Nr // 32), K // 32
        nbytes = Nb * G * 144 * 4
        n = _copies(nbytes, l2)
        packed = _packed_copies(torch, n, Nb, G)
        bufs = [_view(packed[i], (1, Nb, G, 144), np.int32) for i in range(n)]
        floor = _graph_us(ops, lambda: [ops.stream_read(b.ptr, nbytes, sink) for b in bufs], n, reps)
        progress(f"{name}: {n} copies of {nbytes / 1e6:.2f} MB, floor {floor:.2f} us")
        Wb = torch.randn(_copies(Nr * K * 2, l2), Nr, K, dtype=torch.bfloat16, device="cuda")
        tiny_w, tiny_why = _tinygemm_weights(torch, Nr, K, l2)
        for M in batches:
            x = torch.randn(M, K, dtype=torch.float32, device="cuda")
            out = torch.empty(M, N, dtype=torch.float32, device="cuda")
            xd, od = _view(x, (M, K), np.float32), _view(out, (M, N), np.float32)
            t = {}
            for numerics in ("fp32", "bf16"):
                def launches(numerics=numerics):
                    for b in bufs:
                        ops.w4a16_mma(xd, K, b, N, od, N, M, mode=mode, numerics=numerics)
                launches()                                     # reserves the split-K workspace
                t[numerics] = _graph_us(ops, launches, n, reps)
            xb = x.to(torch.bfloat16)
            t["cublas"] = _torch_graph_us(torch, lambda: [torch.nn.functional.linear(xb, w) for w in Wb], len(Wb), reps)
            t["tinygemm"] = None
            if tiny_w is not None:
                t["tinygemm"] = _torch_graph_us(
                    torch, lambda: [torch._weight_int4pack_mm(xb, w, 32, sz) for w, sz in tiny_w], len(tiny_w), reps)
            entry, gx, ks = ops.w4a16_plan(Nb, G, 1, None, min(M, 64), "fp32")
            row = {"shape": name, "K": K, "N": Nr, "batch": M, "bytes": nbytes, "floor_us": floor,
                   "fast_fp32_launch": {"entry": entry, "blocks": gx, "splits": ks},
                   "fast_fp32_us": t["fp32"], "fast_bf16_us": t["bf16"], "cublas_bf16_us": t["cublas"],
                   "tinygemm_us": t["tinygemm"], "gbps_fast_fp32": nbytes / t["fp32"] / 1e3,
                   "gbps_floor": nbytes / floor / 1e3, "fast_vs_floor": t["fp32"] / floor,
                   "bf16_vs_floor": t["bf16"] / floor, "cublas_over_fast": t["cublas"] / t["fp32"],
                   "tinygemm_over_fast": None if t["tinygemm"] is None else t["tinygemm"] / t["fp32"]}
            rows.append(row)
            progress(_row_text(row))
        del packed, Wb, tiny_w
        torch.cuda.empty_cache()
    out = {**device_info(), "l2_bytes": int(l2), "reps": reps, "rows": rows, "tinygemm": tiny_why}
    if moe:
        out["moe_layer"] = _moe_layer(torch, ops, sink, reps, progress)
        out["moe_grouped"] = moe_grouped(torch, ops, sink, grouped, reps, progress) if grouped else []
    out["aims"] = _aims(out)
    return out


def _tinygemm_weights(torch, N: int, K: int, l2: int):
    """([(packed, scales_and_zeros)] copies, why) for torch._weight_int4pack_mm at group 32, or (None, why)."""
    if not hasattr(torch, "_weight_int4pack_mm") or not hasattr(torch, "_convert_weight_to_int4pack"):
        return None, "this torch has no _weight_int4pack_mm"
    try:
        n = _copies(N * K // 2, l2)
        out = []
        for _ in range(n):
            u = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device="cuda")
            w = torch._convert_weight_to_int4pack(u, 8)
            sz = torch.ones(K // 32, N, 2, dtype=torch.bfloat16, device="cuda")
            out.append((w, sz))
        x = torch.randn(1, K, dtype=torch.bfloat16, device="cuda")
        torch._weight_int4pack_mm(x, out[0][0], 32, out[0][1])
        torch.cuda.synchronize()
        return out, f"torch {torch.__version__} _weight_int4pack_mm, group 32, inner k tiles 8"
    except Exception as e:  # noqa: BLE001 - any failure: report why and bench without it
        return None, f"torch {torch.__version__} _weight_int4pack_mm unavailable here: {type(e).__name__}: {e}"


def _moe_layer(torch, ops, sink, reps: int, progress) -> dict:
    """One K2.6 MoE layer, one token: 384 + 1 INT4 experts on the device, top-8 + shared per step; each
    replayed step uses different experts (cold)."""
    E, K, D, I = MOE["experts"], MOE["top_k"], MOE["hidden"], MOE["width"]
    S = K + 1
    gu = _packed_copies(torch, E + 1, 2 * I // 32, D // 32)        # [E + 1, 128, 224, 144]
    dn = _packed_copies(torch, E + 1, D // 32, I // 32)            # [E + 1, 224, 64, 144]
    gud, dnd = _view(gu, tuple(gu.shape), np.int32), _view(dn, tuple(dn.shape), np.int32)
    steps = 16
    rng = np.random.default_rng(0)
    ids = np.stack([np.concatenate([rng.permutation(E)[:K], [E]]) for _ in range(steps)]).astype(np.int32)
    ids_d = DevBuf.from_array(ids)
    w_d = DevBuf.from_array(np.concatenate([np.full((steps, K), 0.1, np.float32), np.ones((steps, 1), np.float32)], 1))
    x = DevBuf.from_array(np.random.default_rng(1).standard_normal((1, D)).astype(np.float32))
    act, y = DevBuf((S, I), np.float32), DevBuf((S, D), np.float32)
    out, h_out, y_norm = (DevBuf((1, D), np.float32) for _ in range(3))
    w_norm = DevBuf.from_array(np.ones(D, np.float32))
    per_expert = (gu[0].numel() + dn[0].numel()) * 4

    def step(s: int) -> None:
        slots = ids_d.ptr + 4 * S * s
        ops.w4a16_mma(x, D, gud, I, act, I, mode=1, slot_ids=slots, T=1, S=S, nk=S)
        ops.w4a16_mma(act, I, dnd, D, y, D, slot_ids=slots, T=1, S=S, nk=S, x_by_slot=True)
        ops.moe_combine(y, slots, w_d.ptr + 4 * S * s, out, 1, K, S, x, h_out, w_norm, y_norm, 1e-6)

    def part(s: int, which: str) -> None:
        slots = ids_d.ptr + 4 * S * s
        if which == "gate_up":
            ops.w4a16_mma(x, D, gud, I, act, I, mode=1, slot_ids=slots, T=1, S=S, nk=S)
        elif which == "down":
            ops.w4a16_mma(act, I, dnd, D, y, D, slot_ids=slots, T=1, S=S, nk=S, x_by_slot=True)
        else:
            ops.moe_combine(y, slots, w_d.ptr + 4 * S * s, out, 1, K, S, x, h_out, w_norm, y_norm, 1e-6)

    step(0)
    ops.stream.synchronize()
    t_layer = _graph_us(ops, lambda: [step(s) for s in range(steps)], steps, reps)
    parts = {w: _graph_us(ops, lambda w=w: [part(s, w) for s in range(steps)], steps, reps)
             for w in ("gate_up", "down", "combine")}
    big = gu.numel() * 4 // 16 * 16
    t_read = _graph_us(ops, lambda: ops.stream_read(gud.ptr, big, sink), 1, max(3, reps // 4))
    copy_gbps = big / t_read / 1e3
    nbytes = S * per_expert
    r = {"experts_on_device": E + 1, "slots": S, "bytes_per_token": nbytes, "us_per_token": t_layer,
         "gbps": nbytes / t_layer / 1e3, "copy_gbps": copy_gbps, "fraction_of_copy": nbytes / t_layer / 1e3 / copy_gbps,
         "launches": 3, "what": "fused gate+up + fused down + combine (router not included)",
         "us_gate_up": parts["gate_up"], "us_down": parts["down"], "us_combine": parts["combine"],
         "gbps_gate_up": S * gu[0].numel() * 4 / parts["gate_up"] / 1e3,
         "gbps_down": S * dn[0].numel() * 4 / parts["down"] / 1e3}
    progress(f"MoE layer, one token, {S} experts of {E + 1}: {t_layer:.1f} us, {r['gbps']:.0f} GB/s = "
             f"{100 * r['fraction_of_copy']:.0f}% of the copy bandwidth ({copy_gbps:.0f} GB/s)")
    del gu, dn
    torch.cuda.empty_cache()
    return r


def moe_grouped(torch, ops, sink, Ts=GROUPED_T, reps: int = 20, progress=print) -> list[dict]:
    """The K2.6 MoE layer over a forward of T tokens (each of Ts), random routing (top-8 of 384 INT4 experts,
    distinct per token; the shared expert's slot present but not run): the grouped path (moe_group, grouped
    gate+up, grouped down: the engine's T > 1 path, int8 digits; and the same on the bf16 terms' entries) and
    the one-pair-per-z path on the same routing, each one
    captured graph replayed (a forward reads far more than the L2 holds). Floor: the distinct experts' bytes
    at the copy bandwidth of one large stream read."""
    from cuda_engine.w4a16_plan import w4a16_group_tokens, w4a16_groups_cap

    E, K, D, I = MOE["experts"], MOE["top_k"], MOE["hidden"], MOE["width"]
    S = K + 1
    gu = _packed_copies(torch, E, 2 * I // 32, D // 32)            # [E, 128, 224, 144]
    dn = _packed_copies(torch, E, D // 32, I // 32)                # [E, 224, 64, 144]
    gud, dnd = _view(gu, tuple(gu.shape), np.int32), _view(dn, tuple(dn.shape), np.int32)
    per_expert = (gu[0].numel() + dn[0].numel()) * 4
    big = gu.numel() * 4 // 16 * 16
    copy_gbps = big / _graph_us(ops, lambda: ops.stream_read(gud.ptr, big, sink), 1, max(3, reps // 4)) / 1e3
    rows = []
    for T in Ts:
        rng = np.random.default_rng(T)
        ids = np.stack([np.concatenate([rng.permutation(E)[:K], [E]]) for _ in range(T)]).astype(np.int32)
        ids_d = DevBuf.from_array(ids)
        x = DevBuf.from_array(rng.standard_normal((T, D)).astype(np.float32))
        act, y = DevBuf((T * S, I), np.float32), DevBuf((T * S, D), np.float32)
        Ms = {"digits": w4a16_group_tokens(T), "terms": w4a16_group_tokens(T, digits=False)}
        Zs = {k: w4a16_groups_cap(T * K, E, m) for k, m in Ms.items()}
        glist = {k: DevBuf((1 + 3 * z + T * K,), np.int32) for k, z in Zs.items()}

        def part(which: str, kind: str = "digits") -> None:
            M, Z, groups, dg = Ms[kind], Zs[kind], glist[kind], kind == "digits"
            if which in ("group", "layer"):
                ops.moe_group(ids_d, T, S, 0, K, 0, E, M, Z, groups)
            if which in ("gate_up", "layer"):
                ops.w4a16_mma(x, D, gud, I, act, I, M, mode=1, groups=groups, Z=Z, S=S, digits=dg)
            if which in ("down", "layer"):
                ops.w4a16_mma(act, I, dnd, D, y, D, M, groups=groups, Z=Z, S=S, x_by_slot=True, digits=dg)
            if which == "pairs":
                ops.w4a16_mma(x, D, gud, I, act, I, mode=1, slot_ids=ids_d, T=T, S=S, nk=K)
                ops.w4a16_mma(act, I, dnd, D, y, D, slot_ids=ids_d, T=T, S=S, nk=K, x_by_slot=True)

        for w, kind in (("layer", "digits"), ("layer", "terms"), ("pairs", "digits")):
            part(w, kind)                                      # reserves the split-K workspace
        ops.stream.synchronize()
        t = {w: _graph_us(ops, lambda w=w: part(w), 1, reps) for w in ("layer", "group", "gate_up", "down", "pairs")}
        t["terms"] = _graph_us(ops, lambda: part("layer", "terms"), 1, reps)
        M = Ms["digits"]
        distinct = int(np.unique(ids[:, :K]).size)
        floor = distinct * per_expert / copy_gbps / 1e3
        r = {"tokens": T, "pairs": T * K, "distinct_experts": distinct, "bytes": distinct * per_expert,
             "group_tokens": M, "groups_cap": Zs["digits"], "copy_gbps": copy_gbps, "floor_us": floor,
             "us_layer": t["layer"],
             "layer_vs_floor": t["layer"] / floor, "us_group": t["group"], "us_gate_up": t["gate_up"],
             "us_down": t["down"], "us_pairs": t["pairs"], "pairs_vs_floor": t["pairs"] / floor,
             "us_layer_bf16_terms": t["terms"], "terms_vs_floor": t["terms"] / floor,
             "terms_group_tokens": Ms["terms"],
             "what": "moe_group + grouped gate+up + grouped down (router, shared expert and combine not included)"}
        rows.append(r)
        progress(_grouped_text(r))
    del gu, dn
    torch.cuda.empty_cache()
    return rows


def _grouped_text(r: dict) -> str:
    return (f"MoE layer, {r['tokens']} tokens ({r['pairs']} pairs, {r['distinct_experts']} distinct experts of 384, "
            f"{r['bytes'] / 1e9:.2f} GB, groups of <= {r['group_tokens']}): grouped {r['us_layer']:.1f} us = "
            f"{r['layer_vs_floor']:.2f}x the floor {r['floor_us']:.1f} us (work list {r['us_group']:.1f}, gate+up "
            f"{r['us_gate_up']:.1f}, down {r['us_down']:.1f}); one pair per z {r['us_pairs']:.1f} us = "
            f"{r['pairs_vs_floor']:.2f}x; grouped on the bf16 terms (groups of <= {r['terms_group_tokens']}) "
            f"{r['us_layer_bf16_terms']:.1f} us = {r['terms_vs_floor']:.2f}x")


def _row_text(r: dict) -> str:
    tg = "      -" if r["tinygemm_us"] is None else f"{r['tinygemm_us']:7.2f}"
    return (f"{r['shape']:>20} b{r['batch']:<3} fast {r['fast_fp32_us']:7.2f} us ({r['gbps_fast_fp32']:5.0f} GB/s, "
            f"{r['fast_vs_floor']:.2f}x floor {r['floor_us']:.2f})  bf16 {r['fast_bf16_us']:7.2f}  "
            f"cuBLAS {r['cublas_bf16_us']:7.2f} ({r['cublas_over_fast']:.2f}x)  tinygemm {tg}")


AIM_CARD = "H200"           # the card the aims are stated for (issue 28): a ratio to the floor depends on the card's memory
ONE_TOKEN_AIM = 0.75        # the one-token K2.6 MoE layer's share of the copy bandwidth


def aim_card_fields(device: str | None) -> dict:
    """What an aim records about the card it was measured on: the aims' card, the device name, and whether that
    device is the aims' card. "H200" must stand as a model name of its own, so a GH200 (a Grace Hopper superchip,
    another memory system) is not taken for one; an "H200 NVL" is."""
    on = device is not None and re.search(rf"(?<![A-Za-z0-9]){AIM_CARD}(?![0-9])", device) is not None
    return {"aim_card": AIM_CARD, "device": device, "on_aim_card": on}


def _aims(out: dict) -> list[dict]:
    """The speed aims (docs/cuda-engine.md), each with the measured value, whether it is met, and whether the card
    measured is the one the aims are for (`on_aim_card`, from the device name)."""
    def row(shape, batch):
        return next((r for r in out["rows"] if r["shape"] == shape and r["batch"] == batch), None)
    aims = []
    r1, r16 = row("7168->2048", 1), row("7168->2048", 16)
    if r1:
        aims.append({"aim": "batch 1, 7168->2048: <= 1.25x the floor", "value": r1["fast_vs_floor"],
                     "met": r1["fast_vs_floor"] <= 1.25})
        aims.append({"aim": "batch 1, 7168->2048: >= 2.5x faster than cuBLAS bf16", "value": r1["cublas_over_fast"],
                     "met": r1["cublas_over_fast"] >= 2.5})
    if r16:
        aims.append({"aim": "batch 16, 7168->2048: <= 1.6x the floor", "value": r16["fast_vs_floor"],
                     "met": r16["fast_vs_floor"] <= 1.6})
    if "moe_layer" in out:
        f = out["moe_layer"]["fraction_of_copy"]
        aims.append({"aim": f"one-token K2.6 MoE layer: >= {ONE_TOKEN_AIM:.0%} of the copy bandwidth", "value": f,
                     "met": f >= ONE_TOKEN_AIM})
    for r in out.get("moe_grouped", []):
        aims.append({"aim": f"K2.6 MoE layer over {r['tokens']} tokens, grouped: <= 1.6x the distinct experts' floor",
                     "value": r["layer_vs_floor"], "met": r["layer_vs_floor"] <= 1.6})
    device = out.get("device")
    for a in aims:
        a.update(aim_card_fields(device))
    return aims


def aim_verdict(a: dict) -> str:
    """'met' / 'MISSED', and where the card measured is not the aims' card, which card it was."""
    verdict = "met" if a["met"] else "MISSED"
    if a.get("on_aim_card", True):
        return verdict
    return f"{verdict} on {a.get('device') or 'an unnamed device'}, not on an {a['aim_card']}, the card the aim is for"


def table(out: dict) -> str:
    lines = [f"{out['device']} (cc {out['compute_capability']}), L2 {out['l2_bytes'] / 2**20:.0f} MiB, "
             f"cold cache, CUDA graphs; tinygemm: {out['tinygemm']}"]
    lines += [_row_text(r) for r in out["rows"]]
    if "moe_layer" in out:
        m = out["moe_layer"]
        lines.append(f"MoE layer (one token, {m['slots']} of {m['experts_on_device']} INT4 experts, {m['what']}): "
                     f"{m['us_per_token']:.1f} us, {m['gbps']:.0f} GB/s, {100 * m['fraction_of_copy']:.0f}% of copy "
                     f"bandwidth {m['copy_gbps']:.0f} GB/s; alone: gate+up {m['us_gate_up']:.1f} us "
                     f"({m['gbps_gate_up']:.0f} GB/s), down {m['us_down']:.1f} us ({m['gbps_down']:.0f} GB/s), "
                     f"combine {m['us_combine']:.1f} us")
    lines += [_grouped_text(r) for r in out.get("moe_grouped", [])]
    lines += [f"aim: {a['aim']}: {a['value']:.2f} -> {aim_verdict(a)}" for a in out["aims"]]
    return "\n".join(lines)
