"""PixelDP on MNIST: accuracy, certified accuracy and the cost of the noise layer.

Trains PixelDP (L = 0.1, epsilon = 1, delta = 0.05, l2, noise after the first convolution) on
full MNIST and certifies 1,000 test images with n = 1,000 draws at eta = 0.95. Prints and
writes to benchmarks/results/pixeldp_mnist.json:

* clean accuracy (the certifier's prediction on the certified images, and one noise draw on
  the whole test set) and certified accuracy at T in {0.05, 0.1, 0.2, 0.3};
* training images/s of the PixelDP network beside the same network without the noise layer,
  measured side by side in alternating rounds;
* certification forward passes/s beside plain batched inference of the same network.

``--demo`` runs a small version (5k training images, 2 epochs, 100 images, n = 200) in about a
minute on 2 CPU cores and writes it under the ``demo`` key of benchmarks/results/pixeldp_mnist.json.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import demo_parser, environment, log, write_run  # noqa: E402
from dpmech.robustness.certification import certify  # noqa: E402
from dpmech.datasets.splits import load_splits  # noqa: E402
from dpmech.robustness.evaluation import certified_accuracy_curve, predict  # noqa: E402
from dpmech.pixeldp.trainer import PixelDPConfig, PixelDPTrainer  # noqa: E402

SIZES = (0.05, 0.1, 0.2, 0.3)


def training_throughput(cfg: PixelDPConfig, x, y, device, steps: int, rounds: int) -> tuple[float, float]:
    """Images/s of PixelDP and of the same network without noise, in alternating rounds."""
    sub = min(x.shape[0], steps * cfg.batch_size)
    rates = {True: [], False: []}
    trainers = {flag: PixelDPTrainer(cfg, x[:sub], y[:sub], device=device, with_noise=flag) for flag in (True, False)}
    for flag in (True, False):  # warm-up
        trainers[flag].train_epoch()
    for _ in range(rounds):
        for flag in (True, False):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainers[flag].train_epoch()
            if device.type == "cuda":
                torch.cuda.synchronize()
            rates[flag].append(sub / (time.perf_counter() - t0))
    return statistics.median(rates[True]), statistics.median(rates[False])


@torch.no_grad()
def inference_throughput(model, x, passes: int, batch_size: int, device) -> float:
    """Plain batched forward passes/s over ``passes`` images (cycled), batch ``batch_size``."""
    model.eval()
    reps = max(1, passes // x.shape[0])
    xb_all = x.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    done = 0
    for _ in range(reps):
        for s in range(0, xb_all.shape[0], batch_size):
            model(xb_all[s:s + batch_size]).argmax(1)
            done += min(batch_size, xb_all.shape[0] - s)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return done / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    ap = demo_parser(__doc__)
    ap.add_argument("--certify", type=int, default=None, help="test images to certify")
    ap.add_argument("--n", type=int, default=None, help="noise draws per certified image")
    ap.add_argument("--eta", type=float, default=0.95)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    demo = args.demo
    epochs = args.epochs or (2 if demo else 12)
    train_size = args.train_size or (5000 if demo else None)
    n_cert = args.certify or (100 if demo else 1000)
    n_draws = args.n or (200 if demo else 1000)
    device = torch.device(args.device)

    log(f"PixelDP MNIST benchmark on {device} ({'demo' if demo else 'full'}): loading MNIST ...")
    train, test = load_splits("mnist", train_size=train_size, seed=args.seed)
    x, y = train.tensors
    xt, yt = test.tensors
    cfg = PixelDPConfig(dataset="mnist", epsilon=1.0, delta=0.05, attack_bound=0.1, norm="l2",
                        noise_after=1, epochs=epochs, batch_size=128, lr=1e-3, seed=args.seed)
    log(f"  {x.shape[0]} training images, {xt.shape[0]} test images; noise sigma = {cfg.noise_scale:.4f}")

    log("measuring training throughput (PixelDP vs the same network without noise) ...")
    rate_dp, rate_plain = training_throughput(cfg, x, y, device, steps=20 if demo else 60, rounds=3)
    log(f"  {rate_dp:.0f} vs {rate_plain:.0f} images/s: overhead {rate_plain / rate_dp:.3f}x")

    trainer = PixelDPTrainer(cfg, x, y, device=device)
    t0 = time.perf_counter()
    for e in range(epochs):
        m = trainer.train_epoch()
        acc = trainer.accuracy(xt, yt)
        log(f"  epoch {e + 1}/{epochs}: train_loss {m['train_loss']:.4f}, test_acc (one draw) {acc:.4f}")
    train_s = time.perf_counter() - t0

    log(f"certifying {n_cert} test images with n = {n_draws} draws ...")
    xc, yc = xt[:n_cert], yt[:n_cert]
    last = [0.0]

    def progress(done):
        now = time.perf_counter()
        if now - last[0] > 10 or done == n_cert:
            last[0] = now
            log(f"  {done}/{n_cert} images")

    t0 = time.perf_counter()
    res = certify(trainer.model, xc, yc, n=n_draws, eta=args.eta, bounds="argmax", progress=progress)
    cert_s = time.perf_counter() - t0
    cert_rate = n_cert * n_draws / cert_s
    plain = PixelDPTrainer(cfg, x[:10], y[:10], device=device, with_noise=False).model
    plain.load_state_dict(trainer.model.state_dict(), strict=False)
    infer_rate = inference_throughput(plain, xt, passes=min(n_cert * n_draws, 200_000), batch_size=4096, device=device)

    curve = certified_accuracy_curve(res, SIZES)
    guarantee = trainer.guarantee()
    single = float((predict(trainer.model, xt) == yt.numpy()).mean())
    result = {
        "benchmark": "pixeldp_mnist",
        "mode": "demo" if demo else "full",
        "config": cfg.to_dict(),
        "train_images": int(x.shape[0]),
        "epochs": epochs,
        "certified_images": n_cert,
        "n": n_draws,
        "eta": args.eta,
        "acc_clean": res.accuracy(),
        "acc_clean_one_draw_full_test": single,
        **curve,
        "guarantee": guarantee,
        "train_images_per_s_pixeldp": rate_dp,
        "train_images_per_s_plain": rate_plain,
        "train_overhead_ratio": rate_plain / rate_dp,
        "train_seconds": train_s,
        "certify_passes_per_s": cert_rate,
        "inference_passes_per_s_plain": infer_rate,
        "certify_throughput_ratio": cert_rate / infer_rate,
        "certify_seconds": cert_s,
        "targets": {"acc_clean": ">= 0.98", "train_overhead_ratio": "<= 1.15", "certify_throughput_ratio": ">= 0.9"},
        "environment": environment(device),
    }
    log(f"clean accuracy {result['acc_clean']:.4f} (certifier, {n_cert} images), "
        f"{single:.4f} (one draw, {xt.shape[0]} images)")
    log("certified accuracy: " + ", ".join(f"T={t}: {curve['cert_acc_' + format(t, 'g')]:.4f}" for t in SIZES))
    log(f"training overhead of the noise layer: {result['train_overhead_ratio']:.3f}x "
        f"({rate_dp:.0f} vs {rate_plain:.0f} images/s)")
    log(f"certification: {cert_rate:.0f} passes/s vs plain inference {infer_rate:.0f}/s "
        f"= {result['certify_throughput_ratio']:.3f}x")
    log(f"guarantee recomputed from the noise used: epsilon {guarantee['epsilon']:.4f} at delta "
        f"{guarantee['delta']}, L {guarantee['attack_bound']}, measured sensitivity {guarantee['sensitivity']:.4f}")
    write_run("pixeldp_mnist", result, demo, args.out)
    return result


if __name__ == "__main__":
    main()
