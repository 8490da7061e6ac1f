"""benchmarks/gpu_check.sh on a machine without a GPU: its dry run (the interpreter it picks, its paths, plan and
budget, the files it leaves), and a run against stand-ins for the interpreter and compute-sanitizer (what each
step sees in its environment, the verdicts, the summary). The GPU machine it is written for has python3 and no
python, and returns at most 8 files from $OUT."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
STEPS = ["environment", "build", "selfcheck", "tests", "benchmark", "memcheck", "initcheck"]
SANITIZER_STEPS = {"memcheck", "initcheck"}
# What the script may call besides bash's builtins: a PATH of these alone shows it needs nothing else.
TOOLS = ["cat", "date", "dirname", "env", "grep", "head", "mkdir", "mktemp", "rm", "sed", "tail", "timeout", "wc"]
PLAN = re.compile(r"^plan: (\S+) \| (\d+) s \| (\S+) \| (.*)$", re.MULTILINE)
needs_tools = pytest.mark.skipif(not all(shutil.which(t) for t in TOOLS + ["bash"]),
                                 reason="needs bash and coreutils")


def tool_dir(tmp_path: Path, pythons=("python3",)) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for name in pythons:
        (bin_dir / name).symlink_to(sys.executable)
    return bin_dir


def run(tmp_path: Path, bin_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The script with OUT and TMPDIR relative to tmp_path (its cwd), an inherited TORCH_CUDA_ARCH_LIST and a
    DEFORM_CONV_* variable, and nothing else from this process's environment."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    base = {"PATH": str(bin_dir), "HOME": str(tmp_path), "OUT": "out/check", "TMPDIR": "tmp",
            "TORCH_CUDA_ARCH_LIST": "8.0", "DEFORM_CONV_CUDA": "0"}
    return subprocess.run([shutil.which("bash"), str(SCRIPT), *args], cwd=tmp_path, env={**base, **env},
                          capture_output=True, text=True, timeout=60, check=False)


def header(stdout: str, key: str) -> str:
    match = re.search(rf"^  {re.escape(key)} +(.*)$", stdout, re.MULTILINE)
    assert match, f"no {key!r} line in:\n{stdout}"
    return match.group(1)


def summary_steps(out: Path) -> dict:
    lines = (out / "summary.txt").read_text().splitlines()
    found = [line.split(": ", 1) for line in lines if line.split(":", 1)[0] in STEPS]
    assert [name for name, _ in found] == STEPS, lines  # each step once, in order
    return dict(found)


def files_in(out: Path) -> list:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def test_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_finds_nothing():
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout


@needs_tools
@pytest.mark.parametrize("mode, limit", [("full", 480), ("quick", 240)])
def test_dry_run(tmp_path, mode, limit):
    bin_dir = tool_dir(tmp_path)
    result = run(tmp_path, bin_dir, "--dry-run", *(["--quick"] if mode == "quick" else []))
    assert result.returncode == 0, result.stdout + result.stderr
    stdout = result.stdout
    out = (tmp_path / "out" / "check").resolve()

    assert header(stdout, "interpreter").startswith(f"{bin_dir}/python3 (python3 on PATH")
    assert header(stdout, "OUT").startswith(f"{out} ")
    cache = Path(header(stdout, "cache").split()[0])
    assert cache.is_absolute() and cache.parent.parent == (tmp_path / "tmp").resolve()
    assert out not in cache.parents
    assert not cache.parent.exists()  # the private directory goes at exit
    assert "TORCH_CUDA_ARCH_LIST unset (was '8.0')" in stdout
    assert header(stdout, "python sees") == "PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=<unset>"
    assert header(stdout, "unset").startswith("DEFORM_CONV_CUDA ")

    plan = PLAN.findall(stdout)
    assert [name for name, *_ in plan] == STEPS
    for name, seconds, log, command in plan:
        assert Path(log).is_absolute() and Path(log).parent == out, log
        assert ("PYTORCH_NO_CUDA_MEMORY_CACHING=1" in command) == (name in SANITIZER_STEPS), command
        assert f"{bin_dir}/python3" in command.split(), command
    budget = sum(int(seconds) for _, seconds, *_ in plan)
    assert budget < limit
    assert header(stdout, "budget").startswith(f"{budget} s ")

    steps = summary_steps(out)
    for name, seconds, *_ in plan:
        assert steps[name] == ("skipped (dry run)" if int(seconds) else f"skipped (not in {mode} mode)")
    # A real run writes the same files, and the benchmark's gpu.md besides.
    logs = {Path(log).name for *_, log, _ in plan}
    assert files_in(out) == sorted(logs | {"summary.txt"})
    assert len(files_in(out)) + 1 <= 8


@needs_tools
@pytest.mark.parametrize("pythons, python_env, chosen", [
    (("python3",), None, "python3 (python3 on PATH"),
    (("python3", "python"), None, "python3 (python3 on PATH"),
    (("python",), None, "python (python on PATH"),
    (("python", "custom-python"), "custom-python", "custom-python ($PYTHON"),
])
def test_interpreter_choice(tmp_path, pythons, python_env, chosen):
    bin_dir = tool_dir(tmp_path, pythons)
    result = run(tmp_path, bin_dir, "--dry-run", **({"PYTHON": python_env} if python_env else {}))
    assert result.returncode == 0, result.stderr
    assert header(result.stdout, "interpreter").startswith(f"{bin_dir}/{chosen}")


@needs_tools
def test_no_interpreter_is_an_error(tmp_path):
    result = run(tmp_path, tool_dir(tmp_path, pythons=()), "--dry-run")
    assert result.returncode == 2 and "no python3 or python on PATH" in result.stderr


@needs_tools
def test_a_step_that_no_longer_fits_before_the_deadline_is_skipped(tmp_path):
    result = run(tmp_path, tool_dir(tmp_path), "--dry-run", GPU_CHECK_DEADLINE="100")
    assert result.returncode == 0, result.stderr
    steps = summary_steps(tmp_path / "out" / "check")
    assert steps["environment"] == "skipped (dry run)"
    assert re.fullmatch(r"skipped \(out of time: (99|100) s left, the step may take \d+ s\)", steps["build"]), steps


# Stand-ins: an interpreter that answers each of the script's commands as on a healthy GPU machine and records
# what it was run with, and a compute-sanitizer that runs its program (or refuses, or finds an error).
FAKE_PYTHON = """\
    import json, os, subprocess, sys
    args = sys.argv[1:]
    if args[0] == "-c":
        os.execv(REAL, [REAL, *args])
    keys = ("PYTHONUNBUFFERED", "PYTORCH_NO_CUDA_MEMORY_CACHING", "TORCH_CUDA_ARCH_LIST", "DEFORM_CONV_CUDA",
            "DEFORM_CONV_CACHE_DIR", "PYTHONPATH")
    with open(os.environ["FAKE_CALLS"], "a") as calls:
        calls.write(json.dumps({"args": args, "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in keys}}) + "\\n")
    if args[0].endswith("environment.py"):
        print("torch: 2.11.0+cu130 (CUDA 13.0)\\ndevice: NVIDIA H200 (capability 9.0; 1 visible)")
    elif args[:3] == ["-m", "deform_conv", "build"] and os.environ.get("FAKE_BUILD") == "fail":
        sys.exit("deform_conv: the build failed")
    elif args[:2] == ["-m", "pytest"]:
        print("======== 61 passed, 2 skipped in 30.01s ========")
    elif args[:3] == ["-m", "deform_conv", "bench"]:
        out = args[args.index("--out") + 1]
        for name in ["gpu.md"] + [f"extra{i}.md" for i in range(int(os.environ.get("FAKE_EXTRA_FILES", "0")))]:
            open(os.path.join(out, name), "w").write("| table |\\n")
    elif args[0].endswith("gpu_memcheck_case.py"):
        print("memcheck case ran on cuda")
"""
FAKE_SANITIZER = """\
    import os, subprocess, sys
    args = sys.argv[1:]
    if args == ["--version"]:
        sys.exit(print("NVIDIA (R) Compute Sanitizer\\nVersion 2025.3.0.0"))
    while args[0].startswith("--"):
        args = args[2:]
    print("========= COMPUTE-SANITIZER", flush=True)
    how = os.environ.get("FAKE_SANITIZER", "")
    if how == "refuse":
        sys.exit(print("========= Error: Device not supported") or 1)
    rc = subprocess.call(args)
    if how == "errors":
        print("========= Invalid __global__ write of size 4 bytes\\n========= ERROR SUMMARY: 1 error")
        sys.exit(1)
    print("========= ERROR SUMMARY: 0 errors")
    sys.exit(rc)
"""


def stand_ins(tmp_path: Path, sanitizer: bool = True):
    bin_dir = tool_dir(tmp_path)
    for name, source in [("fake-python", FAKE_PYTHON)] + ([("compute-sanitizer", FAKE_SANITIZER)] if sanitizer else []):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\nREAL = {sys.executable!r}\n" + textwrap.dedent(source))
        path.chmod(0o755)
    return bin_dir


def run_with_stand_ins(tmp_path, sanitizer=True, **env):
    bin_dir = stand_ins(tmp_path, sanitizer)
    calls = tmp_path / "calls.jsonl"
    result = run(tmp_path, bin_dir, PYTHON="fake-python", FAKE_CALLS=str(calls), **env)
    recorded = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return result, recorded, summary_steps(tmp_path / "out" / "check")


@needs_tools
def test_a_healthy_run(tmp_path):
    result, calls, steps = run_with_stand_ins(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(verdict.startswith("passed (") for verdict in steps.values()), steps
    assert steps["tests"].endswith("; 61 passed, 2 skipped in 30.01s)")
    assert steps["memcheck"].endswith("; 0 errors)")
    summary = (tmp_path / "out" / "check" / "summary.txt").read_text()
    assert "device: NVIDIA H200 (capability 9.0; 1 visible)" in summary
    assert "torch: 2.11.0+cu130 (CUDA 13.0)" in summary

    out = (tmp_path / "out" / "check").resolve()
    assert files_in(out) == ["benchmark.log", "build.log", "environment.log", "gpu.md", "sanitizer.log",
                             "selfcheck.log", "summary.txt", "tests.log"]
    assert "WARNING" not in summary
    assert (out / "sanitizer.log").read_text().count("memcheck case ran on cuda") == 2  # memcheck, initcheck

    # Five steps run the interpreter (the full mode's benchmark step twice: the bench, then ms_deform_attn's
    # encoder case), the two sanitizer steps the case under it.
    assert len(calls) == 8
    cache = {call["env"]["DEFORM_CONV_CACHE_DIR"] for call in calls}
    assert len(cache) == 1 and Path(cache.pop()).is_absolute()
    for call in calls:
        case = call["args"][0].endswith("gpu_memcheck_case.py")
        assert call["cwd"] == str(REPO)
        assert call["env"]["PYTHONUNBUFFERED"] == "1"
        assert call["env"]["PYTORCH_NO_CUDA_MEMORY_CACHING"] == ("1" if case else None), call
        assert call["env"]["TORCH_CUDA_ARCH_LIST"] is None and call["env"]["DEFORM_CONV_CUDA"] is None
        assert call["env"]["PYTHONPATH"].split(":")[0] == str(REPO / "src")
        assert out not in Path(call["env"]["DEFORM_CONV_CACHE_DIR"]).parents
    bench = next(call["args"] for call in calls if call["args"][:3] == ["-m", "deform_conv", "bench"])
    assert bench[3:] == ["--gpu", "--out", str(out)]


@needs_tools
def test_a_sanitizer_that_refuses_the_device_is_a_skip(tmp_path):
    result, _, steps = run_with_stand_ins(tmp_path, FAKE_SANITIZER="refuse")
    assert result.returncode == 0, result.stdout
    assert steps["memcheck"] == "skipped (compute-sanitizer refused the device: Error: Device not supported)"
    assert steps["initcheck"] == steps["memcheck"]


@needs_tools
def test_a_missing_sanitizer_is_a_skip(tmp_path):
    result, _, steps = run_with_stand_ins(tmp_path, sanitizer=False)
    assert result.returncode == 0, result.stdout
    assert steps["memcheck"] == steps["initcheck"] == "skipped (compute-sanitizer not installed)"


@needs_tools
def test_errors_found_by_the_sanitizer_fail_the_check(tmp_path):
    result, _, steps = run_with_stand_ins(tmp_path, FAKE_SANITIZER="errors")
    assert result.returncode == 1
    assert re.fullmatch(r"failed \(exit 1 after \d+ s; 1 error\)", steps["memcheck"]), steps["memcheck"]


@needs_tools
def test_a_failed_build_skips_every_later_step(tmp_path):
    result, calls, steps = run_with_stand_ins(tmp_path, FAKE_BUILD="fail")
    assert result.returncode == 1
    assert re.fullmatch(r"failed \(exit 1 after \d+ s\)", steps["build"]), steps["build"]
    assert all(steps[name] == "skipped (the build failed)" for name in STEPS[2:]), steps
    assert [call["args"][:3] for call in calls][1:] == [["-m", "deform_conv", "build"]]


@needs_tools
def test_more_than_8_files_in_out_are_reported(tmp_path):
    result, _, _ = run_with_stand_ins(tmp_path, FAKE_EXTRA_FILES="2")
    assert result.returncode == 0, result.stdout
    assert "WARNING: 10 files in" in (tmp_path / "out" / "check" / "summary.txt").read_text()
