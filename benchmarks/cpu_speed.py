"""CPU benchmark suite: deform_conv vs torchvision vs conv2d on S1-S5 (and --extra shapes).

    python benchmarks/cpu_speed.py --extra      # writes benchmarks/results/cpu.md and cpu.png
    python benchmarks/cpu_speed.py --threads 1,2,4     # cpu_threads.md: thread scaling on S1-S3
    python benchmarks/cpu_speed.py --dtype bfloat16    # cpu_bfloat16.md: ours in bf16 vs fp32 and conv2d
    deform-conv bench [--smoke] [--extra] [--small] [--threads N[,N...]] [--dtype D] [--out DIR]

The suite itself lives in the package (deform_conv/_bench/) so that the command line can run it.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    import deform_conv  # noqa: F401  (loads the kernels)
    from deform_conv import _bench

    args = sys.argv[1:]
    if "--out" not in args:
        args += ["--out", str(Path(__file__).resolve().parent / "results")]
    sys.exit(_bench.main(args))
