// Calls deform_conv::deform_conv2d and deform_conv::dcnv3 from C++ with no Python: load the library that
// `import deform_conv` built, find each op through torch's dispatcher, run it once on fixed inputs and write its
// output to a file.
//
//   deform_conv_example <library.so> <deform_conv2d output.bin> <dcnv3 output.bin>
//
// Each output file is the result ([B, C_out, H_out, W_out]; [N, H_out, W_out, C]) as raw little-endian float64,
// row-major, so a test can compare it with the Python op on the same inputs (tests/integration/test_cpp_example.py).
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>

// Only the headers used: with torch/torch.h (autograd, nn, optim, ...) this file takes 3.5 times as long to
// compile (21 s instead of 6 s on one core).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/arange.h>

namespace {

// shift + scale * sin(freq * k + phase) for k = 0, 1, ... in row-major order. Deterministic on every machine,
// unlike a random generator; tests/integration/test_cpp_example.py rebuilds the same tensors with the same formula.
at::Tensor wave(at::IntArrayRef shape, double freq, double phase, double scale, double shift = 0.0) {
  int64_t numel = 1;
  for (int64_t size : shape) numel *= size;
  at::Tensor k = at::arange(numel, at::TensorOptions().dtype(at::kDouble));
  return k.mul(freq).add(phase).sin().mul(scale).add(shift).reshape(shape);
}

// Byte by byte rather than fwrite of the buffer, so the file is little-endian whatever the host is.
bool write_le_float64(const at::Tensor& t, const char* path) {
  at::Tensor c = t.contiguous();
  const double* data = c.data_ptr<double>();
  std::ofstream out(path, std::ios::binary);
  for (int64_t i = 0; i < c.numel(); ++i) {
    uint64_t bits;
    std::memcpy(&bits, &data[i], sizeof bits);
    char bytes[8];
    for (int b = 0; b < 8; ++b) bytes[b] = static_cast<char>((bits >> (8 * b)) & 0xff);
    out.write(bytes, 8);
  }
  return static_cast<bool>(out);
}

// Looks the op up, runs it on the fixed inputs and writes the output; c10::Error (no such op, a schema that
// does not match Signature, a failed check in the kernel) propagates to main.
int run_deform_conv2d(const char* output_path) {
  // The signature the dispatcher maps the schema to: Tensor? -> optional<Tensor>, int[2] -> IntArrayRef,
  // str -> string_view (C++ callers pass every argument, defaults included). typed<> checks it against the
  // registered schema and throws on a mismatch.
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                               at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, c10::string_view);
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("deform_conv::deform_conv2d", "").typed<Signature>();

  // The awkward geometry of the tests: kernel 3x2, stride (2, 1), padding (1, 0), dilation (2, 1),
  // 2 weight groups, 3 offset groups (which do not nest in the weight groups), with mask and bias.
  const int64_t batch = 2, in_channels = 6, out_channels = 4, height = 9, width = 7;
  const int64_t kh = 3, kw = 2, groups = 2, offset_groups = 3;
  const int64_t stride[2] = {2, 1}, padding[2] = {1, 0}, dilation[2] = {2, 1};
  const int64_t out_h = (height + 2 * padding[0] - dilation[0] * (kh - 1) - 1) / stride[0] + 1;  // 4
  const int64_t out_w = (width + 2 * padding[1] - dilation[1] * (kw - 1) - 1) / stride[1] + 1;   // 6
  const int64_t taps = kh * kw;

  at::Tensor input = wave({batch, in_channels, height, width}, 0.37, 0.0, 1.0);
  // Scale 2.5: many sampling points land across the border or outside the image.
  at::Tensor offset = wave({batch, 2 * offset_groups * taps, out_h, out_w}, 0.53, 0.3, 2.5);
  at::Tensor weight = wave({out_channels, in_channels / groups, kh, kw}, 0.71, 1.1, 0.5);
  at::Tensor mask = wave({batch, offset_groups * taps, out_h, out_w}, 0.29, 0.7, 0.5, 0.5);  // in [0, 1]
  at::Tensor bias = wave({out_channels}, 1.3, 0.2, 1.0);

  // border_gradient: "torchvision" (or "mmcv"); it changes only the backward's derivative at y or x = -1.
  at::Tensor out = op.call(input, offset, weight, mask, bias, stride, padding, dilation, "torchvision");  // [2, 4, 4, 6]

  if (!write_le_float64(out, output_path)) {
    std::cerr << "error: cannot write the output to '" << output_path << "'\n";
    return 1;
  }
  std::cout << "output shape " << out.sizes() << " written to " << output_path << "\n";
  return 0;
}

// DCNv3 (InternImage's), channels last, on the same kind of awkward geometry.
int run_dcnv3(const char* output_path) {
  // dcnv3(Tensor input, Tensor offset, Tensor mask, int[2] kernel_size, int[2] stride, int[2] padding,
  //       int[2] dilation, int group, float offset_scale, bool remove_center) -> Tensor
  using Signature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                               at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t, double, bool);
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("deform_conv::dcnv3", "").typed<Signature>();

  // kernel 3x2, stride (2, 1), padding (1, 0), dilation (2, 1), 3 groups of 5 channels.
  const int64_t batch = 2, height = 7, width = 6, group = 3, group_channels = 5;
  const int64_t kernel[2] = {3, 2}, stride[2] = {2, 1}, padding[2] = {1, 0}, dilation[2] = {2, 1};
  const int64_t out_h = (height + 2 * padding[0] - dilation[0] * (kernel[0] - 1) - 1) / stride[0] + 1;  // 3
  const int64_t out_w = (width + 2 * padding[1] - dilation[1] * (kernel[1] - 1) - 1) / stride[1] + 1;   // 5
  const int64_t points = group * kernel[0] * kernel[1];

  at::Tensor input = wave({batch, height, width, group * group_channels}, 0.41, 0.2, 1.0);
  at::Tensor offset = wave({batch, out_h, out_w, points * 2}, 0.57, 0.1, 2.5);  // (x, y) of each point, in pixels
  at::Tensor mask = wave({batch, out_h, out_w, points}, 0.31, 0.9, 0.5, 0.5);
  at::Tensor out = op.call(input, offset, mask, kernel, stride, padding, dilation, group, 1.5, false);  // [2, 3, 5, 15]

  if (!write_le_float64(out, output_path)) {
    std::cerr << "error: cannot write the output to '" << output_path << "'\n";
    return 1;
  }
  std::cout << "dcnv3 output shape " << out.sizes() << " written to " << output_path << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: " << argv[0] << " <deform_conv library .so> <deform_conv2d output file> <dcnv3 output file>\n";
    return 2;
  }
  const char* library = argv[1];

  // RTLD_NOW: an unresolved symbol (a library built for another torch) fails here, not mid-run.
  // RTLD_LOCAL: what torch.ops.load_library (ctypes.CDLL) does, and what the package relies on: the CPU and
  // CUDA libraries both contain the device-independent code, and must not resolve to each other's copy.
  // Registration needs no exported symbol: the library's static initializers register the op when it loads.
  // Its dependencies (libtorch_cpu, libc10, libgomp) are already loaded, since this program links them.
  if (dlopen(library, RTLD_NOW | RTLD_LOCAL) == nullptr) {
    std::cerr << "error: cannot load the deform_conv library '" << library << "': " << dlerror() << "\n";
    return 1;
  }
  try {
    const int status = run_deform_conv2d(argv[2]);
    return status != 0 ? status : run_dcnv3(argv[3]);
  } catch (const c10::Error& e) {
    std::cerr << "error: deform_conv's ops from '" << library << "': " << e.what_without_backtrace() << "\n";
    return 1;
  }
}
