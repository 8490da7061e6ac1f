// The family's CUDA kernels behind their launchers (launchers.h): each launcher launches one kernel of
// sampled_sum_kernels.cuh, with the sizes in the kernel's index type. The host code that chooses and checks the
// launches is sampled_sum_cuda.cpp; this file includes no torch header but c10's half types (through launch.h), so
// that nvcc parses little besides the kernels. The few device-specific calls go through execution.cuh, so the CUDA
// simulation runs this same source in the tests.
#include "launchers.h"
#include "sampled_sum_kernels.cuh"

namespace deform_conv {
namespace cuda {
namespace {

template <typename index_t>
SampledSum<index_t> sampled_sum_view(const SampledSumSizes& s, const SampledSumLevels& levels) {
  return SampledSum<index_t>(s, levels.point_levels, levels.spatial_shapes, levels.level_start_index);
}

}  // namespace

template <typename scalar_t, typename index_t>
void SampledSumLaunchers<scalar_t, index_t>::forward(const LaunchConfig& config, const SampledSumSizes& s,
                                                     const SampledSumLevels& levels, Split split,
                                                     const scalar_t* value, const acc_t* points, scalar_t* output) {
  launch(sampled_sum_forward_kernel<scalar_t, index_t>, config, sampled_sum_view<index_t>(s, levels), split, value,
         points, output);
}

template <typename scalar_t, typename index_t>
void SampledSumLaunchers<scalar_t, index_t>::backward(const LaunchConfig& config, const SampledSumSizes& s,
                                                      const SampledSumLevels& levels, Split split,
                                                      BorderGradient border, const scalar_t* value,
                                                      const acc_t* points, const scalar_t* grad_output,
                                                      acc_t* grad_value, acc_t* grad_points) {
  launch(sampled_sum_backward_kernel<scalar_t, index_t>, config, sampled_sum_view<index_t>(s, levels), split, border,
         value, points, grad_output, grad_value, grad_points);
}

template <typename scalar_t, typename index_t>
void SampledSumLaunchers<scalar_t, index_t>::entry_keys(const LaunchConfig& config, const SampledSumSizes& s,
                                                        const SampledSumLevels& levels, const acc_t* points,
                                                        int64_t first, int64_t count, int64_t keys,
                                                        int64_t* entry_keys) {
  launch(sampled_sum_entry_keys_kernel<scalar_t, index_t>, config, sampled_sum_view<index_t>(s, levels), points,
         index_t(first), index_t(count), index_t(keys), entry_keys);
}

template <typename scalar_t, typename index_t>
void SampledSumLaunchers<scalar_t, index_t>::value_grad_gather(const LaunchConfig& config, const SampledSumSizes& s,
                                                               const SampledSumLevels& levels, Split split,
                                                               const acc_t* points, const scalar_t* grad_output,
                                                               const int64_t* sorted_entries,
                                                               const int64_t* key_starts, int64_t first, int64_t keys,
                                                               acc_t* grad_value) {
  launch(sampled_sum_value_grad_gather_kernel<scalar_t, index_t>, config, sampled_sum_view<index_t>(s, levels), split,
         points, grad_output, sorted_entries, key_starts, index_t(first), index_t(keys), grad_value);
}

// Every launcher the host code can call: each dtype and index type.
#define DC_INSTANTIATE_SAMPLED_SUM_LAUNCHERS(scalar_t, index_t) template struct SampledSumLaunchers<scalar_t, index_t>;
DC_FOR_EACH_LAUNCH_TYPE(DC_INSTANTIATE_SAMPLED_SUM_LAUNCHERS)
#undef DC_INSTANTIATE_SAMPLED_SUM_LAUNCHERS

}  // namespace cuda
}  // namespace deform_conv
