// Bilinear sampling of one point and the derivatives of its weights: the only copy of this math.
// CPU loops and CUDA kernels both call it (DC_HOST_DEVICE), so the two backends cannot drift apart.
//
// The forward follows torchvision's deform_conv2d (= mmcv = ONNX DeformConv): a point (y, x) with
// y <= -1, y >= height, x <= -1 or x >= width contributes 0; otherwise each of its four integer
// neighbours that lies inside the image contributes (bilinear weight) * value, and the neighbours
// outside contribute exactly 0 (they are left out, not multiplied by 0).
//
// The interpolant has kinks at integer coordinates; there the derivatives are the one-sided ones from
// above. At y = -1 and x = -1 the two libraries differ (BorderGradient): the value there is 0, but moving the
// point inwards brings row (column) 0 in, so torchvision's derivative (one-sided from above) is not 0, while
// mmcv counts y <= -1 as outside and gives 0 for both coordinates. This matters in practice: zero offsets with
// padding 1 (a freshly initialised layer) put the border taps exactly at -1.
//
// Non-finite coordinates (offsets are predicted by a network and may be NaN or infinite):
//  - NaN (in y or x): the sample is NaN, and so are its derivatives with respect to y and x; it reads no
//    pixel, so it adds nothing to the input's gradient. The NaN propagates as through any other op.
//  - +-inf or huge finite: outside the image, so 0, with derivative 0 -- whatever the mask, since the point
//    does not depend on its coordinates at all (coordinate_grad).
// The checks below come before any float-to-integer conversion, so no such point ever yields an index.
#pragma once

#include <cmath>
#include <cstdint>

// No torch header here: the CUDA kernels include this file, and nvcc parses every header of theirs several times.
#ifdef __CUDACC__
#define DC_HOST_DEVICE __host__ __device__
#else
#define DC_HOST_DEVICE
#endif

namespace deform_conv {

// The derivative with respect to y and x of a point at exactly y = -1 or x = -1 (see above).
enum class BorderGradient : int { torchvision = 0, mmcv = 1 };

DC_HOST_DEVICE inline float floor_of(float v) { return floorf(v); }
DC_HOST_DEVICE inline double floor_of(double v) { return floor(v); }

// One sampling point's four integer neighbours, corner q = 0..3 being (y0, x0), (y0, x0 + 1), (y0 + 1, x0),
// (y0 + 1, x0 + 1). Everything a kernel needs is a function of a corner number, so loops over q = 0..3 unroll
// with constant q and the point lives in registers (the CUDA kernels: no local memory, no stack frame).
template <typename T, typename index_t>
struct BilinearPoint {
  bool nan = false;       // a coordinate is NaN (then no corner is valid)
  bool inside = false;    // -1 <= y < height and -1 <= x < width: at least one corner lies in the image
  index_t y0 = 0, x0 = 0; // the top-left neighbour
  T ly = 0, lx = 0;       // distance to it, in [0, 1)
  T hy = 0, hx = 0;       // 1 - ly, 1 - lx
  bool top = false, bottom = false, left = false, right = false;  // which rows and columns lie in the image

  DC_HOST_DEVICE bool valid(int q) const { return (q < 2 ? top : bottom) && ((q & 1) ? right : left); }
  DC_HOST_DEVICE bool on_lower_border() const {  // y == -1 or x == -1 exactly
    return (y0 == -1 && ly == T(0)) || (x0 == -1 && lx == T(0));
  }
  DC_HOST_DEVICE index_t pixel(int q, index_t width) const {  // y * width + x of corner q
    return (y0 + (q >> 1)) * width + x0 + (q & 1);
  }
  DC_HOST_DEVICE T weight(int q) const { return (q < 2 ? hy : ly) * ((q & 1) ? lx : hx); }
  DC_HOST_DEVICE T weight_dy(int q) const {  // d weight / d y
    const T w = (q & 1) ? lx : hx;
    return q < 2 ? -w : w;
  }
  DC_HOST_DEVICE T weight_dx(int q) const {  // d weight / d x
    const T w = q < 2 ? hy : ly;
    return (q & 1) ? w : -w;
  }
};

template <typename T, typename index_t>
DC_HOST_DEVICE inline BilinearPoint<T, index_t> bilinear_point(T y, T x, index_t height, index_t width) {
  BilinearPoint<T, index_t> b;
  if (y != y || x != x) {  // NaN
    b.nan = true;
    return b;
  }
  // At y == -1 (x == -1) the only in-image neighbours have weight 0: the value is 0 and the derivative the
  // one from above.
  if (!(y >= T(-1) && y < T(height) && x >= T(-1) && x < T(width))) return b;
  b.inside = true;
  const T y_floor = floor_of(y);
  const T x_floor = floor_of(x);
  b.y0 = static_cast<index_t>(y_floor);
  b.x0 = static_cast<index_t>(x_floor);
  b.ly = y - y_floor;
  b.lx = x - x_floor;
  b.hy = T(1) - b.ly;
  b.hx = T(1) - b.lx;
  b.top = b.y0 >= 0;
  b.bottom = b.y0 + 1 < height;
  b.left = b.x0 >= 0;
  b.right = b.x0 + 1 < width;
  return b;
}

// The same point as a compact list of its in-image neighbours (the CPU loops walk it). `T` is the
// accumulation type (float or double).
template <typename T>
struct BilinearSample {
  bool nan = false;       // the coordinate is NaN (then count is 0)
  bool on_lower_border = false;  // y == -1 or x == -1 exactly
  int count = 0;          // neighbours inside the image, 0..4
  int64_t pixel[4];       // y * width + x of each neighbour
  T weight[4];            // its bilinear weight
  T weight_dy[4];         // d weight / d y
  T weight_dx[4];         // d weight / d x
};

template <typename T>
DC_HOST_DEVICE inline BilinearSample<T> bilinear_sample(T y, T x, int64_t height, int64_t width) {
  const BilinearPoint<T, int64_t> b = bilinear_point(y, x, height, width);
  BilinearSample<T> s;
  s.nan = b.nan;
  s.on_lower_border = b.inside && b.on_lower_border();
  for (int q = 0; q < 4; ++q) {
    if (!b.valid(q)) continue;
    s.pixel[s.count] = b.pixel(q, width);
    s.weight[s.count] = b.weight(q);
    s.weight_dy[s.count] = b.weight_dy(q);
    s.weight_dx[s.count] = b.weight_dx(q);
    ++s.count;
  }
  return s;
}

// grid_sample's convention (align_corners=False; multi-scale deformable attention): a location u in [0, 1] spans
// `size` pixels, pixel i's centre at (i + 0.5) / size, so its pixel coordinate is u * size - 0.5 (and
// d coordinate / d u = size). Sampled with bilinear_point / bilinear_sample and BorderGradient::torchvision, this
// is grid_sample's bilinear sampling with zero padding, derivatives included: a corner outside the image adds
// nothing, and at integer coordinates the derivative is the one-sided one from above.
template <typename T>
DC_HOST_DEVICE inline T half_pixel_coordinate(T u, int64_t size) {
  return u * static_cast<T>(size) - T(0.5);
}

// Where a point's sums (its value, d value / d y, d value / d x) start before its neighbours are added: 0, or
// NaN for a NaN coordinate, so that all of them come out NaN.
template <typename T>
DC_HOST_DEVICE inline T sum_start(bool nan) {
  return nan ? T(NAN) : T(0);
}
template <typename T>
DC_HOST_DEVICE inline T sum_start(const BilinearSample<T>& s) {
  return sum_start<T>(s.nan);
}

// d loss / d y (or x) of a point with mask factor m, given the derivative of the unmasked value: m * grad,
// except for a point outside the image, whose value does not depend on its coordinates: exactly 0 even where
// m is infinite or NaN (m * 0 would be NaN).
template <typename T>
DC_HOST_DEVICE inline T coordinate_grad(bool outside, T m, T grad) {
  return outside ? T(0) : m * grad;
}
// With BorderGradient::mmcv a point at exactly y = -1 or x = -1 counts as outside too.
template <typename T>
DC_HOST_DEVICE inline T coordinate_grad(const BilinearSample<T>& s, T m, T grad, BorderGradient border) {
  return coordinate_grad((s.count == 0 && !s.nan) || (border == BorderGradient::mmcv && s.on_lower_border), m, grad);
}
template <typename T, typename index_t>
DC_HOST_DEVICE inline T coordinate_grad(const BilinearPoint<T, index_t>& b, T m, T grad, BorderGradient border) {
  return coordinate_grad((!b.inside && !b.nan) || (border == BorderGradient::mmcv && b.inside && b.on_lower_border()),
                         m, grad);
}

}  // namespace deform_conv
