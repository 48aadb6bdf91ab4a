"""Label DP with priors computed from the images alone (issue 38; docs/label_dp.md, "High privacy").

Under label DP the images are public: anything computed from the images alone (ScatterNet features,
their standardisation, a PCA of them, a k-means clustering, the order of a random split) is a fixed
function of public data and costs no privacy. Only the releases that read labels are charged, each
in the :class:`LabelLedger`.

The method (``cluster_rr``), for a training set of N images with private labels in {0..K-1}:

1. **Image-only clustering** (free): ScatterNet features (Oyallon & Mallat 2015; Tramer & Boneh 2021,
   ``dpmech.networks.scatternet``), standardised, projected on their top ``pca_dim`` principal
   components, then k-means (Lloyd's algorithm from a k-means++ start) into ``n_clusters`` clusters.
2. **Noisy per-cluster label histograms** (Ghazi et al. 2021, "Deep Learning with Label Differential
   Privacy", Sec. 3.2 / Alg. 4's histogram query on clusters of self-supervised representations):
   ``H[c, k] = #{i in cluster c : y_i = k} + Lap(2 / eps_hist)``. Changing one label moves one count
   of one cluster down by one and another count of the same cluster up by one: L1 sensitivity 2, so
   the release is eps_hist-DP (Laplace mechanism, Dwork et al. 2006). The prior of an example is its
   cluster's histogram, clipped at 0, plus ``smoothing``, normalised (post-processing).
3. **RR-with-prior** (Ghazi et al. 2021, Alg. 2, ``dpmech.label_dp.rr_prior``) with ``eps_rr`` on
   each label once, in ``stages`` disjoint parts (LP-MST, Alg. 3): stage 1 uses the cluster prior;
   each later stage uses as prior the softmax of a linear model trained on everything released so
   far (its images and the released information only: post-processing).
4. **Training on posteriors** (post-processing): each released label o_i is turned into the exact
   posterior of the true label under the prior and the known RR-Top-k channel,
   ``q_i(y) ∝ prior_i(y) P(o_i | y)`` (``rr_posterior``), and a linear head on the features is
   trained on these soft labels (cross-entropy with soft targets).

Ledger: every label takes part in the histogram release once and in exactly one RR stage, so by basic
composition (Dwork & Roth 2014, Thm. 3.16) and parallel composition over disjoint stages the run is
``eps_hist + eps_rr``-label-DP with delta = 0 (pure). :meth:`LabelLedger.epsilon` computes it per
example from what was recorded (the largest sum over any label of the epsilons of the releases that
read it), never from the config.

Labels are held by :class:`PrivateLabels`; the only way to read them is
:meth:`PrivateLabels.reveal`, which only a release registered with the ledger may call. A prior
function is run by :meth:`LabelLedger.public_prior`, during which any ``reveal`` raises
:class:`LabelLeakError`: a "prior" that reads the labels is refused (the negative control of the
tests). A function that was handed a raw label tensor by its author cannot be detected this way;
:func:`prior_label_dependence` gives a black-box check (the prior must not move when the labels do).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from dpmech import _validate as v
from dpmech.label_dp.rr_prior import rr_prior_choose_k, rr_top_k
from dpmech.privacy.mechanisms import laplace_noise
from dpmech.privacy.secret import NoiseKey

__all__ = ["LabelLeakError", "PrivateLabels", "LabelLedger", "PublicFeatures", "standardise", "pca_project",
           "kmeans", "noisy_cluster_histograms", "histogram_prior", "rr_posterior", "LinearConfig",
           "train_linear", "LinearRun", "release_cluster_rr", "softmax_of", "cluster_assignment", "rr_release", "ClusterRRConfig", "train_cluster_rr", "prior_label_dependence", "derive_seed"]

#: L1 distance between the histograms of two label vectors that differ in one label
HISTOGRAM_SENSITIVITY = 2.0


class LabelLeakError(RuntimeError):
    """A computation declared public (a prior) tried to read the private labels."""


def derive_seed(seed: int, stream: int) -> int:
    """A public sub-seed (images-only randomness: split, k-means start, model init, batch order)."""
    return int(np.random.SeedSequence([int(seed), 38, int(stream)]).generate_state(1)[0])


# --------------------------------------------------------------------------- ledger and labels


class PrivateLabels:
    """The private labels; read only by a release registered with a :class:`LabelLedger`."""

    __slots__ = ("_y", "num_classes", "_ledger")

    def __init__(self, y: torch.Tensor, num_classes: int):
        k = v.positive_int("num_classes", num_classes, minimum=2)
        if not torch.is_tensor(y) or y.dim() != 1 or y.dtype.is_floating_point or y.dtype == torch.bool:
            raise ValueError(f"y must be a 1-D integer tensor of labels, got {getattr(y, 'dtype', type(y).__name__)}")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= k):
            raise ValueError(f"y must hold labels in [0, {k - 1}], got [{int(y.min())}, {int(y.max())}]")
        self._y = y.detach().to("cpu", torch.int64).clone()
        self.num_classes = k
        self._ledger = None

    def __len__(self) -> int:
        return int(self._y.shape[0])

    def __repr__(self) -> str:
        return f"PrivateLabels(n={len(self)}, num_classes={self.num_classes})"

    def reveal(self, token) -> torch.Tensor:
        """The labels, for the release that holds ``token`` (from :meth:`LabelLedger.release`)."""
        led = self._ledger
        if led is None or token is None or token is not led._active:
            raise LabelLeakError("labels can only be read inside a release recorded by the ledger "
                                 "(LabelLedger.release); a prior must be computed from the images alone")
        return self._y.clone()


@dataclass
class LedgerEntry:
    name: str
    epsilon: float
    delta: float
    mask: torch.Tensor          # bool [N]: the labels this release read

    def to_dict(self) -> dict:
        return {"name": self.name, "epsilon": self.epsilon, "delta": self.delta, "labels_read": int(self.mask.sum())}


class LabelLedger:
    """Records every release of label information and composes them per label (basic composition;
    disjoint releases compose in parallel). ``epsilon()`` / ``delta()`` are the largest per-label
    sums over the recorded releases."""

    def __init__(self, labels: PrivateLabels):
        if not isinstance(labels, PrivateLabels):
            raise ValueError(f"labels must be PrivateLabels, got {type(labels).__name__}")
        if labels._ledger is not None:
            raise ValueError("these PrivateLabels already belong to a ledger")
        labels._ledger = self
        self.labels = labels
        self.entries: list[LedgerEntry] = []
        self._active = None
        self._public = False

    @contextmanager
    def release(self, name: str, epsilon: float, index: torch.Tensor | None = None, delta: float = 0.0):
        """Context of one release reading the labels at ``index`` (all when None): yields a token for
        :meth:`PrivateLabels.reveal`; the release is recorded on entry (charged even if it fails)."""
        if self._public:
            raise LabelLeakError(f"release {name!r} attempted inside a public computation (a prior)")
        epsilon = v.positive("epsilon", epsilon)
        delta = v.unit_interval("delta", delta, high_open=True)
        n = len(self.labels)
        mask = torch.zeros(n, dtype=torch.bool)
        if index is None:
            mask[:] = True
        else:
            mask[torch.as_tensor(index, dtype=torch.int64)] = True
        self.entries.append(LedgerEntry(name, epsilon, delta, mask))
        token = object()
        self._active = token
        try:
            yield token
        finally:
            self._active = None

    @contextmanager
    def _public_phase(self):
        self._public, prev = True, self._active
        self._active = None
        try:
            yield
        finally:
            self._public, self._active = False, prev

    def public_prior(self, prior_fn, *args, **kwargs):
        """Run ``prior_fn(*args, **kwargs)`` as a public computation: any read of the labels inside it
        raises :class:`LabelLeakError` (refused, nothing charged or returned)."""
        with self._public_phase():
            return prior_fn(*args, **kwargs)

    def per_label_epsilon(self) -> torch.Tensor:
        tot = torch.zeros(len(self.labels), dtype=torch.float64)
        for e in self.entries:
            tot += e.mask.to(torch.float64) * e.epsilon
        return tot

    def epsilon(self) -> float:
        """The largest over the labels of the sum of the epsilons of the releases that read it."""
        return float(self.per_label_epsilon().max()) if self.entries else 0.0

    def delta(self) -> float:
        tot = torch.zeros(len(self.labels), dtype=torch.float64)
        for e in self.entries:
            tot += e.mask.to(torch.float64) * e.delta
        return float(tot.max()) if self.entries else 0.0

    def guarantee(self) -> str:
        return "pure" if self.delta() == 0.0 else "approximate"

    def to_dict(self) -> dict:
        return {"epsilon": self.epsilon(), "delta": self.delta(), "guarantee": self.guarantee(),
                "entries": [e.to_dict() for e in self.entries]}


# --------------------------------------------------------------------------- image-only computations


@dataclass(frozen=True)
class PublicFeatures:
    """Features of the training images (public under label DP): float32 [N, D]."""

    x: torch.Tensor

    def __post_init__(self):
        if not torch.is_tensor(self.x) or self.x.dim() != 2 or not self.x.is_floating_point():
            raise ValueError("features must be a float tensor [N, D]")


def standardise(train: torch.Tensor, *others: torch.Tensor, eps: float = 1e-6):
    """Each feature centred and scaled by the training images' mean and standard deviation (images only)."""
    train = train.reshape(train.shape[0], -1).float()
    mu, sd = train.mean(0), train.std(0) + eps
    out = [(train - mu) / sd] + [(o.reshape(o.shape[0], -1).float() - mu) / sd for o in others]
    return out[0] if not others else tuple(out)


def pca_project(x: torch.Tensor, dim: int, *, fit_rows: int = 10000, seed: int = 0) -> torch.Tensor:
    """``x`` (centred) on its top ``dim`` principal components: the eigenvectors of the covariance of
    ``fit_rows`` images drawn with ``seed`` (all when fewer; an image-only, public computation)."""
    dim = v.positive_int("pca_dim", dim)
    if dim > x.shape[1]:
        raise ValueError(f"pca_dim must be <= the feature dimension ({x.shape[1]}), got {dim}")
    mu = x.mean(0)
    fit = x
    if x.shape[0] > fit_rows:
        fit = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(int(seed)))[:fit_rows]]
    fc = (fit - mu).float()
    if fc.shape[0] < fc.shape[1]:            # fewer images than features: the SVD of the images is cheaper
        _, _, vh = torch.linalg.svd(fc.double(), full_matrices=False)
        top = vh[:dim].T.float()
        if top.shape[1] < dim:
            top = torch.cat([top, torch.zeros(top.shape[0], dim - top.shape[1])], 1)
        return (x - mu).float() @ top
    cov = (fc.T @ fc).double() / max(1, fit.shape[0] - 1)
    _, vecs = torch.linalg.eigh(cov)
    return (x - mu).float() @ vecs[:, -dim:].flip(1).float()


def kmeans(x: torch.Tensor, n_clusters: int, *, seed: int, iters: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means from a k-means++ start (Arthur & Vassilvitskii 2007); returns (assignment
    int64 [N], centres [C, D]). Deterministic given ``seed``; an emptied cluster is re-seeded at
    the point farthest from its centre."""
    c = v.positive_int("n_clusters", n_clusters)
    n = x.shape[0]
    if c > n:
        raise ValueError(f"n_clusters must be <= the number of images ({n}), got {c}")
    g = torch.Generator().manual_seed(int(seed))
    x = x.float()
    sq = (x * x).sum(1)
    centres = torch.empty(c, x.shape[1])
    centres[0] = x[torch.randint(n, (1,), generator=g)]
    d2 = (sq - 2 * x @ centres[0] + centres[0] @ centres[0]).clamp_min(0)
    for j in range(1, c):
        p = d2.double() / d2.double().sum() if d2.sum() > 0 else torch.full((n,), 1.0 / n, dtype=torch.float64)
        i = torch.multinomial(p, 1, generator=g)
        centres[j] = x[i]
        d2 = torch.minimum(d2, (sq - 2 * x @ centres[j] + centres[j] @ centres[j]).clamp_min(0))

    def assign(cent):
        d = sq[:, None] - 2 * x @ cent.T + (cent * cent).sum(1)[None, :]
        return d.argmin(1), d.min(1).values

    a = assign(centres)[0]
    for _ in range(iters):
        counts = torch.bincount(a, minlength=c).float()
        sums = torch.zeros_like(centres).index_add_(0, a, x)
        new = sums / counts.clamp_min(1)[:, None]
        empty = counts == 0
        if empty.any():
            _, dist = assign(centres)
            far = torch.argsort(dist, descending=True)[: int(empty.sum())]
            new[empty] = x[far]
        centres = new
        a_new = assign(centres)[0]
        if torch.equal(a_new, a):
            break
        a = a_new
    return a, centres


# --------------------------------------------------------------------------- the label releases


def noisy_cluster_histograms(ledger: LabelLedger, assignment: torch.Tensor, n_clusters: int, epsilon: float,
                             generator: torch.Generator, name: str = "cluster_histograms") -> torch.Tensor:
    """``H[c, k] = #{i : a_i = c, y_i = k} + Lap(2 / epsilon)`` (float64 [C, K]); charged eps to every label."""
    epsilon = v.positive("epsilon", epsilon)
    k = ledger.labels.num_classes
    a = assignment.to("cpu", torch.int64)
    if a.shape != (len(ledger.labels),) or (a < 0).any() or (a >= n_clusters).any():
        raise ValueError(f"assignment must be int [N] with values in [0, {n_clusters - 1}]")
    with ledger.release(name, epsilon) as tok:
        y = ledger.labels.reveal(tok)
        counts = torch.zeros(n_clusters * k, dtype=torch.float64).index_add_(
            0, a * k + y, torch.ones(a.shape[0], dtype=torch.float64)).reshape(n_clusters, k)
        return counts + laplace_noise(counts, HISTOGRAM_SENSITIVITY / epsilon, generator)


def histogram_prior(hist: torch.Tensor, assignment: torch.Tensor, smoothing: float = 1.0) -> torch.Tensor:
    """Each example's prior: its cluster's noisy histogram clipped at 0, plus ``smoothing``, normalised
    (post-processing of the histogram release; float64 [N, K])."""
    smoothing = v.positive("smoothing", smoothing)
    h = hist.clamp_min(0.0) + smoothing
    h = h / h.sum(1, keepdim=True)
    return h[assignment.to("cpu", torch.int64)]


def rr_release(ledger: LabelLedger, index: torch.Tensor, prior: torch.Tensor, epsilon: float,
               generator: torch.Generator, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RRWithPrior (Ghazi et al. 2021, Alg. 2) of the labels at ``index`` under ``prior`` (rows match
    ``index``); charged eps to those labels. Returns (released int64, k* int64, top-k order)."""
    kstar, order = rr_prior_choose_k(prior, epsilon)
    with ledger.release(name, epsilon, index) as tok:
        y = ledger.labels.reveal(tok)[index]
        out = rr_top_k(y, order, kstar, epsilon, generator)
    return out, kstar, order


def rr_posterior(prior: torch.Tensor, released: torch.Tensor, kstar: torch.Tensor, order: torch.Tensor,
                 epsilon: float) -> torch.Tensor:
    """``q(y | o) ∝ prior(y) P(o | y)`` for RR-Top-k* (Alg. 1): P(o | y) is ``e^eps/(e^eps+k-1)`` if
    y = o, ``1/(e^eps+k-1)`` if y is another top-k label and ``1/k`` if y is outside the top k
    (float64 [N, K]; post-processing of the release)."""
    p = prior.double() / prior.double().sum(1, keepdim=True)
    n, kk = p.shape
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(kk).expand(n, kk).contiguous())    # rank[i, y]: position of y
    k = kstar[:, None].double()
    t = math.exp(-epsilon)
    keep = 1.0 / (1.0 + (k - 1.0) * t)
    other = t / (1.0 + (k - 1.0) * t)
    inside = rank < kstar[:, None]
    lik = torch.where(inside, other.expand(n, kk), (1.0 / k).expand(n, kk)).clone()
    is_o = torch.arange(kk)[None, :] == released[:, None]
    lik = torch.where(is_o & inside, keep.expand(n, kk), lik)
    q = p * lik
    return q / q.sum(1, keepdim=True)


# --------------------------------------------------------------------------- the linear head


@dataclass
class LinearConfig:
    """The linear head on standardised ScatterNet features (Tramer & Boneh 2021's ScatterNet + linear)."""

    epochs: int = 20
    batch_size: int = 256
    lr: float = 1e-3               # Adam
    weight_decay: float = 1e-4

    def __post_init__(self):
        v.positive_int("epochs", self.epochs)
        v.positive_int("batch_size", self.batch_size)
        v.positive("lr", self.lr)
        v.non_negative("weight_decay", self.weight_decay)


class LinearRun:
    """A linear layer trained with AdamW on the soft-label cross-entropy ``-sum_k q_k log softmax_k``,
    the learning rate decaying linearly to 0 over ``cfg.epochs``; one epoch per ``train_epoch``."""

    def __init__(self, x: torch.Tensor, soft: torch.Tensor, cfg: LinearConfig, seed: int):
        self.x, self.soft, self.cfg = x, soft.float(), cfg
        self.gen = torch.Generator().manual_seed(int(seed))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            self.model = torch.nn.Linear(x.shape[1], soft.shape[1])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        steps = cfg.epochs * math.ceil(x.shape[0] / cfg.batch_size)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: max(0.0, 1.0 - s / steps))
        self.epoch = 0

    def train_epoch(self) -> float:
        n, total = self.x.shape[0], 0.0
        perm = torch.randperm(n, generator=self.gen)
        for s in range(0, n, self.cfg.batch_size):
            idx = perm[s:s + self.cfg.batch_size]
            loss = -(self.soft[idx] * F.log_softmax(self.model(self.x[idx]), 1)).sum(1).mean()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            total += float(loss.detach()) * len(idx)
        self.epoch += 1
        return total / n

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                "gen": self.gen.get_state(), "epoch": self.epoch}

    def load_state_dict(self, st: dict) -> None:
        self.model.load_state_dict(st["model"])
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.gen.set_state(st["gen"])
        self.epoch = int(st["epoch"])


def train_linear(x: torch.Tensor, soft: torch.Tensor, cfg: LinearConfig, seed: int) -> torch.nn.Linear:
    """``cfg.epochs`` epochs of :class:`LinearRun`; returns the layer."""
    run = LinearRun(x, soft, cfg, seed)
    for _ in range(cfg.epochs):
        run.train_epoch()
    return run.model


@torch.no_grad()
def softmax_of(model, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.softmax(model(x[s:s + 8192]).double(), 1) for s in range(0, x.shape[0], 8192)])


# --------------------------------------------------------------------------- the whole method


@dataclass
class ClusterRRConfig:
    """Hyperparameters of ``cluster_rr`` (docs/label_dp.md, "High privacy")."""

    n_clusters: int = 100
    hist_share: float = 0.5        # share of epsilon spent on the histograms (the rest on RR)
    stages: int = 2                # RR stages (LP-MST); 1 = one stage with the cluster prior
    pca_dim: int = 50
    smoothing: float = 1.0
    temperature: float = 1.0       # RR's top-k choice uses prior^temperature (< 1: flatter, larger k*)
    kmeans_iters: int = 30
    linear: LinearConfig = field(default_factory=LinearConfig)

    def __post_init__(self):
        v.positive_int("n_clusters", self.n_clusters)
        v.unit_interval("hist_share", self.hist_share, low_open=True)
        v.positive_int("stages", self.stages)
        v.positive_int("pca_dim", self.pca_dim)
        v.positive("smoothing", self.smoothing)
        v.positive("temperature", self.temperature)
        v.positive_int("kmeans_iters", self.kmeans_iters)

    def to_dict(self) -> dict:
        return asdict(self)


def cluster_assignment(feats: torch.Tensor, cfg: ClusterRRConfig, seed: int) -> torch.Tensor:
    """The image-only part: PCA of the standardised features and k-means (a public function)."""
    return kmeans(pca_project(feats, cfg.pca_dim, seed=derive_seed(seed, 0)), cfg.n_clusters, seed=derive_seed(seed, 1),
                  iters=cfg.kmeans_iters)[0]


def release_cluster_rr(feats: torch.Tensor, labels: PrivateLabels, epsilon: float, cfg: ClusterRRConfig, *,
                       seed: int, noise_key: NoiseKey | None = None, assignment: torch.Tensor | None = None,
                       log=None) -> tuple[LabelLedger, dict]:
    """The releases of ``cluster_rr`` at total label-DP ``epsilon`` (pure) on standardised features [N, D].
    Returns (ledger, info) with the posteriors as ``info["soft_labels"]``. ``seed`` drives the public randomness; the noise
    comes from ``noise_key`` (a fresh secret key by default; docs/threat_model.md). ``assignment``: the
    clusters of ``cluster_assignment(feats, cfg, seed)`` computed earlier (a cache of that public
    function; anything else is the caller's responsibility)."""
    epsilon = v.positive("epsilon", epsilon)
    t0 = time.perf_counter()
    ledger = LabelLedger(labels)
    n, k = len(labels), labels.num_classes
    key = NoiseKey.resolve(noise_key)
    eps_h = epsilon * cfg.hist_share
    eps_rr = epsilon - eps_h
    info: dict = {"eps_hist": eps_h, "eps_rr": eps_rr}
    assign = assignment if assignment is not None else ledger.public_prior(cluster_assignment, feats, cfg, seed)
    hist = noisy_cluster_histograms(ledger, assign, cfg.n_clusters, eps_h,
                                    key.generator("label_dp.cluster_hist", derive_seed(seed, 2)))
    prior = histogram_prior(hist, assign, cfg.smoothing)
    soft = prior.clone()
    if eps_rr > 0:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, 3)))
        parts = torch.tensor_split(perm, cfg.stages)
        gen = key.generator("label_dp.cluster_rr", derive_seed(seed, 4))
        released = torch.zeros(n, dtype=torch.bool)
        for t, idx in enumerate(parts):
            if t > 0:   # the prior of stage t: a model trained on what stages < t released (post-processing)
                m = train_linear(feats, soft, cfg.linear, derive_seed(seed, 10 + t))
                prior_t = softmax_of(m, feats[idx])
            else:
                prior_t = prior[idx]
            choose = prior_t ** cfg.temperature        # the top-k choice only; the posterior uses prior_t
            out, kstar, order = rr_release(ledger, idx, choose, eps_rr, gen, f"rr_stage{t + 1}")
            soft[idx] = rr_posterior(prior_t, out, kstar, order, eps_rr)
            released[idx] = True
            if log is not None:
                log(f"    stage {t + 1}: mean k* {kstar.double().mean():.2f} ({time.perf_counter() - t0:.0f} s)")
            info[f"stage{t + 1}_mean_k"] = float(kstar.double().mean())
    info["release_seconds"] = time.perf_counter() - t0
    info["soft_labels"] = soft
    return ledger, info


def train_cluster_rr(feats: torch.Tensor, labels: PrivateLabels, epsilon: float, cfg: ClusterRRConfig, *,
                     seed: int, noise_key: NoiseKey | None = None, assignment: torch.Tensor | None = None,
                     log=None) -> tuple[torch.nn.Module, LabelLedger, dict]:
    """:func:`release_cluster_rr`, then the linear head trained on the posteriors (post-processing).
    Returns (linear model, ledger, diagnostics)."""
    t0 = time.perf_counter()
    ledger, info = release_cluster_rr(feats, labels, epsilon, cfg, seed=seed, noise_key=noise_key,
                                      assignment=assignment, log=log)
    soft = info.pop("soft_labels")
    model = train_linear(feats, soft, cfg.linear, derive_seed(seed, 20))
    info["train_seconds"] = time.perf_counter() - t0
    return model, ledger, info


def prior_label_dependence(prior_fn, images, labels_a: torch.Tensor, labels_b: torch.Tensor) -> float:
    """Black-box check of a prior function of the form ``prior_fn(images, labels)`` (a signature that
    could read labels): the largest absolute change of its output when the labels change. A prior that
    costs no privacy returns 0 here for every pair of label vectors."""
    pa = torch.as_tensor(prior_fn(images, labels_a), dtype=torch.float64)
    pb = torch.as_tensor(prior_fn(images, labels_b), dtype=torch.float64)
    return float((pa - pb).abs().max())
