"""The loader: the kernel libraries built for this machine at first import, cached, and loaded on every import.

One concern a module: ``settings`` (every environment variable, validated), ``sources`` (what each library is
compiled from and with; plain data that setup.py reads too), ``variant`` (what a library is built from and for,
its key and entry name), ``cache`` (where entries live, whether they may be trusted, every write there),
``toolchain`` (compiler, ninja, nvcc), ``compile`` (the build in a child process), ``loader`` (which library is
loaded: bundled, cached or built under the lock), ``progress`` (build progress on stderr), ``errors``
(:class:`BuildError`) and ``doctor`` (``deform-conv doctor`` and ``clean``).

Nothing here is imported by this file: ``import deform_conv`` imports what the warm path needs, and setup.py
imports these modules without running the package's ``__init__``.
"""
