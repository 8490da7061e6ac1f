// deform_conv2d's CUDA backend source, compiled by the host compiler against the simulation (simt.h).
#define DEFORM_CONV_CUDA_SIMULATION 1
#include "../deform_conv2d/cuda/deform_conv_cuda.cu"
