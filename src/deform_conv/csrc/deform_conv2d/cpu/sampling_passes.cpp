#include "sampling_passes.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "sampling_point.h"

#if DC_CPU_VECTOR_BITS == 512 && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace deform_conv {
namespace cpu {
namespace {

// A run of one offset group's channels that lies in one weight group (offset groups and weight groups need not
// nest): channels [channel, channel + length) of the input, written at `column` + tap * C_in/G of a row's columns.
struct ChannelPiece {
  int64_t channel, length, column;
};

// For each offset group, its pieces: pieces[starts[group]] up to pieces[starts[group + 1]].
struct OffsetGroupPieces {
  std::vector<ChannelPiece> pieces;
  std::vector<int64_t> starts;

  explicit OffsetGroupPieces(const ConvParams& p) {
    const int64_t per_group = p.in_channels_per_group(), per_offset_group = p.channels_per_offset_group();
    for (int64_t group = 0; group < p.offset_groups; ++group) {
      starts.push_back(static_cast<int64_t>(pieces.size()));
      for_each_weight_group_piece(p, group * per_offset_group, (group + 1) * per_offset_group,
                                  [&](int64_t g, int64_t c0, int64_t c1) {
        pieces.push_back({c0, c1 - c0, g * p.taps() * per_group + c0 - g * per_group});
      });
    }
    starts.push_back(static_cast<int64_t>(pieces.size()));
  }
};

// Calls f(length_of), length_of(piece) a piece's length: where the offset group's pieces all have one length, a
// constant of with_common_width (cpu_lanes.h) if it is 8, 12, 16, 32 or 64 channels, up to max_width (0: none). (A
// stride-2 layer of 16 channels in two offset groups filled its columns 1.45x faster so; a layer of 96 channels in 4
// weight and 6 offset groups, whose offset groups are whole 16 or two pieces of 8, ran its forward 8-11% faster with
// the pieces' width fixed too.)
template <int64_t max_width, typename F>
inline void with_piece_length(const ChannelPiece* begin, const ChannelPiece* end, const F& f) {
  if constexpr (max_width > 0) {
    const auto as_first = [begin](const ChannelPiece& piece) { return piece.length == begin->length; };
    if (std::all_of(begin, end, as_first)) {
      with_common_width<max_width>(begin->length, [&](const auto width) {
        f([width](const ChannelPiece&) { return static_cast<int64_t>(width); });
      });
      return;
    }
  }
  f([](const ChannelPiece& piece) { return piece.length; });
}

// The widths the passes fix (with_piece_length) where they compute in scalar_t on an image of image_t and write
// column_t: every width in float32; in float64 (exact checks) none, as each width is another copy of the pass to
// compile; where the fill reads or writes a half type (its corners widened, its columns rounded in registers), up
// to 16 channels: fixed at 64 the half types' fill ran 15% slower (S1 bfloat16's forward), fixed at 8 and 16 faster
// (bfloat16 forwards of G6 1.5x, of G4 1.2x).
template <typename scalar_t, typename image_t = scalar_t, typename column_t = scalar_t>
constexpr int64_t kFixedWidthsUpTo =
    !std::is_same_v<scalar_t, float> ? 0
    : std::is_same_v<image_t, float> && std::is_same_v<column_t, float> ? 64
                                                                         : 16;

#if DC_CPU_VECTOR_BITS == 512 && defined(__GNUC__)
#define DC_GROUP_VECTORS 1
// An offset group of at most 16 channels, which the weight groups may cut into pieces (8 + 2, 6 + 4, ...), as one
// AVX-512 vector of floats in each of the three passes: masked loads of its four corners, and a masked store (or
// load) for each piece at its column, where each piece took loops of its own around its few vectors (a layer of 40
// channels in 5 weight and 4 offset groups, H8, on the Xeon, 2 threads: forward 26% faster, forward+backward 30%).
// The same operations on each value, and the same lanes for the sums: the same bits. float32 images and columns;
// bfloat16 ones too in the libraries for AVX512-BF16, whose CPUs all have AVX512BW's masked 16-bit loads and
// stores (the corners widened, the columns rounded in registers as the piece loops do: cpu_lanes.h).
struct GroupVector {
  int64_t first_channel = 0;
  int pieces = 0;  // 0: the group takes the piece loops
  uint16_t lanes;                   // the group's channels
  uint16_t piece_lanes[kSumLanes];  // piece i's
  int64_t store_shift[kSumLanes];   // its column less its first lane: where lane 0 would be stored

  GroupVector() = default;
  GroupVector(const ChannelPiece* begin, const ChannelPiece* end) : first_channel(begin->channel) {
    pieces = static_cast<int>(end - begin);
    int64_t length = 0;
    for (int i = 0; i < pieces; ++i) {
      const int64_t lane = begin[i].channel - first_channel;
      piece_lanes[i] = static_cast<uint16_t>(((1u << begin[i].length) - 1) << lane);
      store_shift[i] = begin[i].column - lane;
      length += begin[i].length;
    }
    lanes = static_cast<uint16_t>((1u << length) - 1);
  }

  // Where piece i's lane 0 would lie in a row starting at `row` (which may be before the row: only the piece's
  // lanes are read or written there).
  template <typename T>
  T* piece_base(T* row, int i) const {
    return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(row) + store_shift[i] * static_cast<int64_t>(sizeof(T)));
  }

  // The group's channels of a corner's pixel, widened to float, +0 in the other lanes.
  DC_AVX512_ASM void load_corner(const float* pixel, FloatLanes& v) const {
    const __m512 loaded = _mm512_maskz_loadu_ps(lanes, pixel + first_channel);
    std::memcpy(&v, &loaded, sizeof(loaded));
  }
#if defined(DC_CPU_AVX512_BF16)
  DC_AVX512_ASM void load_corner(const c10::BFloat16* pixel, FloatLanes& v) const {
    HalfBitLanes half;
    asm("kmovw %1, %%k1\n\tvmovdqu16 %2, %0%{%%k1%}%{z%}"
        : "=v"(half)
        : "r"(uint32_t(lanes)), "m"(*reinterpret_cast<const uint16_t(*)[kSumLanes]>(pixel + first_channel))
        : "k1");
    widen_bfloat16_bits(half, v);
  }
#endif

  // Each piece's lanes of `value` at its column of the row `dst`: float, or rounded to bfloat16 (store_lanes).
  DC_AVX512_ASM void store_pieces(const FloatLanes& value, float* dst) const {
    __m512 out;
    std::memcpy(&out, &value, sizeof(out));
    for (int i = 0; i < pieces; ++i) _mm512_mask_storeu_ps(piece_base(dst, i), piece_lanes[i], out);
  }
#if defined(DC_CPU_AVX512_BF16)
  DC_AVX512_ASM void store_pieces(const FloatLanes& value, c10::BFloat16* dst) const {
    HalfBitLanes rounded;
    store_lanes(value, reinterpret_cast<c10::BFloat16*>(&rounded));
    for (int i = 0; i < pieces; ++i) {
      asm("kmovw %1, %%k1\n\tvmovdqu16 %2, %0%{%%k1%}"
          : "+m"(*reinterpret_cast<uint16_t(*)[kSumLanes]>(piece_base(dst, i)))
          : "r"(uint32_t(piece_lanes[i])), "v"(rounded)
          : "k1");
    }
  }
#endif

  // dst[column of channel c] = corner_value of c, for the group's channels c.
  template <typename image_t, typename column_t>
  DC_AVX512_ASM void interpolate(const Corners<float, image_t>& k, bool masked, float m, column_t* dst) const {
    FloatLanes v[4];
    for (int q = 0; q < 4; ++q) load_corner(k.pixel[q], v[q]);
    // corner_value's sum, in its order (written out: Clang does not pass a 512-bit vector across instruction sets).
    FloatLanes value = k.weight[0] * v[0] + k.weight[1] * v[1] + k.weight[2] * v[2] + k.weight[3] * v[3];
    if (masked) value = value * m;
    store_pieces(value, dst);
  }

  // The group's values of a row of columns (or their gradient) whose pieces start at `row`, in lanes 0 to the
  // group's length, +0 in the others.
  DC_AVX512_ASM __m512 gather(const float* row) const {
    __m512 values = _mm512_setzero_ps();
    for (int i = 0; i < pieces; ++i) values = _mm512_mask_loadu_ps(values, piece_lanes[i], piece_base(row, i));
    return values;
  }

  // corner_dots' sums of the group's channels of the column gradient row `grad` with the four corners, in its lanes
  // and order (lane_dots: +0 plus each product, lanes past the group +0 * +0; total_four).
  template <typename image_t>
  DC_AVX512_ASM void dots(const Corners<float, image_t>& k, const float* grad, float dot[4]) const {
    const __m512 g = gather(grad);
    FloatLanes grads, part[4];
    std::memcpy(&grads, &g, sizeof(g));
    for (int q = 0; q < 4; ++q) {
      FloatLanes v;
      load_corner(k.pixel[q], v);
      part[q] = FloatLanes{};
      part[q] += grads * v;
    }
    total_four(part[0], part[1], part[2], part[3], dot);
  }

  // For each corner of point b in the image (points.valid), the group's channels of its pixel (points.address: an
  // input gradient's) += m * its weight * the column gradient row `grad`'s (add_to_four_corners' and add_scaled's
  // sum).
  DC_AVX512_ASM void add_to_corners(const PointBlock<float>& points, int64_t b, float m, const float* grad) const {
    const __m512 g = gather(grad);
    FloatLanes grads;
    std::memcpy(&grads, &g, sizeof(g));
    for (int q = 0; q < 4; ++q) {
      if (!points.valid[q][b]) continue;
      float* to = reinterpret_cast<float*>(points.address[q][b]);
      FloatLanes v;
      load_corner(to, v);
      v = v + (m * points.weight[q][b]) * grads;
      __m512 sum;
      std::memcpy(&sum, &v, sizeof(v));
      _mm512_mask_storeu_ps(to + first_channel, lanes, sum);
    }
  }
};

// Whether the passes take the group's channels as one vector (GroupVector): at most 16 of them, unless its pieces all
// have one length that with_piece_length fixes at compile time (is_common_width: as fast with two pieces of 8,
// faster with one). Groups of 5, 6 and 10 channels in one piece, on the Xeon, 2 threads: forward 13-19% faster so,
// forward+backward 3-21%.
inline bool takes_group_vectors(const ChannelPiece* begin, const ChannelPiece* end, int64_t per_offset_group) {
  const auto as_first = [begin](const ChannelPiece& piece) { return piece.length == begin->length; };
  return per_offset_group <= kSumLanes && !(is_common_width(begin->length) && std::all_of(begin, end, as_first));
}

// Whether GroupVector loads and stores T: float, and bfloat16 in the libraries for AVX512-BF16.
template <typename T>
constexpr bool kGroupVectorType = std::is_same_v<T, float>
#if defined(DC_CPU_AVX512_BF16)
                                  || std::is_same_v<T, c10::BFloat16>
#endif
    ;
#endif

// What each pass needs to walk its sampling points block by block: TapPoints and the offset groups' channel pieces.
template <typename scalar_t>
struct BlockWalk : TapPoints<scalar_t> {
  const OffsetGroupPieces groups;
#if defined(DC_GROUP_VECTORS)
  std::vector<GroupVector> vectors;  // each offset group's (no pieces where it takes the piece loops)
#endif

  BlockWalk(const ConvParams& p_, const SamplingInputs<scalar_t>& in_) : TapPoints<scalar_t>(p_, in_), groups(p_) {
#if defined(DC_GROUP_VECTORS)
    for (int64_t group = 0; group < p_.offset_groups; ++group) {
      const bool takes = takes_group_vectors(pieces_begin(group), pieces_end(group), p_.channels_per_offset_group());
      vectors.push_back(takes ? GroupVector(pieces_begin(group), pieces_end(group)) : GroupVector());
    }
#endif
  }

  const ChannelPiece* pieces_begin(int64_t group) const { return groups.pieces.data() + groups.starts[group]; }
  const ChannelPiece* pieces_end(int64_t group) const { return groups.pieces.data() + groups.starts[group + 1]; }
#if defined(DC_GROUP_VECTORS)
  // The group's vector where it takes one (takes_group_vectors), else nullptr.
  const GroupVector* group_vector(int64_t group) const {
    return vectors[group].pieces > 0 ? &vectors[group] : nullptr;
  }
#endif
};

// The fill of rows [row_begin, row_end). `in_pairs`: bfloat16 corners and columns, 32 channels at a time
// (interpolate_corners), for layers whose every piece has at least kPairsFromChannels; a copy of its own, so that
// the other layers' loops are compiled as without it (with it in their function, layers of 16 and 32 channels a
// point ran 6-8% slower).
template <typename scalar_t, typename image_t, typename column_t, bool in_pairs>
void fill_rows_body(const ConvParams& p, const SamplingInputs<scalar_t, image_t>& in,
                    int64_t first_image, int64_t row_begin, int64_t row_end,
                    column_t* columns, std::bool_constant<in_pairs>) {
  const int64_t channels = p.in_channels, pixels = p.out_pixels(), per_group = p.in_channels_per_group();
  const int64_t row_size = p.taps() * channels;
  const bool masked = in.mask != nullptr;
  const image_t* zeros = zero_row<image_t>(channels);
  BlockWalk<scalar_t> walk(p, SamplingInputs<scalar_t>{nullptr, in.offset, in.mask});
  for (int64_t row = row_begin; row < row_end;) {
    const int64_t n_local = row / pixels, first = row % pixels, n = first_image + n_local;
    const int64_t len = std::min({kPointBlock, row_end - row, pixels - first});
    const image_t* image = in.input + n * p.height * p.width * channels;
    walk.start_block(first, len);
    column_t* block_columns = columns + (row - row_begin) * row_size;
    for (int64_t group = 0; group < p.offset_groups; ++group) {
      walk.compute_group(n, group, first, len, corner_source(image, channels, zeros));
      const ChannelPiece *pieces_begin = walk.pieces_begin(group), *pieces_end = walk.pieces_end(group);
#if defined(DC_GROUP_VECTORS)
      if constexpr (std::is_same_v<scalar_t, float> && kGroupVectorType<image_t> && kGroupVectorType<column_t>) {
        if (const GroupVector* vector = walk.group_vector(group)) {
          for (int64_t b = 0; b < len; ++b) {
            for (int64_t tap = 0; tap < p.taps(); ++tap) {
              const scalar_t m = masked ? in.mask[p.mask_index(n, group, tap, first + b)] : scalar_t(1);
              vector->interpolate(walk.taps[tap].template corners<image_t>(b), masked, m,
                                 block_columns + b * row_size + tap * per_group);
            }
          }
          continue;
        }
      }
#endif
      constexpr int64_t fixed_up_to = in_pairs ? 0 : kFixedWidthsUpTo<scalar_t, image_t, column_t>;
      with_piece_length<fixed_up_to>(pieces_begin, pieces_end, [&](const auto length_of) {
        for (int64_t b = 0; b < len; ++b) {
          for (int64_t tap = 0; tap < p.taps(); ++tap) {
            const Corners<scalar_t, image_t> corners = walk.taps[tap].template corners<image_t>(b);
            const scalar_t m = masked ? in.mask[p.mask_index(n, group, tap, first + b)] : scalar_t(1);
            column_t* dst = block_columns + b * row_size + tap * per_group;
            for (const ChannelPiece* piece = pieces_begin; piece != pieces_end; ++piece) {
              interpolate_corners<in_pairs>(corners, piece->channel, length_of(*piece), masked, m,
                                            dst + piece->column);
            }
          }
        }
      });
    }
    row += len;
  }
}
DC_CPU_KERNEL(fill_rows)

// Pieces of at least this many channels take the bfloat16 fill in pairs: S1's 64 (5% faster forward on the
// Xeon), not S5's 32 (8% slower).
constexpr int64_t kPairsFromChannels = 64;

// Whether the fill of image_t into column_t takes pairs of 32 channels: bfloat16 in both, in a library with
// AVX512-BF16, every piece of the layer kPairsFromChannels or more.
template <typename image_t, typename column_t>
bool fills_in_pairs(const ConvParams& p) {
#if defined(DC_CPU_AVX512_BF16)
  if constexpr (std::is_same_v<image_t, c10::BFloat16> && std::is_same_v<column_t, c10::BFloat16>) {
    const std::vector<ChannelPiece>& pieces = OffsetGroupPieces(p).pieces;
    return std::all_of(pieces.begin(), pieces.end(),
                       [](const ChannelPiece& piece) { return piece.length >= kPairsFromChannels; });
  }
#endif
  (void)p;
  return false;
}

// fill_rows, in pairs where fills_in_pairs said so (`in_pairs`).
template <typename scalar_t, typename image_t, typename column_t>
void fill_rows_of(const ConvParams& p, const SamplingInputs<scalar_t, image_t>& in, int64_t first_image,
                  int64_t row_begin, int64_t row_end, column_t* columns, bool in_pairs) {
#if defined(DC_CPU_AVX512_BF16)
  if constexpr (std::is_same_v<image_t, c10::BFloat16> && std::is_same_v<column_t, c10::BFloat16>) {
    if (in_pairs) {
      fill_rows<scalar_t>(p, in, first_image, row_begin, row_end, columns, std::true_type{});
      return;
    }
  }
#endif
  (void)in_pairs;
  fill_rows<scalar_t>(p, in, first_image, row_begin, row_end, columns, std::false_type{});
}

template <typename scalar_t, typename image_t>
void coordinate_rows_body(const ConvParams& p, const SamplingInputs<scalar_t, image_t>& in,
                          int64_t first_image, int64_t row_begin, int64_t row_end,
                          const scalar_t* grad_columns, scalar_t* grad_offset,
                          scalar_t* grad_mask) {
  const int64_t channels = p.in_channels, pixels = p.out_pixels(), per_group = p.in_channels_per_group();
  const int64_t row_size = p.taps() * channels, per_offset_group = p.channels_per_offset_group();
  const image_t* zeros = zero_row<image_t>(channels);
  std::vector<scalar_t> gathered(per_offset_group);
  BlockDots<scalar_t> dots(p.taps());
  BlockWalk<scalar_t> walk(p, SamplingInputs<scalar_t>{nullptr, in.offset, in.mask});
  for (int64_t row = row_begin; row < row_end;) {
    const int64_t n_local = row / pixels, first = row % pixels, n = first_image + n_local;
    const int64_t len = std::min({kPointBlock, row_end - row, pixels - first});
    const image_t* image = in.input + n * p.height * p.width * channels;
    walk.start_block(first, len);
    const scalar_t* block_grad = grad_columns + (row - row_begin) * row_size;
    for (int64_t group = 0; group < p.offset_groups; ++group) {
      walk.compute_group(n, group, first, len, corner_source(image, channels, zeros));
      const ChannelPiece *pieces_begin = walk.pieces_begin(group), *pieces_end = walk.pieces_end(group);
#if defined(DC_GROUP_VECTORS)
      if constexpr (std::is_same_v<scalar_t, float> && kGroupVectorType<image_t>) {
        if (const GroupVector* vector = walk.group_vector(group)) {
          for (int64_t b = 0; b < len; ++b) {
            for (int64_t tap = 0; tap < p.taps(); ++tap) {
              const PointBlock<scalar_t>& points = walk.taps[tap];
              scalar_t dot[4] = {};
              if (points.inside[b]) {
                vector->dots(points.template corners<image_t>(b), block_grad + b * row_size + tap * per_group, dot);
              }
              dots.set(tap, b, dot);
            }
          }
          walk.write_coordinate_grads(n, group, first, len, dots, grad_offset, grad_mask);
          continue;
        }
      }
#endif
      // On a half-type image, one loop: fixed widths made its backward no faster measurably (G4, G6).
      constexpr int64_t fixed_up_to = std::is_same_v<image_t, scalar_t> ? kFixedWidthsUpTo<scalar_t> : 0;
      with_piece_length<fixed_up_to>(pieces_begin, pieces_end, [&](const auto length_of) {
        for (int64_t b = 0; b < len; ++b) {
          for (int64_t tap = 0; tap < p.taps(); ++tap) {
            const PointBlock<scalar_t>& points = walk.taps[tap];
            scalar_t dot[4] = {};
            if (points.inside[b]) {
              const Corners<scalar_t, image_t> corners = points.template corners<image_t>(b);
              const scalar_t* grad = block_grad + b * row_size + tap * per_group;
              // The offset group's columns' gradient, in the order of its channels: gathered where the weight groups
              // cut it into pieces, so that one dot product a corner sums the whole group, with one total, where a
              // piece each took a total each (a layer of 40 channels in 5 weight groups and 4 offset groups, pieces
              // of 2 to 8 channels: forward+backward about 5% faster so on the 2-core EPYC).
              const scalar_t* group_grad = grad + pieces_begin->column;
              int64_t group_length = length_of(*pieces_begin);
              if (pieces_end - pieces_begin > 1) {
                for (const ChannelPiece* piece = pieces_begin; piece != pieces_end; ++piece) {
                  scalar_t* to = gathered.data() + (piece->channel - pieces_begin->channel);
                  for (int64_t c = 0; c < piece->length; ++c) to[c] = grad[piece->column + c];
                }
                group_grad = gathered.data();
                group_length = per_offset_group;
              }
              corner_dots(corners, pieces_begin->channel, group_length, group_grad, dot);
            }
            dots.set(tap, b, dot);
          }
        }
      });
      walk.write_coordinate_grads(n, group, first, len, dots, grad_offset, grad_mask);
    }
    row += len;
  }
}
DC_CPU_KERNEL(coordinate_rows)

// Tasks are (image, block of channels) pairs: each owns the part of grad_input it writes. An element of grad_input
// belongs to one offset group, and sums its terms output pixel by output pixel, tap by tap within a pixel. Output
// pixels [pixel_begin, pixel_end) of each image: grad_columns holds their rows, image after image.
template <typename scalar_t>
void input_grad_tasks_body(const ConvParams& p, const SamplingInputs<scalar_t>& in,
                           int64_t first_image, int64_t blocks, int64_t task_begin,
                           int64_t task_end, int64_t pixel_begin, int64_t pixel_end,
                           const scalar_t* grad_columns, scalar_t* grad_input) {
  const int64_t pixels = p.out_pixels(), channels = p.in_channels, per_offset_group = p.channels_per_offset_group();
  const int64_t row_size = p.taps() * channels, per_group = p.in_channels_per_group();
  const bool masked = in.mask != nullptr;
  BlockWalk<scalar_t> walk(p, in);
  for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t n_local = task / blocks, block = task % blocks, n = first_image + n_local;
    const int64_t block_begin = block * channels / blocks, block_end = (block + 1) * channels / blocks;
    scalar_t* image_grad = grad_input + n * p.height * p.width * channels;
    for (int64_t first = pixel_begin; first < pixel_end; first += kPointBlock) {
      const int64_t len = std::min(kPointBlock, pixel_end - first);
      walk.start_block(first, len);
      const int64_t tile_row = n_local * (pixel_end - pixel_begin) + first - pixel_begin;  // of grad_columns
      const scalar_t* block_grad = grad_columns + tile_row * row_size;
      for (int64_t group = 0; group < p.offset_groups; ++group) {
        if (std::max(block_begin, group * per_offset_group) >= std::min(block_end, (group + 1) * per_offset_group)) {
          continue;
        }
        walk.compute_group(n, group, first, len, corner_source<scalar_t>(image_grad, channels, nullptr));
        const ChannelPiece *pieces_begin = walk.pieces_begin(group), *pieces_end = walk.pieces_end(group);
        // Each piece's channels in the task's block: the whole piece where the block is the image's channels.
        const auto add_points = [&](const auto length_of) {
          for (int64_t b = 0; b < len; ++b) {
            for (int64_t tap = 0; tap < p.taps(); ++tap) {
              const PointBlock<scalar_t>& points = walk.taps[tap];
              const scalar_t m = masked ? in.mask[p.mask_index(n, group, tap, first + b)] : scalar_t(1);
              const scalar_t* grad_row = block_grad + b * row_size + tap * per_group;
              for (const ChannelPiece* piece = pieces_begin; piece != pieces_end; ++piece) {
                const int64_t c0 = std::max(block_begin, piece->channel);
                const int64_t count = length_of(*piece, c0);
                if (count <= 0) continue;
                const scalar_t* __restrict__ grad = grad_row + piece->column + (c0 - piece->channel);
                scalar_t* dst[4];
                scalar_t k[4];
                if (points.all_corners(b, c0, m, dst, k)) {
                  add_to_four_corners(dst, k, count, [&](const auto& tag, int64_t c) {
                    std::decay_t<decltype(tag)> value;
                    std::memcpy(&value, grad + c, sizeof(value));
                    return value;
                  });
                  continue;
                }
                for (int q = 0; q < 4; ++q) {
                  if (!points.valid[q][b]) continue;
                  scalar_t* __restrict__ dst = reinterpret_cast<scalar_t*>(points.address[q][b]) + c0;
                  add_scaled(m * points.weight[q][b], grad, count, dst);
                }
              }
            }
          }
        };
#if defined(DC_GROUP_VECTORS)
        if constexpr (std::is_same_v<scalar_t, float>) {
          const GroupVector* vector = walk.group_vector(group);
          if (blocks == 1 && vector != nullptr) {
            for (int64_t b = 0; b < len; ++b) {
              for (int64_t tap = 0; tap < p.taps(); ++tap) {
                const float m = masked ? in.mask[p.mask_index(n, group, tap, first + b)] : 1.f;
                vector->add_to_corners(walk.taps[tap], b, m, block_grad + b * row_size + tap * per_group);
              }
            }
            continue;
          }
        }
#endif
        if (blocks == 1) {
          with_piece_length<kFixedWidthsUpTo<scalar_t>>(pieces_begin, pieces_end, [&](const auto length_of) {
            add_points([&](const ChannelPiece& piece, int64_t) { return length_of(piece); });
          });
        } else {
          add_points([&](const ChannelPiece& piece, int64_t c0) {
            return std::min(block_end, piece.channel + piece.length) - c0;
          });
        }
      }
    }
  }
}
DC_CPU_KERNEL(input_grad_tasks)

}  // namespace

template <typename scalar_t, typename column_t, typename image_t>
void fill_columns(const ConvParams& p, const SamplingInputs<scalar_t, image_t>& in, int64_t first_image,
                  int64_t images, column_t* columns) {
  const bool in_pairs = fills_in_pairs<image_t, column_t>(p);
  at::parallel_for(0, images * p.out_pixels(), kRowsPerTask, [&](int64_t begin, int64_t end) {
    fill_rows_of(p, in, first_image, begin, end, columns + begin * p.taps() * p.in_channels, in_pairs);
  });
}

template <typename scalar_t, typename column_t, typename image_t>
void fill_column_rows(const ConvParams& p, const SamplingInputs<scalar_t, image_t>& in, int64_t first_image,
                      int64_t row_begin, int64_t row_end, column_t* columns) {
  fill_rows_of(p, in, first_image, row_begin, row_end, columns, fills_in_pairs<image_t, column_t>(p));
}

template <typename scalar_t, typename image_t>
void coordinate_and_mask_grads(const ConvParams& p, const SamplingInputs<scalar_t, image_t>& in, int64_t first_image,
                               int64_t images, const scalar_t* grad_columns, scalar_t* grad_offset,
                               scalar_t* grad_mask) {
  at::parallel_for(0, images * p.out_pixels(), kRowsPerTask, [&](int64_t begin, int64_t end) {
    coordinate_rows<scalar_t>(p, in, first_image, begin, end, grad_columns + begin * p.taps() * p.in_channels,
                              grad_offset, grad_mask);
  });
}

template <typename scalar_t>
void accumulate_input_grad(const ConvParams& p, const SamplingInputs<scalar_t>& in, int64_t first_image,
                           int64_t images, const scalar_t* grad_columns, scalar_t* grad_input) {
  // As few channel blocks (of at least 8 channels) as make images * blocks a multiple of the thread count:
  // at::parallel_for hands each thread one fixed share of the tasks, which are then equal, and each block
  // repeats the sampling arithmetic for every point. The result does not depend on the blocking: each element
  // of grad_input lies in exactly one block and sums its terms in the same order.
  const int64_t threads = at::get_num_threads();
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(threads / std::gcd(images, threads), p.in_channels / 8));
  at::parallel_for(0, images * blocks, 1, [&](int64_t begin, int64_t end) {
    input_grad_tasks<scalar_t>(p, in, first_image, blocks, begin, end, int64_t(0), p.out_pixels(), grad_columns,
                               grad_input);
  });
}

template <typename image_t>
void tile_grads(const ConvParams& p, const SamplingInputs<float, image_t>& in, int64_t n, int64_t pixel_begin,
                int64_t pixel_end, const float* grad_columns, float* grad_offset, float* grad_mask,
                float* grad_input) {
  coordinate_rows<float>(p, in, n, pixel_begin, pixel_end, grad_columns, grad_offset, grad_mask);
  input_grad_tasks<float>(p, SamplingInputs<float>{nullptr, in.offset, in.mask}, n, int64_t(1), int64_t(0),
                          int64_t(1), pixel_begin, pixel_end, grad_columns, grad_input);
}

template void tile_grads<float>(const ConvParams&, const SamplingInputs<float, float>&, int64_t, int64_t, int64_t,
                                const float*, float*, float*, float*);
template void tile_grads<c10::BFloat16>(const ConvParams&, const SamplingInputs<float, c10::BFloat16>&, int64_t,
                                        int64_t, int64_t, const float*, float*, float*, float*);
template void tile_grads<c10::Half>(const ConvParams&, const SamplingInputs<float, c10::Half>&, int64_t, int64_t,
                                    int64_t, const float*, float*, float*, float*);

#define DEFORM_CONV_INSTANTIATE(T)                                                                              \
  template void fill_columns<T, T>(const ConvParams&, const SamplingInputs<T>&, int64_t, int64_t, T*);         \
  template void fill_column_rows<T, T>(const ConvParams&, const SamplingInputs<T>&, int64_t, int64_t, int64_t, T*); \
  template void coordinate_and_mask_grads<T, T>(const ConvParams&, const SamplingInputs<T>&, int64_t, int64_t, \
                                                const T*, T*, T*);                                             \
  template void accumulate_input_grad<T>(const ConvParams&, const SamplingInputs<T>&, int64_t, int64_t,        \
                                         const T*, T*);
DEFORM_CONV_INSTANTIATE(float)
DEFORM_CONV_INSTANTIATE(double)
#undef DEFORM_CONV_INSTANTIATE
template void fill_columns<float, c10::BFloat16, c10::BFloat16>(
    const ConvParams&, const SamplingInputs<float, c10::BFloat16>&, int64_t, int64_t, c10::BFloat16*);
template void fill_columns<float, c10::Half, c10::Half>(const ConvParams&, const SamplingInputs<float, c10::Half>&,
                                                       int64_t, int64_t, c10::Half*);
// The half types' backward: the coordinates' gradient from their image, in float.
template void coordinate_and_mask_grads<float, c10::BFloat16>(const ConvParams&,
                                                              const SamplingInputs<float, c10::BFloat16>&, int64_t,
                                                              int64_t, const float*, float*, float*);
template void coordinate_and_mask_grads<float, c10::Half>(const ConvParams&, const SamplingInputs<float, c10::Half>&,
                                                          int64_t, int64_t, const float*, float*, float*);
template void fill_column_rows<float, c10::BFloat16, c10::BFloat16>(
    const ConvParams&, const SamplingInputs<float, c10::BFloat16>&, int64_t, int64_t, int64_t, c10::BFloat16*);
template void fill_column_rows<float, c10::Half, c10::Half>(const ConvParams&, const SamplingInputs<float, c10::Half>&,
                                                           int64_t, int64_t, int64_t, c10::Half*);

}  // namespace cpu
}  // namespace deform_conv
