"""What the benchmark runs: the cases (S1-S5, the extra, small, scaling and smoke shapes), their inputs, the
implementations compared on them (ours, torchvision's deform_conv2d, conv2d of the same shape) and the dtypes."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    in_channels: int
    out_channels: int
    size: int
    groups: int = 1
    offset_groups: int = 1
    mask: bool = True
    kernel: int = 3
    stride: int = 1
    padding: int = 1
    width: Optional[int] = None  # None: a square image, `size` by `size`; otherwise `size` is the height

    def image_size(self) -> Tuple[int, int]:
        """(height, width) of the input image."""
        return self.size, self.size if self.width is None else self.width

    def output_size(self) -> Tuple[int, int]:
        """(height, width) of the output, as conv2d computes it (dilation 1)."""
        height, width = self.image_size()
        return self._output_extent(height), self._output_extent(width)

    def _output_extent(self, extent: int) -> int:
        return (extent + 2 * self.padding - self.kernel) // self.stride + 1

    def describe(self) -> str:
        extra = []
        if self.groups > 1:
            extra.append("depthwise" if self.groups == self.in_channels else f"groups {self.groups}")
        if self.offset_groups > 1:
            extra.append(f"offset_groups {self.offset_groups}")
        extra.append("DCNv2" if self.mask else "DCNv1")
        if (self.kernel, self.stride, self.padding) != (3, 1, 1):
            extra.append(f"k{self.kernel} s{self.stride} p{self.padding}")
        height, width = self.image_size()
        return (f"batch {self.batch}, {self.in_channels}->{self.out_channels}, {height}x{width}, "
                + ", ".join(extra))


CASES = [
    Case("S1", 8, 64, 64, 56),
    Case("S2", 4, 256, 256, 28),
    Case("S3", 2, 512, 512, 14),
    Case("S4", 8, 128, 128, 28, groups=128),
    Case("S5", 4, 128, 128, 32, offset_groups=4, mask=False),
]

# Shapes beyond the five: other kernel sizes, strides and group counts, so the speed is not tuned to a list.
EXTRA_CASES = [
    Case("X1", 4, 96, 192, 40, kernel=5, stride=2, padding=2),
    Case("X2", 4, 128, 128, 28, groups=4, offset_groups=2),
    Case("X3", 2, 48, 96, 64, kernel=1, padding=0, offset_groups=3, mask=False),
]

# Small images and few channels, with weight and offset groups and a non-square image: here the per-call and
# per-group overheads weigh as much as the arithmetic, which the S and X shapes hide.
SMALL_CASES = [
    Case("G1", 16, 32, 48, 80, offset_groups=2, stride=2),
    Case("G2", 3, 60, 60, 33, groups=3, offset_groups=5, width=31),
    Case("G3", 4, 96, 96, 40, kernel=5, padding=2),
    # Beyond G1-G3: a strided layer with few channels and many images; weight groups and offset groups that do not
    # divide each other (4 groups of 24 channels, 3 offset groups of 32), odd sides; a stem-like stride-2 layer
    # of 16 channels on a large odd image.
    Case("G4", 32, 16, 32, 64, stride=2),
    Case("G5", 8, 96, 96, 29, groups=4, offset_groups=3, width=27),
    Case("G6", 4, 16, 32, 113, offset_groups=2, stride=2, width=97),
]

# Thread scaling runs on these: the shapes of S1-S3 differ in how much work each thread gets.
SCALING_CASES = CASES[:3]

# A few milliseconds each: what CI runs so the suite cannot rot.
SMOKE_CASES = [Case("T1", 2, 8, 8, 10), Case("T2", 2, 8, 8, 10, groups=8, mask=False)]


def make_inputs(case: Case, seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32
                ) -> Dict[str, torch.Tensor]:
    tensors = _make_inputs(case, seed)
    return {k: (v.to(device=device, dtype=dtype) if v is not None else None) for k, v in tensors.items()}


def _make_inputs(case: Case, seed: int) -> Dict[str, Optional[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    height, width = case.image_size()
    out_h, out_w = case.output_size()
    taps = case.kernel * case.kernel
    return {
        "x": torch.randn(case.batch, case.in_channels, height, width, generator=g),
        "weight": torch.randn(case.out_channels, case.in_channels // case.groups, case.kernel, case.kernel, generator=g)
        / math.sqrt(case.in_channels // case.groups * taps),
        "offset": torch.randn(case.batch, 2 * case.offset_groups * taps, out_h, out_w, generator=g),
        "mask": torch.rand(case.batch, case.offset_groups * taps, out_h, out_w, generator=g) if case.mask else None,
    }


def to_channels_last(tensors: Dict[str, Optional[torch.Tensor]]) -> Dict[str, Optional[torch.Tensor]]:
    """The input and the weight in channels_last, as a model moved with `.to(memory_format=torch.channels_last)`
    would hold them (conv2d picks its layout from both); offset and mask as they are."""
    return {k: (v.contiguous(memory_format=torch.channels_last) if k in ("x", "weight") else v)
            for k, v in tensors.items()}


def _ours(case: Case, t: Dict[str, torch.Tensor]) -> torch.Tensor:
    import deform_conv

    return deform_conv.deform_conv2d(t["x"], t["offset"], t["weight"], None, case.stride, case.padding, 1, t["mask"])


def _torchvision(case: Case, t: Dict[str, torch.Tensor]) -> torch.Tensor:
    import torchvision

    return torchvision.ops.deform_conv2d(t["x"], t["offset"], t["weight"], None, case.stride, case.padding, 1,
                                         t["mask"])


def _conv2d(case: Case, t: Dict[str, torch.Tensor]) -> torch.Tensor:
    return F.conv2d(t["x"], t["weight"], None, case.stride, case.padding, 1, case.groups)


IMPLEMENTATIONS: Dict[str, Callable[[Case, Dict[str, torch.Tensor]], torch.Tensor]] = {
    "ours": _ours,
    "torchvision": _torchvision,
    "conv2d": _conv2d,
}

# (name, backward) of the two measurements per implementation.
PHASES = (("fwd", False), ("fwdbwd", True))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """`bfloat16` for torch.bfloat16, and so on."""
    return str(dtype).replace("torch.", "")
