// Every op's CUDA backend, listed once for the two units that register it: ops_cuda.cpp for CUDA tensors
// (namespace deform_conv) and the simulation's cuda_simulation/ops_sim.cpp for CPU tensors (deform_conv_sim).
// Host code; `Library` is torch::Library (torch/library.h stays in the registration units).
#pragma once

#include "../dcnv3/entry_points.h"
#include "../dcnv4/entry_points.h"
#include "../deform_conv2d/entry_points.h"
#include "../flash_deform_attn/entry_points.h"
#include "../ms_deform_attn/entry_points.h"

namespace deform_conv {
namespace cuda {

template <typename Library>
void impl_ops(Library& m) {
  m.impl("deform_conv2d", &deform_conv2d_forward);
  m.impl("deform_conv2d_backward", &deform_conv2d_backward);
  m.impl("ms_deform_attn", &ms_deform_attn_forward);
  m.impl("ms_deform_attn_backward", &ms_deform_attn_backward);
  m.impl("dcnv3", &dcnv3_forward);
  m.impl("dcnv3_backward", &dcnv3_backward);
  m.impl("dcnv4", &dcnv4_forward);
  m.impl("dcnv4_backward", &dcnv4_backward);
  m.impl("flash_deform_attn", &flash_deform_attn_forward);
  m.impl("flash_deform_attn_backward", &flash_deform_attn_backward);
}

}  // namespace cuda
}  // namespace deform_conv
