"""DPAL on MNIST: conventional accuracy under attack, certified accuracy, and the cost of training.

The paper's MNIST protocol (Sec. 4, Appendix M: m = 2,499, xi = 1, psi = 2, T_mu = 10, lr 1e-4,
I-FGSM + MIM + MadryEtAl in training), in the [-1, 1] domain. Prints and writes to
benchmarks/results/dpal_mnist.json:

* conventional accuracy under FGSM, I-FGSM, MIM and MadryEtAl at mu_a = 0.2 (l_inf) for
  eps_t in {0.2, 2.0} (paper, averaged over the four attacks: 82.7% and 89.59%), with the verified
  prediction (argmax of n psi-noisy draws, Section 4) and with the deterministic centre
  f(x + chi_1/m) (Appendix L's limit) beside it;
* certified accuracy at mu_a in {0.05, 0.1, 0.2, 0.3, 0.6} for eps_t = 1.0 (paper: 84.29% at 0.05,
  72.41% at 0.6), on the clean test images and under each attack of that size, with the sound
  robustness size max(kappa, phi) (docs/dpal.md) and the distribution of the certified sizes;
* for the eps_t = 1.0 model, conventional accuracy and certified sizes on clean images for
  psi in {2, 10, 100, 1000} (the fresh noise b/psi trades accuracy for certified size);
* seconds per epoch of DPAL beside a non-private network of the same architecture trained with plain
  cross-entropy (no noise, no adversarial examples), same batch size;
* every component of the privacy budget as the trainer recomputes it.

Attacks: sizes in the [-1, 1] domain, labels = the model's predictions, crafted against the
deterministic centre (the fixed training noise, no fresh noise); I-FGSM/MIM/MadryEtAl take 10 steps.

``--demo`` runs a small version (10k training images, m = 1,000, 3 epochs, T_mu = 2, 100 test images,
n = 100) in a few minutes on 2 CPU cores and writes it under the ``demo`` key of that file. Its
noise scales are 2.5x the full run's (they are inversely proportional to m), so its numbers are not
comparable with the paper's.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import demo_parser, environment, log, write_run  # noqa: E402
from dpmech.robustness.attacks import attack  # noqa: E402
from dpmech.datasets.splits import load_splits  # noqa: E402
from dpmech.dpal.config import DPALConfig  # noqa: E402
from dpmech.dpal.trainer import DPALTrainer
from dpmech.dpal.model import NonPrivateNet
from dpmech.dpal.verify import certified_accuracy, verified_inference

EVAL_ATTACKS = ("fgsm", "ifgsm", "mim", "pgd")          # pgd = MadryEtAl
CONV_EPS = (0.2, 2.0)
CERT_EPS = 1.0
CERT_SIZES = (0.05, 0.1, 0.2, 0.3, 0.6)
MU_CONV = 0.2
PSI_SWEEP = (2.0, 10.0, 100.0, 1000.0)   # Appendix L's psi: fresh inference noise b / psi
PAPER = {"conv_acc_avg_eps_0.2": 0.827, "conv_acc_avg_eps_2": 0.8959, "cert_acc_0.05": 0.8429, "cert_acc_0.6": 0.7241}


def craft(trainer: DPALTrainer, x: torch.Tensor, name: str, size: float, seed: int, batch_size: int = 500):
    """Adversarial examples against the deterministic centre (labels: its predictions)."""
    centre = trainer.scorer(fresh=False)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in range(0, x.shape[0], batch_size):
        kw = {"eps": size, "norm": "linf"}
        if name != "fgsm":
            kw["steps"] = 10
        if name == "pgd":
            kw["generator"] = gen
        out.append(attack(name, centre, x[s:s + batch_size].to(trainer.device), None, **kw).cpu())
    return torch.cat(out)


def train(cfg: DPALConfig, x, y, xt, yt, tag: str) -> tuple[DPALTrainer, list[float]]:
    trainer = DPALTrainer(cfg, x, y)
    times = []
    for e in range(cfg.epochs):
        t0 = time.perf_counter()
        m = trainer.train_epoch()
        times.append(time.perf_counter() - t0)
        log(f"  [{tag}] epoch {e + 1}/{cfg.epochs}: train_loss {m['train_loss']:.2f}, recon {m['recon_loss']:.1f}, "
            f"centre test acc {trainer.accuracy(xt, yt):.4f} ({times[-1]:.1f}s)")
    return trainer, times


def nonprivate_epoch_seconds(cfg: DPALConfig, x, y, epochs: int) -> list[float]:
    """Seconds per epoch of the same architecture trained as a plain classifier (same batch size)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        net = NonPrivateNet(cfg.dataset, cfg.theta1_bound)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    times = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        net.train()
        order = torch.randperm(x.shape[0], generator=gen)
        for s in range(0, x.shape[0] - cfg.batch_size + 1, cfg.batch_size):
            idx = order[s:s + cfg.batch_size]
            loss = F.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> dict:
    ap = demo_parser(__doc__)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--attack-steps", type=int, default=None, help="T_mu in training")
    ap.add_argument("--test", type=int, default=None, help="test images evaluated")
    ap.add_argument("--n", type=int, default=None, help="Monte Carlo draws per image")
    ap.add_argument("--eta", type=float, default=0.95)
    ap.add_argument("--psi", type=float, default=2.0)
    ap.add_argument("--theta1-bound", type=float, default=1.0)
    ap.add_argument("--bounds", default="hoeffding", choices=("hoeffding", "argmax"))
    ap.add_argument("--lr", type=float, default=None)
    args = ap.parse_args(argv)
    demo = args.demo
    epochs = args.epochs or (3 if demo else 30)
    train_size = args.train_size or (10_000 if demo else None)
    m = args.batch_size or (1000 if demo else 2499)
    steps = args.attack_steps or (2 if demo else 10)
    n_test = args.test or (100 if demo else 1000)
    n_draws = args.n or (100 if demo else 1000)
    lr = args.lr or (1e-3 if demo else 1e-4)
    device = torch.device("cpu")

    log(f"DPAL MNIST benchmark ({'demo' if demo else 'full'}): loading MNIST ...")
    train_set, test_set = load_splits("mnist", train_size=train_size, seed=args.seed)
    x, y = train_set.tensors
    xt_all, yt_all = test_set.tensors
    xt, yt = xt_all[:n_test], yt_all[:n_test]
    log(f"  {x.shape[0]} training images, {n_test} of {xt_all.shape[0]} test images evaluated")

    def config(eps_t: float) -> DPALConfig:
        return DPALConfig(dataset="mnist", eps_t=eps_t, psi=args.psi, xi=1.0, attack_steps=steps, mu_a=MU_CONV,
                          n=n_draws, eta=args.eta, bounds=args.bounds, batch_size=m, lr=lr, epochs=epochs,
                          theta1_bound=args.theta1_bound, seed=args.seed)

    result = {"benchmark": "dpal_mnist", "mode": "demo" if demo else "full", "train_images": int(x.shape[0]),
              "test_images": n_test, "epochs": epochs, "batch_size": m, "attack_steps_train": steps,
              "n": n_draws, "eta": args.eta, "psi": args.psi, "theta1_bound": args.theta1_bound,
              "bounds": args.bounds, "paper": PAPER, "runs": {}}
    epoch_seconds = []

    # ------------------------------------------------------------ conventional accuracy under attack
    for eps_t in CONV_EPS:
        cfg = config(eps_t)
        log(f"training eps_t = {eps_t}: noise scales x {cfg.noise_scales.x:.3g}, h {cfg.noise_scales.h:.3g}, "
            f"y {cfg.noise_scales.y:.3g}")
        tr, times = train(cfg, x, y, xt_all, yt_all, f"eps_t={eps_t}")
        epoch_seconds += times
        run = {"config": cfg.to_dict(), "privacy": tr.privacy(), "epoch_seconds": times,
               "acc_centre_clean_full_test": tr.accuracy(xt_all, yt_all)}
        clean = verified_inference(tr, xt, yt, seed=args.seed + 11)
        run["acc_clean"] = clean.accuracy()
        run["acc_centre_clean"] = float((tr.predict(xt) == yt).float().mean())
        verified, centre = {}, {}
        for name in EVAL_ATTACKS:
            adv = craft(tr, xt, name, MU_CONV, args.seed + 12)
            verified[name] = verified_inference(tr, adv, yt, seed=args.seed + 13).accuracy()
            centre[name] = float((tr.predict(adv) == yt).float().mean())
            log(f"  mu_a = {MU_CONV} {name}: conventional accuracy {verified[name]:.4f} (verified), "
                f"{centre[name]:.4f} (centre)")
        run["acc_under_attack"] = {f"acc_{k}_{MU_CONV:g}": val for k, val in verified.items()}
        run["acc_centre_under_attack"] = {f"acc_{k}_{MU_CONV:g}": val for k, val in centre.items()}
        run["acc_under_attack_avg"] = float(np.mean(list(verified.values())))
        run["acc_centre_under_attack_avg"] = float(np.mean(list(centre.values())))
        log(f"  eps_t = {eps_t}: average over attacks {run['acc_under_attack_avg']:.4f} verified, "
            f"{run['acc_centre_under_attack_avg']:.4f} centre (paper: {PAPER['conv_acc_avg_eps_' + format(eps_t, 'g')]})")
        result["runs"][f"eps_t={eps_t:g}"] = run

    # ------------------------------------------------------------ certified accuracy
    cfg = config(CERT_EPS)
    log(f"training eps_t = {CERT_EPS} for certification ...")
    tr, times = train(cfg, x, y, xt_all, yt_all, f"eps_t={CERT_EPS}")
    epoch_seconds += times
    run = {"config": cfg.to_dict(), "privacy": tr.privacy(), "epoch_seconds": times}
    t0 = time.perf_counter()
    clean = verified_inference(tr, xt, yt, seed=args.seed + 21)
    run["certify_seconds_clean"] = time.perf_counter() - t0
    run["acc_clean"] = clean.accuracy()
    run["cert_acc_clean"] = {f"cert_acc_{t:g}": a for t, a in certified_accuracy(clean, CERT_SIZES).items()}
    run["certified_fraction"] = float((clean.certified_size > 0).mean())
    run["certified_size_quantiles"] = {q: float(np.quantile(clean.certified_size, float(q)))
                                       for q in ("0.5", "0.9", "0.99", "1.0")}
    run["kappa_max"] = float(clean.kappa.max())
    run["phi_max"] = float(clean.phi.max())
    log(f"  clean: conventional {run['acc_clean']:.4f}, certified fraction {run['certified_fraction']:.3f}, "
        f"largest certified size {clean.certified_size.max():.3g}")
    sweep = {}
    for psi in PSI_SWEEP:
        r = verified_inference(tr, xt, yt, psi=psi, seed=args.seed + 24)
        sweep[f"{psi:g}"] = {"acc_clean": r.accuracy(), "certified_fraction": float((r.certified_size > 0).mean()),
                             "certified_size_max": float(r.certified_size.max()),
                             "certified_size_median": float(np.median(r.certified_size))}
        log(f"  psi = {psi:g}: conventional {r.accuracy():.4f}, certified fraction "
            f"{sweep[f'{psi:g}']['certified_fraction']:.3f}, largest size {r.certified_size.max():.3g}")
    run["psi_sweep"] = sweep
    under = {}
    for name in EVAL_ATTACKS:
        for size in CERT_SIZES:
            adv = craft(tr, xt, name, size, args.seed + 22)
            res = verified_inference(tr, adv, yt, mu_a=size, seed=args.seed + 23)
            under[f"cert_acc_{name}_{size:g}"] = res.certified_accuracy()
            under[f"acc_{name}_{size:g}"] = res.accuracy()
        log(f"  {name}: certified accuracy " + ", ".join(f"{s:g}: {under[f'cert_acc_{name}_{s:g}']:.4f}" for s in CERT_SIZES))
    run["under_attack"] = under
    run["cert_acc_avg_over_attacks"] = {f"cert_acc_{s:g}": float(np.mean([under[f"cert_acc_{a}_{s:g}"] for a in EVAL_ATTACKS]))
                                        for s in CERT_SIZES}
    result["runs"][f"eps_t={CERT_EPS:g}"] = run

    # ------------------------------------------------------------ cost
    log("timing the non-private network of the same architecture ...")
    plain = nonprivate_epoch_seconds(config(CERT_EPS), x, y, epochs=2)
    result["epoch_seconds_dpal_median"] = statistics.median(epoch_seconds)
    result["epoch_seconds_nonprivate_median"] = statistics.median(plain)
    result["epoch_time_ratio"] = result["epoch_seconds_dpal_median"] / result["epoch_seconds_nonprivate_median"]
    result["environment"] = environment(device)
    log(f"epoch time: DPAL {result['epoch_seconds_dpal_median']:.2f}s vs non-private "
        f"{result['epoch_seconds_nonprivate_median']:.2f}s = {result['epoch_time_ratio']:.2f}x")
    write_run("dpal_mnist", result, demo, args.out)
    return result


if __name__ == "__main__":
    main()
