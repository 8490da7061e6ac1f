"""Benchmark suite (`deform-conv bench [--gpu]`, `python benchmarks/cpu_speed.py`).

For each case: forward and forward+backward time of ours, of torchvision's deform_conv2d and of conv2d at the
same shape (the floor), the ratios, and the peak memory of ours and torchvision's during a forward+backward
(measured in a child process each: the rise of the resident set's high-water mark over what the inputs occupy,
with malloc made to return freed blocks at once so that the resident set follows the live memory; for ours plus
the scratch memory its kernels keep between calls). onnxruntime's DeformConv runs as a forward-only peer where it
is installed, timed on its own after the others (its threads spin for a while after each run, on the cores the
next implementation would need). Timing: one warm-up call each, then
ours, torchvision's and conv2d take turns, one call each per round, so that all of them meet the same machine (a
shared machine's load drifts within seconds, and measured one after the other the ratios would measure the
drift); each is called until at least ``min_seconds`` of its calls have passed (at least 3, at most 50 calls) and
its median is reported; threads = all cores unless --threads says otherwise. The command line also turns malloc's
trimming off (steady_malloc).

Two more CPU tables come from the same timing (their code, and the GPU table's: tables.py):
`--threads 1,2,4` (a list) times ours and conv2d in fp32 at each thread count (thread scaling, cpu_threads.md),
and `--dtype bfloat16` / `--dtype float16` times ours in that dtype against ours in fp32 and conv2d in that dtype,
NCHW and channels_last (cpu_<dtype>.md); torchvision's CPU kernels have no bfloat16, so it is left out of that
table, as are onnxruntime and the peak memory.

`--op dcnv3|dcnv4|flash_deform_attn` times that op against its grid_sample composition and the floor of its shape
(family.py; cpu_<op>.md).

A module a concern, each importing only those listed before it: ``cases`` (shapes, inputs, implementations),
``timing`` (interleaved medians, peak memory, onnxruntime), ``environment`` (the environment line), ``report``
(number formats, results files), ``suite`` (the main table and its plot), ``tables`` (the other tables),
``family`` (the DCNv3 family's tables) and ``cli`` (the options, and ``main``).
"""

from .cases import IMPLEMENTATIONS, Case, make_inputs
from .cli import main
from .timing import steady_malloc

# main: the command line; steady_malloc: for other benchmarks' timings; Case, make_inputs and IMPLEMENTATIONS: what
# the peak-memory child process (timing.py) runs.
__all__ = ["IMPLEMENTATIONS", "Case", "main", "make_inputs", "steady_malloc"]
