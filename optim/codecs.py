"""Codecs for pseudo-gradients on the wire, with exact byte accounting, and error feedback.

A :class:`Codec` turns one tensor into an :class:`Encoded` (the payload tensors a peer sends)
and back into an fp32 tensor of the same shape. ``Encoded.nbytes`` is the exact size of the
payload: ``sum(t.numel() * t.element_size())`` over its tensors, plus :data:`HEADER_BYTES`
(0: shapes, dtypes and codec settings are agreed by the group before a run, as the model and
the config are, and are never sent). Padding that would go on the wire is counted; padding a
codec only uses internally (block quantizers pad the last block to compute scales) is not sent.

============  ==================================  =======================================
codec         bytes for n elements                error per element
============  ==================================  =======================================
``none``      4 n                                 0
``fp16``      2 n                                 ≤ 2⁻¹¹ |x| (+ 2⁻²⁵ below 6.1e-5)
``bf16``      2 n                                 ≤ 2⁻⁸ |x|
``int8``      n + 4 ⌈n / block⌉                   ≤ absmax_block / 254
``int4``      ⌈n / 2⌉ + 4 ⌈n / block⌉             ≤ absmax_block / 14
``topk``      k (index bytes + value bytes)       0 on kept entries up to the value dtype
============  ==================================  =======================================

:class:`ErrorFeedback` keeps, per peer, what compression dropped and adds it to the next
round's update (error feedback as in DeMo, https://arxiv.org/abs/2411.19870, and SparseLoCo,
https://arxiv.org/abs/2508.15706), so a lossy codec delays information instead of losing it.

Every codec refuses a non-finite input with a ``ValueError``: a diverged peer's NaN must never
be encoded into the group's mean.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

HEADER_BYTES = 0
"""Bytes of metadata per encoded tensor counted in ``nbytes`` (none: see the module docstring)."""

FP16_MAX = 65504.0
"""Largest finite float16; larger magnitudes would arrive as Inf."""


@dataclass(kw_only=True)
class Encoded:
    """One tensor as a codec sends it."""

    codec: str
    """Name of the codec that made it (``decode`` checks it)."""
    shape: tuple[int, ...]
    """Shape of the original tensor (``()`` for a 0-dim tensor)."""
    payload: dict[str, Tensor]
    """The tensors that go on the wire, by role (``codes``, ``scales``, ``indices``, ...)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exact payload size in bytes: every payload tensor's storage plus the header."""
        return HEADER_BYTES + sum(t.numel() * t.element_size() for t in self.payload.values())


def encoded_nbytes(encoded: list[Encoded]) -> int:
    """Total bytes of a list of encoded tensors (one peer's message in a round)."""
    return sum(e.nbytes for e in encoded)


class Codec(abc.ABC):
    """Encode a tensor into payload tensors and decode them back to fp32, same shape."""

    name: ClassVar[str]
    """Registry name, also stored in every :class:`Encoded` it makes."""

    def encode(self, tensor: Tensor) -> Encoded:
        """Check that ``tensor`` is finite, flatten it to fp32 and encode it."""
        x = _finite_fp32(tensor)
        payload = self._encode_flat(x.reshape(-1))  # x: any shape -> (n,)
        return Encoded(codec=self.name, shape=tuple(x.shape), payload=payload)

    def decode(self, encoded: Encoded) -> Tensor:
        """The fp32 tensor ``encoded`` stands for, on the payload's device."""
        if encoded.codec != self.name:
            raise ValueError(
                f"this payload was encoded by codec '{encoded.codec}', not '{self.name}': "
                "decode it with the codec the sender used (every peer must use the same codec)"
            )
        flat = self._decode_flat(encoded.payload, encoded.numel)  # (n,) fp32
        return flat.reshape(encoded.shape)

    def round_trip(self, tensors: list[Tensor]) -> tuple[list[Tensor], int]:
        """What a group receives of ``tensors`` (fp32, same shapes) and the payload's bytes, for
        a sender that averages the decoded values itself and keeps no payload. It may return
        the inputs themselves: pass tensors that are the caller's to overwrite."""
        encoded = [self.encode(t) for t in tensors]
        return [self.decode(e) for e in encoded], encoded_nbytes(encoded)

    @abc.abstractmethod
    def _encode_flat(self, x: Tensor) -> dict[str, Tensor]:
        """Payload for a finite fp32 vector ``x`` of shape (n,)."""

    @abc.abstractmethod
    def _decode_flat(self, payload: dict[str, Tensor], numel: int) -> Tensor:
        """The (numel,) fp32 vector a payload stands for."""


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether no tensor holds a NaN or an Inf. One summing pass per tensor: a NaN or an Inf
    makes the sum non-finite, so a finite sum proves the tensor finite; a sum that is not (also
    an overflow of huge finite values) is checked element by element. ``isfinite(x).all()``
    writes a bool copy and reads it again: 24x the time of the sum on the 2-core machine, and
    the check runs on every update four times a round (codec, Δ, mean, outer step)."""
    for tensor in tensors:
        summed = float(tensor.detach().sum()) if tensor.numel() else 0.0
        if not math.isfinite(summed) and not bool(torch.isfinite(tensor).all()):
            return False
    return True


def _finite_fp32(tensor: Tensor) -> Tensor:
    if not tensor.is_floating_point():
        raise ValueError(f"codecs take floating-point tensors (got {tensor.dtype}): pass the fp32 update")
    x = tensor.detach().to(torch.float32)
    if not all_finite([x]):
        raise ValueError(
            "the update is not finite (it holds NaN/Inf): this peer diverged; it must not be sent. "
            "Skip the round or restore the global params, and lower the inner learning rate"
        )
    return x


def _check_fits_fp16(values: Tensor, what: str) -> None:
    if values.numel() and values.abs().max().item() > FP16_MAX:
        raise ValueError(
            f"{what} exceed the float16 range (|x| > {FP16_MAX:g}) and would arrive as Inf: "
            "use bf16 (same range as fp32) or fp32 values"
        )


# --- dense casts ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class NoCodec(Codec):
    """fp32 as is: 4 B/element, exact."""

    name: ClassVar[str] = "none"

    def _encode_flat(self, x: Tensor) -> dict[str, Tensor]:
        return {"values": x.clone()}  # (n,) fp32; a copy, so an in-place reduce cannot alias it

    def round_trip(self, tensors: list[Tensor]) -> tuple[list[Tensor], int]:
        """The fp32 inputs themselves (checked finite): what the group receives, without the
        two copies of an encode and a decode (0.45x of a 10.8M-param outer step on 2 cores)."""
        values = [_finite_fp32(t) for t in tensors]
        return values, sum(HEADER_BYTES + v.numel() * v.element_size() for v in values)

    def _decode_flat(self, payload: dict[str, Tensor], numel: int) -> Tensor:
        return payload["values"].to(torch.float32, copy=True)


@dataclass(frozen=True, kw_only=True)
class Float16Codec(Codec):
    """IEEE half: 2 B/element; relative error ≤ 2⁻¹¹ (absolute ≤ 2⁻²⁵ in the subnormal range
    below 6.1e-5). Refuses magnitudes above 65504, which float16 cannot hold."""

    name: ClassVar[str] = "fp16"

    def _encode_flat(self, x: Tensor) -> dict[str, Tensor]:
        _check_fits_fp16(x, "values")
        return {"values": x.to(torch.float16)}  # (n,) fp16

    def _decode_flat(self, payload: dict[str, Tensor], numel: int) -> Tensor:
        return payload["values"].to(torch.float32)


@dataclass(frozen=True, kw_only=True)
class BFloat16Codec(Codec):
    """bfloat16: 2 B/element; relative error ≤ 2⁻⁸ (8 mantissa bits), fp32's exponent range."""

    name: ClassVar[str] = "bf16"

    def _encode_flat(self, x: Tensor) -> dict[str, Tensor]:
        values = x.to(torch.bfloat16)  # (n,) bf16
        # Its largest value (3.3895e38) is a little below fp32's: values between round to Inf.
        if values.numel() and not bool(torch.isfinite(values).all()):  # (non-finite x is refused before)
            raise ValueError(
                "values exceed the bfloat16 range (|x| > 3.3895e38) and would arrive as Inf: use fp32 values"
            )
        return {"values": values}

    def _decode_flat(self, payload: dict[str, Tensor], numel: int) -> Tensor:
        return payload["values"].to(torch.float32)


# --- blockwise absmax quantizers ------------------------------------------------------------------


def _block_scales(x: Tensor, block: int, levels: int) -> tuple[Tensor, Tensor]:
    """Split (n,) into blocks (zero-padded, padding not sent) and quantize each to
    round(x / scale) with scale = absmax_block / levels. Returns (codes (n,) int, scales (B,))."""
    n = x.numel()
    blocks = torch.nn.functional.pad(x, (0, -n % block)).view(-1, block)  # (B, block)
    scales = blocks.abs().amax(dim=1) / levels  # (B,) fp32; 0 for an all-zero block
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # no 0/0 -> NaN
    codes = torch.round(blocks / divisor[:, None]).clamp_(-levels, levels)  # (B, block)
    return codes.reshape(-1)[:n], scales


def _dequantize(codes: Tensor, scales: Tensor, block: int, numel: int) -> Tensor:
    """codes (n,) integer levels, scales (B,) -> (n,) fp32."""
    padded = torch.nn.functional.pad(codes.to(torch.float32), (0, -numel % block))
    return (padded.view(-1, block) * scales[:, None]).reshape(-1)[:numel]


def _check_block(block: int) -> None:
    if block < 1:
        raise ValueError(f"block must be >= 1 element (got {block}); 64 is the usual choice")


@dataclass(frozen=True, kw_only=True)
class Int8Codec(Codec):
    """Blockwise absmax int8: per block of ``block`` elements one fp32 scale = absmax / 127 and
    one int8 code = round(x / scale) per element. Cost: 1 B/element + 4 B/block (1.0625 B/element
    at block 64). Error per element ≤ scale / 2 = absmax_block / 254; an all-zero block decodes
    to exact zeros."""

    name: ClassVar[str] = "int8"
    block: int = 64
    """Elements per scale; smaller blocks cost more scales and track outliers better."""

    def __post_init__(self) -> None:
        _check_block(self.block)

    def _encode_flat(self, x: Tensor) -> dict[str, Tensor]:
        codes, scales = _block_scales(x, self.block, 127)
        return {"codes": codes.to(torch.int8), "scales": scales}  # (n,) int8, (⌈n/block⌉,) fp32

    def _decode_flat(self, payload: dict[str, Tensor], numel: int) -> Tensor:
        return _dequantize(payload["codes"], payload["scales"], self.block, numel)


@dataclass(frozen=True, kw_only=True)
class Int4Codec(Codec):
    """Blockwise absmax int4: signed levels -7..7 (scale = absmax / 7 per block, fp32), two codes
    per uint8 (element 2i in the low nibble, 2i+1 in the high one, stored as level + 8). Cost:
    ⌈n / 2⌉ B + 4 B/block (0.5625 B/element at block 64). Error per element ≤ scale / 2 =
    absmax_block / 14."""

    name: ClassVar[str] = "int4"
    block: int = 64
    """Elements per scale; smaller blocks cost more scales and track outliers better."""

    def __post_init__(self) -> None:
        _check_block(self.block)

    def _encode_flat(self, x: Tensor) -> dict[str, Tensor]:
        codes, scales = _block_scales(x, self.block, 7)
        nibbles = (codes + 8).to(torch.uint8)  # (n,) in 1..15
        nibbles = torch.nn.functional.pad(nibbles, (0, x.numel() % 2), value=8)  # (2m,), 8 = level 0
        packed = nibbles[0::2] | (nibbles[1::2] << 4)  # (m,) = (⌈n/2⌉,)
        return {"codes": packed, "scales": scales}

    def _decode_flat(self, payload: dict[str, Tensor], numel: int) -> Tensor:
        packed = payload["codes"]  # (⌈n/2⌉,) uint8
        nibbles = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:numel]  # (n,)
        return _dequantize(nibbles.to(torch.int16) - 8, payload["scales"], self.block, numel)


# --- sparsification -------------------------------------------------------------------------------


def _top_count(density: float, n: int) -> int:
    """k = ⌈density · n⌉, rounded first so that 0.07 · 100 gives 7, not 8."""
    return math.ceil(round(density * n, 9))


@dataclass(frozen=True, kw_only=True)
class TopKCodec(Codec):
    """Keep the k = ⌈density · n⌉ entries of largest |x|, send their indices and values; decode
    scatters them into zeros. Kept entries are exact up to ``value_dtype`` (fp16: relative
    2⁻¹¹), dropped ones decode to 0 (pair it with :class:`ErrorFeedback`).

    Whole-tensor mode (``chunk=None``): int32 indices (int64 when n ≥ 2³¹), so k · 6 B with fp16
    values. Chunk mode, as in SparseLoCo (https://arxiv.org/abs/2508.15706): the flat tensor is
    cut in chunks of ``chunk`` elements (the last one may be shorter) and each chunk keeps its own
    ⌈density · chunk_len⌉ entries, with indices local to the chunk: int16 when chunk ≤ 2¹⁵, else
    int32, so k · 4 B with fp16 values and chunks ≤ 32768. Ties are broken by ``torch.topk``,
    deterministically; indices are sent sorted.
    """

    name: ClassVar[str] = "topk"
    density: float = 0.01
    """Fraction of entries kept, in (0, 1]."""
    value_dtype: torch.dtype = torch.float16
    """Dtype of the kept values on the wire: float16 (2 B), bfloat16 (2 B) or float32 (4 B)."""
    chunk: int | None = None
    """Elements per top-k chunk (SparseLoCo uses 4096); None = one top-k over the whole tensor."""
    value_bits: int = 16
    """16: values as ``value_dtype``. 2: SparseLoCo's wire format: each kept value is one of 4
    levels (2 bits, 4 to a byte) from a per-tensor table, and with ``chunk`` <= 4096 its
    in-chunk index takes 12 bits (2 indices in 3 bytes): 1.75 B per kept value, plus 20 B of
    table per tensor. See :func:`quantize_2bit`."""

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ValueError(f"density must be in (0, 1] (got {self.density}); 0.01 keeps 1% of entries")
        if self.value_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(
                f"value_dtype must be torch.float16, torch.bfloat16 or torch.float32 (got {self.value_dtype})"
            )
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"chunk must be >= 1 element or None (got {self.chunk}); SparseLoCo uses 4096")
        if self.value_bits not in (2, 16):
            raise ValueError(f"value_bits must be 16 or 2 (got {self.value_bits}); SparseLoCo uses 2")

    def _layout(self, n: int) -> tuple[int, int, int, int, torch.dtype]:
        """(chunk length, full chunks, kept per full chunk, kept in the short tail, index dtype)."""
        if self.chunk is None:
            index_dtype = torch.int32 if n < 2**31 else torch.int64
            return max(n, 1), (1 if n else 0), _top_count(self.density, n), 0, index_dtype
        index_dtype = torch.int16 if self.chunk <= 2**15 else torch.int32
        full, tail = divmod(n, self.chunk)
        return (
            self.chunk,
            full,
            _top_count(self.density, self.chunk),
            _top_count(self.density, tail),
            index_dtype,
        )

    def _encode_flat(self, x: Tensor) -> dict[str, Tensor]:
        length, full, k, k_tail, index_dtype = self._layout(x.numel())
        indices, values = [], []
        head = x[: full * length].view(full, length)  # (C, chunk)
        local = head.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values  # (C, k)
        indices.append(local.reshape(-1))
        values.append(head.gather(1, local).reshape(-1))
        if k_tail:
            tail = x[full * length :]  # (n mod chunk,)
            local = tail.abs().topk(k_tail, sorted=False).indices.sort().values  # (k_tail,)
            indices.append(local)
            values.append(tail[local])
        kept = torch.cat(values)  # (C·k + k_tail,)
        local = torch.cat(indices)
        if self.value_bits == 2:
            codes, table = quantize_2bit(kept)
            packed = _pack_12bit(local) if self._packs_indices else local.to(index_dtype)
            return {"indices": packed, "codes": _pack_2bit(codes), "table": table}
        if self.value_dtype == torch.float16:
            _check_fits_fp16(kept, "kept values")
        return {"indices": local.to(index_dtype), "values": kept.to(self.value_dtype)}

    @property
    def _packs_indices(self) -> bool:
        return self.value_bits == 2 and self.chunk is not None and self.chunk <= 4096

    def _decode_flat(self, payload: dict[str, Tensor], numel: int) -> Tensor:
        length, full, k, k_tail, _ = self._layout(numel)
        count = full * k + k_tail
        if self.value_bits == 2:
            raw = payload["indices"]
            local = _unpack_12bit(raw, count) if self._packs_indices else raw.to(torch.int64)
            values = dequantize_2bit(_unpack_2bit(payload["codes"], count), payload["table"])
        else:
            local = payload["indices"].to(torch.int64)  # (C·k + k_tail,)
            values = payload["values"].to(torch.float32)
        offsets = torch.arange(full, device=local.device).repeat_interleave(k) * length  # (C·k,)
        offsets = torch.cat([offsets, torch.full((k_tail,), full * length, device=local.device)])
        out = torch.zeros(numel, dtype=torch.float32, device=local.device)
        out[local + offsets] = values
        return out


QUANT_LEVELS = 4
QUANT_RANGE = 6.0
"""SparseLoCo's 2-bit quantizer: 4 bins over 6 standard deviations of the kept values."""


def quantize_2bit(values: Tensor) -> tuple[Tensor, Tensor]:
    """(codes 0..3 as uint8, table) for a tensor's kept values, as SparseLoCo quantizes them:
    centre on the mean, bins of 1.5 standard deviations (6σ over 4 bins), code
    ``clamp(round(u + 2), 0, 3)``; each code decodes to the mean of the values it holds, so
    the quantizer is unbiased per bin. ``table`` is fp32 [mean, level 0, ..., level 3] (20 B).

    Exact zeros (a chunk with fewer than k nonzero entries keeps some zeros) decode to exactly 0:
    they take no part in the mean and spread, and get a code of their own whose level is minus
    the mean (``-m + m`` is 0 in floating point): a bin the nonzero values left empty, else the
    nonzero values share 3 bins (6σ over 3) and zeros take the fourth. Otherwise a kept zero
    came back as its bin's value, counted as kept by :func:`optim.contribution.keepers` and
    pushed back and forth by error feedback on a coordinate that never moved. The decoder is
    the same either way."""
    live = values != 0
    nonzero = values[live]
    shift = nonzero.mean() if nonzero.numel() else values.new_zeros(())
    centred = nonzero - shift
    codes = _bin_codes(centred, QUANT_LEVELS)
    zero_code = None
    if nonzero.numel() < values.numel():
        used = torch.zeros(QUANT_LEVELS, dtype=torch.bool)
        used[codes.long()] = True
        empty = (~used).nonzero()
        if empty.numel():
            zero_code = int(empty[0])
        else:
            codes, zero_code = _bin_codes(centred, QUANT_LEVELS - 1), QUANT_LEVELS - 1
    sums = torch.zeros(QUANT_LEVELS).index_add_(0, codes.long(), centred)
    counts = torch.zeros(QUANT_LEVELS).index_add_(0, codes.long(), torch.ones_like(centred))
    levels = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros(QUANT_LEVELS))
    out = torch.empty(values.shape, dtype=torch.uint8)
    out[live] = codes
    if zero_code is not None:
        levels[zero_code] = -shift
        out[~live] = zero_code
    return out, torch.cat([shift.reshape(1), levels]).float()


def _bin_codes(centred: Tensor, bins: int) -> Tensor:
    """Codes 0..bins-1 of centred values: ``bins`` bins over 6 standard deviations, the middle
    code (``bins // 2``) at the mean; all one code when the values do not spread."""
    std = centred.std() if centred.numel() > 1 else centred.abs().sum()
    scale = QUANT_RANGE * std / bins
    if not float(scale) > 0:  # all values equal (or one value, or none)
        return torch.full_like(centred, bins // 2, dtype=torch.uint8)
    return (centred / scale + bins // 2).round().clamp(0, bins - 1).to(torch.uint8)


def dequantize_2bit(codes: Tensor, table: Tensor) -> Tensor:
    return table[1:][codes.long()] + table[0]


def _pack_2bit(codes: Tensor) -> Tensor:
    """Four 2-bit codes to a byte, the first in the low bits."""
    padded = torch.zeros(-(-codes.numel() // 4) * 4, dtype=torch.uint8)
    padded[: codes.numel()] = codes
    quads = padded.view(-1, 4)
    return quads[:, 0] | quads[:, 1] << 2 | quads[:, 2] << 4 | quads[:, 3] << 6


def _unpack_2bit(packed: Tensor, count: int) -> Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    return ((packed.unsqueeze(1) >> shifts) & 3).reshape(-1)[:count]


def _pack_12bit(indices: Tensor) -> Tensor:
    """Two indices below 4096 in three bytes."""
    padded = torch.zeros(-(-indices.numel() // 2) * 2, dtype=torch.int32)
    padded[: indices.numel()] = indices.to(torch.int32)
    a, b = padded[0::2], padded[1::2]
    packed = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1)
    return packed.reshape(-1).to(torch.uint8)


def _unpack_12bit(packed: Tensor, count: int) -> Tensor:
    triples = packed.to(torch.int64).view(-1, 3)
    a = triples[:, 0] | (triples[:, 1] & 0xF) << 8
    b = triples[:, 1] >> 4 | triples[:, 2] << 4
    return torch.stack([a, b], dim=1).reshape(-1)[:count]


# --- registry -------------------------------------------------------------------------------------

CODECS: dict[str, type[Codec]] = {
    "none": NoCodec,
    "fp16": Float16Codec,
    "bf16": BFloat16Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
    "topk": TopKCodec,
}
"""Every codec by name."""


def make_codec(name: str, **kwargs: Any) -> Codec:
    """Build the codec called ``name`` with its keyword options (``block``, ``density``, ...)."""
    if name not in CODECS:
        raise ValueError(f"unknown codec '{name}'; choose one of: {', '.join(CODECS)}")
    cls = CODECS[name]
    options = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    unknown = sorted(set(kwargs) - options)
    if unknown:
        accepted = ", ".join(sorted(options)) or "none"
        raise ValueError(f"codec '{name}' has no option(s) {', '.join(unknown)}; it accepts: {accepted}")
    return cls(**kwargs)


# --- error feedback -------------------------------------------------------------------------------


class ErrorFeedback:
    """Per-peer memory of what the codec dropped, added back before the next encode.

    For each tensor: ``corrected = input + residual``; send ``encode(corrected)``; the group
    receives ``decoded = decode(...)``; keep ``residual = corrected − decoded``. So every call
    conserves ``input + old_residual == decoded + new_residual`` (up to fp32 rounding), and over
    any number of rounds ``Σ decoded + residual == Σ inputs``: compression delays coordinates,
    it never loses them (DeMo, https://arxiv.org/abs/2411.19870; SparseLoCo,
    https://arxiv.org/abs/2508.15706). Residuals are fp32 on the input's device.
    """

    def __init__(self, codec: Codec, *, decay: float = 1.0) -> None:
        if not 0 <= decay <= 1:
            raise ValueError(f"decay must be in [0, 1] (got {decay}); SparseLoCo uses 0.95")
        self.codec = codec
        self.decay = decay
        """The residual is multiplied by this before it is added back (SparseLoCo's β); below 1
        the conservation above holds with the decayed residual, and old coordinates fade."""
        self.residuals: list[Tensor] | None = None
        """One fp32 residual per tensor, same shapes; None before the first call / after reset."""

    @torch.no_grad()
    def compress(self, tensors: list[Tensor]) -> tuple[list[Encoded], list[Tensor]]:
        """Encode ``tensors`` with their residuals; returns (payloads to send, what the group
        will decode from them). Checks every tensor before touching any residual, so a refused
        call (non-finite update, changed model) leaves the memory as it was."""
        inputs = [_finite_fp32(t) for t in tensors]
        residuals = self.residuals
        if residuals is None:
            residuals = [torch.zeros_like(x) for x in inputs]
        self._check_shapes(inputs, residuals)
        encoded, decoded, new_residuals = [], [], []
        for x, residual in zip(inputs, residuals):
            corrected = x + self.decay * residual.to(x.device)  # any shape, fp32
            enc = self.codec.encode(corrected)
            dec = self.codec.decode(enc)
            encoded.append(enc)
            decoded.append(dec)
            new_residuals.append(corrected - dec)
        self.residuals = new_residuals
        return encoded, decoded

    def _check_shapes(self, inputs: list[Tensor], residuals: list[Tensor]) -> None:
        if len(inputs) != len(residuals):
            raise ValueError(
                f"got {len(inputs)} tensors but the error-feedback memory holds {len(residuals)}: "
                "the model changed; call reset() (or load a matching state_dict) first"
            )
        for i, (x, r) in enumerate(zip(inputs, residuals)):
            if x.shape != r.shape:
                raise ValueError(
                    f"tensor {i} has shape {tuple(x.shape)} but its residual has {tuple(r.shape)}: "
                    "the model changed; call reset() (or load a matching state_dict) first"
                )

    @torch.no_grad()
    def take_back(self, decoded: list[Tensor]) -> None:
        """What :meth:`compress` returned was never applied (the round was refused, or this peer
        was left out of it): keep it for the next round, so that ``Σ applied + residual ==
        Σ inputs`` still holds. Nothing after a :meth:`reset` (a downloaded state replaced
        what it belonged to)."""
        if self.residuals is None:
            return
        self._check_shapes(decoded, self.residuals)
        for residual, d in zip(self.residuals, decoded):
            residual.add_(d.to(residual.device, torch.float32))

    def reset(self) -> None:
        """Forget all residuals (after a state download, or when the model changes)."""
        self.residuals = None

    def state_dict(self) -> dict[str, list[Tensor]]:
        """``{"residuals": [fp32 tensor per parameter]}`` (empty list before the first call)."""
        return {"residuals": [r.detach().clone() for r in self.residuals or []]}

    def load_state_dict(self, state: dict[str, list[Tensor]]) -> None:
        """Restore residuals saved by :meth:`state_dict` (an empty list resets)."""
        residuals = [_finite_fp32(r).clone() for r in state["residuals"]]
        self.residuals = residuals or None
