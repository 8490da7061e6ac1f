"""Command line: deform-conv (the same as python -m deform_conv).

deform-conv [check] builds the kernels if needed, runs the op once against the pure-PyTorch reference (forward
and every gradient) and prints the versions, the cache entry, whether it was built now, and timings. doctor,
build and clean look after the kernel cache; bench runs the CPU benchmark suite. The help texts below are
plain text: a terminal shows them as they are.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

import deform_conv
from deform_conv._jit import cache as _cache, doctor as _doctor, loader as _loader, toolchain as _toolchain
from deform_conv._jit import build as _build, variant as _variant


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


# (rtol, atol) per dtype, the tests' own: what each dtype's arithmetic allows.
TOLERANCES = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5)}


def _errors(dtype: torch.dtype, device: str) -> List[Tuple[float, bool]]:
    """For the output and each of the five gradients: the largest absolute difference from the reference, and
    whether every element is within the dtype's tolerance. The reference runs in float64 on the same values: a
    float32 reference has rounding errors of its own (torch's float32 einsum, which it uses, was off by 3e-2 on
    one platform), which the check would blame on the op."""
    rtol, atol = TOLERANCES[dtype]
    args = _case(dtype, device)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    results = []
    for fn, as_dtype in ((deform_conv.deform_conv2d, dtype), (deform_conv.deform_conv2d_reference, torch.float64)):
        leaves = [t.detach().to(as_dtype).requires_grad_() for t in tensors]
        it = iter(leaves)
        call = [next(it) if isinstance(a, torch.Tensor) else a for a in args]
        out = fn(*call)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        results.append([out, *grads])
    errors = []
    for ours, exact in zip(*results):
        diff = (ours.double() - exact).abs()
        errors.append((diff.max().item(), bool((diff <= atol + rtol * exact.abs()).all())))
    return errors


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
        key = _cache.inspect_entry(lib.entry, hash_library=False).key
        built = f" ({_doctor.build_summary(key, lib.from_cache)})" if key is not None else ""
        print(f"  {lib.variant.kind:10s} {lib.entry.name}: {how}{built}")

    if "cpu" not in {lib.variant.kind for lib in deform_conv.libraries}:
        print("FAILED: no compiled CPU kernels are loaded (DEFORM_CONV_FALLBACK=reference runs the reference)")
        return 1
    print(f"  cpu GEMMs  {_doctor.batch_reduce_gemm()}")
    print(f"  cpu half   {_doctor.half_precision_paths()}")
    ok = True
    names = ("output", "grad_input", "grad_offset", "grad_weight", "grad_bias", "grad_mask")
    # The CUDA kernels too, where their library is loaded and a GPU is visible.
    devices = ["cpu"] + (["cuda"] if "cuda" in {lib.variant.kind for lib in deform_conv.libraries} and gpus else [])
    for device in devices:
        for dtype, (rtol, atol) in TOLERANCES.items():
            errors = _errors(dtype, device)
            passed = all(within for _, within in errors)
            ok &= passed
            detail = ", ".join(f"{n} {e:.1e}{'' if within else ' (too far)'}" for n, (e, within) in zip(names, errors))
            print(f"  {device:4s} {str(dtype):14s} {'PASS' if passed else 'FAIL'} vs reference in float64 "
                  f"(|diff| <= {atol:.0e} + {rtol:.0e} |reference|), max |diff|: {detail}")

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


def build(cuda_arch: Optional[str], cpu_only: bool, portable: bool = False) -> int:
    """Prebuilds into the cache (without loading), e.g. before launching N training processes, or for a GPU
    this machine does not have; ``portable``: a CPU library for every x86-64 CPU, to copy to other machines."""
    if cuda_arch and torch.version.cuda is None:
        print(f"deform-conv: --cuda-arch needs a CUDA build of torch; torch {torch.__version__} has no CUDA",
              file=sys.stderr)
        return 2
    variants = [_variant.cpu_variant(portable)]
    archs = () if cpu_only else _variant.requested_cuda_archs(cuda_arch)
    if archs:
        variants.append(_variant.Variant("cuda", archs))
    root = _loader.cache_root()
    built = {v: _loader.find_entry(v, root, _variant.environment_inputs(v), any_toolchain=False)[0] for v in variants}
    failed = _build.build_concurrently(tuple(variants))  # CPU and CUDA compiles overlap
    for variant in variants:
        if variant in failed:
            raise failed[variant]
        found = built[variant]
        # (What build_concurrently compiled, build finds under the lock and returns.)
        entry = found.path if found else _build.build(variant, root, load=False)
        print(f"{variant.label}: {entry}{' (already built)' if found else ''}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="deform-conv", description="Deformable convolution kernels for PyTorch: build them, check them against "
        "the reference, look after their cache. The same as python -m deform_conv.")
    sub = parser.add_subparsers(dest="command", metavar="{check,doctor,build,bench,clean}")

    def command(name: str, help: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", **kwargs)

    command("check", "build the kernels if needed, check the op against the reference (forward and every "
            "gradient), print versions and timings; the default")
    command("doctor", "show the toolchain, GPUs, CPU paths and cache, with a remedy for each problem found")
    build_parser = command("build", "prebuild the kernels into the cache without loading them")
    build_parser.add_argument("--cuda-arch", help="GPU archs to build for, e.g. '8.0;9.0' (default: the visible GPUs "
                              "or $TORCH_CUDA_ARCH_LIST)")
    build_parser.add_argument("--cpu-only", action="store_true", help="build only the CPU library")
    build_parser.add_argument("--portable", action="store_true", help="build a CPU library for every x86-64 CPU "
                              "(copies of its kernels for x86-64, AVX2 and AVX-512), to copy to other machines; "
                              "by default it is built for this CPU only, as an import builds it")
    command("bench", "CPU benchmark against torchvision and conv2d; its own --help lists its options",
            add_help=False)
    clean_parser = command("clean", "remove the cache entries and whatever else the package keeps in the cache")
    clean_parser.add_argument("--stale", action="store_true", help="remove only entries the current setup would not "
                              "load (in a cache that machines of several kinds share, the others' entries too)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own options: parsed by the benchmark module
        if not {"-h", "--help"} & set(argv[1:]):  # the help needs no kernels, and must not wait for a build
            deform_conv._load_libraries()
        from deform_conv import _bench

        return _bench.main(argv[1:])
    args = parser.parse_args(argv)
    try:
        if args.command == "doctor":
            return _doctor.doctor()
        if args.command == "build":
            return build(args.cuda_arch, args.cpu_only, args.portable)
        if args.command == "clean":
            return _doctor.clean(args.stale)
        deform_conv._load_libraries()
        return check()
    except deform_conv.BuildError as error:
        print(f"deform-conv: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
