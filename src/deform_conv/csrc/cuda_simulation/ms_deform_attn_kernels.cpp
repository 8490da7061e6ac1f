// Multi-scale deformable attention's CUDA kernels and their launchers (the .cu), compiled by the host compiler
// against the simulation (simt.h). Its host code, ms_deform_attn_cuda.cpp, needs no wrapper: the simulation
// compiles it as it is.
#define DEFORM_CONV_CUDA_SIMULATION 1
#include "../ms_deform_attn/cuda/ms_deform_attn_cuda.cu"
