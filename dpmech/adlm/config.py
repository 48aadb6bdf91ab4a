"""The configuration of one AdLM run (defaults: the paper's experiments and the reference MNIST script
where they give one; docs/adlm.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dpmech import _validate as v
from dpmech.adlm.budget import LOSS_SENSITIVITIES, PAPER_SPLIT, RELEVANCE_NORMS, split_budget

DATASETS = ("mnist", "fashion_mnist")
RELEVANCE_SOURCES = ("public", "training")


@dataclass
class AdLMConfig:
    """Hyperparameters of one AdLM run.

    ``epsilon`` is the Theorem's total eps_1 + eps_2 + eps_3, split by ``budget_split`` (the paper's
    experiments: equal thirds). ``relevance_source`` says which data the LRP network is trained on:
    ``public`` (data disjoint from the training set, handed to the trainer; sound) or ``training``
    (the private training set itself, as the reference's pre-trained LeNet-5 was: the network is then
    a non-private function of the data that eps_1 does not cover). ``relevance_norm`` normalises each
    example's relevance map (``linf``: the paper's Delta_R = 2d/|D|; ``l1``: 2/|D|). ``beta_min`` floors
    the redistribution vector (the reference floors at 1e-5). ``input_clip`` clips the perturbed
    inputs to [-clip, clip] (the reference's 10; post-processing). ``loss_sensitivity`` is the Delta_L
    that scales chi_3: ``labels`` (2 |h_pi|, the perturbed coefficients' own sensitivity) or ``paper``
    (the reference's K (|h_pi| + |h_pi|^2 / 4)).
    """

    dataset: str = "mnist"
    epsilon: float = 1.0
    budget_split: tuple = PAPER_SPLIT
    relevance_source: str = "public"
    relevance_norm: str = "linf"
    relevance_epochs: int = 2
    lrp_epsilon: float = 1.0
    loss_sensitivity: str = "labels"
    beta_min: float = 0.01
    input_clip: float = 10.0
    batch_size: int = 1800
    lr: float = 5e-4
    epochs: int = 10
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.budget_split, list):
            self.budget_split = tuple(self.budget_split)
        self.validate()

    def validate(self) -> None:
        v.choice("dataset", self.dataset, DATASETS)
        split_budget(self.epsilon, self.budget_split)
        v.choice("relevance_source", self.relevance_source, RELEVANCE_SOURCES)
        v.choice("relevance_norm", self.relevance_norm, RELEVANCE_NORMS)
        v.positive_int("relevance_epochs", self.relevance_epochs, minimum=0)
        v.positive("lrp_epsilon", self.lrp_epsilon)
        v.choice("loss_sensitivity", self.loss_sensitivity, LOSS_SENSITIVITIES)
        v.unit_interval("beta_min", self.beta_min, low_open=True, high_open=True)
        v.positive("input_clip", self.input_clip)
        v.positive_int("batch_size", self.batch_size)
        v.positive("lr", self.lr)
        v.positive_int("epochs", self.epochs)
        v.positive_int("seed", self.seed, minimum=0)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["budget_split"] = list(self.budget_split)
        return out
