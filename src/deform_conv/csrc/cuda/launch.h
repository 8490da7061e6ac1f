// What a kernel launch is, as both sides of every op's CUDA backend see it: the host code (.cpp, compiled by the
// host compiler against ATen) and the kernels (.cu, compiled by nvcc against no more of torch than c10's two half
// types, whose headers nvcc parses in seconds where ATen's take half a minute). Plain types only.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

// cudaStream_t is `CUstream_st*`: declared here, host code names a stream without cuda_runtime.h (the simulation is
// built where there is no CUDA toolkit at all).
struct CUstream_st;

namespace deform_conv {
namespace cuda {

using Stream = CUstream_st*;

constexpr int kWarp = 32;
constexpr int kThreads = 256;  // a multiple of the warp: kernels that shuffle need whole warps

struct LaunchConfig {
  int64_t blocks;
  int threads;
  Stream stream;
};

// How the threads of a launch share the work: a group of 2^lanes_log2 adjacent threads (at most a warp) takes one
// item (a sampling point, a pixel, a row block) and strides over its channels.
struct Split {
  int lanes_log2;
};

// The type the kernels compute and accumulate in, as at::opmath_type (which nvcc would parse ATen for): float for
// the half types, else the type itself.
template <typename T>
struct OpMath {
  using type = T;
};
template <>
struct OpMath<c10::Half> {
  using type = float;
};
template <>
struct OpMath<c10::BFloat16> {
  using type = float;
};
template <typename T>
using opmath_type = typename OpMath<T>::type;

}  // namespace cuda
}  // namespace deform_conv

// MACRO(scalar_t, index_t) for every dtype the ops take (cuda/host.h's DC_DISPATCH) and both index widths
// (with_index_width): each .cu instantiates its launchers for exactly these, all its host code can ask for.
#define DC_FOR_EACH_LAUNCH_TYPE(MACRO)                                                              \
  MACRO(double, int32_t) MACRO(double, int64_t) MACRO(float, int32_t) MACRO(float, int64_t)         \
  MACRO(c10::Half, int32_t) MACRO(c10::Half, int64_t) MACRO(c10::BFloat16, int32_t)                 \
  MACRO(c10::BFloat16, int64_t)
