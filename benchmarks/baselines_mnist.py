"""The DPAL paper's baselines side by side on MNIST (issue 5's benchmark).

For each mechanism (DPAL, DP-SGD, SecureSGD, SecureSGD-AGM, AdLM, PixelDP) at eps_t in
{0.2, 1.0, 2.0}: conventional accuracy under the paper's four l-inf attacks (FGSM, I-FGSM, MIM,
MadryEtAl = pgd) at mu_a = 0.2, and training images/s beside a non-private network of the same
architecture (a deep copy of the mechanism's own network, trained with plain Adam on the same
batches, measured in the same run right after the private epoch).

Every mechanism runs exactly as a sweep trial does: its trial schema (so the defaults of
``dpsweep mechanisms``), its adapter from ``trainables``, and ``trainables.runtime.evaluate``;
only Ray and MLflow are left out. The epsilon of the table is the trial's reported ``epsilon``
(for DPAL eps_t, for PixelDP the robustness parameter of its noise layer, for the others the
training-data guarantee computed from what the trainer did).

Prints a table and writes benchmarks/results/baselines_mnist.json (``--demo``: a 5,000-image
subset, 2 epochs, 200 test images; written under that file's ``demo`` key).
"""

from __future__ import annotations

import copy
import importlib
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import demo_parser, environment, log, write_run  # noqa: E402

ATTACKS = {"fgsm": [0.2], "ifgsm": [0.2], "mim": [0.2], "pgd": [0.2]}
EPSILONS = (0.2, 1.0, 2.0)
# trainable -> (adapter "module:Class", the key of its privacy budget, keys of this benchmark)
MECHANISMS = {
    "dpal": ("trainables.dpal:DPALMechanism", "eps_t", {}),
    "dpsgd": ("trainables.dpsgd:DPSGDMechanism", "epsilon", {}),
    "secure_sgd": ("trainables.secure_sgd:SecureSGDMechanism", "epsilon", {}),
    "secure_sgd_agm": ("trainables.secure_sgd:SecureSGDMechanism", "epsilon", {}),
    "adlm": ("trainables.adlm:AdLMMechanism", "epsilon", {}),
    "pixeldp": ("trainables.pixeldp:PixelDPMechanism", "epsilon", {"attack_norm": "linf"}),
}


def _adapter(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def trial_config(name: str, eps: float, args) -> object:
    """The trial schema of ``name`` at budget ``eps`` with this benchmark's data and evaluation."""
    from trainables.registry import get_trainable

    _, eps_key, extra = MECHANISMS[name]
    schema = get_trainable(name).config_model
    fields = schema.model_fields
    values = {eps_key: eps, "dataset": "mnist", "train_size": args.train_size, "test_size": args.test,
              "attacks": ATTACKS, "attack_norm": "linf", "attack_steps": args.attack_steps,
              "certify_images": 0, "seed": args.seed, **extra}
    if args.epochs is not None and "epochs" in fields:
        values["epochs"] = args.epochs
    if "batch_size" in fields and args.train_size is not None:
        default = fields["batch_size"].default
        if default is not None and default >= args.train_size // 2:  # DPAL's m = 2,499 needs >= 2 batches
            values["batch_size"] = max(2, args.train_size // 5)
    if name == "dpal" and args.train_attack_steps is not None:
        values["train_attack_steps"] = args.train_attack_steps
    if "n_predict" in fields and name == "dpal":
        values["n_predict"] = args.n_predict
    return schema(**{k: val for k, val in values.items() if k in fields})


def _logits(model, x):
    out = model(x)
    return out[0] if isinstance(out, tuple) else out


def plain_images_per_second(model: torch.nn.Module, x, y, batch_size: int, seconds: float) -> float:
    """Non-private training of a deep copy of ``model`` (fresh Adam, cross-entropy) on the same
    data for about ``seconds``: images/s."""
    net = copy.deepcopy(model).train()
    for m in net.modules():  # a private trainer's hooks (Opacus's per-example gradients) are not copied
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks):
            hooks.clear()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    seen, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        idx = torch.randperm(x.shape[0], generator=gen)[:batch_size].to(x.device)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(_logits(net, x[idx]), y[idx]).backward()
        opt.step()
        seen += idx.numel()
    return seen / (time.perf_counter() - t0)


def run_one(name: str, eps: float, args, data, device) -> dict:
    from trainables.runtime import evaluate

    (x, y), (xt, yt) = data
    cfg = trial_config(name, eps, args)
    mech = _adapter(MECHANISMS[name][0])(cfg, x, y, device)
    train_seconds, losses = 0.0, []
    while mech.epoch < cfg.epochs:
        t0 = time.perf_counter()
        losses.append(mech.train_epoch()["train_loss"])
        train_seconds += time.perf_counter() - t0
        log(f"  {name} eps={eps:g} epoch {mech.epoch}/{cfg.epochs}: loss {losses[-1]:.4f}")
    private_rate = x.shape[0] * cfg.epochs / train_seconds
    batch = getattr(cfg, "batch_size", 128)
    plain_rate = plain_images_per_second(mech.model, x, y, batch, seconds=min(20.0, max(3.0, train_seconds / 4)))
    t0 = time.perf_counter()
    metrics = evaluate(mech, cfg, xt, yt)["metrics"]
    accs = {k: float(v) for k, v in metrics.items() if k.startswith("acc_")}
    attacked = [accs[f"acc_{a}_0.2"] for a in ATTACKS if f"acc_{a}_0.2" in accs]
    return {"trainable": name, "eps_target": eps, "epsilon": float(metrics.get("epsilon", math.nan)),
            "delta": float(metrics.get("delta", math.nan)), **accs,
            "acc_attack_avg_0.2": sum(attacked) / len(attacked) if attacked else math.nan,
            "train_images_per_s": private_rate, "plain_images_per_s": plain_rate,
            "slowdown_vs_plain": plain_rate / private_rate, "train_seconds": train_seconds,
            "eval_seconds": time.perf_counter() - t0, "epochs": cfg.epochs, "batch_size": batch,
            "final_train_loss": losses[-1] if losses else math.nan}


def main() -> None:
    ap = demo_parser(__doc__, "5,000 training images, 2 epochs, 200 test images")
    ap.add_argument("--mechanisms", default=",".join(MECHANISMS), help="comma-separated trainables")
    ap.add_argument("--epsilons", default=",".join(f"{e:g}" for e in EPSILONS))
    ap.add_argument("--test", type=int, default=None, help="test images evaluated")
    ap.add_argument("--attack-steps", type=int, default=10, help="iterations of I-FGSM, MIM and PGD")
    ap.add_argument("--train-attack-steps", type=int, default=None, help="DPAL's T_mu")
    ap.add_argument("--n-predict", type=int, default=100, help="DPAL's psi-noisy draws per prediction")
    args = ap.parse_args()
    if args.demo:
        args.train_size = args.train_size or 5000
        args.test = args.test or 200
        args.epochs = args.epochs or 2
        args.train_attack_steps = args.train_attack_steps or 2
    args.test = args.test or 1000
    names = [n.strip() for n in args.mechanisms.split(",") if n.strip()]
    for n in names:
        if n not in MECHANISMS:
            raise SystemExit(f"--mechanisms: unknown {n!r}; known: {', '.join(MECHANISMS)}")
    epsilons = [float(e) for e in args.epsilons.split(",")]

    from dpmech.datasets.splits import load_splits

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train, test = load_splits("mnist", train_size=args.train_size, test_size=args.test, seed=0)
    data = (tuple(t.to(device) for t in train.tensors), tuple(t.to(device) for t in test.tensors))
    log(f"MNIST: {data[0][0].shape[0]} training, {data[1][0].shape[0]} test images on {device}")
    rows = []
    for name in names:
        for eps in epsilons:
            log(f"{name} at eps {eps:g}")
            try:
                rows.append(run_one(name, eps, args, data, device))
            except ValueError as exc:  # e.g. a budget the mechanism's split cannot reach
                log(f"  skipped: {exc}")
                rows.append({"trainable": name, "eps_target": eps, "skipped": str(exc)})

    head = f"{'mechanism':<15}{'eps':>6}{'epsilon':>9}{'clean':>7}{'fgsm':>7}{'ifgsm':>7}{'mim':>7}{'pgd':>7}" \
           f"{'avg':>7}{'img/s':>8}{'plain':>8}{'x':>6}"
    print("\n" + head)
    for r in rows:
        if "skipped" in r:
            print(f"{r['trainable']:<15}{r['eps_target']:>6g}  skipped: {r['skipped']}")
            continue
        print(f"{r['trainable']:<15}{r['eps_target']:>6g}{r['epsilon']:>9.3g}{r['acc_clean']:>7.3f}"
              + "".join(f"{r.get(f'acc_{a}_0.2', math.nan):>7.3f}" for a in ATTACKS)
              + f"{r['acc_attack_avg_0.2']:>7.3f}{r['train_images_per_s']:>8.0f}{r['plain_images_per_s']:>8.0f}"
              f"{r['slowdown_vs_plain']:>6.1f}")
    payload = {"benchmark": "baselines_mnist", "mode": "demo" if args.demo else "full",
               "train_images": int(data[0][0].shape[0]), "test_images": int(data[1][0].shape[0]),
               "attacks": ATTACKS, "attack_norm": "linf", "attack_steps": args.attack_steps,
               "paper_dpal_fig2_avg": {"0.2": 0.827, "2.0": 0.8959}, "rows": rows,
               "environment": environment(device)}
    write_run("baselines_mnist", payload, args.demo, args.out)


if __name__ == "__main__":
    main()
