// What the CUDA kernels of every op share beyond execution.cuh: vector loads and stores, and the lane group of a
// thread (launch.h's Split). Device code only.
#pragma once

#include <cstdint>

#include "execution.cuh"

namespace deform_conv {
namespace cuda {

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

}  // namespace cuda
}  // namespace deform_conv
