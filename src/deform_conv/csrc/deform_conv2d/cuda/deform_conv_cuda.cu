// deform_conv2d's CUDA kernels behind their launchers (launchers.h): each launcher launches one kernel of
// sampling_kernels.cuh or depthwise_kernels.cuh, with the op's sizes in the kernel's index type. The host code that
// chooses and checks the launches is deform_conv_cuda.cpp; this file includes no torch header but c10's half types
// (through launch.h), so that nvcc parses little besides the kernels. The few device-specific calls go through
// execution.cuh, so the CUDA simulation runs this same source in the tests.
#include "depthwise_kernels.cuh"
#include "launchers.h"
#include "sampling_kernels.cuh"

namespace deform_conv {
namespace cuda {
namespace {

// Calls f with the columns' gradient's policy (sampling_kernels.cuh) for `source`.
template <typename scalar_t, typename index_t, typename F>
void with_grad_columns(const GradColumnsSource<scalar_t>& source, F&& f) {
  if (source.grad_columns != nullptr) {
    f(GradColumnsBuffer<scalar_t, index_t>{source.grad_columns});
  } else {
    f(DepthwiseGradColumns<scalar_t, index_t>{source.weight_tc, source.grad_rows});
  }
}

}  // namespace

template <typename scalar_t, typename index_t, int V>
void VectorLaunchers<scalar_t, index_t, V>::fill_columns(const LaunchConfig& config, const ConvParams& p, Split split,
                                                         const scalar_t* input, const scalar_t* offset,
                                                         const scalar_t* mask, int64_t first, int64_t points,
                                                         scalar_t* columns) {
  launch(fill_columns_kernel<scalar_t, index_t, V>, config, Geometry<index_t>(p), split, input, offset, mask,
         index_t(first), index_t(points), columns);
}

template <typename scalar_t, typename index_t, int V>
void VectorLaunchers<scalar_t, index_t, V>::coordinate_grads(const LaunchConfig& config, const ConvParams& p,
                                                             Split split, const scalar_t* input,
                                                             const scalar_t* offset, const scalar_t* mask,
                                                             const GradColumnsSource<scalar_t>& source, int64_t first,
                                                             int64_t points, scalar_t* grad_offset,
                                                             scalar_t* grad_mask) {
  with_grad_columns<scalar_t, index_t>(source, [&](auto grad_columns) {
    launch(coordinate_grads_kernel<scalar_t, index_t, V, decltype(grad_columns)>, config, Geometry<index_t>(p), split,
           input, offset, mask, grad_columns, index_t(first), index_t(points), grad_offset, grad_mask);
  });
}

template <typename scalar_t, typename index_t, int V>
void VectorLaunchers<scalar_t, index_t, V>::input_grad_atomic(const LaunchConfig& config, const ConvParams& p,
                                                              Split split, const scalar_t* offset,
                                                              const scalar_t* mask,
                                                              const GradColumnsSource<scalar_t>& source,
                                                              int64_t first, int64_t points, acc_t* grad_input) {
  with_grad_columns<scalar_t, index_t>(source, [&](auto grad_columns) {
    launch(input_grad_atomic_kernel<scalar_t, index_t, V, decltype(grad_columns)>, config, Geometry<index_t>(p),
           split, offset, mask, grad_columns, index_t(first), index_t(points), grad_input);
  });
}

template <typename scalar_t, typename index_t, int V>
void VectorLaunchers<scalar_t, index_t, V>::depthwise_forward(const LaunchConfig& config, const ConvParams& p,
                                                              Split split, const scalar_t* input,
                                                              const scalar_t* offset, const scalar_t* mask,
                                                              const scalar_t* weight_tc, const scalar_t* bias,
                                                              int64_t first, int64_t items, scalar_t* out_rows) {
  launch(depthwise_forward_kernel<scalar_t, index_t, V>, config, Geometry<index_t>(p), split, input, offset, mask,
         weight_tc, bias, index_t(first), index_t(items), out_rows);
}

template <typename scalar_t, typename index_t, int V>
void VectorLaunchers<scalar_t, index_t, V>::depthwise_weight_partials(
    const LaunchConfig& config, const ConvParams& p, Split split, const scalar_t* input, const scalar_t* offset,
    const scalar_t* mask, const scalar_t* grad_rows, int64_t first, int64_t rows, int64_t rows_per_block,
    int64_t items, acc_t* partials) {
  launch(depthwise_weight_partials_kernel<scalar_t, index_t, V>, config, Geometry<index_t>(p), split, input, offset,
         mask, grad_rows, index_t(first), index_t(rows), index_t(rows_per_block), index_t(items), partials);
}

template <typename scalar_t, typename index_t>
void GatherLaunchers<scalar_t, index_t>::entry_keys(const LaunchConfig& config, const ConvParams& p,
                                                    const scalar_t* offset, const scalar_t* mask, int64_t first,
                                                    int64_t points, int64_t keys, int64_t* entry_keys) {
  launch(entry_keys_kernel<scalar_t, index_t>, config, Geometry<index_t>(p), offset, mask, index_t(first),
         index_t(points), index_t(keys), entry_keys);
}

template <typename scalar_t, typename index_t>
void GatherLaunchers<scalar_t, index_t>::input_grad_gather(const LaunchConfig& config, const ConvParams& p,
                                                           Split split, const scalar_t* offset, const scalar_t* mask,
                                                           const GradColumnsSource<scalar_t>& source,
                                                           const int64_t* sorted_entries, const int64_t* key_starts,
                                                           int64_t first, int64_t keys, acc_t* grad_input) {
  with_grad_columns<scalar_t, index_t>(source, [&](auto grad_columns) {
    launch(input_grad_gather_kernel<scalar_t, index_t, decltype(grad_columns)>, config, Geometry<index_t>(p), split,
           offset, mask, grad_columns, sorted_entries, key_starts, index_t(first), index_t(keys), grad_input);
  });
}

// Every launcher the host code can call: each dtype and index type, each vector width.
#define DC_INSTANTIATE_LAUNCHERS(scalar_t, index_t)                           \
  template struct VectorLaunchers<scalar_t, index_t, 1>;                      \
  template struct VectorLaunchers<scalar_t, index_t, kWideVector<scalar_t>>;  \
  template struct GatherLaunchers<scalar_t, index_t>;
DC_FOR_EACH_LAUNCH_TYPE(DC_INSTANTIATE_LAUNCHERS)
#undef DC_INSTANTIATE_LAUNCHERS

}  // namespace cuda
}  // namespace deform_conv
