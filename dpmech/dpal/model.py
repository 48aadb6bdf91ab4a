"""DPAL's network f(x) = g(a(x, theta_1), theta_2) (Sec. 3, Figure 1) with Appendix M's
architectures for MNIST and CIFAR-10.

* ``BoundedAffine`` is a(x, theta_1): the first convolution, whose kernel is divided **inside every
  forward pass** by max(1, N(W) / c), where N(W) is an upper bound of the l1 -> l1 operator norm
  of x -> W * x (Lemma 3's Delta_h1 = ||theta_1^T||_{1,1}) and c the configured bound. The bound
  Lemma 3 (gamma) relies on therefore holds at every step of training and at inference, whatever
  the optimiser does. Its output h = tanh(W * x + b) lies in [-1, 1], as Lemma 2 requires; tanh is
  1-Lipschitz, so it never increases a sensitivity. ``decode`` is the tied-weight reconstruction
  x_tilde = theta_1 h of Eq. 5-7 (a transposed convolution).
* ``DPALNet`` adds the training noise 2 chi_2 / m to h (Eq. 7), the hidden layers up to h_pi,
  bounded in [-1, 1] by tanh (Lemma 4 needs it), and the output layer W_pi without bias (a bias
  would make the label counts sum_i y_ik a coefficient of the objective, unprotected by chi_3).

MNIST (Appendix M): conv 5x5/2 32 maps (beta = 14^2, d = 25) -> conv 5x5/2 64 maps -> fc 256 ->
10. CIFAR-10: centre crop 28x28 (the reference crops to 28), conv 4x4/2 128 maps (beta = 14^2,
d = 16, 3 channels) -> conv 5x5 128 -> conv 5x5 256 -> avg-pool 2 -> fc 256 -> 10.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from dpmech import _validate as v

ARCHITECTURES = {
    # name: input shape, noised input shape (after the crop), first layer (maps, kernel, stride, padding,
    # output_padding of the decoder), |h_pi|, classes
    "mnist": {"input": (1, 28, 28), "noised": (1, 28, 28), "maps": 32, "kernel": 5, "stride": 2, "padding": 2,
              "output_padding": 1, "h_pi": 256, "classes": 10},
    "cifar10": {"input": (3, 32, 32), "noised": (3, 28, 28), "maps": 128, "kernel": 4, "stride": 2, "padding": 1,
                "output_padding": 0, "h_pi": 256, "classes": 10},
}


def l1_operator_bound(weight: torch.Tensor, stride: int) -> torch.Tensor:
    """Upper bound of the l1 -> l1 operator norm of the convolution x -> W * x (any padding).

    Input pixel (c, r, s) is read by kernel taps (u, v) with u = r + pad - p * stride, so one pixel
    meets only the taps of one residue class (u mod stride, v mod stride), each at most once per
    output map; the column sums of the layer's matrix are therefore at most
    max over c and the class (a, b) of sum_{o, u = a mod s, v = b mod s} |W[o, c, u, v]|,
    with equality for interior pixels. (For stride 1 this is the total l1 norm per channel.)
    """
    a = weight.abs()
    best = None
    for i in range(stride):
        for j in range(stride):
            s = a[:, :, i::stride, j::stride].sum(dim=(0, 2, 3))  # per input channel
            best = s if best is None else torch.maximum(best, s)
    return best.max()


class BoundedAffine(nn.Module):
    """a(x, theta_1): h = tanh(W_n * x + b) with ||W_n||_{1->1} <= ``bound`` enforced in the forward pass."""

    def __init__(self, in_channels: int, maps: int, kernel: int, stride: int, padding: int,
                 output_padding: int, bound: float):
        super().__init__()
        self.bound = v.positive("theta1_bound", bound)
        self.stride, self.padding, self.output_padding = stride, padding, output_padding
        self.weight = nn.Parameter(torch.empty(maps, in_channels, kernel, kernel))
        self.bias = nn.Parameter(torch.zeros(maps))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.enforce = True  # tests switch this off for the negative control only

    @property
    def patch_size(self) -> int:
        """d of Lemma 2: the inputs of one channel that one hidden neuron reads."""
        return self.weight.shape[2] * self.weight.shape[3]

    def raw_norm(self) -> torch.Tensor:
        return l1_operator_bound(self.weight, self.stride)

    def normalized_weight(self) -> torch.Tensor:
        """W / max(1, N(W) / c): gradients flow through the division (as in spectral normalisation)."""
        if not self.enforce:
            return self.weight
        return self.weight / torch.clamp(self.raw_norm() / self.bound, min=1.0)

    def pre_activation(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.normalized_weight(), self.bias, stride=self.stride, padding=self.padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """h = tanh(theta_1^T x + b), in [-1, 1] (Lemma 2's assumption)."""
        return torch.tanh(self.pre_activation(x))

    def decode(self, h: torch.Tensor) -> torch.Tensor:
        """x_tilde = theta_1 h (Eq. 5): the tied-weight transposed convolution, no bias."""
        return F.conv_transpose2d(h, self.normalized_weight(), None, stride=self.stride, padding=self.padding,
                                  output_padding=self.output_padding)

    @torch.no_grad()
    def l1_norm(self) -> float:
        """Delta_h1 of the weights in use: the l1 -> l1 bound of the normalised kernel (<= bound)."""
        return float(l1_operator_bound(self.normalized_weight(), self.stride))

    @torch.no_grad()
    def linf_to_l1_norm(self, input_shape) -> float:
        """sup ||W_n * a||_1 over ||a||_inf <= 1 for inputs of ``input_shape`` (exact upper bound: every
        output unit is at most the l1 norm of the kernel taps that fall inside the image)."""
        ones = torch.ones((1, *input_shape), dtype=self.weight.dtype, device=self.weight.device)
        return float(F.conv2d(ones, self.normalized_weight().abs(), None, stride=self.stride,
                              padding=self.padding).sum())


class DPALNet(nn.Module):
    """f(x) = g(a(x, theta_1) + noise_h, theta_2) with the inputs already perturbed by the caller."""

    def __init__(self, dataset: str = "mnist", theta1_bound: float = 1.0, w_pi_bound: float = 1.0):
        super().__init__()
        self.dataset = v.choice("dataset", dataset, tuple(ARCHITECTURES))
        arch = ARCHITECTURES[dataset]
        self.input_shape = arch["input"]
        self.noised_shape = arch["noised"]
        c = arch["noised"][0]
        self.encoder = BoundedAffine(c, arch["maps"], arch["kernel"], arch["stride"], arch["padding"],
                                     arch["output_padding"], theta1_bound)
        side = (arch["noised"][1] + 2 * arch["padding"] - arch["kernel"]) // arch["stride"] + 1
        self.hidden_shape = (arch["maps"], side, side)
        self.h_pi = arch["h_pi"]
        self.classes = arch["classes"]
        if dataset == "mnist":
            self.body = nn.Sequential(
                nn.Conv2d(arch["maps"], 64, 5, stride=2, padding=2), nn.BatchNorm2d(64), nn.ReLU(), nn.Flatten(),
                nn.Linear(64 * 7 * 7, arch["h_pi"]), nn.BatchNorm1d(arch["h_pi"]))
        else:
            self.body = nn.Sequential(
                nn.Conv2d(arch["maps"], 128, 5, padding=2), nn.BatchNorm2d(128), nn.ReLU(),
                nn.Conv2d(128, 256, 5, padding=2), nn.BatchNorm2d(256), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
                nn.Linear(256 * 7 * 7, arch["h_pi"]), nn.BatchNorm1d(arch["h_pi"]))
        self.w_pi_bound = v.positive("w_pi_bound", w_pi_bound)
        self.w_pi_raw = nn.Parameter(torch.empty(arch["h_pi"], arch["classes"]))
        nn.init.normal_(self.w_pi_raw, 0.0, 1.0 / math.sqrt(arch["h_pi"]))

    # ------------------------------------------------------------------ pieces
    @property
    def beta(self) -> int:
        """beta of Lemma 2: hidden neurons of one feature map of h_1."""
        return self.hidden_shape[1] * self.hidden_shape[2]

    @property
    def in_channels(self) -> int:
        return self.noised_shape[0]

    def theta1(self) -> list[nn.Parameter]:
        return list(self.encoder.parameters())

    def theta2(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("encoder.")]

    def crop(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the network reads it (CIFAR-10: the centre 28x28 crop)."""
        if tuple(x.shape[1:]) == tuple(self.noised_shape):
            return x
        if tuple(x.shape[1:]) != tuple(self.input_shape):
            raise ValueError(f"x must hold images of shape {self.input_shape}, got {tuple(x.shape[1:])}")
        _, h, w = self.noised_shape
        top = (x.shape[2] - h) // 2
        left = (x.shape[3] - w) // 2
        return x[:, :, top:top + h, left:left + w]

    def affine(self, x_bar: torch.Tensor) -> torch.Tensor:
        """h = a(x_bar, theta_1) in [-1, 1] (before the noise 2 chi_2 / m)."""
        return self.encoder(x_bar)

    def hidden(self, h_bar: torch.Tensor) -> torch.Tensor:
        """h_pi = g's last hidden layer, bounded in [-1, 1] by tanh (Lemma 4)."""
        return torch.tanh(self.body(h_bar))

    @property
    def w_pi(self) -> torch.Tensor:
        """W_pi with every column's l2 norm at most ``w_pi_bound`` (enforced in the forward pass): the
        perturbed Eq. 11 has the linear term -<chi_3, W_pi>, unbounded below on an unbounded domain."""
        norms = self.w_pi_raw.norm(dim=0, keepdim=True)
        return self.w_pi_raw / torch.clamp(norms / self.w_pi_bound, min=1.0)

    def output(self, h_pi: torch.Tensor) -> torch.Tensor:
        """Logits z_k = h_pi W_pi,k (Eq. 11: no bias)."""
        return h_pi @ self.w_pi

    def logits(self, x_bar: torch.Tensor, noise_h: torch.Tensor | float = 0.0) -> torch.Tensor:
        """f's logits for already perturbed (and cropped) inputs x_bar and the noise on h."""
        return self.output(self.hidden(self.affine(x_bar) + noise_h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The noiseless network (the non-private baseline uses it); DPAL's scorers add the noise."""
        return self.logits(self.crop(x))

    # ------------------------------------------------------------------ sensitivities
    def theta1_norm(self) -> float:
        """Delta_h1 in use (Lemma 3), never above the configured bound while enforcement is on."""
        return self.encoder.l1_norm()

    def hidden_sensitivity(self, norm: str) -> float:
        """Per unit attack size: sup ||h(x + a) - h(x)||_1 over ||a||_p <= 1 (tanh is 1-Lipschitz).
        ``linf``: the l_inf -> l1 norm of the first layer; ``l1``: its l1 -> l1 norm."""
        norm = v.choice("norm", norm, ("linf", "l1"))
        if norm == "l1":
            return self.encoder.l1_norm()
        return self.encoder.linf_to_l1_norm(self.noised_shape)

    def input_sensitivity(self, norm: str) -> float:
        """Per unit attack size: sup ||a||_1 over ||a||_p <= 1 on the noised input (d for l_inf, 1 for l1)."""
        norm = v.choice("norm", norm, ("linf", "l1"))
        return float(math.prod(self.noised_shape)) if norm == "linf" else 1.0


class NonPrivateNet(nn.Module):
    """The same architecture trained as a plain classifier (the benchmark's non-private baseline)."""

    def __init__(self, dataset: str = "mnist", theta1_bound: float = 1.0):
        super().__init__()
        self.net = DPALNet(dataset, theta1_bound)
        self.net.encoder.enforce = False

    def forward(self, x):
        return self.net(x)
