"""The paths the CPU optimisations create: chunk boundaries, uneven channel splits, the depthwise path without
GEMMs, the tiled float32 forward, and the determinism of the race-free backward."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import platform

import pytest
import torch
import torchvision

from helpers.deform_conv2d import assert_all_close, half_gemm_path, make_case, output_and_grads

import deform_conv

ours = deform_conv.deform_conv2d
reference = deform_conv.deform_conv2d_reference

# Where the float32 layers' GEMMs run on the batch-reduce GEMM (cpu/brgemm.cpp), as the library says: it is
# compiled in only against torch >= 2.9 (ATen's CPUBLAS_BRGEMM_F32F32F32) and used only on x86 with AVX2 and
# oneDNN. Elsewhere they take the driver's path, as exact but on ATen's GEMMs.
BATCH_REDUCE_GEMM = torch.ops.deform_conv.brgemm_available()
NO_BATCH_REDUCE_GEMM = (f"the batch-reduce GEMM is not compiled in or not usable here (torch {torch.__version__}, "
                        f"{platform.machine()}, CPU capability {torch.backends.cpu.get_cpu_capability()}): it needs "
                        "torch >= 2.9 on x86-64 with AVX2 and oneDNN")


def test_batch_not_divisible_by_the_chunk():
    """20 channels, 3x3 taps, 40x40 output in float64: 2.2 MiB of columns per image, so 3 images share an
    8 MiB chunk and a batch of 7 ends with a partial chunk of 1."""
    case = make_case(torch.float64, batch=7, in_channels=20, out_channels=6, size=(40, 40), kernel=(3, 3),
                     stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=2, offset_groups=5)
    assert_all_close(output_and_grads(ours, case), output_and_grads(reference, case), torch.float64)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(in_channels=15, out_channels=9, groups=3, offset_groups=5),   # 5 channels per group, 3 per offset group
        dict(in_channels=7, out_channels=7, groups=1, offset_groups=7),    # one channel per offset group
        dict(in_channels=33, out_channels=11, groups=11, offset_groups=3), # 3 per group, 11 per offset group
    ],
    ids=["15ch_g3_og5", "7ch_og7", "33ch_g11_og3"],
)
def test_odd_channel_counts(dtype, kwargs):
    case = make_case(dtype, **kwargs)
    results = output_and_grads(ours, case)
    assert_all_close(results, output_and_grads(reference, case), dtype)
    assert_all_close(results, output_and_grads(torchvision.ops.deform_conv2d, case), dtype)


@pytest.mark.parametrize("batch", [1, 2], ids=["one_image", "two_images"])
@pytest.mark.parametrize("per_offset_group", [8, 12, 16, 32, 64, 24])
def test_offset_group_widths(dtype, per_offset_group, batch):
    """In float32, an offset group of 8, 12, 16, 32 or 64 channels within one weight group runs channel loops of that
    fixed width (sampling_passes.cpp, with_piece_length), 24 those of any width; float64 runs the loops of any width
    for all of them, the same shapes checked against the reference. Two images: two offset groups. One image, on
    two threads or more, and one offset group: the input gradient's channels are cut into blocks that cut the
    offset group, and take the loops of any width."""
    offset_groups = 1 if batch == 1 else 2
    case = _network_scale(make_case(dtype, batch=batch, in_channels=offset_groups * per_offset_group, out_channels=5,
                                    groups=1, offset_groups=offset_groups))
    results = output_and_grads(ours, case)
    assert_all_close(results, output_and_grads(reference, case), dtype)
    assert_all_close(results, output_and_grads(torchvision.ops.deform_conv2d, case), dtype)


@pytest.mark.parametrize("piece", [8, 12, 16])
def test_offset_groups_cut_into_equal_pieces(dtype, piece):
    """6 * piece channels in 2 weight groups and 3 offset groups: the middle offset group is cut into two pieces of
    `piece` channels, which in float32 run the channel loops of that fixed width (with_piece_length), the others
    are whole (of 2 * piece channels)."""
    case = _network_scale(make_case(dtype, batch=2, in_channels=6 * piece, out_channels=4, groups=2, offset_groups=3))
    results = output_and_grads(ours, case)
    assert_all_close(results, output_and_grads(reference, case), dtype)
    assert_all_close(results, output_and_grads(torchvision.ops.deform_conv2d, case), dtype)


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("offset_groups", [1, 4])
def test_depthwise_path(dtype, with_mask, offset_groups):
    """groups == in_channels == out_channels runs without columns and GEMMs; 300 rows of weight-gradient
    blocks and a batch of 37 exercise its block sums."""
    case = make_case(dtype, batch=37, in_channels=8, out_channels=8, groups=8, offset_groups=offset_groups,
                     kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), size=(5, 6), with_mask=with_mask)
    results = output_and_grads(ours, case)
    assert_all_close(results, output_and_grads(reference, case), dtype)
    assert_all_close(results, output_and_grads(torchvision.ops.deform_conv2d, case), dtype)


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("per_offset_group", [16, 24, 48, 72, 64, 96, 128])
def test_depthwise_channel_widths(dtype, per_offset_group, with_mask):
    """The depthwise forward sums blocks of 6, 4 and 2 vectors of channels in registers, then single vectors, then the
    last channels one by one (8 floats a vector for AVX2: 24 a block of two and a vector, 48 a block of six, 72 six,
    two and one, 64 two blocks of four rather than six and two, 96 two of six, 128 six, six and four; 16 floats for
    AVX-512: 64 one block of four, 96 one of six, 128 two of four); its backward takes the channels of an offset group
    in one pass where they come in runs of 16 (all but 24 and 72), three passes otherwise. Two offset groups, the
    awkward geometry's kernel, stride and dilation, offsets across the border."""
    channels = 2 * per_offset_group
    case = make_case(dtype, batch=2, in_channels=channels, out_channels=channels, groups=channels, offset_groups=2,
                     size=(9, 7), with_mask=with_mask)
    results = output_and_grads(ours, case)
    assert_all_close(results, output_and_grads(reference, case), dtype)
    assert_all_close(results, output_and_grads(torchvision.ops.deform_conv2d, case), dtype)


def assert_batch_and_images_alone_alike(case, gemm_path="auto"):
    """On two threads: each image's output and its input, offset and mask gradients from the whole batch are the
    same bits as from the image alone (with DEFORM_CONV_CPU_HALF_GEMM=`gemm_path`)."""
    shape = case.call(ours, case.tensors()).shape
    grad_output = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(case.input.dtype)

    def per_image(images):  # output, grad_input, grad_offset, grad_mask of images [first, last)
        leaves = [t[images].detach().clone().requires_grad_() for t in (case.input, case.offset, case.mask)]
        x, offset, mask = leaves
        out = ours(x, offset, case.weight, case.bias, case.stride, case.padding, case.dilation, mask)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_output[images])]

    batch = case.input.shape[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with half_gemm_path(gemm_path):
            together = per_image(slice(0, batch))
            alone = [per_image(slice(n, n + 1)) for n in range(batch)]
    finally:
        torch.set_num_threads(threads)
    for n, results in enumerate(alone):
        for name, got, expected in zip(["output", "input", "offset", "mask"], together, results):
            assert torch.equal(got[n:n + 1], expected), (n, name)


@pytest.mark.parametrize("dtype_", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_depthwise_images_turned_per_thread_or_up_front_alike(dtype_):
    """On two threads, a batch of three images has each thread turn its images to channels-last itself
    (thread_images.h; thread 0 moves on from image 0 to image 1, which thread 1 turns too); one image alone is turned
    up front. Each image's output and its gradients (of the input, the offsets and the mask) are the same bits
    either way; a bfloat16 input is widened as it is turned."""
    assert_batch_and_images_alone_alike(
        make_case(dtype_, batch=3, in_channels=24, out_channels=24, groups=24, offset_groups=2, size=(9, 7)))


@pytest.mark.parametrize("dtype_", [
    pytest.param(torch.float32, marks=pytest.mark.skipif(not BATCH_REDUCE_GEMM, reason=NO_BATCH_REDUCE_GEMM)),
    torch.bfloat16,
], ids=["float32", "bfloat16"])
def test_tiled_backward_and_the_driver_passes_alike(dtype_):
    """The tiled backward (cpu/tiled_backward.h) against the driver's GEMMs and passes, which it replaces where a
    chunk has an image per thread. On two threads, four images of 8.6 MB of float32 columns each go in chunks of two
    (the tiled backward, the second chunk's from image 2 on, each image's 14,399 pixels in tiles of 128, an odd count
    that the half types' GEMM pads to pairs); one image alone takes the driver's (the profiler's ranges show both).
    Each image's output and its input, offset and mask gradients are the same bits either way: the columns' gradient
    tile by tile, the coordinates' gradient point by point, and the input's summed in the same order. Weight groups
    and offset groups that do not nest, 3 output channels a group; bfloat16 on the half path (its portable GEMM where
    the CPU has no native one)."""
    case = make_case(dtype_, batch=4, in_channels=6, out_channels=6, size=(121, 119), kernel=(5, 5),
                     stride=(1, 1), padding=(2, 2), dilation=(1, 1), groups=2, offset_groups=3)
    native = dtype_ == torch.float32 or torch.ops.deform_conv.cpu_half_path(dtype_).startswith("bfloat16: native,")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert_batch_and_images_alone_alike(case, "auto" if native else "portable")
    passes = {e.name for e in prof.events() if e.name.startswith("deform_conv2d::")}
    assert {"deform_conv2d::tiled_backward", "deform_conv2d::coordinate_grads"} <= passes, passes


def test_group_vectors_and_the_piece_loops_alike():
    """40 channels in 5 weight groups and 4 offset groups: each offset group of 10 channels comes in pieces of 8 + 2,
    6 + 4, 4 + 6 and 2 + 8, which the AVX-512 libraries take as one vector (GroupVector, cpu/sampling_passes.cpp).
    One image on two threads splits the input gradient's pass into two blocks of channels, which take the piece loops;
    on one thread it is one block, and the group vector adds each point's terms. The input gradient is the same bits
    either way (elsewhere both take the piece loops), and so are the output and the offset and mask gradients; the
    float64 reference checks all of them."""
    case = _network_scale(make_case(torch.float32, batch=1, in_channels=40, out_channels=40, size=(17, 23),
                                    kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=5,
                                    offset_groups=4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        vector = _gradients(ours, case, case.tensors())
        torch.set_num_threads(2)
        pieces = _gradients(ours, case, case.tensors())
    finally:
        torch.set_num_threads(threads)
    # [output, input, offset, weight, bias, mask]: the weight's and the bias' sums may split by thread count.
    for name, got, expected in zip(("output", "input", "offset", "weight", "bias", "mask"), vector, pieces):
        if name not in ("weight", "bias"):
            assert torch.equal(got, expected), name
    exact = [t.float() for t in _gradients(reference, case, [t.double() for t in case.tensors()])]
    assert_all_close(vector, exact, torch.float32)


def test_depthwise_with_channels_last_and_strided_inputs():
    case = make_case(torch.float64, batch=3, in_channels=6, out_channels=6, groups=6, offset_groups=2)
    strided = [case.input.contiguous(memory_format=torch.channels_last), case.offset.transpose(2, 3).contiguous()
               .transpose(2, 3), case.weight, case.bias, case.mask]
    assert_all_close(output_and_grads(ours, case, strided), output_and_grads(reference, case), torch.float64)



# 5.1 MiB of columns per image: one image per 8 MiB chunk, but a backward chunk holds as many as there are threads.
STRETCHED_CHUNKS = dict(batch=3, in_channels=64, out_channels=16, groups=1, offset_groups=1, kernel=(3, 3),
                        stride=(1, 1), padding=(1, 1), dilation=(1, 1), size=(48, 48))


@pytest.mark.parametrize("shape", [dict(groups=1), dict(groups=8), STRETCHED_CHUNKS],
                         ids=["columns", "depthwise", "stretched_chunks"])
def test_backward_is_bitwise_reproducible(shape):
    """Under torch.use_deterministic_algorithms(True) (which the CPU backward does not refuse) and with the same
    threads: the same bits, run after run (no atomics, fixed summation orders). The depthwise path has no GEMM,
    and its sums do not depend on the number of threads either; nor do the float32 columns path's, where its
    GEMMs run on the batch-reduce GEMM in tasks that each own their results, and its chunks of images follow
    the thread count (stretched_chunks). ATen's GEMMs, where it does not, split their sums by thread count."""
    groups = shape["groups"]
    case = make_case(torch.float32, **{**dict(batch=5, in_channels=8, out_channels=8, offset_groups=2, kernel=(3, 3),
                                              stride=(1, 1), padding=(1, 1), dilation=(1, 1), size=(24, 20)),
                                       **shape})
    threads = torch.get_num_threads()
    many = max(threads, 2)  # (stretched_chunks: one image a chunk on one thread, two on two)
    counts = (many, many, 1) if groups == 8 or BATCH_REDUCE_GEMM else (many, many)
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for n in counts:
            torch.set_num_threads(n)
            runs.append(output_and_grads(ours, case))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)


def test_scratch_is_kept_between_calls_and_bounded():
    kept = torch.ops.deform_conv.kept_scratch_bytes
    case = make_case(torch.float32, batch=2, size=(30, 28))
    output_and_grads(ours, case)
    after_first = kept()
    assert after_first > 0  # the column buffer, the channels-last input copy, the workers' tiles
    output_and_grads(ours, case)
    assert kept() == after_first  # reused, not grown
    # A column buffer over 32 MiB is allocated afresh each time, not kept: 1x1 kernel, 400 x 400 x 64 doubles
    # (82 MB) for one image; the input is channels-last already, so it is not copied either. (In float64: a
    # float32 forward would take the tiled path, whose buffers are small and kept.)
    big = make_case(torch.float64, batch=1, in_channels=64, out_channels=4, size=(400, 400), kernel=(1, 1),
                    stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1, offset_groups=1)
    ours(big.input.contiguous(memory_format=torch.channels_last), big.offset, big.weight, big.bias, big.stride,
         big.padding, big.dilation, big.mask)
    assert kept() == after_first


@pytest.mark.parametrize("dtype_", [torch.float64, torch.float32], ids=["driver", "tiled"])
def test_threads_calling_at_once_each_use_their_own_scratch(dtype_):
    cases = [make_case(dtype_, batch=2, seed=seed) for seed in range(6)]
    expected = [output_and_grads(ours, case) for case in cases]
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        got = list(pool.map(lambda case: output_and_grads(ours, case), cases * 3))
    # Shared scratch would give garbage; the tolerance only allows for GEMMs that split their sums by thread count.
    for i, results in enumerate(got):
        assert_all_close(results, expected[i % len(cases)], dtype_)


# The tiled float32 forward (cpu/tiled_forward.cpp) serves every float32 layer whose tile holds 32 pixels, where
# the batch-reduce GEMM runs on oneDNN (x86 with AVX2, oneDNN on); with oneDNN off, the same layers take the
# driver's path.
TILED_SHAPES = {
    # 2 tiles of 128 pixels per image (more and smaller beyond 3 threads); 72 output channels, a GEMM panel of
    # 64 and one of 8; 576 weight rows, summed in blocks of 512 and 64.
    "tiles_panels_depth_blocks": dict(batch=3, in_channels=64, out_channels=72, size=(16, 16), kernel=(3, 3),
                                      stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1, offset_groups=2),
    # 3 weight groups of 16 channels, 4 offset groups of 12: the groups do not nest.
    "groups": dict(batch=2, in_channels=48, out_channels=96, size=(15, 17), kernel=(3, 3), stride=(1, 1),
                   padding=(1, 1), dilation=(1, 1), groups=3, offset_groups=4),
    # One image: fewer images than threads, so the input is turned to channels-last up front.
    "one_image": dict(batch=1, in_channels=64, out_channels=72, size=(16, 16), kernel=(3, 3), stride=(1, 1),
                      padding=(1, 1), dilation=(1, 1), groups=1, offset_groups=2),
    # 2 groups of 64 input channels (576 weight rows each, in depth blocks) and of 80 output channels (panels
    # of 64 and 16): group and panel offsets both nonzero.
    "groups_wide": dict(batch=3, in_channels=128, out_channels=160, size=(12, 11), kernel=(3, 3), stride=(1, 1),
                        padding=(1, 1), dilation=(1, 1), groups=2, offset_groups=2),
    # 256 channels: a weight of 2.4 MB, over 2 MiB, so tiles of up to 1 MiB where the L2 cache holds 2 MiB or
    # more (tiled_forward.cpp's tile_bytes): 2 tiles of 66 pixels an image (3 of 44 pixels elsewhere).
    "large_weight": dict(batch=2, in_channels=256, out_channels=256, size=(11, 12), kernel=(3, 3), stride=(1, 1),
                         padding=(1, 1), dilation=(1, 1), groups=1, offset_groups=1),
    "awkward_geometry": dict(),
    "no_mask_no_bias": dict(with_mask=False, with_bias=False),
}


@pytest.mark.parametrize("threads, passes", [
    (2, ("backward_gemms", "coordinate_grads", "input_grad")),
    pytest.param(1, ("tiled_backward",), marks=pytest.mark.skipif(not BATCH_REDUCE_GEMM, reason=NO_BATCH_REDUCE_GEMM)),
], ids=["driver", "tiled"])
def test_the_backward_opens_a_profiler_range_for_each_pass(threads, passes):
    """torch.profiler's trace splits the op's time between its passes (columns_driver.cpp's DC_PASS_RANGE): each
    of the backward's passes once per chunk (here one), inside the op's own range. One image on two threads takes
    the driver's GEMMs and passes; on one thread, the tiled backward (cpu/tiled_backward.h), one range for all
    three."""
    case = make_case(torch.float32, batch=1, in_channels=8, out_channels=6, groups=2, offset_groups=2)
    output = case.call(ours, [t.detach().requires_grad_() for t in case.tensors()])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            output.backward(torch.ones_like(output))
    finally:
        torch.set_num_threads(before)
    events = [e for e in prof.events() if e.name.startswith("deform_conv2d::")]
    assert sorted(e.name for e in events) == sorted(
        f"deform_conv2d::{name}" for name in ("channels_last", "fill_columns", *passes, "channels_first"))
    op = next(e for e in prof.events() if e.name == "deform_conv::deform_conv2d_backward")
    for event in events:
        assert op.time_range.start <= event.time_range.start <= event.time_range.end <= op.time_range.end, event.name


def _network_scale(case):
    """The case with weights at the scale of a network's initialisation (1/sqrt(fan_in)): the float32 tolerance
    holds for outputs of order 1, not for sums of 576 unit-scale products."""
    return dataclasses.replace(case, weight=case.weight / case.weight[0].numel() ** 0.5)


def _exact_output(case):
    """The reference in float64 on the same float32 values, rounded to float32."""
    wide = [t.double() for t in case.tensors()]
    return case.call(reference, wide).float()


def _input_in_layout(case, layout):
    tensors = case.tensors()
    if layout == "channels_last":
        tensors[0] = tensors[0].contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        tensors[0] = tensors[0].transpose(2, 3).contiguous().transpose(2, 3)
    return tensors


# torch.backends.mkldnn.flags warns, on builds without Intel GPU support, that it cannot set TF32 for one.
ignore_tf32_warning = pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")


@ignore_tf32_warning
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
@pytest.mark.parametrize("shape", list(TILED_SHAPES), ids=list(TILED_SHAPES))
@pytest.mark.parametrize("onednn", [True, False], ids=["tiled", "driver"])
def test_float32_forward_on_both_paths(shape, layout, onednn):
    case = _network_scale(make_case(torch.float32, **TILED_SHAPES[shape]))
    with torch.backends.mkldnn.flags(enabled=onednn):
        out = case.call(ours, _input_in_layout(case, layout))
    assert_all_close([out], [_exact_output(case)], torch.float32)


@ignore_tf32_warning
def test_brgemm_available_names_the_path_float32_layers_take():
    """The op answers for the path a float32 forward takes, per call: no convolution of ATen where it says True,
    the driver's convolution where it says False (oneDNN off, or the GEMM not there)."""
    case = make_case(torch.float32, **TILED_SHAPES["tiles_panels_depth_blocks"])
    answers = {}
    for onednn in (True, False):
        with torch.backends.mkldnn.flags(enabled=onednn), torch.profiler.profile() as profile:
            answers[onednn] = torch.ops.deform_conv.brgemm_available()
            case.call(ours, case.tensors())
        assert ("aten::conv2d" not in {event.name for event in profile.events()}) == answers[onednn], answers
    assert answers == {True: BATCH_REDUCE_GEMM, False: False}
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 9) or platform.machine() != "x86_64":
        assert not BATCH_REDUCE_GEMM


@ignore_tf32_warning
@pytest.mark.skipif(not BATCH_REDUCE_GEMM, reason=NO_BATCH_REDUCE_GEMM)
def test_float32_layers_take_the_batch_reduce_gemm():
    """The tiled forward runs no convolution of ATen, and the backward no mm: their GEMMs are the batch-reduce
    GEMM's. With oneDNN off, the driver runs them as a convolution and mm per image."""
    case = make_case(torch.float32, **TILED_SHAPES["tiles_panels_depth_blocks"])

    def ops_run(onednn):
        leaves = [t.detach().clone().requires_grad_() for t in case.tensors()]
        with torch.backends.mkldnn.flags(enabled=onednn), torch.profiler.profile() as profile:
            case.call(ours, leaves).sum().backward()
        return {event.name for event in profile.events()}

    gemms = {"aten::conv2d", "aten::mm", "aten::addmm_", "aten::addmm"}
    tiled, driver = ops_run(True), ops_run(False)
    assert {"deform_conv::deform_conv2d", "deform_conv::deform_conv2d_backward"} <= tiled
    assert not gemms & tiled, gemms & tiled
    assert {"aten::conv2d", "aten::mm"} <= driver


@pytest.mark.parametrize("batch", [1, 3])
def test_float32_forward_on_two_thread_counts(batch):
    """On the tiled forward, tiles follow the shape, not the threads; with one image the input is turned up front
    on two threads and by the one thread itself on one: the same bits either way. On the driver's path (no
    batch-reduce GEMM) ATen's GEMM splits its sums by thread count: the same values to float32's tolerance."""
    case = _network_scale(make_case(torch.float32, **dict(TILED_SHAPES["tiles_panels_depth_blocks"], batch=batch)))
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (max(threads, 2), 1):
            torch.set_num_threads(n)
            outputs.append(case.call(ours, case.tensors()))
    finally:
        torch.set_num_threads(threads)
    if BATCH_REDUCE_GEMM:
        assert torch.equal(outputs[0], outputs[1])
    else:
        assert_all_close(outputs[:1], outputs[1:], torch.float32)


# The backward's GEMMs on the batch-reduce GEMM (cpu/brgemm.cpp), for every float32 layer; with oneDNN off,
# ATen's mm per image and group.
BACKWARD_SHAPES = {
    # 576 output pixels: the weight gradient sums them in depth blocks of 512 and 64, the columns' gradient runs
    # on tiles of 128 pixels and one of 64; 72 output channels, in blocks (of 36 on 2 threads); 576 weight
    # columns in 9 panels; 1.3 MiB of columns per image, so the 7 images come in chunks of 6 and 1.
    "blocks_tiles_chunks": dict(batch=7, in_channels=64, out_channels=72, size=(24, 24), kernel=(3, 3),
                                stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1, offset_groups=2),
    "groups": TILED_SHAPES["groups"],
    "groups_wide": TILED_SHAPES["groups_wide"],
    # 520 output channels: the columns' gradient sums them in depth blocks of 512 and 8.
    "many_outputs": dict(batch=2, in_channels=64, out_channels=520, size=(10, 10), kernel=(3, 3), stride=(1, 1),
                         padding=(1, 1), dilation=(1, 1), groups=1, offset_groups=1),
    # 18 KiB of columns per pixel: the forward takes the driver's path, the backward's GEMMs do not; 72 panels
    # of weight columns by one block of 40 output channels.
    "driver_forward": dict(batch=2, in_channels=512, out_channels=40, size=(6, 5), kernel=(3, 3), stride=(1, 1),
                           padding=(1, 1), dilation=(1, 1), groups=1, offset_groups=1),
    "stretched_chunks": STRETCHED_CHUNKS,
    "awkward_geometry": dict(),
}


def _gradients(fn, case, tensors):
    """Output and gradients for a grad_output of scale 1/sqrt(batch * pixels): the weight's gradient, a sum over
    every image and pixel, is then of order 1 like the output, where the float32 tolerance holds."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = case.call(fn, leaves)
    grad_output = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grad_output = (grad_output / (out.shape[0] * out.shape[2] * out.shape[3]) ** 0.5).to(out.dtype)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_output)]


@ignore_tf32_warning
@pytest.mark.parametrize("shape", list(BACKWARD_SHAPES), ids=list(BACKWARD_SHAPES))
@pytest.mark.parametrize("onednn", [True, False], ids=["brgemm", "driver"])
def test_float32_backward_on_both_paths(shape, onednn):
    case = _network_scale(make_case(torch.float32, **BACKWARD_SHAPES[shape]))
    with torch.backends.mkldnn.flags(enabled=onednn):
        got = _gradients(ours, case, case.tensors())
    exact = [t.float() for t in _gradients(reference, case, [t.double() for t in case.tensors()])]
    assert_all_close(got, exact, torch.float32)


def test_tiled_forward_with_an_image_split_between_two_threads():
    """2 threads, 3 images of 2 tiles: the first thread takes image 0 and the first tile of image 1, the second
    the rest; both turn image 1 to channels-last."""
    case = _network_scale(make_case(torch.float32, **TILED_SHAPES["tiles_panels_depth_blocks"]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = case.call(ours, case.tensors())
    finally:
        torch.set_num_threads(threads)
    assert_all_close([out], [_exact_output(case)], torch.float32)


def test_float32_paths_with_strided_tensors_and_an_expanded_grad_output():
    """Every tensor in a layout of its own, and the stride-0 grad_output of a scaled sum()."""
    case = _network_scale(make_case(torch.float32, **TILED_SHAPES["groups"]))
    strided = [case.input.contiguous(memory_format=torch.channels_last),
               case.offset.transpose(2, 3).contiguous().transpose(2, 3),
               case.weight.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),
               torch.stack([case.bias, case.bias], 1)[:, 0],
               case.mask.transpose(2, 3).contiguous().transpose(2, 3)]
    assert not any(t.is_contiguous() for t in strided[1:])

    def grads(tensors, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in tensors]
        out = case.call(ours if dtype == torch.float32 else reference, leaves)
        (out.sum() / out[:, 0].numel()).backward()
        return [out.detach().float()] + [leaf.grad.float() for leaf in leaves]

    assert_all_close(grads(strided, torch.float32), grads(case.tensors(), torch.float64), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("out_channels, in_channels, kernel", [(40, 512, 3), (7, 17, 3), (33, 16, 1), (9, 19, 5)],
                         ids=["wide", "odd", "1x1", "5x5"])
def test_the_weight_is_turned_to_the_columns_order_bit_for_bit(dtype, out_channels, in_channels, kernel):
    """The CPU turns a contiguous weight to the columns' order itself (taps_outer: 16 channels a gather where the
    library has AVX-512, the rest one by one, the last values of the weight one by one too); on the driver's path
    (the backward, and forwards whose tiles would be too small: 512 channels) a weight in another layout takes
    ATen's copy instead. Both give the same forward and backward, bit for bit (the half types on their native path,
    here with DEFORM_CONV_CPU_HALF_GEMM=portable)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, in_channels, 6, 7, generator=g).to(dtype)
    offset = torch.randn(2, 2 * kernel * kernel, 6, 7, generator=g).to(dtype)
    weight = torch.randn(out_channels, in_channels, kernel, kernel, generator=g).to(dtype)
    grad_output = torch.randn(2, out_channels, 6, 7, generator=g).to(dtype)

    def run(w):
        leaves = [x.clone().requires_grad_(), w.detach().clone(memory_format=torch.preserve_format).requires_grad_()]
        out = deform_conv.deform_conv2d(leaves[0], offset, leaves[1], padding=kernel // 2)
        return [out] + list(torch.autograd.grad(out, leaves, grad_output))

    with half_gemm_path("portable" if dtype != torch.float32 else "auto"):
        turned_here = run(weight)
        turned_by_aten = run(weight.contiguous(memory_format=torch.channels_last))
    for a, b in zip(turned_here, turned_by_aten):
        assert torch.equal(a, b)
