"""The routes of book-keeping clipping (dpmech.privacy.clipping, issue 26 "Speed"): every route's
per-example norms and clipped sum against the per-example reference of torch.func in float64
(bit-close), in chunks that do not divide the batch, with two rows per example, the fused routes
(the sums taken chunk by chunk, after every other layer's norms), the measured choice, pinned
routes and their errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from dpmech.privacy import clipping
from dpmech.privacy.clipping import ROUTES, BookKeeper

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few examples (the default working set holds a whole test batch): 7 examples
    in chunks of 3, 3, 1 for the layers below."""
    monkeypatch.setattr(clipping, "chunk_size", lambda p, d, t: 3)


@pytest.fixture
def fresh_measurements(monkeypatch):
    monkeypatch.setattr(clipping, "_MEASURED", {})


def per_row_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[N, P] per-row gradients of the cross entropy of each row, by torch.func (the reference)."""
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}

    def loss(ps, xi, yi):
        return F.cross_entropy(functional_call(model, {**ps, **frozen}, (xi[None],)), yi[None])

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g[k].reshape(x.shape[0], -1) for k in params], dim=1)


def run_bk(model, x, y, c, k=1, per_norms=False, **kw):
    """(norms, flat clipped sum, BookKeeper) of one book-keeping step on rows x (k rows per example)."""
    bk = BookKeeper(model, rows_per_example=k, **kw)
    for p in model.parameters():
        p.grad = None
    bk.enabled = True
    logits = model(x)
    bk.enabled = False
    loss = F.cross_entropy(logits, y, reduction="none").sum()
    if per_norms:                      # the closure API (bug_zoo's): unfused routes, any factors
        norms, closures = bk.per_example_norms(loss)
        factor = (c / (norms + 1e-6)).clamp(max=1.0)
        for m, clip in closures:
            w, b = clip(factor)
            for p, g in ((m.weight, w), (getattr(m, "bias", None), b)):
                if p is not None and p.requires_grad and g is not None:
                    p.grad = g if p.grad is None else p.grad + g
    else:
        norms = bk.clipped_sum(loss, c)
    got = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    bk.remove()
    return norms, got, bk


def two_convs() -> nn.Module:
    # conv with stride and padding, conv with dilation and no bias, a linear layer on 3-d input
    # (positions), a linear head: every routed layer kind, several routed layers (fusion picks one)
    return nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.Tanh(),
                         nn.Conv2d(4, 5, 2, dilation=2, bias=False), nn.Tanh(),   # 4x4 -> 2x2
                         nn.Flatten(2), nn.Linear(4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(15, 3))


def model64():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return two_convs().double()


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def clip_bound(norms: torch.Tensor) -> float:
    """A clipping norm between the 3rd and 4th smallest per-example norms (some clipped, some not)."""
    s = norms.sort().values
    return float(s[2] + s[3]) / 2


SPLIT = ("bmm@2", "bmm_f@2", "grouped@3", "grouped_f@2", "ghost@2", "bmm_w@2")   # chunks over 2 or 3 threads
# compiled routes (torch.compile) are tested too: a few seconds of compilation for these small graphs


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("route", ROUTES + SPLIT)
def test_every_route_equals_the_per_example_reference_in_float64(route, k, small_chunks):
    x, y = data(7 * k)
    model = model64()
    rows = per_row_grads(model, x, y)
    ref = rows.reshape(k, 7, -1).sum(0)                     # example i = rows i, 7 + i, ...
    c = clip_bound(ref.norm(dim=1))
    factor = (c / (ref.norm(dim=1) + 1e-6)).clamp(max=1.0)
    assert (factor < 1).any() and (factor == 1).any()
    manual = (ref * factor[:, None]).sum(0)
    for per_norms in (False, True):
        norms, got, bk = run_bk(model64(), x, y, c, k=k, per_norms=per_norms, prefer=route)
        assert torch.allclose(norms, ref.norm(dim=1), rtol=1e-12, atol=0)
        assert torch.allclose(got, manual, rtol=1e-10, atol=1e-14)
        assert not torch.allclose(got, ref.sum(0), rtol=1e-3)          # negative control: unclipped sum
        # linear layers have no grouped or compiled route; the compiled one needs one row per example
        # (and torch.compile: where it fails, a warning and bmm)
        want = route.replace("grouped", "bmm").replace("compiled", "bmm")
        conv = route if k == 1 else route.replace("compiled", "bmm")
        expect = {"0": conv, "2": conv, "5": want}
        if k == 2:
            expect["8"] = want       # two rows per example: the head has 2 positions, no longer rank one
        if per_norms:                 # the closure API takes any factors: the unfused forms
            expect = {n: r.replace("_f", "") for n, r in expect.items()}
        fallback = {n: r.replace("compiled", "bmm") for n, r in expect.items()}
        assert bk.routes == expect or (clipping._COMPILE_ERROR and bk.routes == fallback)


@pytest.mark.parametrize("pins", [{"5": "bmm_f"}, {"0": "grouped_f", "5": "bmm_f"}])
def test_a_wrong_factor_in_the_fused_sum_is_detected(pins, small_chunks, monkeypatch):
    """Negative control of the fused routes (one fused layer; two, as a group): a fused sum whose
    factors forget the other layers' norms gives a different clipped sum."""
    x, y = data(7)
    ref = per_row_grads(model64(), x, y)
    c = clip_bound(ref.norm(dim=1))
    manual = (ref * (c / (ref.norm(dim=1) + 1e-6)).clamp(max=1.0)[:, None]).sum(0)
    _, good, bk = run_bk(model64(), x, y, c, prefer="bmm", routes=pins)
    assert {n: bk.routes[n] for n in pins} == pins and torch.allclose(good, manual, rtol=1e-10)
    real = clipping._fused_group
    monkeypatch.setattr(clipping, "_fused_group", lambda lays, r, rest, cn, w=1: real(lays, r, rest * 0, cn, w))
    _, bad, _ = run_bk(model64(), x, y, c, prefer="bmm", routes=pins)
    assert not torch.allclose(bad, manual, rtol=1e-3)


def test_measured_choice_times_every_route_once_and_is_exact(fresh_measurements):
    x, y = data(7)
    ref = per_row_grads(model64(), x, y)
    c = clip_bound(ref.norm(dim=1))
    manual = (ref * (c / (ref.norm(dim=1) + 1e-6)).clamp(max=1.0)[:, None]).sum(0)
    norms, got, bk = run_bk(model64(), x, y, c)               # prefer="measured" is the default
    assert torch.allclose(got, manual, rtol=1e-10) and torch.allclose(norms, ref.norm(dim=1), rtol=1e-12)
    assert set(bk.timings) == {"0", "2", "5"}
    # every route but the compiled ones (not timed on layers this small: COMPILE_MIN); no grouped on linear
    assert set(bk.timings["0"]) == {r for r in ROUTES if "compiled" not in r}
    assert set(bk.timings["5"]) == {r for r in ROUTES if "grouped" not in r and "compiled" not in r}
    assert all(t > 0 for times in bk.timings.values() for t in times.values())
    for name, r in bk.routes.items():                          # the fastest measured
        assert r == min(bk.timings[name], key=bk.timings[name].get)
    # the timing is one-off: a second BookKeeper on the same shapes measures nothing
    _, again, bk2 = run_bk(model64(), x, y, c)
    assert bk2.timings == {} and bk2.routes == bk.routes and torch.allclose(again, manual, rtol=1e-10)


def test_measured_choice_with_two_threads_times_split_chunks(fresh_measurements, small_chunks):
    """With 2 threads every chunked route is also timed with its chunks split over 2 threads."""
    x, y = data(40)
    torch.set_num_threads(2)                   # the one_thread fixture restores the count
    _, got, bk = run_bk(model64(), x, y, 1e9)
    _, ref, _ = run_bk(model64(), x, y, 1e9, prefer="inst")
    assert torch.allclose(got, ref, rtol=1e-12)
    assert {"bmm@2", "bmm_f@2", "grouped@2", "grouped_f@2"} <= set(bk.timings["0"])
    assert "inst@2" not in bk.timings["0"]      # whole-batch instantiation has no chunks to split
    assert torch.get_num_threads() == 2         # restored after the split runs


def test_pinned_routes_and_their_errors(small_chunks):
    x, y = data(7)
    _, _, bk = run_bk(model64(), x, y, 1.0, prefer="ghost", routes={"0": "grouped_w@2", "5": "inst"})
    assert bk.routes == {"0": "grouped_w@2", "2": "ghost", "5": "inst"}
    with pytest.raises(ValueError, match="^routes: 'conv' is not a parameterised layer"):
        BookKeeper(model64(), routes={"conv": "ghost"})
    with pytest.raises(ValueError, match="^routes: the route of '0' must be one of"):
        BookKeeper(model64(), routes={"0": "fast"})
    with pytest.raises(ValueError, match="^routes: the route of '0' must be one of .*'@k', k >= 1"):
        BookKeeper(model64(), routes={"0": "bmm@0"})
    with pytest.raises(ValueError, match="^prefer must be one of"):
        BookKeeper(model64(), prefer="fastest")


def test_routes_that_keep_gradients_give_way_over_inst_max(small_chunks, monkeypatch):
    """Over INST_MAX floats of per-example gradients a kept route takes its form that drops them
    (the sum then comes from the re-weighted weight gradient), and stays exact."""
    monkeypatch.setattr(clipping, "INST_MAX", 10)
    x, y = data(7)
    ref = per_row_grads(model64(), x, y)
    c = clip_bound(ref.norm(dim=1))
    manual = (ref * (c / (ref.norm(dim=1) + 1e-6)).clamp(max=1.0)[:, None]).sum(0)
    for route, want in (("grouped", "grouped_w"), ("bmm", "bmm_w"), ("inst", "ghost")):
        _, got, bk = run_bk(model64(), x, y, c, prefer=route)
        assert bk.routes["0"] == want and torch.allclose(got, manual, rtol=1e-10)


def test_float32_routes_agree_on_the_benchmark_networks():
    """tb_cnn and pixeldp_cnn at a batch of 40 (float32, default chunks): every route's norms and
    sum agree with the fused default to float32 rounding."""
    from dpmech.dpsgd.trainer import build_dpsgd_model

    g = torch.Generator().manual_seed(3)
    x = torch.rand(40, 1, 28, 28, generator=g) * 2 - 1
    y = torch.randint(0, 10, (40,), generator=g)
    for name in ("tb_cnn", "pixeldp_cnn"):
        base_norms, base, _ = run_bk(build_dpsgd_model("mnist", 0, name), x, y, 0.5, prefer="inst")
        for route in ROUTES:
            norms, got, _ = run_bk(build_dpsgd_model("mnist", 0, name), x, y, 0.5, prefer=route)
            assert torch.allclose(norms, base_norms, rtol=1e-4)
            assert torch.allclose(got, base, rtol=1e-3, atol=1e-6 * base.abs().max())


def test_torch_compile_failure_falls_back_to_the_eager_route(small_chunks, monkeypatch):
    """Where torch.compile cannot run (no C++ compiler), the compiled routes warn once and take
    the eager batched matmul, with the same clipped sum; "measured" then drops them."""
    def broken(*_):
        raise RuntimeError("no working C++ compiler")
    monkeypatch.setattr(clipping, "_compiled", lambda *kind: broken)
    monkeypatch.setattr(clipping, "_COMPILE_ERROR", None)
    x, y = data(7)
    ref = per_row_grads(model64(), x, y)
    c = clip_bound(ref.norm(dim=1))
    manual = (ref * (c / (ref.norm(dim=1) + 1e-6)).clamp(max=1.0)[:, None]).sum(0)
    with pytest.warns(UserWarning, match="torch.compile failed .*no working C\\+\\+ compiler"):
        _, got, _ = run_bk(model64(), x, y, c, prefer="compiled_f")
    assert torch.allclose(got, manual, rtol=1e-10)
    _, _, bk = run_bk(model64(), x, y, c, prefer="compiled_f")    # after the failure: resolved to bmm
    assert bk.routes == {"0": "bmm_f", "2": "bmm_f", "5": "bmm_f"}


def test_a_checkpoint_carries_the_routes_and_a_restored_trainer_pins_them():
    """DPSGDTrainer.state_dict holds the engine's routes ("measured" times them per process); a
    trainer restored from it takes the same ones, whatever it would measure."""
    from dpmech.dpsgd.trainer import DPSGDConfig, DPSGDTrainer, build_dpsgd_model

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 1, 28, 28, generator=g) * 2 - 1, torch.randint(0, 10, (64,), generator=g)
    cfg = DPSGDConfig(epsilon=None, noise_multiplier=1.0, max_grad_norm=1.0, batch_size=16, epochs=1)
    first = DPSGDTrainer(build_dpsgd_model("mnist", 0, "tb_cnn"), x, y, cfg)
    first.bookkeeper.pin({"features.0": "grouped_w", "features.3": "bmm_f"})   # not what prefer would give
    first.train_step()
    state = first.state_dict()
    assert state["bk_routes"] == {"features.0": "grouped_w", "features.3": "bmm_f"}
    restored = DPSGDTrainer(build_dpsgd_model("mnist", 1, "tb_cnn"), x, y, cfg)
    restored.load_state_dict(state)
    restored.train_step()
    assert restored.bookkeeper.routes == state["bk_routes"]
    control = DPSGDTrainer(build_dpsgd_model("mnist", 1, "tb_cnn"), x, y, cfg)      # negative control
    control.bookkeeper.prefer = "ghost"
    control.train_step()
    assert control.bookkeeper.routes != state["bk_routes"]
