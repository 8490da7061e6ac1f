"""DCNv4's module: the DCNv4 repository's ``DCNv4.modules.DCNv4`` on :func:`deform_conv.dcnv4`."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .._ops.dcnv4 import dcnv4
from .dcnv3 import CenterFeatureScaleModule


class DCNv4(nn.Module):
    """The DCNv4 repository's DCNv4 module (DCNv4_op/DCNv4/modules/dcnv4.py): its arguments, submodules,
    state_dict keys (``offset_mask``, ``offset_mask_dw`` with ``dw_kernel_size``, ``value_proj`` and
    ``output_proj`` unless ``without_pointwise``, the centre feature scale's), initialisation
    (``_reset_parameters``) and forward ``(input [N, L, C], shape=None) -> [N, L, C]`` (``shape`` (H, W); by
    default a square, as upstream), with none of its restrictions (upstream asserts channels a group a multiple
    of 16 and its kernel takes only 3x3). ``offset_mask`` has ``ceil(group * K * 3 / 8) * 8`` outputs, as
    upstream; the op ignores the padding ones. Unknown keyword arguments are accepted and ignored, as upstream."""

    def __init__(self, channels: int = 64, kernel_size: int = 3, stride: int = 1, pad: int = 1, dilation: int = 1,
                 group: int = 4, offset_scale: float = 1.0, dw_kernel_size: Optional[int] = None,
                 center_feature_scale: bool = False, remove_center: bool = False, output_bias: bool = True,
                 without_pointwise: bool = False, **kwargs) -> None:
        super().__init__()
        if channels % group != 0:
            raise ValueError(f"channels must be divisible by group, but got {channels} and {group}")
        self.offset_scale = offset_scale
        self.channels = channels
        self.kernel_size = kernel_size
        self.stride = stride
        self.dilation = dilation
        self.pad = pad
        self.group = group
        self.group_channels = channels // group
        self.dw_kernel_size = dw_kernel_size
        self.center_feature_scale = center_feature_scale
        self.remove_center = int(remove_center)
        self.without_pointwise = without_pointwise
        self.K = group * (kernel_size * kernel_size - self.remove_center)
        if dw_kernel_size is not None:
            self.offset_mask_dw = nn.Conv2d(channels, channels, dw_kernel_size, stride=1,
                                            padding=(dw_kernel_size - 1) // 2, groups=channels)
        self.offset_mask = nn.Linear(channels, int(math.ceil((self.K * 3) / 8) * 8))
        if not without_pointwise:
            self.value_proj = nn.Linear(channels, channels)
            self.output_proj = nn.Linear(channels, channels, bias=output_bias)
        self._reset_parameters()
        if center_feature_scale:
            self.center_feature_scale_proj_weight = nn.Parameter(torch.zeros(group, channels))
            self.center_feature_scale_proj_bias = nn.Parameter(torch.zeros(group))
            self.center_feature_scale_module = CenterFeatureScaleModule()

    def _reset_parameters(self) -> None:
        """Upstream's: zero offsets and mask values, Xavier-uniform projections with zero bias."""
        nn.init.zeros_(self.offset_mask.weight)
        nn.init.zeros_(self.offset_mask.bias)
        if not self.without_pointwise:
            nn.init.xavier_uniform_(self.value_proj.weight)
            nn.init.zeros_(self.value_proj.bias)
            nn.init.xavier_uniform_(self.output_proj.weight)
            if self.output_proj.bias is not None:
                nn.init.zeros_(self.output_proj.bias)

    def forward(self, input: Tensor, shape: Optional[Tuple[int, int]] = None) -> Tensor:
        batch, length, channels = input.shape
        if shape is not None:
            height, width = shape
        else:
            height = width = int(length**0.5)
        x = input
        if not self.without_pointwise:
            x = self.value_proj(x)
        x = x.reshape(batch, height, width, -1)
        if self.dw_kernel_size is not None:
            offset_mask_input = self.offset_mask_dw(input.view(batch, height, width, channels).permute(0, 3, 1, 2))
            offset_mask_input = offset_mask_input.permute(0, 2, 3, 1).reshape(batch, length, channels)
        else:
            offset_mask_input = input
        offset_mask = self.offset_mask(offset_mask_input).reshape(batch, height, width, -1)
        x_proj = x
        x = dcnv4(x, offset_mask, self.kernel_size, self.stride, self.pad, self.dilation, self.group,
                  self.offset_scale, bool(self.remove_center))
        if self.center_feature_scale:
            # Upstream computes the scale from the op's output (not from its input as DCNv3 does): kept as it is.
            scale = self.center_feature_scale_module(x, self.center_feature_scale_proj_weight,
                                                     self.center_feature_scale_proj_bias)
            scale = scale[..., None].repeat(1, 1, 1, 1, self.channels // self.group).flatten(-2)
            x = x * (1 - scale) + x_proj * scale
        x = x.reshape(batch, length, -1)
        if not self.without_pointwise:
            x = self.output_proj(x)
        return x

    def extra_repr(self) -> str:
        return (f"channels={self.channels}, kernel_size={self.kernel_size}, stride={self.stride}, pad={self.pad}, "
                f"dilation={self.dilation}, group={self.group}, offset_scale={self.offset_scale}, "
                f"remove_center={bool(self.remove_center)}")
