// Every schema of the library (schemas.h). Backends register implementations with
// TORCH_LIBRARY_IMPL(deform_conv, <DispatchKey>, m); autograd and fake kernels live in Python (_ops.py).
#include <torch/library.h>

#include "deform_conv2d/cpu/brgemm.h"
#include "deform_conv2d/cpu/half_gemm.h"
#include "deform_conv2d/cpu/scratch.h"
#include "schemas.h"

TORCH_LIBRARY(deform_conv, m) {
  m.def(deform_conv::kDeformConv2dSchema);
  m.def(deform_conv::kDeformConv2dBackwardSchema);
  m.def(deform_conv::kMsDeformAttnSchema);
  m.def(deform_conv::kMsDeformAttnBackwardSchema);
  // Bytes of scratch memory the CPU kernels keep between calls, over all threads (cpu/scratch.h).
  m.def("kept_scratch_bytes() -> int", &deform_conv::cpu::kept_scratch_bytes);
  // Whether float32 layers run their GEMMs on ATen's batch-reduce GEMM here, now (cpu/brgemm.h).
  m.def("brgemm_available() -> bool", &deform_conv::cpu::batch_reduce_gemm_works);
  // Which path a bfloat16 or float16 layer's forward takes here, now, in words (cpu/half_gemm.h).
  m.def("cpu_half_path(ScalarType dtype) -> str", &deform_conv::cpu::cpu_half_path);
}
