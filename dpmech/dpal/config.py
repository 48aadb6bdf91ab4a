"""The configuration of one DPAL run (defaults: Appendix M's MNIST setting where the paper gives one)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dpmech import _validate as v
from dpmech.robustness.attacks import ALIASES
from dpmech.dpal.budget import Budget, delta_l2, delta_r, dpal_budget, noise_scales, NoiseScales
from dpmech.dpal.model import ARCHITECTURES

TRAIN_ATTACKS = ("ifgsm", "mim", "pgd")     # Alg. 1's ensemble A: I-FGSM, MIM, MadryEtAl
BOUNDS = ("hoeffding", "argmax")
NORMS = ("linf", "l1")


def _canonical_attack(name) -> str:
    if not isinstance(name, str):
        raise ValueError(f"attacks must hold attack names, got {name!r}")
    key = ALIASES.get(name.lower(), name.lower())
    if key not in TRAIN_ATTACKS:
        raise ValueError(f"attacks must be names among {', '.join(TRAIN_ATTACKS)} (or madry, madryetal, bim); got {name!r}")
    return key


@dataclass
class DPALConfig:
    """Hyperparameters of one DPAL run.

    ``eps_t`` is the total privacy budget of Theorem 4; eps_1 and eps_2 follow from it as in Appendix M
    (``budget``). ``theta1_bound`` is the l1 -> l1 operator-norm bound Delta_h1 enforced on theta_1
    (Lemma 3's gamma uses it). ``psi`` scales the fresh inference noise down (Appendix L), ``xi``
    weighs the adversarial term (Eq. 10), ``attacks``/``attack_steps`` are Alg. 1's ensemble A and
    T_mu, ``mu_a`` the attack size verified inference tests (Alg. 1 line 15), ``n``/``eta`` the Monte
    Carlo draws and confidence, ``bounds`` Hoeffding on the scores (the paper) or Clopper-Pearson on
    argmax counts (the reference code).
    """

    dataset: str = "mnist"
    eps_t: float = 1.0
    psi: float = 2.0
    xi: float = 1.0
    attacks: tuple = TRAIN_ATTACKS
    attack_steps: int = 10
    mu_a: float = 0.2
    n: int = 1000
    eta: float = 0.95
    bounds: str = "hoeffding"
    norm: str = "linf"
    batch_size: int = 2499
    lr: float = 1e-4
    epochs: int = 10
    theta1_bound: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.attacks, list):
            self.attacks = tuple(self.attacks)
        self.validate()

    def validate(self) -> None:
        v.choice("dataset", self.dataset, tuple(ARCHITECTURES))
        v.positive("eps_t", self.eps_t)
        v.positive("psi", self.psi)
        v.non_negative("xi", self.xi)
        if not isinstance(self.attacks, tuple) or len(self.attacks) == 0:
            raise ValueError(f"attacks must be a non-empty tuple of attack names, got {self.attacks!r}")
        names = tuple(_canonical_attack(a) for a in self.attacks)
        if len(set(names)) != len(names):
            raise ValueError(f"attacks must not repeat an attack, got {self.attacks!r}")
        v.positive_int("attack_steps", self.attack_steps)
        v.positive("mu_a", self.mu_a)
        v.positive_int("n", self.n)
        v.open_unit("eta", self.eta)
        v.choice("bounds", self.bounds, BOUNDS)
        v.choice("norm", self.norm, NORMS)
        v.positive_int("batch_size", self.batch_size, minimum=max(2, len(names)))
        v.positive("lr", self.lr)
        v.positive_int("epochs", self.epochs)
        v.positive("theta1_bound", self.theta1_bound)
        v.positive_int("seed", self.seed, minimum=0)
        self.budget  # eps_t must be splittable as Appendix M does (raises ValueError naming eps_t)

    @property
    def attack_names(self) -> tuple[str, ...]:
        return tuple(_canonical_attack(a) for a in self.attacks)

    @property
    def delta_R(self) -> float:
        """Lemma 2 with Appendix M's d and beta for the dataset's first layer."""
        a = ARCHITECTURES[self.dataset]
        side = (a["noised"][1] + 2 * a["padding"] - a["kernel"]) // a["stride"] + 1
        return delta_r(a["kernel"] ** 2, side * side, channels=a["noised"][0])

    @property
    def delta_L2(self) -> float:
        return delta_l2(ARCHITECTURES[self.dataset]["h_pi"])

    @property
    def budget(self) -> Budget:
        """Theorem 4's components for eps_t, with gamma from the enforced bound ``theta1_bound``."""
        return dpal_budget(self.eps_t, self.dataset, delta_R=self.delta_R, delta_L2=self.delta_L2,
                           batch_size=self.batch_size, theta1_norm=self.theta1_bound)

    @property
    def noise_scales(self) -> NoiseScales:
        return noise_scales(self.budget)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["attacks"] = list(self.attacks)
        return d
