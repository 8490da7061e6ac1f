// Multi-scale deformable attention's CUDA backend source, compiled by the host compiler against the simulation
// (simt.h).
#define DEFORM_CONV_CUDA_SIMULATION 1
#include "../ms_deform_attn/cuda/ms_deform_attn_cuda.cu"
