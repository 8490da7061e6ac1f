// The CUDA backend's own source, compiled by the host compiler against the simulation (simt.h).
#define DEFORM_CONV_CUDA_SIMULATION 1
#include "../cuda/deform_conv_cuda.cu"
