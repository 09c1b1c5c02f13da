"""Decode latency per token of the CUDA engine (tiny golden model, AR, batch 1), with and without the
CUDA graph, against the launch floor measured in the same run. Needs a GPU and pycuda.

    python bench/bench_engine.py [BUNDLE] [--steps N]        (or: kdtr bench engine)
"""
import argparse
import json

from cuda_engine.bench import decode_latency


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", nargs="?", default="bundles/model_tiny.kdtr")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    print(json.dumps(decode_latency(args.bundle, args.steps), indent=1))


if __name__ == "__main__":
    main()
