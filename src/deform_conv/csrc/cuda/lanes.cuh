// What the CUDA kernels of every op share beyond execution.cuh: vector loads and stores, and how a launch splits
// its work into lane groups. Device code only.
#pragma once

#include <algorithm>
#include <cstdint>

#include "execution.cuh"

namespace deform_conv {
namespace cuda {

constexpr int kWarp = 32;

// V consecutive elements, loaded and stored as one access of V * sizeof(T) bytes.
template <typename T, int V>
struct alignas(sizeof(T) * V) Vector {
  T v[V];
};

template <int V, typename T>
DC_DEVICE Vector<T, V> load_vector(const T* address) {
  return *reinterpret_cast<const Vector<T, V>*>(address);
}

template <int V, typename T>
DC_DEVICE void store_vector(T* address, const Vector<T, V>& value) {
  *reinterpret_cast<Vector<T, V>*>(address) = value;
}


// How the threads of a launch share the work: a group of 2^lanes_log2 adjacent threads (at most a warp) takes one
// item (a sampling point, a pixel, a row block) and strides over its channels.
struct Split {
  int lanes_log2;
};

// Lane group, lane within it, and the grid-stride step in items, of the calling thread.
template <typename index_t>
struct LaneGroup {
  index_t item, lane, lanes, step;

  DC_DEVICE explicit LaneGroup(Split split) {
    const index_t thread = blockIdx.x * index_t(blockDim.x) + threadIdx.x;
    lanes = index_t(1) << split.lanes_log2;
    lane = thread & (lanes - 1);
    item = thread >> split.lanes_log2;
    step = (index_t(blockDim.x) * gridDim.x) >> split.lanes_log2;
  }
};

// ------------------------------------------------------------------------------------------- host side

constexpr int kThreads = 256;  // a multiple of the warp: kernels that shuffle need whole warps

inline int64_t blocks_for(int64_t threads) {
  // Grid-stride loops cover the rest; 2^20 blocks keep every SM busy on any GPU. (The simulation may cap the grid
  // lower, so that the tests run the loops' later iterations too.)
  return grid_blocks(std::max<int64_t>(1, std::min<int64_t>((threads + kThreads - 1) / kThreads, int64_t(1) << 20)));
}

// The smallest power of two of lanes that covers `vectors` channel vectors, at most a warp.
inline Split split_for(int64_t vectors) {
  int log2 = 0;
  while (log2 < 5 && (int64_t(1) << log2) < vectors) ++log2;
  return Split{log2};
}

// Calls f(int32_t(0)) when every index of a launch fits in 32 bits (`fits_int32`, decided by the op), else
// f(int64_t(0)); the simulation counts which.
template <typename F>
void with_index_width(bool fits_int32, F&& f) {
  if (fits_int32) {
    note_index_bits(32);
    f(int32_t(0));
  } else {
    note_index_bits(64);
    f(int64_t(0));
  }
}

}  // namespace cuda
}  // namespace deform_conv
