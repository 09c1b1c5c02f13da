"""The diagnosis on the committed tiny bundles (docs/diagnosis.md §6): every planted mistake
(conformance/engines/mistakes.PLANTED) on each bundle where it can act, fault by fault what was said
and whether the top-1 id is the planted one; then the honest variants (conformance/engines/honest.py),
which must pass with nothing diagnosed; and the time the diagnosis adds to a failing verify, as the
ratio (verify + diagnosis) / verify (aim: at most 1.2).

    python bench/bench_diagnosis.py [--only ID,ID] [--no-honest] [--json OUT] [BUNDLE_FP32 BUNDLE_INT4]

On a small machine run torch-free engines only; every run here is the reference engine with a mistake
planted, or honestly varied.
"""
import argparse
import json
import sys

from conformance.engines.honest import VARIANTS, HonestEngine
from conformance.engines.mistakes import PLANTED
from conformance.verify.runner import verify

BUNDLES = ["bundles/model_tiny.kdtr", "bundles/model_int4_tiny.kdtr"]


def planted(paths, only) -> list[dict]:
    rows = []
    print(f"{'mistake':24} {'bundle':22} {'top-1':24} {'kind':10} {'ok':3} {'verify s':>8} {'diag s':>7} {'ratio':>6}")
    for mistake, (make, where) in PLANTED.items():
        if only and mistake not in only:
            continue
        for path in (paths[1:] if where == "int4" else paths):
            v = verify(path, engine=make())
            d, info = v.diagnosis or [], v.info
            base = info["engine_seconds"] + info["judge_seconds"]
            top = d[0] if d else {"id": "(none)", "kind": "", "evidence": "no known mistake explains it"}
            row = {"mistake": mistake, "bundle": path, "top1": top["id"], "kind": top["kind"],
                   "correct": top["id"] == mistake, "said": top["evidence"], "all": [x["id"] for x in d],
                   "verify_s": base, "diagnosis_s": info["diagnosis_seconds"],
                   "ratio": (base + info["diagnosis_seconds"]) / base}
            rows.append(row)
            print(f"{mistake:24} {path.split('/')[-1]:22} {top['id']:24} {top['kind']:10} "
                  f"{'yes' if row['correct'] else 'NO':3} {base:8.2f} {row['diagnosis_s']:7.2f} {row['ratio']:6.3f}")
            print(f"    said: {top['evidence'][:220]}")
    return rows


def honest(paths) -> list[dict]:
    rows = []
    for variant in VARIANTS:
        for path in paths:
            v = verify(path, engine=HonestEngine(variant))
            matched = [x["id"] for x in (v.diagnosis or []) if x["kind"] == "matched"]
            rows.append({"variant": variant, "bundle": path, "verdict": v.verdict, "matched": matched})
            print(f"honest {variant:22} {path.split('/')[-1]:22} {v.verdict:5} exit {int(v.exit_code)} "
                  f"matched {matched or 'none'}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundles", nargs="*", default=BUNDLES, help="the FP32 bundle, then the INT4 bundle")
    ap.add_argument("--only", default="", help="comma-separated mistake ids (default: every planted one)")
    ap.add_argument("--no-honest", action="store_true", help="skip the honest variants")
    ap.add_argument("--json", help="write every row here")
    a = ap.parse_args(argv)
    if len(a.bundles) != 2:
        ap.error(f"give two bundles (FP32, then INT4), got {len(a.bundles)}")
    rows = planted(a.bundles, set(filter(None, a.only.split(","))))
    ok = sum(r["correct"] for r in rows)
    ratios = sorted(r["ratio"] for r in rows)
    if rows:
        print(f"top-1 correct: {ok} of {len(rows)} ({100 * ok / len(rows):.0f}%); (verify + diagnosis) / verify: "
              f"median {ratios[len(ratios) // 2]:.3f}, worst {ratios[-1]:.3f}")
    hon = [] if a.no_honest else honest(a.bundles)
    if hon:
        print(f"honest variants: {sum(not r['matched'] for r in hon)} of {len(hon)} runs with no matched diagnosis")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"planted": rows, "honest": hon}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
