"""Every environment variable the package reads, validated in one place.

Each reader returns the parsed value or raises :class:`BuildError` naming the variable, its value and what it
accepts. The README's table of variables lists :data:`VARIABLES` (a test keeps the two in step).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple

from .errors import BuildError

# name -> (default, what it accepts): the README's table, one row each.
VARIABLES: Dict[str, Tuple[str, str]] = {
    "DEFORM_CONV_CACHE_DIR": ("unset", "a directory: the kernel cache (relative paths are made absolute)"),
    "XDG_CACHE_HOME": ("unset", "an absolute directory; the cache is `$XDG_CACHE_HOME/deform_conv` "
                                "(a relative value is ignored, as the XDG spec says)"),
    "DEFORM_CONV_FALLBACK": ("unset (off)", "`reference`: a library that cannot be built is a warning, and its "
                                            "device runs the pure-PyTorch implementation; `0` or empty: off"),
    "DEFORM_CONV_VERBOSE": ("0", "`1`: show the compiler's output as it runs; `0`: progress lines only"),
    "DEFORM_CONV_CUDA": ("1", "`0`: CPU kernels only, even with a GPU visible; `1`: the CUDA library too where "
                              "a GPU is visible or TORCH_CUDA_ARCH_LIST names archs"),
    "DEFORM_CONV_SANITIZE": ("0", "`1` (= `address,undefined`) or a comma-separated list of `address`, "
                                  "`undefined`: the CPU library with sanitizers, an entry of its own"),
    "DEFORM_CONV_CPU_HALF_GEMM": ("auto", "`auto`: bfloat16/float16 layers multiply in their type where the CPU does "
                                          "so natively and faster than in float32 (AMX; AVX512-BF16 on AMD's cores for "
                                          "bfloat16; AMX-FP16 for float16), in float32 elsewhere; `float32`: in "
                                          "float32 everywhere; `portable`: in their type everywhere, on ATen's "
                                          "portable GEMM where the CPU has no native one (slow; for tests); read on "
                                          "every call"),
    "DEFORM_CONV_AOT": ("0", "`1`: `pip install --no-build-isolation .` compiles the kernels at install time"),
    "MAX_JOBS": ("as many as cores and memory allow", "a positive integer: parallel compile jobs"),
    "TORCH_CUDA_ARCH_LIST": ("the visible GPUs' archs", "archs by number such as `8.0;9.0+PTX` (`;`, `,` or "
                                                        "spaces between them; `a`/`f` suffixes as in `9.0a`; not "
                                                        "names such as `Hopper`)"),
}

SANITIZERS = ("address", "undefined")  # what DEFORM_CONV_SANITIZE=1 means, and all it accepts
_ARCH = re.compile(r"^\d+\.\d+[af]?(\+PTX)?$")


def _raw(name: str) -> str:
    return os.environ.get(name, "").strip()


def _invalid(name: str, value: str, variable: Optional[str] = None) -> BuildError:
    """The error for ``name`` (a variable, or an option that takes ``variable``'s values) set to ``value``."""
    default, accepts = VARIABLES[variable or name]
    return BuildError(f"{name} must be {accepts}; got {value!r}.\nRemedy: set it to one of those values, or "
                      f"unset it (default: {default}).")


def _switch(name: str, default: bool) -> bool:
    value = _raw(name)
    if value == "":
        return default
    if value not in ("0", "1"):
        raise _invalid(name, value)
    return value == "1"


def cache_dir() -> Path:
    """The cache root, absolute: ``$DEFORM_CONV_CACHE_DIR``, else ``$XDG_CACHE_HOME/deform_conv``, else
    ``~/.cache/deform_conv``. Absolute before anything uses it: the compiler runs in another directory."""
    explicit = _raw("DEFORM_CONV_CACHE_DIR")
    if explicit:
        return Path(os.path.abspath(os.path.expanduser(explicit)))
    xdg = _raw("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
    return Path(os.path.abspath(base / "deform_conv"))


def fallback_to_reference() -> bool:
    value = _raw("DEFORM_CONV_FALLBACK")
    if value in ("", "0"):
        return False
    if value != "reference":
        raise _invalid("DEFORM_CONV_FALLBACK", value)
    return True


def verbose() -> bool:
    return _switch("DEFORM_CONV_VERBOSE", False)


def cuda_wanted() -> bool:
    return _switch("DEFORM_CONV_CUDA", True)


def ahead_of_time() -> bool:
    return _switch("DEFORM_CONV_AOT", False)


def sanitizers() -> Tuple[str, ...]:
    """$DEFORM_CONV_SANITIZE as sorted -fsanitize= names: unset, empty or 0 is none, 1 is both of SANITIZERS."""
    value = _raw("DEFORM_CONV_SANITIZE")
    if value in ("", "0"):
        return ()
    if value == "1":
        return SANITIZERS
    names = tuple(sorted({n.strip() for n in value.split(",") if n.strip()}))
    if not names or any(n not in SANITIZERS for n in names):
        raise _invalid("DEFORM_CONV_SANITIZE", value)
    return names


def max_jobs() -> Optional[int]:
    """$MAX_JOBS as a positive int, None when unset (0 is refused: it would mean "no limit" to ninja)."""
    value = _raw("MAX_JOBS")
    if value == "":
        return None
    if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:  # not str.isdigit(), which takes superscripts
        raise _invalid("MAX_JOBS", value)
    return int(value)


def cuda_archs(spec: Optional[str] = None, name: str = "TORCH_CUDA_ARCH_LIST") -> Optional[Tuple[str, ...]]:
    """``spec`` (the CLI's --cuda-arch) or $TORCH_CUDA_ARCH_LIST as sorted arch names; None when neither is set."""
    value = (spec if spec is not None else _raw("TORCH_CUDA_ARCH_LIST")).strip()
    if not value:
        return None
    archs = [a for a in re.split(r"[;,\s]+", value) if a]
    if not all(_ARCH.match(a) for a in archs):
        raise _invalid(name, value, "TORCH_CUDA_ARCH_LIST")
    return tuple(sorted(set(archs)))


HALF_GEMM_CHOICES = ("auto", "float32", "portable")


def cpu_half_gemm() -> str:
    """How the CPU multiplies the half types (the kernels read the variable themselves on every call, and
    refuse a bad value too: csrc/deform_conv2d/cpu/half_gemm.h)."""
    value = _raw("DEFORM_CONV_CPU_HALF_GEMM")
    if value == "":
        return "auto"
    if value not in HALF_GEMM_CHOICES:
        raise _invalid("DEFORM_CONV_CPU_HALF_GEMM", value)
    return value


def validate_all() -> None:
    """Reads every variable, so that a bad value is an error at import even where it would not be used (a
    warm import builds nothing, yet MAX_JOBS=0 or DEFORM_CONV_VERBOSE=true there is a mistake to report)."""
    for read in (fallback_to_reference, verbose, cuda_wanted, ahead_of_time, sanitizers, max_jobs, cuda_archs,
                 cpu_half_gemm):
        read()
    warn_about_unknown_variables()


def warn_about_unknown_variables() -> None:
    """A misspelt DEFORM_CONV_* variable would otherwise be ignored without a word."""
    unknown = sorted(n for n in os.environ if n.startswith("DEFORM_CONV_") and n not in VARIABLES)
    if unknown:
        known = ", ".join(n for n in VARIABLES if n.startswith("DEFORM_CONV_"))
        warnings.warn(f"deform_conv: unknown environment variable(s) {', '.join(unknown)} ignored; known: {known}",
                      RuntimeWarning, stacklevel=3)
