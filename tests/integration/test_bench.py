"""A smoke run of the CPU benchmark suite (tiny shapes, seconds) so that it cannot rot; the full run is
`python benchmarks/cpu_speed.py --extra`, not a test. Likewise the GPU check's memcheck case, run on the CPU."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deform_conv import _bench
from deform_conv._bench import cases, environment, suite, tables, timing


def test_smoke_benchmark_measures_every_column():
    rows = suite.run(cases.SMOKE_CASES, min_seconds=0.01, memory=True, onnx=True)
    assert [r["case"] for r in rows] == ["T1", "T2"]
    for row in rows:
        for impl in ("ours", "torchvision", "conv2d"):
            for phase in ("fwd", "fwdbwd"):
                value = row[f"{impl}_{phase}"]
                assert math.isfinite(value) and value > 0, (impl, phase, value)
        for impl in ("ours", "torchvision"):
            assert row[f"{impl}_peak_mib"] is None or row[f"{impl}_peak_mib"] >= 0


def test_bench_command_writes_the_table(tmp_path):
    result = subprocess.run([sys.executable, "-m", "deform_conv", "bench", "--smoke", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "cpu.md").read_text()
    assert "| case | config | fwd ms: ours |" in table
    assert "| T1 |" in table and "| T2 |" in table and "torch " in table


def test_a_case_with_a_width_is_not_square():
    case = cases.Case("W", 2, 6, 4, 9, offset_groups=3, width=14, stride=2)
    assert "9x14" in case.describe()
    assert "33x31" in cases.SMALL_CASES[1].describe() and "40x40" in cases.SMALL_CASES[2].describe()
    t = cases.make_inputs(case)
    out_h, out_w = (9 + 2 - 3) // 2 + 1, (14 + 2 - 3) // 2 + 1
    assert out_h != out_w and case.output_size() == (out_h, out_w)
    assert t["x"].shape == (2, 6, 9, 14)
    assert t["offset"].shape == (2, 2 * 3 * 9, out_h, out_w)
    assert t["mask"].shape == (2, 3 * 9, out_h, out_w)
    assert cases._conv2d(case, t).shape == (2, 4, out_h, out_w)


def test_every_peer_computes_the_grouped_non_square_case():
    case = cases.SMALL_CASES[1]  # G2: weight groups 3, offset groups 5, 33x31
    t = cases.make_inputs(case)
    ours = cases._ours(case, t)
    assert ours.shape == (3, 60, 33, 31)
    torch.testing.assert_close(ours, cases._torchvision(case, t), rtol=1e-4, atol=1e-4)
    assert cases._conv2d(case, t).shape == ours.shape
    session = timing.onnxruntime_call(case)
    if session is not None:
        torch.testing.assert_close(torch.from_numpy(session()[0]), ours, rtol=1e-4, atol=1e-4)


def test_half_table_measures_every_column():
    rows = tables.run_half(cases.SMOKE_CASES, torch.bfloat16, min_seconds=0.01)
    assert [r["case"] for r in rows] == ["T1", "T2"]
    for row in rows:
        timings = {k: v for k, v in row.items() if k not in ("case", "config")}
        impls = ("ours_half", "ours_fp32", "conv2d_half", "conv2d_cl_half")
        assert set(timings) == {f"{impl}_{phase}" for impl in impls for phase in ("fwd", "fwdbwd")}
        for key, value in timings.items():
            assert math.isfinite(value) and value > 0, (key, value)
        assert tables.format_half_row(row).count("|") == 15  # 14 cells, as half_header's


def test_channels_last_call_feeds_conv2d_channels_last_tensors():
    case = cases.SMOKE_CASES[0]
    t = cases.to_channels_last(cases.make_inputs(case, dtype=torch.bfloat16))
    assert t["x"].is_contiguous(memory_format=torch.channels_last) and not t["x"].is_contiguous()
    assert cases._conv2d(case, t).is_contiguous(memory_format=torch.channels_last)


def test_thread_scaling_has_a_row_per_case_and_count():
    rows = tables.run_threads(cases.SMOKE_CASES, [1, 2], min_seconds=0.01)
    assert [(r["case"], r["threads"]) for r in rows] == [("T1", 1), ("T1", 2), ("T2", 1), ("T2", 2)]
    for row in rows:
        for key in ("ours_fwd", "ours_fwdbwd", "conv2d_fwd", "conv2d_fwdbwd", "speedup_fwd", "speedup_fwdbwd"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert rows[0]["speedup_fwd"] == 1.0 and rows[0]["speedup_fwdbwd"] == 1.0


def test_thread_counts_above_the_cores_are_skipped_with_a_note():
    usable, notes = tables.usable_thread_counts([1, 2, 4], cores=2)
    assert usable == [1, 2] and len(notes) == 1 and "4 threads" in notes[0]


def test_bench_command_writes_the_thread_scaling_table(tmp_path):
    result = subprocess.run([sys.executable, "-m", "deform_conv", "bench", "--smoke", "--threads", "1,2,4096",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4096 threads skipped" in result.stdout
    table = (tmp_path / "cpu_threads.md").read_text()
    assert "--threads 1,2,4096" in table and "oneDNN ISA: " in table
    rows = re.findall(r"^\| (T\d) \| [^|]+ \| (\d+) \|", table, re.MULTILINE)
    assert rows == [("T1", "1"), ("T1", "2"), ("T2", "1"), ("T2", "2")]


def test_bench_command_writes_the_half_table(tmp_path):
    result = subprocess.run([sys.executable, "-m", "deform_conv", "bench", "--smoke", "--dtype", "bfloat16",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "cpu_bfloat16.md").read_text()
    assert "| fwd ms: ours bfloat16 | ours fp32 | conv2d bfloat16 |" in table
    assert "; bfloat16;" in table and "| T1 |" in table and "| T2 |" in table
    assert not (tmp_path / "cpu.md").exists()


@pytest.mark.parametrize("args, named", [
    (["--threads", "0"], "--threads"),
    (["--threads", "1,x"], "--threads"),
    (["--threads", "2,2"], "--threads"),
    (["--threads", "1,2", "--dtype", "bfloat16"], "--threads"),
    (["--threads", "1,2", "--small"], "--threads"),
    (["--dtype", "int8"], "--dtype"),
    (["--gpu", "--dtype", "float16"], "--gpu"),
    (["--op", "dcnv5"], "--op"),
    (["--op", "dcnv3", "--gpu"], "--op"),
    (["--op", "flash_deform_attn", "--threads", "1,2"], "--op"),
])
def test_bad_arguments_are_argparse_errors_naming_the_argument(args, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _bench.main(args)
    assert exit_info.value.code == 2
    assert f"argument {named}" in capsys.readouterr().err


def test_onednn_isa_names_an_instruction_set():
    assert environment.parse_onednn_isa("x\nonednn_verbose,v1,info,cpu,isa:Intel AVX2\ny") == "Intel AVX2"
    assert environment.parse_onednn_isa("onednn_verbose,v1,info,gpu,runtime:none") == "unknown"
    isa = environment.onednn_isa()
    assert isinstance(isa, str) and isa.strip()
    if torch.backends.mkldnn.is_available():
        assert isa != "unknown"


def test_the_cpu_is_named_with_its_family_model_and_vector_sets():
    zen4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n\n"
            "processor\t: 1\nmodel name\t: other\n")
    assert environment.parse_cpu(zen4) == "AMD EPYC (family 25, model 17; AVX2, AVX-512, AVX512-BF16)"
    first = environment.first_processor(zen4)
    assert first["vendor_id"] == "AuthenticAMD" and first["model name"] == "AMD EPYC"  # not processor 1's "other"
    spr = "cpu family : 6\nmodel : 143\nmodel name : Xeon\nflags : avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16\n"
    assert environment.parse_cpu(spr) == "Xeon (family 6, model 143; AVX2, AVX-512, AVX512-BF16, AVX512-FP16, AMX)"
    assert environment.parse_cpu("model name : Old\nflags : sse2\n") == (
        "Old (family ?, model ?; none of AVX2, AVX-512, AMX)")
    assert environment.parse_cpu("Hardware : some board\n") is None
    assert environment.cpu_name().strip()


def test_interleaved_medians_call_each_at_least_three_times_in_turns():
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in "abc"}
    medians = timing.interleaved_medians(calls, min_seconds=0.0)
    assert set(medians) == set("abc") and all(m >= 0 for m in medians.values())
    assert order[:3] == list("abc")  # a warm-up each
    rounds = [order[i:i + 3] for i in range(3, len(order), 3)]
    assert len(order) == 12 and all(sorted(r) == list("abc") for r in rounds)  # three rounds of one call each


def test_interleaved_medians_shuffle_the_order_of_each_round():
    """No call always runs right after the same one (whose leftovers in the caches it would inherit)."""
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in "abcd"}
    timing.interleaved_medians(calls, min_seconds=1.0)  # 50 rounds: each call takes no time
    rounds = [tuple(order[i:i + 4]) for i in range(4, len(order), 4)]
    assert len(rounds) == 50 and all(sorted(r) == list("abcd") for r in rounds)
    assert len(set(rounds)) > 10
    followers_of_d = {r[r.index("d") + 1] for r in rounds if r[-1] != "d"}
    assert followers_of_d == set("abc")


def test_gpu_memcheck_case_runs_on_the_cpu():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_memcheck_case.py"
    result = subprocess.run([sys.executable, str(script), "cpu"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "memcheck case ran on cpu" in result.stdout


@pytest.mark.parametrize("op", ["dcnv3", "dcnv4", "flash_deform_attn"])
def test_family_table_measures_every_column(op):
    """`--op`'s table on the smoke shapes: a forward and a forward+backward row, every time positive, and the
    grid_sample composition it compares with computes what the op computes."""
    from deform_conv._bench import family

    text = family.table(op, smoke=True, min_seconds=0.01, dtype=torch.float32)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "(ms)" not in line]
    assert [row.split("|")[2].strip() for row in rows] == ["fwd", "fwd+bwd"]
    for row in rows:
        times = [float(cell) for cell in row.split("|")[3:6]]
        assert all(math.isfinite(t) and t > 0 for t in times), row
    calls = (family._flash_calls(family.SMOKE_LEVELS, torch.float64) if op == "flash_deform_attn"
             else family._grid_calls(op, *family.SMOKE_STAGES["smoke"], torch.float64))
    ours, composed = (fn(tensors) for fn, tensors in (calls["ours"], calls["grid_sample"]))
    torch.testing.assert_close(ours, composed, rtol=1e-6, atol=1e-6)


def test_bench_command_writes_a_family_table(tmp_path):
    result = subprocess.run([sys.executable, "-m", "deform_conv", "bench", "--smoke", "--op", "dcnv3", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    table = (tmp_path / "cpu_dcnv3.md").read_text()
    assert "| case | pass | ours (ms) | grid_sample composition (ms) | depthwise conv2d (ms) |" in table
    assert "| smoke | fwd |" in table and "| smoke | fwd+bwd |" in table and "torch " in table


SAMPLING_PASSES_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sampling_passes_speed.py"


def test_sampling_passes_table_times_every_pass_in_each_dtype(tmp_path):
    """benchmarks/sampling_passes_speed.py on the tiny case: a time for every pass in float32 and bfloat16 (the
    half path's passes on any CPU: natively or beside the portable GEMM), each row's ratio to float32. Two images
    on two threads take the tiled backward (cpu/tiled_backward.h), whose row stands for the GEMMs' and the
    coordinates' and input's gradients; float32 takes it where the batch-reduce GEMM runs."""
    out = tmp_path / "passes.md"
    result = subprocess.run([sys.executable, str(SAMPLING_PASSES_SCRIPT), "--threads", "2", "--cases", "T1", "--dtypes",
                             "float32,bfloat16", "--rounds", "1", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| T1 |")]
    names = [row.split("|")[2].strip().split(" (")[0] for row in rows]
    if not torch.ops.deform_conv.brgemm_available():  # float32 on the driver's passes, bfloat16 tiled
        assert names == ["channels_last", "fill_columns", "coordinate_grads", "input_grad", "channels_first",
                         "sampling passes", "backward_gemms", "tiled_backward"]
        pytest.skip("float32 takes the driver's passes here and bfloat16 the tiled backward: rows of one dtype")
    assert names == ["channels_last", "fill_columns", "channels_first", "sampling passes", "tiled_backward"]
    for row in rows:
        cells = [cell.strip() for cell in row.split("|")[3:6]]
        assert "-" not in cells and all(float(cell) >= 0 for cell in cells), row
    assert "bfloat16: native" in rows[-1] or "bfloat16: portable" in rows[-1]


def test_sampling_passes_refuse_a_half_layer_whose_columns_are_float32():
    """The script's check that a half type's backward filled its columns in that type: a bfloat16 call made to take
    the float32 path (DEFORM_CONV_CPU_HALF_GEMM=float32) records float32 columns and is refused, by name; on the
    half path (portable GEMM, any CPU) its columns are bfloat16 and pass."""
    spec = importlib.util.spec_from_file_location("sampling_passes_speed", SAMPLING_PASSES_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    call = timing.make_call(cases.SMOKE_CASES[0], "ours", True, dtype=torch.bfloat16)
    times, column_types = script.profiled_call(call, "float32")
    assert column_types == {"float"} and "fill_columns" in times
    with pytest.raises(SystemExit, match="T1 in bfloat16 filled columns of float, expected c10::BFloat16"):
        script.check_columns("T1", "bfloat16", column_types)
    times, column_types = script.profiled_call(call, "portable")
    assert column_types == {"c10::BFloat16"}
    script.check_columns("T1", "bfloat16", column_types)
