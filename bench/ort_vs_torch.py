"""ONNX Runtime (CPU) vs PyTorch eager on a small K3: decode-step latency and prefill throughput, one run.

    python bench/ort_vs_torch.py [--layers 4] [--hidden 512] [--prefill 128] [--steps 32] [--threads 2]

Prints per-runtime numbers and the ORT/torch ratios (latency ratio < 1 and throughput ratio > 1 favour ORT).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from k3export.converters.onnx import export_onnx, load_export
from k3export.modeling import K3Cache, K3Config, K3ForCausalLM, randomize_weights


def small_config(layers: int, hidden: int) -> K3Config:
    heads, head_dim = 4, 64
    full = [i for i in range(1, layers + 1) if i % 4 == 0 or i == layers]
    return K3Config.tiny(
        vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, num_experts=16, num_experts_per_token=4, moe_intermediate_size=hidden // 2,
        routed_expert_hidden_size=hidden // 2, attn_res_block_size=2, kda_chunk_size=64,
        linear_attn_config=dict(head_dim=head_dim, num_heads=heads, short_conv_kernel_size=4, use_full_rank_gate=True,
                                gate_lower_bound=-5.0, full_attn_layers=full,
                                kda_layers=[i for i in range(1, layers + 1) if i not in full]),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = K3ForCausalLM(small_config(args.layers, args.hidden)).eval()
    randomize_weights(model, 0)
    ids = torch.randint(3, model.config.vocab_size, (1, args.prefill), generator=torch.Generator().manual_seed(1))

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "onnx"
        export_onnx(model, out)
        exp = load_export(out)
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(str(exp.model_path), so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]

        latents = [s["name"] for s in exp.states if s["kind"] == "latent"]

        def ort_run(tokens: np.ndarray, state: dict) -> tuple[np.ndarray, dict]:
            past = state[latents[0]].shape[1] if latents else 0
            mask = np.ones((tokens.shape[0], past + tokens.shape[1]), np.int64)  # no padding
            outs = dict(zip(names, sess.run(None, {"input_ids": tokens, "attention_mask": mask, **state})))
            return outs["logits"], {s["name"]: outs[s["present"]] for s in exp.states}

        # warm-up both
        ort_run(ids[:, :8].numpy(), exp.initial_state(1))
        with torch.no_grad():
            model(ids[:, :8], cache=K3Cache(model.config))

        # prefill
        t = time.perf_counter()
        logits_o, state = ort_run(ids.numpy(), exp.initial_state(1))
        ort_prefill = time.perf_counter() - t
        cache = K3Cache(model.config)
        t = time.perf_counter()
        with torch.no_grad():
            logits_t = model(ids, cache=cache).logits
        torch_prefill = time.perf_counter() - t

        # decode (greedy, each runtime on its own tokens)
        ort_steps, torch_steps = [], []
        tok_o = logits_o[:, -1].argmax(-1)[:, None]
        tok_t = logits_t[:, -1].argmax(-1)[:, None]
        for _ in range(args.steps):
            t = time.perf_counter()
            lo, state = ort_run(tok_o, state)
            ort_steps.append(time.perf_counter() - t)
            tok_o = lo[:, -1].argmax(-1)[:, None]
            t = time.perf_counter()
            with torch.no_grad():
                lt = model(tok_t, cache=cache).logits
            torch_steps.append(time.perf_counter() - t)
            tok_t = lt[:, -1].argmax(-1)[:, None]

    o_dec, t_dec = statistics.median(ort_steps), statistics.median(torch_steps)
    o_tps, t_tps = args.prefill / ort_prefill, args.prefill / torch_prefill
    print(f"model: {args.layers} layers, hidden {args.hidden}, fp32, {args.threads} threads; "
          f"prefill {args.prefill} tokens, {args.steps} decode steps")
    print(f"decode step latency (median): ORT {o_dec * 1e3:.2f} ms   torch {t_dec * 1e3:.2f} ms   "
          f"ratio ORT/torch {o_dec / t_dec:.2f}")
    print(f"prefill throughput:           ORT {o_tps:.0f} tok/s  torch {t_tps:.0f} tok/s  "
          f"ratio ORT/torch {o_tps / t_tps:.2f}")
    print(f"greedy tokens agree: {bool((tok_o == tok_t.numpy()).all())}")


if __name__ == "__main__":
    main()
