// Multi-scale deformable attention's CUDA kernels behind their launchers (launchers.h): each launcher launches one
// kernel of attention_kernels.cuh, with the sizes in the kernel's index type. The host code that chooses and checks
// the launches is ms_deform_attn_cuda.cpp; this file includes no torch header but c10's half types (through
// launch.h), so that nvcc parses little besides the kernels. The few device-specific calls go through
// execution.cuh, so the CUDA simulation runs this same source in the tests.
#include "attention_kernels.cuh"
#include "launchers.h"

namespace deform_conv {
namespace cuda {
namespace {

template <typename index_t>
Attention<index_t> view(const AttentionParams& p, const AttentionLevels& levels) {
  return Attention<index_t>(p, levels.spatial_shapes, levels.level_start_index);
}

}  // namespace

template <typename scalar_t, typename index_t>
void AttentionLaunchers<scalar_t, index_t>::forward(const LaunchConfig& config, const AttentionParams& p,
                                                    const AttentionLevels& levels, Split split, const scalar_t* value,
                                                    const scalar_t* locations, const scalar_t* weights,
                                                    scalar_t* output) {
  launch(attention_forward_kernel<scalar_t, index_t>, config, view<index_t>(p, levels), split, value, locations,
         weights, output);
}

template <typename scalar_t, typename index_t>
void AttentionLaunchers<scalar_t, index_t>::backward(const LaunchConfig& config, const AttentionParams& p,
                                                     const AttentionLevels& levels, Split split,
                                                     const scalar_t* value, const scalar_t* locations,
                                                     const scalar_t* weights, const scalar_t* grad_output,
                                                     acc_t* grad_value, scalar_t* grad_locations,
                                                     scalar_t* grad_weights) {
  launch(attention_backward_kernel<scalar_t, index_t>, config, view<index_t>(p, levels), split, value, locations,
         weights, grad_output, grad_value, grad_locations, grad_weights);
}

template <typename scalar_t, typename index_t>
void AttentionLaunchers<scalar_t, index_t>::entry_keys(const LaunchConfig& config, const AttentionParams& p,
                                                       const AttentionLevels& levels, const scalar_t* locations,
                                                       const scalar_t* weights, int64_t first, int64_t points,
                                                       int64_t keys, int64_t* entry_keys) {
  launch(attention_entry_keys_kernel<scalar_t, index_t>, config, view<index_t>(p, levels), locations, weights,
         index_t(first), index_t(points), index_t(keys), entry_keys);
}

template <typename scalar_t, typename index_t>
void AttentionLaunchers<scalar_t, index_t>::value_grad_gather(const LaunchConfig& config, const AttentionParams& p,
                                                              const AttentionLevels& levels, Split split,
                                                              const scalar_t* locations, const scalar_t* weights,
                                                              const scalar_t* grad_output,
                                                              const int64_t* sorted_entries,
                                                              const int64_t* key_starts, int64_t first, int64_t keys,
                                                              acc_t* grad_value) {
  launch(attention_value_grad_gather_kernel<scalar_t, index_t>, config, view<index_t>(p, levels), split, locations,
         weights, grad_output, sorted_entries, key_starts, index_t(first), index_t(keys), grad_value);
}

// Every launcher the host code can call: each dtype and index type.
#define DC_INSTANTIATE_LAUNCHERS(scalar_t, index_t) template struct AttentionLaunchers<scalar_t, index_t>;
DC_FOR_EACH_LAUNCH_TYPE(DC_INSTANTIATE_LAUNCHERS)
#undef DC_INSTANTIATE_LAUNCHERS

}  // namespace cuda
}  // namespace deform_conv
