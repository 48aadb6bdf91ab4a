"""The trainer behind the ``label_dp`` trial's high-privacy mechanisms (issue 38; docs/label_dp.md,
"High privacy"): ``cluster_rr`` (:mod:`dpmech.label_dp.cluster_prior`, pure epsilon-label-DP) and
``labeldp_pro`` (:mod:`dpmech.label_dp.labeldp_pro`, approximate (epsilon, delta)-label-DP), both a
linear head on standardised ScatterNet features (Tramer & Boneh 2021's ScatterNet + linear).

The network evaluated is :class:`FeatureLinear`: ScatterNet (fixed), flatten, the training images'
per-feature standardisation (image-only), then for ``labeldp_pro`` the row scaling of ``[x, 1]`` to
norm ``clip``, and a linear layer; or, for ``cluster_rr`` with ``head="cnn"``, :class:`FeatureCNN`, the
same standardised features into :class:`dpmech.label_dp.soft_cnn.ScatterSoftCNN` (issue 54.1: the head
of the benchmark's best figures at epsilon 2 and 4). ``cluster_rr`` releases every label in the
constructor (histograms and RR stages) and trains the head on the posteriors, one epoch per
``train_epoch`` (the head reads no label: post-processing, the ledger is the release's);
``labeldp_pro`` charges its ``epochs`` noisy passes in the constructor and runs one pass per
``train_epoch``.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from dpmech import _validate as v
from dpmech.label_dp import cluster_prior as cp
from dpmech.label_dp.labeldp_pro import LabelDPProConfig, LabelDPProRun

MECHANISMS = ("cluster_rr", "labeldp_pro")
HEADS = ("linear", "cnn")


class _Features(nn.Module):
    """ScatterNet -> flatten -> (x - mu) / sd -> [clip: [x, 1] scaled to norm clip]: the heads' input."""

    def __init__(self, input_shape, mu: torch.Tensor, sd: torch.Tensor, clip: float | None):
        super().__init__()
        from dpmech.networks.scatternet import ScatterNet

        self.scatter = ScatterNet(tuple(input_shape))
        self.register_buffer("mu", mu.clone())
        self.register_buffer("sd", sd.clone())
        self.clip = clip

    def features(self, x: torch.Tensor) -> torch.Tensor:
        f = (self.scatter(x).flatten(1) - self.mu) / self.sd
        if self.clip is not None:
            f = torch.cat([f, torch.ones(f.shape[0], 1, device=f.device, dtype=f.dtype)], 1)
            f = f * (self.clip / f.norm(dim=1, keepdim=True))
        return f


class FeatureLinear(_Features):
    """ScatterNet -> flatten -> (x - mu) / sd -> [labeldp_pro: [x, 1] scaled to norm clip] -> linear."""

    def __init__(self, input_shape, mu: torch.Tensor, sd: torch.Tensor, num_classes: int, clip: float | None):
        super().__init__(input_shape, mu, sd, clip)
        d = mu.numel() + (1 if clip is not None else 0)
        self.linear = nn.Linear(d, num_classes, bias=clip is None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.features(x))


class FeatureCNN(_Features):
    """ScatterNet -> flatten -> (x - mu) / sd -> :class:`~dpmech.label_dp.soft_cnn.ScatterSoftCNN` (``cnn``)."""

    def __init__(self, input_shape, mu: torch.Tensor, sd: torch.Tensor, cnn: nn.Module):
        super().__init__(input_shape, mu, sd, None)
        self.cnn = cnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cnn(self.features(x))


@dataclass
class FeatureLabelDPConfig:
    mechanism: str = "cluster_rr"
    epsilon: float = 1.0
    delta: float = 1e-5            # labeldp_pro only
    epochs: int = 10
    seed: int = 0
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 1e-4
    n_clusters: int = 200
    hist_share: float = 1.0
    rr_stages: int = 1
    prior_temperature: float = 1.0
    pca_dim: int = 50
    pro_batch_size: int = 5000
    pro_lr: float = 0.5
    pro_clip: float = 1.0
    pro_proj_images: int = 256
    head: str = "linear"           # cluster_rr: linear, or cnn (dpmech.label_dp.soft_cnn)
    head_width: int = 64           # head cnn: the CNN's channels (width, then 2 width)
    head_hidden: int = 256         # head cnn: its hidden units
    head_dropout: float = 0.3      # head cnn: dropout before each fully connected layer
    head_mixup_alpha: float = 0.0  # head cnn: mixup's Beta(alpha, alpha); 0: none

    def __post_init__(self):
        v.choice("mechanism", self.mechanism, MECHANISMS)
        v.positive("epsilon", self.epsilon)
        v.positive_int("epochs", self.epochs)
        v.choice("head", self.head, HEADS)
        if self.head == "cnn" and self.mechanism != "cluster_rr":
            raise ValueError(f"head: cnn applies to mechanism cluster_rr only (mechanism is {self.mechanism})")

    def cluster_config(self) -> cp.ClusterRRConfig:
        return cp.ClusterRRConfig(n_clusters=self.n_clusters, hist_share=self.hist_share, stages=self.rr_stages,
                                  temperature=self.prior_temperature, pca_dim=self.pca_dim,
                                  linear=cp.LinearConfig(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                                                         weight_decay=self.weight_decay))

    def soft_cnn_config(self):
        """The CNN head's settings (head cnn): the trial's epochs, batch size, rate and weight decay."""
        from dpmech.label_dp.soft_cnn import SoftCNNConfig

        return SoftCNNConfig(epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                             weight_decay=self.weight_decay, width=self.head_width, hidden=self.head_hidden,
                             dropout=self.head_dropout, mixup_alpha=self.head_mixup_alpha)

    def pro_config(self) -> LabelDPProConfig:
        return LabelDPProConfig(epochs=self.epochs, batch_size=self.pro_batch_size, lr=self.pro_lr, clip=self.pro_clip,
                                proj_images=self.pro_proj_images, delta=self.delta)

    def to_dict(self) -> dict:
        return asdict(self)


class FeatureLabelDPTrainer:
    """``model``, ``epoch``, ``train_epoch``, ``accuracy``, ``privacy``, ``state_dict`` (the trial runtime's needs)."""

    def __init__(self, cfg: FeatureLabelDPConfig, x: torch.Tensor, y: torch.Tensor, *, num_classes: int = 10,
                 device=None, noise_key=None):
        from dpmech.networks.scatternet import scatter_features

        self.config, self.num_classes = cfg, num_classes
        feats = scatter_features(x.detach().cpu(), dataset="label_dp").flatten(1)
        mu, sd = feats.mean(0), feats.std(0) + 1e-6
        self.feats = (feats - mu) / sd
        self.y_true = y.detach().to("cpu", torch.int64)
        labels = cp.PrivateLabels(self.y_true, num_classes)
        self.epoch = 0
        if cfg.mechanism == "cluster_rr":
            ccfg = cfg.cluster_config()
            self.ledger, info = cp.release_cluster_rr(self.feats, labels, cfg.epsilon, ccfg, seed=cfg.seed,
                                                      noise_key=noise_key)
            self.soft = info.pop("soft_labels")
            self.info = info
            if cfg.head == "cnn":    # the seed stream benchmarks/labeldp_high_privacy.py's cluster_rr_cnn uses
                from dpmech.label_dp.soft_cnn import SoftCNNRun
                from dpmech.networks.scatternet import feature_shape

                self.run = SoftCNNRun(self.feats, self.soft, cfg.soft_cnn_config(), cp.derive_seed(cfg.seed, 30),
                                      feature_shape(tuple(x.shape[1:])))
                self.model = FeatureCNN(x.shape[1:], mu, sd, self.run.model)
            else:
                self.run = cp.LinearRun(self.feats, self.soft, ccfg.linear, cp.derive_seed(cfg.seed, 20))
                self.model = FeatureLinear(x.shape[1:], mu, sd, num_classes, None)
                self.model.linear = self.run.model
        else:
            pcfg = cfg.pro_config()
            self.run = LabelDPProRun(self.feats, labels, cfg.epsilon, pcfg, seed=cfg.seed, noise_key=noise_key)
            self.ledger, self.info = self.run.ledger, self.run.info
            self.model = FeatureLinear(x.shape[1:], mu, sd, num_classes, pcfg.clip)
            self._sync()

    def _sync(self) -> None:
        if self.config.mechanism == "labeldp_pro":
            with torch.no_grad():
                self.model.linear.weight.copy_(self.run.w.float())

    def train_epoch(self) -> dict[str, float]:
        loss = self.run.train_epoch()
        self._sync()
        self.epoch += 1
        return {"train_loss": float(loss)}

    @torch.no_grad()
    def accuracy(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.model.eval()
        pred = torch.cat([self.model(x[s:s + 1000].cpu()).argmax(1) for s in range(0, x.shape[0], 1000)])
        return float((pred == y.cpu()).float().mean())

    def privacy(self) -> dict[str, float]:
        """epsilon and delta from the ledger (what was released); cluster_rr also the fraction of training
        labels whose posterior's top label is the true one and the mean posterior mass on it (diagnostics)."""
        eps = self.ledger.epsilon()
        out = {"epsilon": eps, "delta": self.ledger.delta(), "label_epsilon": eps}
        if self.config.mechanism == "cluster_rr":
            out["label_keep_rate"] = float((self.soft.argmax(1) == self.y_true).double().mean())
            out["analytic_keep_prob"] = float(self.soft[torch.arange(len(self.y_true)), self.y_true].mean())
        return out

    def state_dict(self) -> dict:
        st = {"config": self.config.to_dict(), "epoch": self.epoch, "run": self.run.state_dict()}
        if self.config.mechanism == "cluster_rr":
            st["soft"] = self.soft.clone()
        return copy.deepcopy(st)

    def load_state_dict(self, st: dict) -> None:
        if st["config"] != self.config.to_dict():
            raise ValueError("checkpoint config differs from this trial's config")
        if self.config.mechanism == "cluster_rr":
            self.soft = st["soft"].clone()
            self.run.soft = self.soft.float()
        self.run.load_state_dict(st["run"])
        self.epoch = int(st["epoch"])
        self._sync()
