// The CPU library's registrations: every schema (schemas.h) and every op's CPU kernels. The one translation unit
// of the library that sees torch/library.h (its headers cost seconds per unit), compiled with every op's host
// code (_jit/sources.py); the kernels' units see ATen/core/Tensor.h and the few ATen functions they call.
// Autograd and fake kernels live in Python (_ops/).
#include <torch/library.h>

#include "dcnv3/entry_points.h"
#include "dcnv4/entry_points.h"
#include "deform_conv2d/cpu/brgemm.h"
#include "deform_conv2d/entry_points.h"
#include "deform_conv2d/cpu/half_gemm.h"
#include "deform_conv2d/cpu/scratch.h"
#include "flash_deform_attn/entry_points.h"
#include "ms_deform_attn/entry_points.h"
#include "schemas.h"

TORCH_LIBRARY(deform_conv, m) {
  for (const char* schema : deform_conv::kSchemas) m.def(schema);
  // Bytes of scratch memory the CPU kernels keep between calls, over all threads (cpu/scratch.h).
  m.def("kept_scratch_bytes() -> int", &deform_conv::cpu::kept_scratch_bytes);
  // Whether float32 layers run their GEMMs on ATen's batch-reduce GEMM here, now (cpu/brgemm.h).
  m.def("brgemm_available() -> bool", &deform_conv::cpu::batch_reduce_gemm_works);
  // Which path a bfloat16 or float16 layer's forward takes here, now, in words (cpu/half_gemm.h).
  m.def("cpu_half_path(ScalarType dtype) -> str", &deform_conv::cpu::cpu_half_path);
}

TORCH_LIBRARY_IMPL(deform_conv, CPU, m) {
  m.impl("deform_conv2d", &deform_conv::cpu::deform_conv2d_forward);
  m.impl("deform_conv2d_backward", &deform_conv::cpu::deform_conv2d_backward);
  m.impl("ms_deform_attn", &deform_conv::cpu::ms_deform_attn_forward);
  m.impl("ms_deform_attn_backward", &deform_conv::cpu::ms_deform_attn_backward);
  m.impl("dcnv3", &deform_conv::cpu::dcnv3_forward);
  m.impl("dcnv3_backward", &deform_conv::cpu::dcnv3_backward);
  m.impl("dcnv4", &deform_conv::cpu::dcnv4_forward);
  m.impl("dcnv4_backward", &deform_conv::cpu::dcnv4_backward);
  m.impl("flash_deform_attn", &deform_conv::cpu::flash_deform_attn_forward);
  m.impl("flash_deform_attn_backward", &deform_conv::cpu::flash_deform_attn_backward);
}
