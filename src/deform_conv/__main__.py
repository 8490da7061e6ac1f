"""Command line: ``deform-conv`` (== ``python -m deform_conv``).

``deform-conv [check]`` builds the kernels if needed, runs the op once against the pure-PyTorch reference
(forward and every gradient) and prints the versions, the cache entry, whether it was built now, and timings.
``doctor``, ``build`` and ``clean`` look after the kernel cache; ``bench`` runs the CPU benchmark suite.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Callable, List, Optional, Sequence

import torch

import deform_conv
from deform_conv import _cache, _doctor, _loader, _toolchain, _variant


def _median_ms(fn: Callable[[], object], repeats: int = 7) -> float:
    fn()  # warm-up
    times: List[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _case(dtype: torch.dtype, device: str, batch: int = 3):
    """Awkward geometry: kernel 3x2, stride (2, 1), padding (1, 0), dilation (2, 1), 2 groups, 3 offset groups."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 6, 13, 8, dtype=dtype, generator=g)
    weight = torch.randn(4, 3, 3, 2, dtype=dtype, generator=g)
    offset = 2 * torch.randn(batch, 2 * 3 * 6, 6, 7, dtype=dtype, generator=g)
    mask = torch.rand(batch, 3 * 6, 6, 7, dtype=dtype, generator=g)
    bias = torch.randn(4, dtype=dtype, generator=g)
    x, offset, weight, mask, bias = (t.to(device) for t in (x, offset, weight, mask, bias))
    return (x, offset, weight, bias, (2, 1), (1, 0), (2, 1), mask)


def _max_errors(dtype: torch.dtype, device: str) -> List[float]:
    """Largest absolute difference from the reference of the output and of the five gradients."""
    args = _case(dtype, device)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    results = []
    for fn in (deform_conv.deform_conv2d, deform_conv.deform_conv2d_reference):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        it = iter(leaves)
        call = [next(it) if isinstance(a, torch.Tensor) else a for a in args]
        out = fn(*call)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        results.append([out, *grads])
    return [(a - b).abs().max().item() for a, b in zip(*results)]


def check() -> int:
    cuda = torch.version.cuda
    gpus = torch.cuda.device_count() if cuda else 0
    print(f"deform_conv {deform_conv.__version__} self-check")
    print(f"  python     {platform.python_version()} on {platform.platform()}")
    print(f"  torch      {torch.__version__} (CUDA {cuda or 'none'}; {gpus} GPU(s) visible)")
    cxx = _toolchain.find_cxx()
    print(f"  compiler   {_toolchain.identify(cxx, _loader.cache_root() / _cache.TOOLCHAINS_FILE) if cxx else 'none found'}")
    print(f"  cache      {_loader.cache_root()}")
    for lib in deform_conv.libraries:
        how = (f"loaded from the cache in {lib.load_seconds * 1e3:.1f} ms" if lib.from_cache
               else f"built now in {lib.build_seconds:.1f} s")
        print(f"  {lib.variant.kind:10s} {lib.entry.name}: {how}")

    if "cpu" not in {lib.variant.kind for lib in deform_conv.libraries}:
        print("FAILED: no compiled CPU kernels are loaded (DEFORM_CONV_FALLBACK=reference runs the reference)")
        return 1
    tolerances = {torch.float64: 1e-10, torch.float32: 1e-4}
    ok = True
    names = ("output", "grad_input", "grad_offset", "grad_weight", "grad_bias", "grad_mask")
    # The CUDA kernels too, where their library is loaded and a GPU is visible.
    devices = ["cpu"] + (["cuda"] if "cuda" in {lib.variant.kind for lib in deform_conv.libraries} and gpus else [])
    for device in devices:
        for dtype, tol in tolerances.items():
            errors = _max_errors(dtype, device)
            worst = max(errors)
            passed = worst <= tol
            ok &= passed
            detail = ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errors))
            print(f"  {device:4s} {str(dtype):14s} {'PASS' if passed else 'FAIL'} vs reference "
                  f"(max |diff| <= {tol:.0e}): {detail}")

    x = torch.randn(4, 64, 32, 32)
    weight = torch.randn(64, 64, 3, 3)
    offset = torch.randn(4, 18, 32, 32)
    mask = torch.rand(4, 9, 32, 32)
    fwd = _median_ms(lambda: deform_conv.deform_conv2d(x, offset, weight, padding=1, mask=mask))
    leaves = [t.clone().requires_grad_() for t in (x, offset, weight, mask)]

    def fwd_bwd() -> None:
        out = deform_conv.deform_conv2d(leaves[0], leaves[1], leaves[2], padding=1, mask=leaves[3])
        out.sum().backward()

    both = _median_ms(fwd_bwd)
    print(
        f"  timings    batch 4, 64->64, 32x32, 3x3, fp32, {torch.get_num_threads()} threads: "
        f"forward {fwd:.1f} ms, forward+backward {both:.1f} ms (median of 7)"
    )
    print("OK" if ok else "FAILED: the op disagrees with the reference")
    return 0 if ok else 1


def build(cuda_arch: Optional[str], cpu_only: bool) -> int:
    """Prebuilds into the cache (without loading), e.g. before launching N training processes, or for a GPU
    this machine does not have."""
    if cuda_arch and torch.version.cuda is None:
        print(f"deform-conv: --cuda-arch needs a CUDA build of torch; torch {torch.__version__} has no CUDA",
              file=sys.stderr)
        return 2
    variants = [_variant.cpu_variant()]
    archs = () if cpu_only else _variant.requested_cuda_archs(cuda_arch)
    if archs:
        variants.append(_variant.Variant("cuda", archs))
    root = _loader.cache_root()
    for variant in variants:
        found, _skipped = _loader.find_entry(variant, root, _variant.environment_inputs(variant), any_toolchain=False)
        entry = found.path if found else _loader.build(variant, root, load=False)
        print(f"{variant.label}: {entry}{' (already built)' if found else ''}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deform-conv", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("check", help="build if needed and check the op against the reference (the default)")
    sub.add_parser("doctor", help="show the toolchain, GPUs and cache, with a remedy for each problem found")
    build_parser = sub.add_parser("build", help="prebuild the kernels into the cache without loading them")
    build_parser.add_argument("--cuda-arch", help="GPU archs to build for, e.g. '8.0;9.0' (default: the visible GPUs "
                              "or $TORCH_CUDA_ARCH_LIST)")
    build_parser.add_argument("--cpu-only", action="store_true", help="build only the CPU library")
    sub.add_parser("bench", help="CPU benchmark against torchvision and conv2d (see `deform-conv bench --help`)",
                   add_help=False)
    clean_parser = sub.add_parser("clean", help="remove cache entries")
    clean_parser.add_argument("--stale", action="store_true", help="remove only entries the current setup would not load")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own options: parsed by the benchmark module
        deform_conv._load_libraries()
        from deform_conv import _bench

        return _bench.main(argv[1:])
    args = parser.parse_args(argv)
    try:
        if args.command == "doctor":
            return _doctor.doctor()
        if args.command == "build":
            return build(args.cuda_arch, args.cpu_only)
        if args.command == "clean":
            return _doctor.clean(args.stale)
        deform_conv._load_libraries()
        return check()
    except deform_conv.BuildError as error:
        print(f"deform-conv: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
