"""Where do more EOT samples stop helping? (issue 18, point 7)

A small MNIST CNN trained with Gaussian noise augmentation (sigma 0.5 in the [-1, 1] domain) and
*kept random at prediction* (noise added on every forward pass, like a smoothed / PixelDP model)
is attacked with PGD-10 whose gradient averages ``eot_samples`` = k forward passes, k in
{1, 2, 4, 8, 16}; accuracy on the adversarial examples is measured with the mean softmax of
32 draws. The same images and attack seeds are used for every k (paired comparison).

    .venv/bin/python -m benchmarks.eot_convergence [--test-size 300] [--train-size 20000]

Writes benchmarks/results/eot_convergence.json.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import environment, log, write_result
from dpmech.robustness.attacks import pgd
from dpmech.datasets.splits import load_splits


class NoisyCNN(nn.Module):
    """A small CNN that adds N(0, sigma^2) to its input on every forward pass."""

    def __init__(self, sigma: float):
        super().__init__()
        self.sigma = sigma
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x + self.sigma * torch.randn_like(x))


@torch.no_grad()
def smoothed_accuracy(model, x, y, draws: int = 32, seed: int = 1) -> float:
    torch.manual_seed(seed)
    probs = sum(F.softmax(model(x), 1) for _ in range(draws))
    return float((probs.argmax(1) == y).float().mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-size", type=int, default=20000)
    ap.add_argument("--test-size", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--sigma", type=float, default=0.5)
    ap.add_argument("--ks", default="1,2,4,8,16")
    ap.add_argument("--settings", default="linf:0.2,l2:2.0", help="norm:eps pairs")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    train, test = load_splits("mnist", train_size=args.train_size, test_size=args.test_size, seed=0)
    xtr, ytr = train.tensors
    xte, yte = test.tensors
    model = NoisyCNN(args.sigma)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    t0 = time.time()
    for ep in range(args.epochs):
        perm = torch.randperm(xtr.shape[0])
        for i in range(0, xtr.shape[0], 128):
            idx = perm[i:i + 128]
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        log(f"epoch {ep + 1}: loss {loss.item():.3f}, {time.time() - t0:.0f}s")
    model.eval()
    clean = smoothed_accuracy(model, xte, yte)
    log(f"clean accuracy (mean softmax of 32 draws): {clean:.3f}")
    ks = [int(k) for k in args.ks.split(",")]
    settings = [(p.split(":")[0], float(p.split(":")[1])) for p in args.settings.split(",")]
    results = []
    for norm, eps in settings:
        row = {"norm": norm, "eps": eps, "acc": {}, "seconds": {}}
        for k in ks:
            t = time.time()
            torch.manual_seed(123)  # the model's noise stream: same for every k
            gen = torch.Generator().manual_seed(7)
            adv = torch.cat([pgd(model, xte[s:s + 250], yte[s:s + 250], eps=eps, steps=10, norm=norm,
                                 eot_samples=k, generator=gen) for s in range(0, xte.shape[0], 250)])
            acc = smoothed_accuracy(model, adv, yte)
            row["acc"][k] = acc
            row["seconds"][k] = round(time.time() - t, 1)
            log(f"{norm} {eps}: eot {k:>2}: acc {acc:.3f} ({time.time() - t:.0f}s)")
        results.append(row)
    payload = {"benchmark": "eot_convergence", "train_size": args.train_size, "test_size": args.test_size,
               "epochs": args.epochs, "sigma": args.sigma, "clean_acc": clean, "attack": "pgd, 10 steps, true labels",
               "prediction": "mean softmax of 32 draws", "results": results,
               "environment": environment(torch.device("cpu"))}
    log(f"wrote {write_result('eot_convergence', payload)}")


if __name__ == "__main__":
    main()
