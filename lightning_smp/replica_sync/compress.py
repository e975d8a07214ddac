"""The average of a flat float32 tensor across a process group, with the payload compressed (DiLoCo's pseudo-gradients
crossing replica groups, where the links between groups are the slow ones).

Formats (:data:`FORMATS`): ``"none"`` (a plain all-reduce of float32, then ``/ G``), ``"bf16"``, ``"int8"`` and
``"int4"`` (blocks of :data:`BLOCK` values, one float32 scale per block, absmax / 127 or absmax / 7, codes packed
two to a byte for int4). :func:`encode` and :func:`decode` are pure functions of a tensor.

Why two phases. A sum of quantized codes is not the quantized sum (every payload has its own scales), so compressed
payloads cannot go through an all-reduce: the sum needs a decode in between. The exchange is therefore the two halves
of a ring all-reduce done by hand: a reduce-scatter (``all_to_all_single`` of encoded chunks: rank ``j`` gets every
rank's chunk ``j``, decodes them, sums them in float32 in rank order and divides by ``G``) then an all-gather of the
encoded averaged chunks. Each rank sends ``2 (G - 1) / G`` times the encoded size of the vector, as a ring all-reduce
of the compressed payload would: the bytes do not grow with ``G`` (an all-gather of everyone's full payload would
send ``G - 1`` times it).

Why the own chunk is decoded from its encoding. Every other rank only sees chunk ``j`` as rank ``j`` encoded it; if
rank ``j`` kept its float32 average, its copy of chunk ``j`` would differ from theirs by the quantization error and the
replica groups would drift apart. Every rank decodes all ``G`` gathered chunks, its own too, so all leave bit-equal.

Every collective is launched with ``async_op=True``; :class:`Exchange` advances from one stage to the next when
:meth:`Exchange.poll` finds the stage's collective completed, so the exchange overlaps with whatever the caller runs
between polls. Nothing here depends on the device: buffers go where the tensor is (CPU/gloo, CUDA/NCCL, ...).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_smp.collectives import ring_bytes
from lightning_smp.errors import HybridShardConfigError
from lightning_smp.names import REPLICA_SYNC_COMPRESSIONS, ReplicaSyncCompression

Compression = ReplicaSyncCompression
#: The compression formats, lightest compression first.
FORMATS: tuple[Compression, ...] = REPLICA_SYNC_COMPRESSIONS
#: Values per block of the int formats (one float32 scale each).
BLOCK = 256
#: Largest code of the int formats: codes are in [-LEVELS, LEVELS] and scale = absmax / LEVELS.
_LEVELS = {"int8": 127, "int4": 7}


def check_compression(fmt: str) -> None:
    """Raise :class:`~lightning_smp.errors.HybridShardConfigError` unless ``fmt`` is one of :data:`FORMATS`."""
    if fmt not in FORMATS:
        raise HybridShardConfigError(
            f"replica_sync compress={fmt!r} is not one of {', '.join(map(repr, FORMATS))}. Fix: 'none' (uncompressed),"
            " or 'bf16', 'int8', 'int4' for 2, 1 or 1/2 bytes per value."
        )


def _blocks(numel: int, fmt: str) -> int:
    if numel % BLOCK:
        raise ValueError(f"{fmt} encodes whole blocks of {BLOCK} values; got {numel} values (pad them with zeros)")
    return numel // BLOCK


def encoded_bytes(numel: int, fmt: str) -> int:
    """Bytes of :func:`encode` of ``numel`` values (for the int formats, ``numel`` a multiple of :data:`BLOCK`)."""
    check_compression(fmt)
    if fmt == "none":
        return 4 * numel
    if fmt == "bf16":
        return 2 * numel
    return 4 * _blocks(numel, fmt) + (numel if fmt == "int8" else numel // 2)


def sync_payload_bytes(values: int, fmt: str, element_size: int = 4) -> int:
    """What ``values`` values of ``element_size`` bytes each (the parameters' dtype) put into a crossing as ``fmt``
    encodes them (the planner's and the report's figure, padding to whole blocks aside); ``"none"`` sends them as
    they are."""
    check_compression(fmt)
    if fmt == "none":
        return values * element_size
    if fmt == "bf16":
        return 2 * values
    return encoded_bytes(-(-values // BLOCK) * BLOCK, fmt)


def encode(x: Tensor, fmt: str) -> Tensor:
    """``x`` (1-D float32) as a uint8 payload of :func:`encoded_bytes` bytes: bf16 values, or for int8/int4 the
    float32 scales of the blocks then their codes. ``"none"`` returns a uint8 view of ``x`` itself."""
    check_compression(fmt)
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"encode takes a 1-D float32 tensor; got {x.dtype} of shape {tuple(x.shape)}")
    if fmt == "none":
        return x.contiguous().view(torch.uint8)
    if fmt == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    levels = _LEVELS[fmt]
    blocks = x.reshape(_blocks(x.numel(), fmt), BLOCK)
    scales = blocks.abs().amax(dim=1) / levels
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block: codes 0, not 0 / 0
    codes = torch.round(blocks / divisor[:, None]).clamp_(-levels, levels).to(torch.int8).flatten()
    if fmt == "int4":
        nibbles = (codes + 8).view(torch.uint8)  # -7..7 -> 1..15
        codes = (nibbles[0::2] | (nibbles[1::2] << 4)).view(torch.int8)  # low nibble first
    return torch.cat([scales.view(torch.uint8), codes.view(torch.uint8)])


def decode(payload: Tensor, fmt: str, numel: int) -> Tensor:
    """The ``numel`` float32 values of an :func:`encode` payload, on the payload's device."""
    if payload.dtype != torch.uint8 or payload.numel() != encoded_bytes(numel, fmt):
        raise ValueError(f"a {fmt} payload of {numel} values is {encoded_bytes(numel, fmt)} uint8 bytes; got "
                         f"{payload.numel()} {payload.dtype}")
    if fmt == "none":
        return payload.view(torch.float32)
    if fmt == "bf16":
        return payload.view(torch.bfloat16).float()
    blocks = numel // BLOCK
    scales, codes = payload[: 4 * blocks].view(torch.float32), payload[4 * blocks:]
    if fmt == "int4":
        values = torch.stack([codes & 0x0F, codes >> 4], dim=1).flatten().float() - 8
    else:
        values = codes.view(torch.int8).float()
    return (values.view(blocks, BLOCK) * scales[:, None]).flatten()


class Exchange:
    """The average of ``flat`` (1-D float32, written in place) across ``group``, in stages, each collective async.

    ``__init__`` launches the first stage; :meth:`poll` advances through every stage whose collective has completed
    without blocking, :meth:`wait` blocks until the end. Leave ``flat`` alone until then. ``"none"`` takes any
    floating dtype (the plain all-reduce). With int8/int4 a NaN or infinity makes its whole block non-finite.

    On an accelerator every stage is queued at once on a stream of its own (a collective's ``wait()`` there orders
    the stream after it, without blocking the host): the host never waits, the compute stream only at :meth:`wait`,
    and every rank issues the stages' collectives at the same point of its program (NCCL wants collectives on
    different communicators issued in one order everywhere). On the CPU (gloo, whose ``wait()`` blocks) the stages
    advance as :meth:`poll` finds each done.
    """

    def __init__(self, flat: Tensor, group: dist.ProcessGroup | None, compress: str,
                 log: list[str] | None = None) -> None:
        check_compression(compress)
        #: where each collective it starts is named as it starts (``"all_reduce"``, ``"other"``: the all-to-all,
        #: ``"all_gather"``), for a caller that accounts for what crossed when
        self.log = log if log is not None else []
        if flat.dim() != 1 or not flat.is_contiguous() or (compress != "none" and flat.dtype != torch.float32):
            raise ValueError(f"Exchange averages a contiguous 1-D tensor, float32 unless compress='none'; got "
                             f"{flat.dtype} of shape {tuple(flat.shape)}")
        self.flat, self.group, self.compress = flat, group, compress
        self.size = dist.get_world_size(group)
        self.done = self.size == 1 or flat.numel() == 0
        self.sent_bytes = 0
        self._work: dist.Work | None = None
        self._stream: Any = None
        if self.done:
            return
        if flat.device.type == "cpu":
            self._start()
            return
        device = torch.get_device_module(flat.device)
        self._stream = device.Stream(device=flat.device)
        self._stream.wait_stream(device.current_stream(flat.device))  # (flat as the caller wrote it)
        with device.stream(self._stream):
            self._start()
            while not self.done:
                self._next()

    def _start(self) -> None:
        """The first stage's collective started (the caller's stream current)."""
        flat, group, compress = self.flat, self.group, self.compress
        if compress == "none":  # what the plain all-reduce does, bit for bit: a sum (gloo has no average), then / G
            self.sent_bytes = round(ring_bytes("all_reduce", flat.numel() * flat.element_size(), self.size))
            self._work = dist.all_reduce(flat, group=group, async_op=True)
            self.log.append("all_reduce")
            self._stages = iter([self._divide])
            return
        # G equal chunks of whole blocks: rank j reduces chunk j
        self.chunk = -(-flat.numel() // (self.size * BLOCK)) * BLOCK
        padded = torch.zeros(self.size * self.chunk, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        self._send = torch.cat([encode(part, compress) for part in padded.split(self.chunk)])
        self._recv = torch.empty_like(self._send)
        self.sent_bytes = round(ring_bytes("all_reduce", self._send.numel(), self.size))  # 2 (G - 1) chunk payloads
        self._work = dist.all_to_all_single(self._recv, self._send, group=group, async_op=True)
        self.log.append("other")
        self._stages = iter([self._reduce, self._write_back])

    def _divide(self) -> None:
        self.flat /= self.size

    def _reduce(self) -> None:
        """Stage 2: this rank's chunk, every rank's encoding decoded and summed in rank order, / G; all-gather it."""
        payloads = self._recv.chunk(self.size)
        average = decode(payloads[0], self.compress, self.chunk).clone()
        for payload in payloads[1:]:
            average += decode(payload, self.compress, self.chunk)
        average /= self.size
        self._send = encode(average, self.compress).contiguous()
        self._recv = torch.empty(self.size * self._send.numel(), dtype=torch.uint8, device=self.flat.device)
        # all_gather_single: torch 2.13's name for all_gather_into_tensor (deprecated under the old name)
        self._work = dist.all_gather_single(self._recv, self._send, group=self.group, async_op=True)
        self.log.append("all_gather")

    def _write_back(self) -> None:
        """Stage 3: every averaged chunk decoded from its encoding (this rank's own too: every rank bit-equal)."""
        average = torch.cat([decode(payload, self.compress, self.chunk) for payload in self._recv.chunk(self.size)])
        self.flat.copy_(average[: self.flat.numel()])
        del self._send, self._recv

    def _next(self) -> None:
        assert self._work is not None
        self._work.wait()  # returns at once after is_completed(); on CUDA it orders the current stream after it
        self._work = None
        next(self._stages)()
        self.done = self._work is None

    def poll(self) -> bool:
        """Advance through every stage whose collective has completed, never blocking; True when the average is in."""
        while not self.done and self._work is not None and self._work.is_completed():
            self._next()
        return self.done

    def wait(self) -> Tensor:
        """Block until the average is in ``flat`` (an accelerator: the current stream waits for it); return
        ``flat``."""
        while not self.done:
            self._next()
        if self._stream is not None:
            torch.get_device_module(self.flat.device).current_stream(self.flat.device).wait_stream(self._stream)
            self._stream = None
        return self.flat


__all__ = ["BLOCK", "FORMATS", "Compression", "Exchange", "check_compression", "decode", "encode", "encoded_bytes",
           "sync_payload_bytes"]
