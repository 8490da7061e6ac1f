// Every schema of the library, written once. Backends register implementations with
// TORCH_LIBRARY_IMPL(deform_conv, <DispatchKey>, m); autograd and fake kernels live in Python (_ops.py).
#include <torch/library.h>

#include "cpu/scratch.h"

TORCH_LIBRARY(deform_conv, m) {
  // input [B, C_in, H, W], offset [B, 2*offset_groups*kh*kw, H_out, W_out], weight [C_out, C_in/groups, kh, kw],
  // mask [B, offset_groups*kh*kw, H_out, W_out], bias [C_out] -> output [B, C_out, H_out, W_out].
  // groups and offset_groups are inferred from the weight's and the offset's shapes, as in torchvision.
  m.def(
      "deform_conv2d(Tensor input, Tensor offset, Tensor weight, Tensor? mask, Tensor? bias, "
      "int[2] stride, int[2] padding, int[2] dilation) -> Tensor");
  // The gradients of deform_conv2d with respect to input, offset, weight, mask (None without a mask)
  // and bias (None unless bias_defined). An op of its own so that compile/export can trace the backward.
  m.def(
      "deform_conv2d_backward(Tensor grad_output, Tensor input, Tensor offset, Tensor weight, Tensor? mask, "
      "int[2] stride, int[2] padding, int[2] dilation, bool bias_defined) "
      "-> (Tensor grad_input, Tensor grad_offset, Tensor grad_weight, Tensor? grad_mask, Tensor? grad_bias)");
  // Bytes of scratch memory the CPU kernels keep between calls, over all threads (cpu/scratch.h).
  m.def("kept_scratch_bytes() -> int", &deform_conv::cpu::kept_scratch_bytes);
}
