"""Compressed averaging across replica groups (``lightning_smp.replica_sync.compress``): each codec's error within
its derived bound, and the staged exchange bit-equal on every rank, equal to the average written out by hand, sending
``2 (G - 1) / G`` times the encoded size, advanced by polling alone."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from lightning_smp import HybridShardConfigError
from lightning_smp.replica_sync.compress import BLOCK, FORMATS, Exchange, decode, encode, encoded_bytes
from lightning_smp.testing import run_distributed
from tests.helpers import BACKENDS, require_devices

EPS = torch.finfo(torch.float32).eps  # 2**-23; the unit roundoff of float32 is EPS / 2
LEVELS = {"int8": 127, "int4": 7}


def _values(numel: int, seed: int) -> torch.Tensor:
    """Normal values, each block at its own magnitude (1e-3 .. 1e3), one block all zeros, one with a single value."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=generator)
    for start in range(0, numel, BLOCK):
        x[start:start + BLOCK] *= 10.0 ** (start // BLOCK % 7 - 3)
    x[BLOCK:2 * BLOCK] = 0
    if numel >= 3 * BLOCK:
        x[2 * BLOCK:3 * BLOCK] = 0
        x[2 * BLOCK + 5] = -3.5
    return x


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int_codecs_stay_within_half_a_step_of_their_block(fmt):
    x = _values(BLOCK * 9, seed=0)
    payload = encode(x, fmt)
    assert payload.dtype == torch.uint8 and payload.numel() == encoded_bytes(x.numel(), fmt)
    y = decode(payload, fmt, x.numel())
    assert y.dtype == torch.float32 and y.shape == x.shape
    # s = fl(m / L) for the block's absmax m, so |x| <= m <= L s (1 + u); r = fl(x / s) is within |x| u of x / s (and
    # within L + 1/2: the clamp never bites); the code q = round(r) within 1/2 of r; y = fl(q s) within L s u of q s.
    # |x - y| <= |x| u + s / 2 + L s u <= s (1/2 + L u (2 + u)) <= s (1/2 + (L + 1) EPS), with u = EPS / 2.
    scales = payload[: 4 * (x.numel() // BLOCK)].view(torch.float32)
    assert torch.equal(scales, x.view(-1, BLOCK).abs().amax(dim=1) / LEVELS[fmt])
    bound = scales.double().repeat_interleave(BLOCK) * (0.5 + (LEVELS[fmt] + 1) * EPS)
    assert ((x.double() - y.double()).abs() <= bound).all()
    assert torch.equal(y[BLOCK:2 * BLOCK], torch.zeros(BLOCK))  # an all-zero block: scale 0, codes 0
    assert y[2 * BLOCK + 5] == -3.5 and torch.count_nonzero(y[2 * BLOCK:3 * BLOCK]) == 1  # its absmax is exact


def test_bf16_rounds_each_value_to_nearest():
    x = _values(BLOCK * 9, seed=1)
    payload = encode(x, "bf16")
    assert payload.dtype == torch.uint8 and payload.numel() == encoded_bytes(x.numel(), "bf16") == 2 * x.numel()
    y = decode(payload, "bf16", x.numel())
    # round to nearest with bfloat16's 8 significant bits: relative error <= its unit roundoff, 2**-8 (its eps / 2);
    # 2**-9 would be a bit too few (1 + 2**-8 - 2**-23 rounds to 1)
    assert torch.finfo(torch.bfloat16).eps / 2 == 2**-8
    assert ((x.double() - y.double()).abs() <= 2**-8 * x.double().abs()).all()
    assert decode(encode(torch.tensor([1 + 2**-8 - 2**-23]), "bf16"), "bf16", 1).item() == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_zeros_stay_zeros_and_payloads_have_their_size(fmt):
    zeros = torch.zeros(BLOCK * 3)
    payload = encode(zeros, fmt)
    assert payload.dtype == torch.uint8 and payload.numel() == encoded_bytes(zeros.numel(), fmt)
    assert torch.equal(decode(payload, fmt, zeros.numel()), zeros)
    per_value = {"none": 4, "bf16": 2, "int8": 1 + 4 / BLOCK, "int4": 0.5 + 4 / BLOCK}[fmt]
    assert encoded_bytes(BLOCK * 3, fmt) == BLOCK * 3 * per_value


def test_int4_packs_every_code_two_to_a_byte_low_nibble_first():
    codes = torch.arange(-7, 8).repeat(BLOCK // 15 + 1)[:BLOCK].float()  # absmax 7: scale 1, every code exact
    payload = encode(codes, "int4")
    assert payload[:4].view(torch.float32).item() == 1.0
    packed = payload[4:]
    assert packed.numel() == BLOCK // 2
    assert torch.equal(packed & 0x0F, (codes[0::2] + 8).to(torch.uint8))
    assert torch.equal(packed >> 4, (codes[1::2] + 8).to(torch.uint8))
    assert torch.equal(decode(payload, "int4", BLOCK), codes)
    assert set(decode(payload, "int4", BLOCK).tolist()) == set(range(-7, 8))


def test_int_codecs_take_whole_blocks_only():
    with pytest.raises(ValueError, match="blocks of 256"):
        encode(torch.zeros(BLOCK + 1), "int8")


def test_a_bad_compress_value_names_the_parameter():
    with pytest.raises(HybridShardConfigError, match=r"compress='fp8'.*'none', 'bf16', 'int8', 'int4'"):
        Exchange(torch.zeros(4), None, "fp8")
    with pytest.raises(HybridShardConfigError, match="compress"):
        encoded_bytes(4, "int2")
    with pytest.raises(ValueError, match="float32 unless compress='none'"):
        Exchange(torch.zeros(BLOCK, dtype=torch.bfloat16), None, "int8")


def _seed(world: int, rank: int, numel: int) -> int:
    return 1000 * world + 10 * rank + numel % 7


def _exchanges(rank: int, world: int, numels: list[int]) -> dict:
    """Per (format, numel): the average by ``wait()``, by ``poll()`` alone (then ``wait()``), ``sent_bytes``, how
    many polls came back False; for "none" the plain ``all_reduce`` + ``/=`` too. Then a group of one rank."""
    results: dict = {}
    for numel in numels:
        x = _values(numel, _seed(world, rank, numel))
        for fmt in FORMATS:
            waited = x.clone()
            exchange = Exchange(waited, None, fmt)
            assert exchange.wait() is waited and exchange.poll()
            polled, pending = x.clone(), 0
            exchange = Exchange(polled, None, fmt)
            deadline = time.monotonic() + 30
            while not exchange.poll():
                assert time.monotonic() < deadline, "poll() never finished"
                pending += 1
                time.sleep(0.001)
            assert exchange.wait() is polled
            results[fmt, numel] = (waited, polled, exchange.sent_bytes, pending)
        plain = x.clone()
        dist.all_reduce(plain)
        plain /= world
        results["plain", numel] = plain
    wide = _values(numels[0], rank).double()  # "none" takes any dtype: the plain all-reduce, as before
    plain = wide.clone()
    dist.all_reduce(plain)
    plain /= world
    results["float64"] = torch.equal(Exchange(wide, None, "none").wait(), plain)
    alone = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    x = _values(BLOCK, 7)
    for fmt in FORMATS:
        flat = x.clone()
        exchange = Exchange(flat, alone, fmt)
        assert exchange.poll() and exchange.wait() is flat
        results["alone", fmt] = (torch.equal(flat, x), exchange.sent_bytes)
    return results


def _reference(inputs: list[torch.Tensor], fmt: str) -> torch.Tensor:
    """The average as the exchange defines it, written out: per chunk, every rank's chunk through its codec, summed
    in rank order, / G, through the codec again."""
    world, numel = len(inputs), inputs[0].numel()
    chunk = -(-numel // (world * BLOCK)) * BLOCK
    padded = [torch.cat([x, torch.zeros(world * chunk - numel)]) for x in inputs]
    out = []
    for j in range(world):
        parts = [decode(encode(x[j * chunk:(j + 1) * chunk], fmt), fmt, chunk) for x in padded]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        total /= world
        out.append(decode(encode(total, fmt), fmt, chunk))
    return torch.cat(out)[:numel]


@pytest.mark.parametrize("world", [2, 4])
def test_the_exchange_is_bit_equal_everywhere_and_the_average_written_out(world):
    numels = [3 * world * BLOCK, 1234]  # whole chunks, and a vector the exchange pads
    runs = run_distributed(_exchanges, world, numels)
    for numel in numels:
        inputs = [_values(numel, _seed(world, rank, numel)) for rank in range(world)]
        for fmt in FORMATS:
            first = runs[0][fmt, numel][0]
            for run in runs:
                waited, polled, sent, _ = run[fmt, numel]
                assert torch.equal(waited, first) and torch.equal(polled, first), (fmt, numel)
                assert waited.numpy().tobytes() == first.numpy().tobytes()  # bit-equal, signs of zeros too
                if fmt == "none":
                    assert torch.equal(waited, run["plain", numel]) and sent == round(2 * (world - 1) / world * 4 * numel)
                else:
                    padded = -(-numel // (world * BLOCK)) * world * BLOCK
                    assert sent == 2 * (world - 1) / world * encoded_bytes(padded, fmt)
            if fmt != "none":
                assert torch.equal(first, _reference(inputs, fmt)), (fmt, numel)
    whole = numels[0]  # no padding: int8 sends (1 + 4 / BLOCK) / 4 of float32's bytes
    assert runs[0]["int8", whole][2] / runs[0]["none", whole][2] == (1 + 4 / BLOCK) / 4
    assert runs[0]["bf16", whole][2] * 2 == runs[0]["none", whole][2]
    assert all(run["alone", fmt] == (True, 0) for run in runs for fmt in FORMATS)
    assert all(run["float64"] for run in runs)


def _on_device(rank: int, world: int, backend: str, numel: int) -> dict:
    """The exchange on the backend's device (a CUDA rank: its own GPU, every stage queued on a side stream), each
    format's average brought back to the CPU."""
    device = torch.device("cpu")
    if backend != "gloo":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    x = _values(numel, _seed(world, rank, numel)).to(device)
    averages = {}
    for fmt in FORMATS:
        flat = x.clone()
        averages[fmt] = Exchange(flat, None, fmt).wait().cpu()
    return averages


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_exchange_is_the_average_written_out_on_every_backend(backend):
    require_devices(backend, 2)
    numel = 1234
    runs = run_distributed(_on_device, 2, backend, numel, backend=backend)
    inputs = [_values(numel, _seed(2, rank, numel)) for rank in range(2)]
    for fmt in FORMATS:
        assert torch.equal(runs[0][fmt], runs[1][fmt]), fmt  # bit-equal on both ranks
        if fmt != "none":
            assert torch.equal(runs[0][fmt], _reference(inputs, fmt)), fmt
        else:  # (one addition of two terms, then / 2: exact whatever the order)
            assert torch.equal(runs[0][fmt], (inputs[0] + inputs[1]) / 2)
