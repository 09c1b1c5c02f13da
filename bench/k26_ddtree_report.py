"""`kdtr bench ddtree --k26`, the report: the host half's models and the device half's measurements joined
into the JSON (summary per context, routing and budget; projections; aims), the console tables, and `run`,
the whole benchmark (docs/k26-scale.md)."""
from __future__ import annotations

import os

import numpy as np

from bench.k26_ddtree import (BUDGETS, CONTEXTS, K26, PUBLISHED, QUICK_BUDGETS, SHARE, best_budget,
                              bundle_acceptance, dense_bytes, expert_bytes, fit_alpha, golden_rounds,
                              independent_distinct, layer_bytes, mean_distinct, project, published_acceptance,
                              tree_shape)
from cuda_engine.bench_w4a16 import aim_card_fields, aim_verdict   # one card and verdict for both benches' aims


def acceptance_models(rounds: list[dict], budgets) -> dict:
    """{name: {"source": ..., "tau": {b: tokens per round}}}: the bundles' measured acceptance and the
    published lengths' modelled one (tree_tau over a per-token acceptance fitted to each)."""
    names = sorted({os.path.basename(r["bundle"]) for r in rounds})
    out = {"bundles": {"source": f"{len(rounds)} golden DDTree rounds of {len(names)} bundles "
                                 f"({', '.join(names)}), trees cut to b nodes (measured up to their budget "
                                 f"{min(r['budget'] for r in rounds)})",
                       "tau": bundle_acceptance(rounds, budgets)}}
    for name, tau in PUBLISHED["tau"].items():
        alpha = fit_alpha(tau, PUBLISHED["block_size"] - 1)
        out[f"published {name}"] = {"source": f"{PUBLISHED['source']}: {name} tau {tau}; per-token acceptance "
                                              f"{alpha:.3f}, geometric ranks, depth <= {PUBLISHED['block_size'] - 1}",
                                    "tau": published_acceptance(budgets, tau)}
    return out


def routing_table(shapes: dict, shares=(0.0, 0.25, 0.5, 0.75), samples: int = 64) -> list[dict]:
    """Per budget: distinct routed experts of the verify (the independent formula, the correlated model at
    each share on the tree's shape) and the least bytes one layer's verify reads at each, over the AR step's."""
    ar = layer_bytes(K26["num_experts_per_tok"], 1, 0)
    rows = []
    for b, parents in sorted(shapes.items()):
        T = len(parents)
        d = {f"{s:g}": mean_distinct(parents, s, samples, seed=b) for s in shares}
        rows.append({"budget": b, "rows": T, "independent": independent_distinct(T), "correlated": d,
                     "bytes_over_ar_at_share": {k: layer_bytes(v, T, 0) / ar for k, v in d.items()}})
    return rows


def held_dense(gpu: dict | None) -> str:
    """How a device run held the layers' dense weights ("bf16" or "float32"; runs before --k26-dense: float32);
    without a run, the model's own storage, bf16."""
    return "bf16" if gpu is None else gpu.get("dense", "float32")


def summarize(gpu: dict) -> list[dict]:
    """Per context, routing and budget: the mean over layers of the measured verify and AR times, their
    ratio, the MoE half, the distinct routed experts and the least bytes over the time (effective GB/s); the
    MoE half against the copy floor of its experts' bytes (the distinct routed ones and the shared one at the
    measured copy bandwidth; the half also holds the router and the combine)."""
    ms = [m for m in gpu.get("measurements", []) if m["us_layer"] is not None and m["distinct_routed"] is not None]
    dense = held_dense(gpu)
    copy = gpu.get("copy_gbps")
    out = []
    for ctx in gpu.get("contexts", []):
        ar = [m for m in ms if m["context"] == ctx and m["routing"] == "ar"]
        ar_us = float(np.mean([m["us_layer"] for m in ar])) if ar else None
        for routing in ("ar", "router", "correlated"):
            for b in sorted({m["budget"] for m in ms if m["routing"] == routing}):
                sel = [m for m in ms if m["context"] == ctx and m["routing"] == routing and m["budget"] == b]
                if not sel:
                    continue
                us = float(np.mean([m["us_layer"] for m in sel]))
                with_moe = [m for m in sel if m["us_moe"] is not None]
                moe = [m["us_moe"] for m in with_moe]
                mla = [m["us_mla"] for m in sel if m.get("us_mla") is not None]
                dist = float(np.mean([m["distinct_routed"] for m in sel]))
                nbytes = layer_bytes(dist, sel[0]["rows"], ctx, dense)   # the dense weights as this run held them
                floor = (dist + K26["n_shared_experts"]) * expert_bytes() / copy / 1e3 if copy else None
                out.append({"context": ctx, "routing": routing, "budget": b, "rows": sel[0]["rows"],
                            "layers": len(sel), "us_layer": us, "us_moe": float(np.mean(moe)) if moe else None,
                            "us_attention": float(np.mean([m["us_layer"] - m["us_moe"] for m in with_moe]))
                            if moe else None, "us_mla": float(np.mean(mla)) if mla else None, "distinct_routed": dist,
                            "bytes": nbytes, "gbps": nbytes / us / 1e3, "ar_us": ar_us, "moe_floor_us": floor,
                            "moe_over_floor": float(np.mean(moe)) / floor if moe and floor else None,
                            "verify_over_ar": us / ar_us if ar_us else None})
    return out


def projections(summary: list[dict], acceptance: dict, draft: float = 0.0) -> list[dict]:
    """Per context, routing model and acceptance model: the projected speedup per budget and the best."""
    out = []
    for ctx in sorted({r["context"] for r in summary}):
        for routing in ("router", "correlated"):
            ratio = {r["budget"]: r["verify_over_ar"] for r in summary
                     if r["context"] == ctx and r["routing"] == routing}
            if not ratio:
                continue
            for name, acc in acceptance.items():
                s = project(ratio, acc["tau"], draft)
                b, best = best_budget(s)
                # the most drafting time per round (AR steps) that still leaves AIM_SPEEDUP at some budget
                room = [acc["tau"][k] / AIM_SPEEDUP - ratio[k] for k in ratio if ratio[k] and acc["tau"].get(k)]
                out.append({"context": ctx, "routing": routing, "acceptance": name, "speedup": s,
                            "best_budget": b, "best_speedup": best, "draft_room": max(room) if room else None})
    return out


def bytes_bound(routing_model: list[dict], acceptance: dict) -> list[dict]:
    """The speedup an engine whose layer time were its least bytes (weights only, each read once at one
    bandwidth) would reach: tau / (verify bytes / AR bytes), per correlated share and acceptance model."""
    out = []
    for share in routing_model[0]["bytes_over_ar_at_share"]:
        ratio = {x["budget"]: x["bytes_over_ar_at_share"][share] for x in routing_model}
        for name, acc in acceptance.items():
            sp = project(ratio, acc["tau"])
            b, best = best_budget(sp)
            out.append({"share": share, "acceptance": name, "speedup": {str(k): v for k, v in sp.items()},
                        "best_budget": b, "best_speedup": best})
    return out


def report(rounds, shapes, synthesised, acceptance, routing_model, gpu: dict | None, draft: float = 0.0,
           gpu_error=None) -> dict:
    """Everything the JSON holds; routing_model: routing_table(shapes) (made once: it samples)."""
    summary = summarize(gpu) if gpu else []
    proj = projections(summary, acceptance, draft)
    return {"what": "kdtr bench ddtree --k26 (docs/k26-scale.md)", "dims": K26, "expert_bytes": expert_bytes(),
            "dense_bytes": dense_bytes(dense=held_dense(gpu)), "budgets": sorted(shapes),
            "shapes": {str(b): {"rows": len(p), "synthesised": synthesised[b], "parents": p.tolist()}
                       for b, p in sorted(shapes.items())},
            "shapes_from": {k: rounds[0][k] for k in ("bundle", "prompt", "round")},
            "acceptance": {k: {"source": v["source"], "tau": {str(b): t for b, t in v["tau"].items()}}
                           for k, v in acceptance.items()},
            "routing_model": routing_model, "bytes_bound": bytes_bound(routing_model, acceptance),
            "draft_ar_steps": draft,
            "gpu": gpu, "gpu_error": gpu_error, "summary": summary,
            "projection": [{**p, "speedup": {str(b): s for b, s in p["speedup"].items()}} for p in proj],
            "aims": aims(proj, (gpu or {}).get("device"))}


AIM_SPEEDUP = 1.5                # the projected batch-1 speedup aimed at, under the published acceptance
# AIM_CARD (cuda_engine/bench_w4a16.py, shared with kdtr bench w4a16): the card the aim is stated for. A verify / AR
# ratio depends on the card's memory speed (an H100's slower memory slows the AR step more than the verify), so a
# projection measured on another card is not the aim's.


def aims(proj: list[dict], device: str | None = None) -> list[dict]:
    """The aim (a projected speedup of at least AIM_SPEEDUP under the published GSM8K acceptance, on an AIM_CARD)
    per context and routing model, with the best budget's value, whether it is met on the card measured, whether
    that card is the aim's (`on_aim_card`, from the device name), and the room for drafting: the most drafter and
    builder time per round, in AR steps, that would still leave AIM_SPEEDUP at some budget (negative: missed even
    with a free drafter)."""
    return [{"aim": f"projected speedup >= {AIM_SPEEDUP}x, published GSM8K acceptance, {p['context']} cached rows, "
                    f"{p['routing']} routing", "best_budget": p["best_budget"], "value": p["best_speedup"],
             "met": p["best_speedup"] is not None and p["best_speedup"] >= AIM_SPEEDUP,
             "draft_room_ar_steps": p["draft_room"], **aim_card_fields(device)}
            for p in proj if p["acceptance"] == "published GSM8K"]


def _f(x, fmt: str) -> str:
    """x formatted, or '-' right-aligned to the format's width where x is None."""
    width = fmt.split(".")[0]
    return f"{'-':>{int(width) if width.isdigit() else 1}}" if x is None else format(x, fmt)


def table(r: dict) -> str:
    """The console tables: routing model, acceptance, measured times, projected speedup per budget."""
    budgets = r["budgets"]

    def head(width: int) -> str:
        return "  " + f"{'budget':<{width}}" + "".join(f"{b:>7d}" for b in budgets)

    lines = ["distinct routed experts per verify (rows = budget + 1) and its least weight bytes over the AR "
             "step's, by routing model:", head(12),
             "  independent " + "".join(f"{x['independent']:7.1f}" for x in r["routing_model"])]
    for s in r["routing_model"][0]["correlated"]:
        lines.append(f"  share {s:<5} " + "".join(f"{x['correlated'][s]:7.1f}" for x in r["routing_model"]))
        lines.append(f"    bytes/AR  " + "".join(f"{x['bytes_over_ar_at_share'][s]:7.2f}" for x in r["routing_model"]))
    lines += ["tokens per round (tau) by acceptance model:", head(44)]
    for name, a in r["acceptance"].items():
        lines.append(f"  {name:<44}" + "".join(f"{_f(a['tau'][str(b)], '7.2f')}" for b in budgets))
    if "bundles" in r["acceptance"]:               # which bundles: the row moves with the ones present
        lines.append(f"  (bundles: {r['acceptance']['bundles']['source']})")
    lines += ["bytes-bound speedup (tau / verify-over-AR weight bytes: an engine at its copy floor), best budget:",
              head(44)]
    for p in r["bytes_bound"]:
        lines.append(f"  share {p['share']:<5} {p['acceptance']:<32}" + "".join(
            f"{_f(p['speedup'][str(b)], '7.2f')}" for b in budgets) + f"   b={p['best_budget']} "
            f"{_f(p['best_speedup'], '.2f')}x")
    if r["gpu"]:
        g = r["gpu"]
        lines.append(f"{g.get('device', '?')}: {g['layers']} random-weight K2.6 MoE layers, {g['reps']} replays per "
                     f"measurement ({g.get('timing', '?')}), dense weights {held_dense(g)}, "
                     f"correlated share {g['share']}, "
                     f"{g.get('elapsed_s', 0):.0f} s, {g.get('skipped', 0)} skipped"
                     + ("" if g.get("complete") else ", INCOMPLETE"))
        lines.append(f"  copy bandwidth {_f(g.get('copy_gbps'), '.0f')} GB/s; MoE/floor: the MoE half over its "
                     f"experts' bytes at that bandwidth")
        lines.append("  attn us: the layer less the MoE half; MLA us: the absorbed-MLA launches alone (q_b .. W_uv)")
        lines.append("  ctx    routing     b rows  layer us    MoE us   attn us    MLA us  experts    GB/s MoE/floor  verify/AR")
        for s in r["summary"]:
            lines.append(f"  {s['context']:<6} {s['routing']:<10} {s['budget']:>2} {s['rows']:>4} {s['us_layer']:9.1f} "
                         f"{_f(s['us_moe'], '9.1f')} {_f(s['us_attention'], '9.1f')} {_f(s.get('us_mla'), '9.1f')} "
                         f"{s['distinct_routed']:8.1f} "
                         f"{s['gbps']:7.0f} {_f(s.get('moe_over_floor'), '9.2f')} {_f(s['verify_over_ar'], '10.2f')}")
        errors = [m for m in g["measurements"] if m["error"] and not m["error"].startswith("skipped")]
        lines += [f"  error: L{m['layer']} ctx {m['context']} {m['routing']} b{m['budget']}: {m['error']}"
                  for m in errors[:5]]
    elif r["gpu_error"]:
        lines.append(f"no device measurement: {r['gpu_error']}")
    if r["projection"]:
        lines.append(f"projected wall speedup over AR (tau / (verify/AR + draft {r['draft_ar_steps']:g})), "
                     f"best budget:")
        lines.append(f"  {'ctx':<6} {'routing':<10} {'acceptance':<28}" + "".join(f"{b:>6d}" for b in budgets)
                     + "   best")
        for p in r["projection"]:
            lines.append(f"  {p['context']:<6} {p['routing']:<10} {p['acceptance']:<28}"
                         + "".join(f"{_f(p['speedup'].get(str(b)), '6.2f')}" for b in budgets)
                         + f"   b={p['best_budget']} {_f(p['best_speedup'], '.2f')}x")
    lines += [f"aim: {a['aim']}: {_f(a['value'], '.2f')} at b={a['best_budget']} -> {aim_verdict(a)}"
              f" (room for drafting: {_f(a['draft_room_ar_steps'], '.2f')} AR steps per round)"
              for a in r.get("aims", [])]
    return "\n".join(lines)


def run(bundles, quick: bool = False, share: float = SHARE, draft: float = 0.0, layers: int = 3,
        reps: int = 5, time_budget_s: float = 90.0, progress=print, checkpoint=None, device: bool = True,
        dense: str = "bf16") -> dict:
    """The whole benchmark: shapes and acceptance from the bundles, the device measurement (fail soft: a
    failure to start is recorded as gpu_error), the summary and the projection. checkpoint(report) is
    called with the report so far after each layer and context of the device run."""
    rounds = golden_rounds(bundles)
    budgets = QUICK_BUDGETS if quick else BUDGETS
    made = {b: tree_shape(rounds, b) for b in budgets}
    shapes, synth = {b: p for b, (p, _) in made.items()}, {b: s for b, (_, s) in made.items()}
    acceptance, routing = acceptance_models(rounds, budgets), routing_table(shapes)
    gpu, err = None, None
    if device:
        if checkpoint:                      # the host half on disk before the device starts (a cut run keeps it)
            checkpoint(report(rounds, shapes, synth, acceptance, routing, None, draft, "device run under way"))
        try:
            from bench.k26_ddtree_gpu import measure

            cb = None if checkpoint is None else (
                lambda g: checkpoint(report(rounds, shapes, synth, acceptance, routing, g, draft)))
            gpu = measure(shapes, CONTEXTS, layers, reps, share, time_budget_s, progress, cb, dense)
        except Exception as e:  # noqa: BLE001 - fail soft: the host half still reports
            err = f"{type(e).__name__}: {e}"[:600]
    else:
        err = "not run (--no-device)"
    return report(rounds, shapes, synth, acceptance, routing, gpu, draft, err)
