// deform_conv2d's CUDA kernels and their launchers (the .cu), compiled by the host compiler against the simulation
// (simt.h). Its host code, deform_conv_cuda.cpp, needs no wrapper: the simulation compiles it as it is.
#define DEFORM_CONV_CUDA_SIMULATION 1
#include "../deform_conv2d/cuda/deform_conv_cuda.cu"
