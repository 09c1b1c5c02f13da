"""`kdtr gen --from-checkpoint DIR --layers N` and `kdtr import DIR --layers N` on synthetic K2.6-layout
checkpoints: a DeepseekV3 saved by transformers in many shards under an index, routed experts compressed by
compressed-tensors (64 experts at small dims), the K2.6 wrapper (text_config, language_model. prefix, vision
tensors) and a max_position_embeddings of 65536. The truncated golden must be what transformers computes
in float64 with num_hidden_layers = N, the reference engine must pass it, and the gen's peak memory must be
bounded by the weights it touched, not by the checkpoint (docs/golden-bundles.md, "Goldens from a
checkpoint")."""
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from cli.main import main
from hf_oracle import hf_logits, hf_model
from kdtr_format import open_kdtr
from refmodel.checkpoint import load_model
from refmodel.config import PRESETS
from refmodel.model import forward
from refmodel.stored import Mapped
from refmodel.truncate import LayersError, mapped_weights, open_truncated
from test_import_checkpoint import build_checkpoint
from test_cli_interrupt import default_sigint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench", "bench_gen_checkpoint.py")
GiB = 1 << 30
N = 2                                               # layers kept of 3: the dense layer and one MoE layer
CFG = dataclasses.replace(PRESETS["tiny"], vocab_size=256, hidden_size=64, intermediate_size=96,
                          moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, q_lora_rank=32,
                          kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                          n_routed_experts=64, num_experts_per_tok=4)
MAX_POSITION = 65536                                # as some K2.x configs say (the default long position fits it)
GEN = ["--num-prompts", "3", "--max-new-tokens", "8", "--bf16-profile", "no", "--distill-steps", "0"]


def bench(ckpt: str, layers: int, out: str, gen_args, synth=None) -> dict:
    """The gen in a fresh process (bench/bench_gen_checkpoint.py): its figures, peak RSS included."""
    cmd = [sys.executable, BENCH, ckpt, "--layers", str(layers), "--out", out]
    cmd += ["--synth", synth] if synth else []
    proc = subprocess.run([*cmd, "--", *gen_args], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("k26_64e"))
    deq = build_checkpoint(root, wrapper=True, shape_dtype=torch.int32, cfg=CFG)
    path = os.path.join(root, "config.json")
    config = json.load(open(path))
    config["text_config"]["max_position_embeddings"] = MAX_POSITION
    json.dump(config, open(path, "w"))
    return root, deq


@pytest.fixture(scope="module")
def made(ckpt, tmp_path_factory):
    root, deq = ckpt
    out = str(tmp_path_factory.mktemp("bundle") / "trunc.kdtr")
    return root, deq, out, bench(root, N, out, GEN)


def truncated(deq: dict) -> dict:
    return {k: v for k, v in deq.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < N}


def test_truncated_golden_matches_transformers_float64(made):
    root, deq, out, _ = made
    cfg = dataclasses.replace(CFG, num_hidden_layers=N, max_position_embeddings=MAX_POSITION)
    W = truncated(deq)
    hf = hf_model(cfg, W, torch.float64)
    worst, noise, rows = 0.0, 0.0, 0
    with open_kdtr(out) as f:
        assert f.metadata["model_config"] == cfg.to_dict()
        for i, pos0 in enumerate(f.metadata["position_offsets"]):
            if pos0:
                continue                     # the long-position prompt: judged by the reference engine below
            p = f"golden/p{i}/"
            prompt, toks = f[p + "prompt_ids"], f[p + "ar/tokens"]
            ids = np.concatenate([prompt, toks[:-1]])                       # teacher-forced: one forward
            theirs = hf_logits(hf, ids)                                    # [P + n - 1, V]
            golden = np.concatenate([f[p + "prefill/logits"], f[p + "ar/logits"][1:]])
            worst = max(worst, float(np.abs(theirs - golden).max()))
            rows += len(ids)
            # the golden is our float64 forward on the checkpoint's dequantized weights, stored float32
            ours, _ = forward(cfg, W, prompt, np.arange(len(prompt)))
            assert np.array_equal(f[p + "prefill/logits"], ours.astype(np.float32)), i
            absorbed, _ = forward(cfg, W, prompt, np.arange(len(prompt)), absorbed=True)
            noise = max(noise, float(np.abs(ours - absorbed).max()))
    print(f"\ntruncated golden ({N} of {CFG.num_hidden_layers} layers, {CFG.n_routed_experts} INT4 experts) vs "
          f"transformers float64 with num_hidden_layers={N}: logits max abs diff {worst:.2e} over {rows} rows; "
          f"float64 noise (naive vs absorbed MLA, both float64) {noise:.1e}")
    # 1e-4 (the required agreement) is ~1e9 x the float64 noise: what fills it is the goldens' float32
    # storage (half a float32 ULP, < 1e-6 at these logits) and transformers' float32 islands in a float64
    # model (RMSNorm, router and RoPE: measured 5e-6 in tests/test_import_checkpoint.py)
    assert noise < 1e-12 and worst <= 1e-4


def test_reference_engine_passes_the_truncated_golden(made):
    result = CliRunner().invoke(main, ["verify", made[2], "--engine", "reference", "--require-coverage", "full"])
    assert result.exit_code == 0, result.output


def test_bundle_holds_only_the_truncated_weights_as_the_checkpoint_stores_them(made):
    root, _, out, _ = made
    t = open_truncated(root, N)
    disk = {}
    for path in t.paths:
        with safe_open(path, "pt") as g:
            disk.update({k: g.get_tensor(k) for k in g.keys()})
    with open_kdtr(out, verify=True) as f:
        names = [n for n in f.names if not n.startswith(("golden/", "drafter."))]
        meta = f.metadata
        assert {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")} == set(range(N))
        e = "model.layers.1.mlp.experts.63.down_proj"
        assert f.info(e + ".qw").int4_shape == (CFG.hidden_size, CFG.moe_intermediate_size)
        assert np.array_equal(f[e + ".qw"], disk["language_model." + e + ".weight_packed"].numpy())
        assert f.info(e + ".sc").dtype == "bfloat16" and f.info("model.norm.weight").dtype == "bfloat16"
        assert np.array_equal(f[e + ".sc"], disk["language_model." + e + ".weight_scale"].view(torch.int16).numpy()
                              .view(np.uint16))
    src = meta["source"]
    index = os.path.join(root, "model.safetensors.index.json")
    assert src["index_sha256"] == hashlib.sha256(open(index, "rb").read()).hexdigest()
    assert src["truncation"]["num_hidden_layers"] == N and src["truncation"]["of"] == CFG.num_hidden_layers
    want = {k for k in disk if k.startswith("language_model.") and (not k.startswith("language_model.model.layers.")
                                                                    or int(k.split(".")[3]) < N)}
    assert set(src["tensor_sha256"]) == want
    k = "language_model.model.layers.1.mlp.experts.7.up_proj.weight_packed"
    assert src["tensor_sha256"][k] == hashlib.sha256(disk[k].numpy().tobytes()).hexdigest()
    assert meta["drafter_training"].startswith("untrained: --distill-steps 0")
    assert meta["tolerances"]["routing"] == "held"                 # a checkpoint's default
    # the long-position prompt at the largest position a 65536-position model allows (prompt 6 + 8 + block 4)
    assert meta["long_position"]["offset"] == MAX_POSITION - (6 + 8 + 4) and meta["long_position"]["chosen_by"] == "default"
    assert meta["position_offsets"][-1] == MAX_POSITION - 18


def test_peak_memory_is_bounded_by_the_touched_layer(made):
    fig = made[3]
    bound = 1.5 * fig["largest_touched_float64_bytes"] + GiB
    print(f"\ngen peak RSS {fig['peak_rss_bytes'] / 2**20:.0f} MiB; largest layer's touched float64 weights "
          f"{fig['largest_touched_float64_bytes'] / 2**20:.1f} MiB (experts touched {fig['touched_experts']}); "
          f"bound {bound / 2**20:.0f} MiB")
    assert fig["peak_rss_bytes"] <= bound


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    """1024 experts at hidden 256, 3 layers (bench/synth_checkpoint.py), and the figures of its gen with all
    3 layers: the truncated model is 1.5 GiB in float64."""
    d = tmp_path_factory.mktemp("e1024")
    ck, out = str(d / "ck"), str(d / "b.kdtr")
    fig = bench(ck, 3, out, ["--num-prompts", "1", "--max-new-tokens", "3", "--long-position", "0",
                             "--bf16-profile", "no", "--budget", "4", "--distill-steps", "0"],
                synth="tiny:3:1024:256:128")
    return ck, fig


def test_peak_memory_stays_bounded_where_a_whole_upcast_would_not(many_experts):
    """The whole truncated model in float64 is above the bound, so a gen that upcast it (or read the
    checkpoint whole) would fail here; the forwards touch ~3% of the experts."""
    fig = many_experts[1]
    bound = 1.5 * fig["largest_touched_float64_bytes"] + GiB
    print(f"\n1024 experts: gen peak RSS {fig['peak_rss_bytes'] / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB, "
          f"whole model in float64 {fig['model_float64_bytes'] / 2**20:.0f} MiB, checkpoint "
          f"{fig['checkpoint_bytes'] / 2**20:.0f} MiB, experts touched {fig['touched_experts']}, {fig['seconds']:.1f} s")
    assert fig["model_float64_bytes"] > bound            # the test can fail: a whole upcast exceeds the bound
    assert fig["peak_rss_bytes"] <= bound


def test_a_gen_interrupted_while_writing_leaves_nothing(many_experts, tmp_path):
    """Ctrl-C once the bundle's temp file exists (the 116 MiB of weights are being streamed into it): no
    bundle, no temp file (the atomic writer; SIGTERM and SIGHUP are tested on kdtr convert)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "gen", "--from-checkpoint", many_experts[0],
                             "--layers", "3", "--num-prompts", "1", "--max-new-tokens", "2", "--long-position", "0",
                             "--bf16-profile", "no", "--budget", "2", "--distill-steps", "0",
                             "--out", str(out_dir / "b.kdtr")], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=default_sigint)   # SIGINT not left ignored
    # Wait for the temp file or the gen's end, however long a loaded machine takes to get there (a 120 s limit
    # here failed now and then under load); the bound only keeps a hung gen from hanging the suite.
    deadline = time.monotonic() + 900
    try:
        while not list(out_dir.iterdir()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        seen = [p.name for p in out_dir.iterdir()]
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:                   # a gen that hung or ignored the signal is not left running
            proc.kill()
            proc.wait()
    assert seen and seen[0].endswith(".kdtr-tmp"), f"no temp file seen before the gen ended (exit {rc}): {seen}"
    assert rc != 0 and list(out_dir.iterdir()) == []


def test_layers_past_the_first_n_are_never_read(ckpt, tmp_path):
    root, _ = ckpt
    index = json.load(open(os.path.join(root, "model.safetensors.index.json")))["weight_map"]
    shards = {}
    for k, f in index.items():
        shards.setdefault(f, set()).add(k.startswith("language_model.model.layers.2."))
    only_layer2 = sorted(f for f, kinds in shards.items() if kinds == {True})
    assert only_layer2, "the fixture has a shard holding layer 2 alone"
    t = open_truncated(root, N)
    assert not {os.path.basename(p) for p in t.paths} & set(only_layer2)
    W = mapped_weights(t)
    assert W.mapped and all(isinstance(a, Mapped) for a, _ in W._dense.values())
    assert not any(n.startswith("model.layers.2.") for n in W)


def test_import_layers_writes_the_truncated_model(ckpt, tmp_path):
    root, deq = ckpt
    out = str(tmp_path / "m.kdtr")
    r = CliRunner().invoke(main, ["import", root, "--layers", str(N), "--out", out])
    assert r.exit_code == 0, r.output
    assert f"{CFG.n_routed_experts * 3} INT4 linears kept packed" in r.output and "2 vision tensors dropped" in r.output
    cfg, W = load_model(out)
    assert cfg.num_hidden_layers == N
    want = truncated(deq)
    assert set(W) == set(want) and all(np.array_equal(W[n], want[n]) for n in want)
    with open_kdtr(out) as f:
        prov = f.metadata["provenance"]
    assert prov["truncation"]["of"] == 3 and len(prov["tensor_sha256"]) > 3 * 2 * CFG.n_routed_experts


@pytest.mark.parametrize("args, code, message", [
    (["import", "{root}", "--layers", "4", "--out", "{out}"], 2, "--layers 4: the checkpoint has 3 layers; pass 1..3"),
    (["gen", "--from-checkpoint", "{root}", "--layers", "4", "--out", "{out}"], 2, "--layers 4: the checkpoint has 3"),
    (["gen", "--layers", "2", "--out", "{out}"], 2, "--layers truncates a checkpoint: pass it with --from-checkpoint"),
    (["gen", "--from-checkpoint", "{root}", "--layers", "2", "--long-position", "196608", *GEN, "--out", "{out}"], 2,
     "--long-position 196608: the long-position prompt's positions must lie in [0, max_position_embeddings = 65536)"),
])
def test_bad_layers_and_long_position_are_clear(ckpt, tmp_path, args, code, message):
    out = str(tmp_path / "x.kdtr")
    r = CliRunner().invoke(main, [a.format(root=ckpt[0], out=out) for a in args])
    assert r.exit_code == code, r.output
    assert message in " ".join(r.output.split()) and "Traceback" not in r.output
    assert not os.path.exists(out)


def test_layers_error_type():
    with pytest.raises(LayersError, match="--layers 0: the checkpoint has 61 layers; pass 1..61"):
        from refmodel.truncate import truncated_config
        truncated_config(PRESETS["k26"], 0)


def test_the_drafter_is_distilled_only_where_the_float64_model_fits(ckpt):
    from conformance.gen.from_checkpoint import DISTILL_COPIES, DISTILL_SHARE, distill_fits
    W = mapped_weights(open_truncated(ckpt[0], N))
    need = DISTILL_COPIES * W.upcast_nbytes() / DISTILL_SHARE
    assert distill_fits(W, budget=int(need) + 1) == (True, "")
    fits, why = distill_fits(W, budget=int(need) - 1)
    assert not fits and why.startswith("the truncated model is 0.0 GiB in float64; distilling needs")


def test_forked_prompt_workers_on_a_mapped_checkpoint_give_the_same_bytes(ckpt, tmp_path, monkeypatch):
    """With CORES_PER_JOB cores per prompt the prompts of a mapped checkpoint run in forked workers, each
    mapping the shards itself (the layer bar stays in the parent): the same bundle as one after the other."""
    import conformance.gen.gen as gen_mod
    pools = []

    class Pool(gen_mod.ProcessPoolExecutor):
        def __init__(self, jobs, **kw):
            pools.append(jobs)
            super().__init__(jobs, **kw)

    monkeypatch.setattr(gen_mod, "ProcessPoolExecutor", Pool)
    shas = []
    for cores in (1, 64):
        monkeypatch.setattr(gen_mod.os, "cpu_count", lambda cores=cores: cores)
        out = tmp_path / "c.kdtr"                                   # the command, --out included, is recorded
        r = CliRunner().invoke(main, ["gen", "--from-checkpoint", ckpt[0], "--layers", str(N), "--num-prompts", "2",
                                      "--max-new-tokens", "4", "--bf16-profile", "no", "--distill-steps", "0",
                                      "--out", str(out)])
        assert r.exit_code == 0, r.output
        shas.append(hashlib.sha256(out.read_bytes()).hexdigest())
        out.unlink()
    assert pools == [3]                      # 2 prompts + the long-position one, forked only with 64 cores
    assert shas[0] == shas[1]
