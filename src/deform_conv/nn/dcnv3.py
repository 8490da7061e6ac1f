"""DCNv3's module: InternImage's ``ops_dcnv3.modules.DCNv3`` (version 1.1) on :func:`deform_conv.dcnv3`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._ops.dcnv3 import dcnv3


class _ChannelsFirst(nn.Module):
    """[N, H, W, C] -> [N, C, H, W] (a view)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.permute(0, 3, 1, 2)


class _ChannelsLast(nn.Module):
    """[N, C, H, W] -> [N, H, W, C] (a view)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.permute(0, 2, 3, 1)


def norm_layer_from_channels_first(channels: int, norm_layer: str) -> nn.Sequential:
    """InternImage's build_norm_layer(channels, norm_layer, 'channels_first', 'channels_last'): the same layers at
    the same indices, so the state_dict keys match ("BN": BatchNorm2d then to channels last; "LN": to channels
    last then LayerNorm with eps 1e-6)."""
    if norm_layer == "BN":
        return nn.Sequential(nn.BatchNorm2d(channels), _ChannelsLast())
    if norm_layer == "LN":
        return nn.Sequential(_ChannelsLast(), nn.LayerNorm(channels, eps=1e-6))
    raise ValueError(f"norm_layer must be 'BN' or 'LN', got {norm_layer!r}")


def activation(act_layer: str) -> nn.Module:
    """InternImage's build_act_layer."""
    layers = {"ReLU": lambda: nn.ReLU(inplace=True), "SiLU": lambda: nn.SiLU(inplace=True), "GELU": nn.GELU}
    if act_layer not in layers:
        raise ValueError(f"act_layer must be one of {sorted(layers)}, got {act_layer!r}")
    return layers[act_layer]()


class CenterFeatureScaleModule(nn.Module):
    """sigmoid(query @ weight.T + bias): how much of the projected input a group's output keeps (InternImage's)."""

    def forward(self, query: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return nn.functional.linear(query, weight=weight, bias=bias).sigmoid()


class DCNv3(nn.Module):
    """InternImage's DCNv3 module (classification/ops_dcnv3/modules/dcnv3.py, version 1.1): its arguments,
    submodules, state_dict keys (``dw_conv``, ``offset``, ``mask``, ``input_proj``, ``output_proj``, and with
    ``center_feature_scale`` ``center_feature_scale_proj_weight`` and ``_bias``), initialisation
    (``_reset_parameters``) and channels-last forward ``[N, H, W, C] -> [N, H, W, C]``, with the mask's softmax
    over each group's points taken before the op, as upstream. Any channels a group (upstream warns unless a power
    of 2). The mask keeps the dtype its softmax gives it (upstream casts it to the input's); under autocast the
    offsets and mask are the Linear layers' bfloat16, which the op accepts, computing the points in float32."""

    def __init__(self, channels: int = 64, kernel_size: int = 3, dw_kernel_size=None, stride: int = 1, pad: int = 1,
                 dilation: int = 1, group: int = 4, offset_scale: float = 1.0, act_layer: str = "GELU",
                 norm_layer: str = "LN", center_feature_scale: bool = False, remove_center: bool = False) -> None:
        super().__init__()
        if channels % group != 0:
            raise ValueError(f"channels must be divisible by group, but got {channels} and {group}")
        dw_kernel_size = dw_kernel_size if dw_kernel_size is not None else kernel_size
        self.offset_scale = offset_scale
        self.channels = channels
        self.kernel_size = kernel_size
        self.dw_kernel_size = dw_kernel_size
        self.stride = stride
        self.dilation = dilation
        self.pad = pad
        self.group = group
        self.group_channels = channels // group
        self.center_feature_scale = center_feature_scale
        self.remove_center = int(remove_center)
        if self.remove_center and kernel_size % 2 == 0:
            raise ValueError("remove_center is only compatible with odd kernel size.")
        points = kernel_size * kernel_size - self.remove_center
        self.dw_conv = nn.Sequential(
            nn.Conv2d(channels, channels, kernel_size=dw_kernel_size, stride=1, padding=(dw_kernel_size - 1) // 2,
                      groups=channels),
            norm_layer_from_channels_first(channels, norm_layer),
            activation(act_layer),
        )
        self.offset = nn.Linear(channels, group * points * 2)
        self.mask = nn.Linear(channels, group * points)
        self.input_proj = nn.Linear(channels, channels)
        self.output_proj = nn.Linear(channels, channels)
        self._reset_parameters()
        if center_feature_scale:
            self.center_feature_scale_proj_weight = nn.Parameter(torch.zeros(group, channels))
            self.center_feature_scale_proj_bias = nn.Parameter(torch.zeros(group))
            self.center_feature_scale_module = CenterFeatureScaleModule()

    def _reset_parameters(self) -> None:
        """InternImage's: zero offsets and mask logits (every point at its grid place, equal weights), Xavier-uniform
        projections with zero bias. InternImage's model code calls it again after its own weight init."""
        for layer in (self.offset, self.mask):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        for layer in (self.input_proj, self.output_proj):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, input: Tensor) -> Tensor:
        batch, height, width, _ = input.shape
        x = self.input_proj(input)
        x_proj = x
        x1 = self.dw_conv(input.permute(0, 3, 1, 2))
        offset = self.offset(x1)
        mask = self.mask(x1).reshape(batch, height, width, self.group, -1).softmax(-1).reshape(batch, height, width, -1)
        x = dcnv3(x, offset, mask, self.kernel_size, self.stride, self.pad, self.dilation, self.group,
                  self.offset_scale, bool(self.remove_center))
        if self.center_feature_scale:
            scale = self.center_feature_scale_module(x1, self.center_feature_scale_proj_weight,
                                                     self.center_feature_scale_proj_bias)
            # [N, H, W, group] -> [N, H, W, channels]: each group's scale for its channels.
            scale = scale[..., None].repeat(1, 1, 1, 1, self.channels // self.group).flatten(-2)
            x = x * (1 - scale) + x_proj * scale
        return self.output_proj(x)

    def extra_repr(self) -> str:
        return (f"channels={self.channels}, kernel_size={self.kernel_size}, stride={self.stride}, pad={self.pad}, "
                f"dilation={self.dilation}, group={self.group}, offset_scale={self.offset_scale}, "
                f"remove_center={bool(self.remove_center)}")
