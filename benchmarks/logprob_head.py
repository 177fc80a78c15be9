"""The output head's token log-probs, forward + backward, three ways, on one GPU.

    python benchmarks/logprob_head.py --out runs/logprob_head.json

  full      logits = h @ W^T in bf16, log_softmax in fp32, gather: what a plain HF loss does
            (the full N x V logits, and an fp32 copy of them, exist at once)
  chunked   learners/logprobs.py with its eager per-chunk kernels (several passes over each chunk)
  fused     learners/logprobs.py as the learner runs it on CUDA: each chunk's log-sum-exp and its
            logit gradient are one compiled kernel each
  +keep     the chunk logits are kept for the backward instead of recomputed

Each is checked against an fp64 computation on a sample of rows (values and the gradients of h and
W) and timed (median of repeats, CUDA-synchronised), with its peak memory over the inputs.
Shapes default to the Qwen2.5-1.5B head (H 1536, V 151936) on 16384 rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from learners import logprobs as lp  # noqa: E402


def run(mode: str, h, w, y, g, reps: int):
    h = h.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    keep = (1 << 40) if mode.endswith("+keep") else 0
    if mode.startswith("chunked"):
        lp._compiled.update(logp_lse=False, grad_logits=False)  # the eager kernels
    elif mode.startswith("fused"):
        for k in ("logp_lse", "grad_logits"):
            if lp._compiled.get(k) is False:
                del lp._compiled[k]

    def once():
        h.grad = w.grad = None
        if mode == "full":
            out = torch.log_softmax((h @ w.t()).float(), dim=-1).gather(1, y[:, None]).squeeze(1)
        else:
            out = lp.linear_logprobs(h[None], w, y[None], 1.0, keep_logits_bytes=keep)[0]
        (out * g).sum().backward()
        return out

    cuda = h.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    once()
    sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = once()
        sync()
        times.append(time.perf_counter() - t)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
    return out.detach(), h.grad, w.grad, statistics.median(times), peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default="full,chunked,fused,fused+keep")
    ap.add_argument("--out", default="runs/logprob_head.json")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    n, hd, v = args.rows, args.hidden, args.vocab
    h = (torch.randn(n, hd, device=dev) * 1.0).bfloat16()
    w = (torch.randn(v, hd, device=dev) * hd**-0.5).bfloat16()
    y = torch.randint(0, v, (n,), device=dev)
    g = torch.randn(n, device=dev)
    # fp64 reference on a row sample: values, dh for those rows, and dW restricted to their terms.
    idx = torch.randperm(n, device=dev)[:256]
    hs, gs = h[idx].double().requires_grad_(True), g[idx].double()
    w64 = w.double().requires_grad_(True)
    ref = torch.log_softmax(hs @ w64.t(), -1).gather(1, y[idx, None]).squeeze(1)
    ref_dh, ref_dw = torch.autograd.grad((ref * gs).sum(), (hs, w64))
    rows = []
    for mode in args.modes.split(","):
        out, dh, dw, med, peak = run(mode, h, w, y, g, args.reps)
        # dW over the sample: recompute through the same mode with g zero outside the sample.
        gm = torch.zeros_like(g)
        gm[idx] = g[idx]
        _, _, dw_s, _, _ = run(mode, h, w, y, gm, 1)
        rel = lambda a, b: float((a.detach().double() - b.detach()).norm() / b.detach().norm())  # noqa: E731
        row = {"mode": mode, "median_s": med, "peak_extra_gib": peak, "rel_err_logp": rel(out[idx], ref),
               "rel_err_dh": rel(dh[idx], ref_dh), "rel_err_dw": rel(dw_s, ref_dw),
               "head_tflops": 6 * n * hd * v / med / 1e12}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                                          "torch": torch.__version__, "rows": rows}, indent=1))
    print("\n| mode | fwd+bwd s | head TFLOP/s (6NHV) | extra peak GiB | rel err logp / dh / dW |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['median_s']:.4f} | {r['head_tflops']:.0f} | {r['peak_extra_gib']:.1f} | "
              f"{r['rel_err_logp']:.1e} / {r['rel_err_dh']:.1e} / {r['rel_err_dw']:.1e} |")
    return 0 if all(r["rel_err_logp"] < 1e-2 and r["rel_err_dh"] < 2e-2 and r["rel_err_dw"] < 2e-2 for r in rows) \
        else 1


if __name__ == "__main__":
    sys.exit(main())
