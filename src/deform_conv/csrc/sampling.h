// Bilinear sampling of one point and the derivatives of its weights: the only copy of this math.
// CPU loops and CUDA kernels both call it (DC_HOST_DEVICE), so the two backends cannot drift apart.
//
// Semantics follow torchvision's deform_conv2d (= mmcv = ONNX DeformConv): a point (y, x) with
// y <= -1, y >= height, x <= -1 or x >= width contributes 0; otherwise each of its four integer
// neighbours that lies inside the image contributes (bilinear weight) * value, and the neighbours
// outside contribute exactly 0 (they are left out, not multiplied by 0).
//
// The interpolant has kinks at integer coordinates; there the derivatives are the one-sided ones from
// above, as torchvision's. That holds at y = -1 and x = -1 too: the value there is 0, but moving the point
// inwards brings row (column) 0 in, so the gradient is not 0. This matters in practice: zero offsets with
// padding 1 (a freshly initialised layer) put the border taps exactly at -1.
//
// Non-finite coordinates (offsets are predicted by a network and may be NaN or infinite):
//  - NaN (in y or x): the sample is NaN, and so are its derivatives with respect to y and x; it reads no
//    pixel, so it adds nothing to the input's gradient. The NaN propagates as through any other op.
//  - +-inf or huge finite: outside the image, so 0, with derivative 0 -- whatever the mask, since the point
//    does not depend on its coordinates at all (coordinate_grad).
// The checks below come before any float-to-integer conversion, so no such point ever yields an index.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#define DC_HOST_DEVICE C10_HOST_DEVICE

namespace deform_conv {

DC_HOST_DEVICE inline float floor_of(float v) { return floorf(v); }
DC_HOST_DEVICE inline double floor_of(double v) { return floor(v); }

// The in-image neighbours of one sampling point. `T` is the accumulation type (float or double).
template <typename T>
struct BilinearSample {
  bool nan = false;       // the coordinate is NaN (then count is 0)
  int count = 0;          // neighbours inside the image, 0..4
  int64_t pixel[4];       // y * width + x of each neighbour
  T weight[4];            // its bilinear weight
  T weight_dy[4];         // d weight / d y
  T weight_dx[4];         // d weight / d x
};

template <typename T>
DC_HOST_DEVICE inline void add_neighbour(BilinearSample<T>& s, int64_t pixel, T weight, T weight_dy,
                                         T weight_dx) {
  s.pixel[s.count] = pixel;
  s.weight[s.count] = weight;
  s.weight_dy[s.count] = weight_dy;
  s.weight_dx[s.count] = weight_dx;
  ++s.count;
}

template <typename T>
DC_HOST_DEVICE inline BilinearSample<T> bilinear_sample(T y, T x, int64_t height, int64_t width) {
  BilinearSample<T> s;
  if (y != y || x != x) {  // NaN
    s.nan = true;
    return s;
  }
  // At y == -1 (x == -1) the only in-image neighbours have weight 0: the value is 0 and the derivative the
  // one from above.
  if (!(y >= T(-1) && y < T(height) && x >= T(-1) && x < T(width))) return s;

  const T y_floor = floor_of(y);
  const T x_floor = floor_of(x);
  const int64_t y0 = static_cast<int64_t>(y_floor);
  const int64_t x0 = static_cast<int64_t>(x_floor);
  const T ly = y - y_floor, lx = x - x_floor;  // distance to the top-left neighbour, in [0, 1)
  const T hy = T(1) - ly, hx = T(1) - lx;
  const bool top = y0 >= 0, bottom = y0 + 1 < height;
  const bool left = x0 >= 0, right = x0 + 1 < width;

  if (top && left) add_neighbour(s, y0 * width + x0, hy * hx, -hx, -hy);
  if (top && right) add_neighbour(s, y0 * width + x0 + 1, hy * lx, -lx, hy);
  if (bottom && left) add_neighbour(s, (y0 + 1) * width + x0, ly * hx, hx, -ly);
  if (bottom && right) add_neighbour(s, (y0 + 1) * width + x0 + 1, ly * lx, lx, ly);
  return s;
}

// Where a point's sums (its value, d value / d y, d value / d x) start before its neighbours are added: 0, or
// NaN for a NaN coordinate, so that all of them come out NaN.
template <typename T>
DC_HOST_DEVICE inline T sum_start(const BilinearSample<T>& s) {
  return s.nan ? T(NAN) : T(0);
}

// d loss / d y (or x) of a point with mask factor m, given the derivative of the unmasked value: m * grad,
// except for a point outside the image, whose value does not depend on its coordinates: exactly 0 even where
// m is infinite or NaN (m * 0 would be NaN).
template <typename T>
DC_HOST_DEVICE inline T coordinate_grad(const BilinearSample<T>& s, T m, T grad) {
  return s.count == 0 && !s.nan ? T(0) : m * grad;
}

}  // namespace deform_conv
