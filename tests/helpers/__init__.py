"""Code the tests share, no tests: ``common`` (tolerances, hypothesis profiles), ``deform_conv2d`` and
``ms_deform_attn`` (each op's inputs, runners and assertions), ``ms_deform_attn_cuda`` (multi-scale deformable
attention's CUDA kernel checks, simulated or on a GPU), ``simulation`` (the CUDA simulation's settings),
``bad_inputs`` and ``errors_doc`` (the error tests' calls and docs/errors.md's table), ``loader`` (child
processes, a fast compiler) and ``ddp_worker`` (a DDP rank, also run as a script).

tests/ is on sys.path (pyproject.toml's pytest ``pythonpath``), so tests import these as ``helpers.<module>``; a
child process that needs them puts tests/ on its path itself."""
