// The CUDA library's registration: every op's CUDA backend (cuda/impl_ops.h) for the schemas the CPU library
// defines (ops.cpp), which is loaded first. The one unit of the CUDA library that sees torch/library.h.
#include <torch/library.h>

#include "cuda/impl_ops.h"

TORCH_LIBRARY_IMPL(deform_conv, CUDA, m) { deform_conv::cuda::impl_ops(m); }
