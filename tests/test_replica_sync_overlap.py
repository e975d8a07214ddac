"""``replica_sync``'s overlap (``delay``), compression (``compress``) and self-chosen window (``every="auto"``) on
real process groups: the overlapped outer step is the rule the docs write out, checked against that rule written
by hand on every rank; compressed syncs leave every group bit-equal; ``"auto"`` chooses the same on every rank, from
the figures it says it measured."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_smp import HybridShardConfigError
from lightning_smp.config.replica_sync import ReplicaSync
from lightning_smp.replica_sync import OuterSync
from lightning_smp.replica_sync.auto import (
    CALIBRATION_STEPS,
    EXPOSED_SHARE,
    HIDE_MARGIN,
    LINK_SHARE,
    choose_schedule,
)
from lightning_smp.testing import run_distributed

WORLD = 4
EPS = torch.finfo(torch.float32).eps
#: (outer_lr, outer_momentum, nesterov): the default (the groups' mean) and the paper's
OUTERS = {"average": (1.0, 0.0, False), "nesterov": (0.7, 0.9, True)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _inner_step(model: nn.Module, inner: torch.optim.Optimizer, generator: torch.Generator,
                dtype: torch.dtype = torch.float32) -> None:
    """One inner step on this rank's next batch (an MSE regression): the loop every test here runs before
    ``after_step``."""
    x, y = torch.randn(32, 8, generator=generator), torch.randn(32, 4, generator=generator)
    inner.zero_grad()
    ((model(x.to(dtype)) - y.to(dtype)) ** 2).mean().backward()
    inner.step()


def _digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha1(b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes()
                                 for t in tensors)).hexdigest()


def _train(rank: int, world: int, steps: int, options: dict) -> list[dict]:
    """Each rank a replica group of its own (AdamW inside, its own data); per step: the parameters before and after
    ``after_step``, the fragments it launched, every fragment's synced copies and outer momentum, and the digests
    of every rank's synced copies and parameters."""
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outer = OuterSync(model.parameters(), None, **options)
    generator = torch.Generator().manual_seed(100 + rank)
    history = []
    for _ in range(steps):
        _inner_step(model, inner, generator)
        before = [p.detach().clone() for p in model.parameters()]
        launched = outer.after_step()
        synced = [[s.detach().clone() for s in f.synced] for f in outer.fragments]
        momentum = [[b.clone() for b in f.momentum()] for f in outer.fragments]
        after = [p.detach().clone() for p in model.parameters()]
        digests: list[tuple[str, str]] = [("", "")] * world
        dist.all_gather_object(digests, (_digest([t for f in synced for t in f]), _digest(after)))
        history.append({"before": before, "after": after, "launched": launched, "synced": synced,
                        "momentum": momentum, "digests": digests})
    return history


@pytest.mark.parametrize("outer", sorted(OUTERS))
@pytest.mark.parametrize(("every", "fragments", "delay"), [(4, 1, 2), (6, 2, 2)], ids=["whole", "2_fragments"])
def test_an_overlapped_sync_moves_each_group_by_the_synced_copy_s_move(every, fragments, delay, outer):
    """The rule, written out: fragment ``f`` launched after step ``t`` sends ``S - x_g(t)`` (``S``: its synced copy,
    ``x_g(t)``: group g's parameters then); after step ``t + delay`` the average of those lands, the outer SGD steps
    ``S`` to ``S'``, and every group's parameters ``x_g(t + delay)`` become ``x_g(t + delay) + (S' - x_g(t))``: the
    outer step's move of the synced copy, from where the group was when it sent, its own progress of the ``delay``
    steps kept. Between a launch and its landing nothing changes but what the inner optimizer does."""
    lr, mu, nesterov = OUTERS[outer]
    steps = 3 * every + delay
    runs = run_distributed(_train, WORLD, steps, {"every": every, "fragments": fragments, "delay": delay,
                                                  "outer_lr": lr, "outer_momentum": mu, "nesterov": nesterov})
    spacing = every // fragments
    sizes = [len(f) for f in runs[0][0]["synced"]]
    cut = [sum(sizes[:i]) for i in range(len(sizes) + 1)]  # (fragment i: parameters cut[i]:cut[i + 1])
    landings = {}
    for step in range(steps):
        records = [run[step] for run in runs]
        assert len({d[0] for d in records[0]["digests"]}) == 1  # the synced copies bit-equal on every rank, always
        expected_launch = [] if (step + 1) % spacing else [((step + 1) // spacing - 1) % fragments]
        assert all(r["launched"] == expected_launch for r in records)
        for f in expected_launch:
            landings[step + delay] = (f, step)
        if step not in landings:
            for r in records:  # nothing lands: the parameters are the inner step's
                assert all(torch.equal(a, b) for a, b in zip(r["before"], r["after"]))
            continue
        f, launched = landings.pop(step)
        synced_then = runs[0][launched - 1]["synced"][f] if launched else None
        start = [p.clone() for p in _model().parameters()][cut[f]:cut[f + 1]]
        anchor = synced_then if synced_then is not None else start
        momentum_then = runs[0][launched - 1]["momentum"][f] if launched else []
        sent = [run[launched]["before"][cut[f]:cut[f + 1]] for run in runs]
        for index, s in enumerate(anchor):
            g = sum(s.double() - x[index].double() for x in sent) / WORLD
            v = mu * momentum_then[index].double() + g if momentum_then else g
            want_synced = s.double() - lr * ((g + mu * v) if nesterov else v)
            got_synced = records[0]["synced"][f][index].double()
            # the ring's sum of WORLD float32 terms, the step's lr (1 + mu), one rounding of the result
            term = max(float((s.double() - x[index].double()).abs().max()) for x in sent) + float(
                want_synced.abs().max()) + float(v.abs().max())
            assert float((got_synced - want_synced).abs().max()) <= (WORLD * lr * (1 + mu) + 2) * EPS * term
            for rank, r in enumerate(records):
                now = r["before"][cut[f] + index].double()
                want = now + (got_synced - sent[rank][index].double())
                # two float32 roundings: S' - x(t), then the sum
                bound = 2 * EPS * float(now.abs().max() + (got_synced - sent[rank][index].double()).abs().max())
                assert float((r["after"][cut[f] + index].double() - want).abs().max()) <= bound
        for r in records:  # the other fragments' parameters are the inner step's
            others = [i for i in range(len(r["before"])) if not cut[f] <= i < cut[f + 1]]
            assert all(torch.equal(r["before"][i], r["after"][i]) for i in others)
        assert len({d[1] for d in records[0]["digests"]}) == WORLD  # each group kept its own delay steps
    assert all(step >= steps for step in landings)  # (only a crossing launched at the end is still in flight)


def _no_delay_equals_blocking(rank: int, world: int) -> bool:
    """Every 2 steps for 6 steps, then the end of training's sync: with a delay of 1 the crossing of step 6 is still
    in flight then, and the end lands it (a sync recorded at step 6) and syncs nothing more (nothing trained since it
    left); without, it landed at once. Three syncs either way; every group ends equal."""
    runs = []
    for delay in (0, 1):
        model = _model()
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        outer = OuterSync(model.parameters(), None, every=2, delay=delay)
        generator = torch.Generator().manual_seed(100 + rank)
        for _ in range(6):
            _inner_step(model, inner, generator)
            outer.after_step()
        in_flight = outer.pending
        assert outer.sync() == [] and not outer.pending  # (the end of fit: every group equal)
        assert (in_flight, outer.syncs, outer.report.step) == (bool(delay), 3, 6)
        runs.append(_digest(list(model.parameters())))
        digests: list[str] = [""] * world
        dist.all_gather_object(digests, runs[-1])
        assert len(set(digests)) == 1
    return runs[0] != runs[1]


def test_the_end_of_training_lands_the_crossing_in_flight_and_leaves_every_group_equal():
    assert all(run_distributed(_no_delay_equals_blocking, 2))  # (and the delay changed the result: it acted)


@pytest.mark.parametrize("compress", ["bf16", "int8", "int4"])
def test_compressed_syncs_leave_every_group_bit_equal_near_the_float32_average(compress):
    runs = run_distributed(_train, WORLD, 6, {"every": 3, "compress": compress})
    plain = run_distributed(_train, WORLD, 3, {"every": 3})
    for step in (2, 5):
        assert len({d[1] for d in runs[0][step]["digests"]}) == 1  # parameters bit-equal on every rank
    # the first sync against the float32 one (the same windows before it): each group's pseudo-gradient quantized,
    # then their average, each within half a quantization step of its block (a scale of at most absmax / levels;
    # bf16: 2^-8 of the value), so at most max |pseudo-gradient| / levels off, plus float32's own roundings
    levels = {"bf16": 128, "int8": 127, "int4": 7}[compress]
    start = [p.detach() for p in _model().parameters()]
    for index, (got, want) in enumerate(zip(runs[0][2]["after"], plain[0][2]["after"])):
        delta = max(float((start[index] - r[2]["before"][index]).abs().max()) for r in runs)
        bound = 2 * delta / levels + 8 * EPS * float(start[index].abs().max() + delta)
        assert float((got - want).abs().max()) <= bound
    assert any(not torch.equal(a, b) for a, b in zip(runs[0][2]["after"], plain[0][2]["after"]))  # (compressed)


def test_auto_chooses_the_smallest_window_that_hides_the_crossing():
    # no overlap: the crossing (x the margin) may show 5 % of the window's compute
    assert choose_schedule(0.5, 0.1, 1, "auto", 0).every == -(-0.5 * HIDE_MARGIN // (EXPOSED_SHARE * 0.1))
    # overlap chosen too: the steps that cover the crossing (x the margin), the window long enough that the link is
    # busy at most half of it
    chosen = choose_schedule(0.5, 0.1, 1, "auto", "auto")
    assert (chosen.delay, chosen.every, chosen.shown_s) == (8, 15, 0.0)
    assert 0.5 * HIDE_MARGIN <= LINK_SHARE * chosen.every * 0.1
    # fragments: each carries a quarter; the window a multiple of the fragments, each turn longer than the delay
    chosen = choose_schedule(0.5, 0.1, 4, "auto", "auto")
    assert (chosen.delay, chosen.every) == (2, 16)
    # a given window caps the delay below a fragment's turn, and the rest shows
    chosen = choose_schedule(2.0, 0.1, 1, 10, "auto")
    assert chosen.delay == 9 and chosen.shown_s == pytest.approx(2.0 - 0.9)
    assert "every 10 steps" in chosen.why and "delay 9" in chosen.why


def _auto(rank: int, world: int) -> tuple:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = OuterSync(model.parameters(), None, every="auto", delay="auto", fragments=2)
    generator = torch.Generator().manual_seed(100 + rank)
    launched: list[list[int]] = []
    # (to the calibration, then a whole window of what it chose: every rank alike, so every rank's loop ends alike)
    while len(launched) < 2 * CALIBRATION_STEPS or len(launched) < 2 * CALIBRATION_STEPS + outer.every:
        _inner_step(model, inner, generator)
        launched.append(outer.after_step())
    return outer.every, outer.delay, outer.chosen.why, launched, outer.schedule()


def test_auto_chooses_alike_on_every_rank_after_its_calibration_sync():
    runs = run_distributed(_auto, 2)
    assert len({run[:3] for run in runs}) == 1  # the slowest rank's figures: one choice
    every, delay, why, launched, schedule = runs[0]
    assert every % 2 == 0 and 0 <= delay < every // 2 and f"every {every} steps" in why
    calibration = 2 * CALIBRATION_STEPS
    assert launched[calibration - 1] == [0, 1]  # the calibration: every fragment at once
    assert all(not s for s in launched[:calibration - 1])
    turns = [(step + 1, s) for step, s in enumerate(launched) if s and step + 1 > calibration]
    assert turns[0] == (calibration + every // 2, [0])  # then in turn, from the calibration's step
    assert schedule == {"every": every, "delay": delay, "origin": calibration, "fragments": 2}


@pytest.mark.parametrize(("values", "match"), [
    ({"every": 4, "delay": 4}, "delay=4 with every=4 and fragments=1.*Fix: delay <= 3"),
    ({"every": 8, "fragments": 4, "delay": 2}, "delay=2 with every=8 and fragments=4.*Fix: delay <= 1, or every >= 12"),
    ({"every": "sometimes"}, "every='sometimes' is neither a number of steps nor 'auto'"),
    ({"every": 4, "compress": "int2"}, "compress='int2' is not one of 'none', 'bf16', 'int8', 'int4'"),
    ({"every": 4, "outer": "adam"}, "outer='adam' is not one of 'average', 'nesterov'"),
    ({"every": 4, "delay": -1}, "delay=-1 is negative"),
])
def test_bad_overlap_and_compression_settings_are_refused_by_name(values, match):
    with pytest.raises(HybridShardConfigError, match=match):
        ReplicaSync.from_mapping(values)


def test_the_outer_preset_fills_only_the_keys_not_given():
    assert (ReplicaSync(every=5).outer_lr, ReplicaSync(every=5).outer_momentum) == (1.0, 0.0)
    paper = ReplicaSync.from_mapping({"every": 5, "outer": "nesterov"})
    assert (paper.outer_lr, paper.outer_momentum, paper.nesterov) == (0.7, 0.9, True)
    assert ReplicaSync.from_mapping({"every": 5, "outer": "nesterov", "outer_lr": 0.5}).outer_lr == 0.5


def _many_buckets(rank: int, world: int, dtype: torch.dtype) -> list:
    """int8 with a delay of 2 over buckets of 64 bytes (several exchanges in flight, each with its second stage);
    at every step: the synced weights shown in place of the group's and hidden again, then every rank's synced
    copies and, after the last sync, parameters."""
    model = _model().to(dtype)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = OuterSync(model.parameters(), None, every=3, delay=2, compress="int8", bucket_bytes=64)
    generator = torch.Generator().manual_seed(100 + rank)
    seen = []
    for _ in range(9):
        _inner_step(model, inner, generator, dtype)
        outer.after_step()
        own = [p.detach().clone() for p in model.parameters()]
        outer.show_synced()  # (validation while a crossing is in flight: the synced weights, then the group's own)
        shown = [p.detach().clone() for p in model.parameters()]
        outer.hide_synced()
        synced = [s.detach().clone() for s in outer.fragments[0].synced]
        assert all(torch.equal(a, b) for a, b in zip(shown, synced)) or not outer.pending
        assert all(torch.equal(a, p) for a, p in zip(own, model.parameters()))
        seen.append(_digest(synced))
    outer.sync()
    return seen, _digest(list(model.parameters())), outer.sync_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_compressed_overlapped_sync_over_many_buckets_leaves_every_group_bit_equal(dtype):
    runs = run_distributed(_many_buckets, WORLD, dtype)
    assert all(run[0] == runs[0][0] for run in runs) and len(set(runs[0][0])) > 1  # synced copies, every step
    assert len({run[1] for run in runs}) == 1  # the parameters after the last sync
    # what a window puts into the crossing: each value in 1 byte, a float32 scale per 256 of them (either dtype)
    values = sum(p.numel() for p in _model().parameters())
    assert runs[0][2] == -(-values // 256) * (256 + 4)


def _loaded_in_flight(rank: int, world: int) -> tuple[bool, bool]:
    """A crossing in flight when the outer state is loaded (a rewind): it is dropped, not applied to what was
    loaded."""
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = OuterSync(model.parameters(), None, every=3, delay=2)
    saved = outer.state_dict()
    start = [p.detach().clone() for p in model.parameters()]
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        _inner_step(model, inner, generator)
        outer.after_step()
    in_flight = outer.pending
    with torch.no_grad():
        for p, value in zip(model.parameters(), start):
            p.copy_(value)
    outer.load_state_dict(saved)
    outer.after_step()
    outer.after_step()  # (where the crossing would have landed)
    return in_flight, all(torch.equal(p, value) for p, value in zip(model.parameters(), start))


def test_a_load_drops_the_crossing_in_flight():
    assert run_distributed(_loaded_in_flight, 2) == [(True, True)] * 2


def test_a_kept_schedule_that_does_not_fit_the_settings_is_not_taken():
    def outer(**options):
        return OuterSync(_model().parameters(), None, **options)

    kept = {"every": 6, "delay": 2, "origin": 10, "fragments": 2}
    assert outer(every="auto", delay="auto", fragments=2).set_schedule(kept)
    assert not outer(every="auto", delay="auto", fragments=3).set_schedule(kept)  # (other fragments)
    assert not outer(every=12, delay="auto", fragments=2).set_schedule(kept)  # (another every given)
    assert not outer(every="auto", delay=1, fragments=2).set_schedule(kept)  # (another delay given)
    assert outer(every="auto", delay=2, fragments=2).set_schedule(kept)
    with pytest.raises(HybridShardConfigError, match="every=3 with delay='auto' and fragments=2"):
        outer(every=3, delay="auto", fragments=2)
