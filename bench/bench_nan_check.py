"""NaN gradient check: steadfast's fused check vs the original's per-parameter loop.

The original (KempnerForge) checks ``torch.isfinite(p.grad).all()`` parameter by
parameter, a host sync per parameter on GPU. steadfast reduces all gradients with one
fused infinity-norm per device/dtype and reads one flag. This prints the time per call of
each, on the same model in the same run, and their ratio.

    .venv/bin/python bench/bench_nan_check.py [--params 400] [--width 256] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from steadfast import NaNDetector


def original_check(model: torch.nn.Module) -> bool:
    for p in model.parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            return False
    return True


def timeit(fn, repeats: int, device: torch.device) -> float:
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=400, help="number of parameter tensors")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.params // 2)]
    model = torch.nn.Sequential(*layers).to(device)
    model(torch.randn(8, args.width, device=device)).sum().backward()
    n = sum(p.numel() for p in model.parameters())
    det = NaNDetector()
    assert det.check_gradients(model, 0) and original_check(model)
    for _ in range(3):  # warm up
        det.check_gradients(model, 0)
        original_check(model)
    fused = timeit(lambda: det.check_gradients(model, 0), args.repeats, device)
    loop = timeit(lambda: original_check(model), args.repeats, device)
    print(f"model: {args.params} parameter tensors, {n / 1e6:.1f}M values, device {device}")
    print(f"per-parameter loop (original): {loop * 1e3:8.3f} ms/call")
    print(f"steadfast fused check:        {fused * 1e3:8.3f} ms/call")
    print(f"ratio fused/original: {fused / loop:.3f} (lower is better)")


if __name__ == "__main__":
    main()
