"""The bench scripts' own smoke tests: each script run as the lent machine runs it, a subprocess
(`python bench/NAME.py --tiny-ish flags`) on the CPU, so a broken bench script is found here
and not on the GPU. What these scripts measure about the product is proved against the product
in the product's own tests; nothing here imports bench/.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Lab tooling, not the product: out of the default suite (its 10-minute aim); .ci/run runs them after it.
pytestmark = pytest.mark.bench

REPO = Path(__file__).resolve().parents[2]
SMOKE_DATA = REPO / "tests" / "data" / "smollm2_regenerated_64.jsonl.gz"


def bench(script: str, *args: str, timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    """`python bench/SCRIPT ARGS...` from the repository root, one intra-op thread (tiny models on
    shared cores), its stdout and stderr as text."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "bench" / script), *args], check=False, capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout, **popen)


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_regenerate_speed_times_every_engine_on_the_same_rows(smollm2_dir, tmp_path):
    """bench/regenerate_speed.py in its tiny mode; a budget that cuts ours mid-round counts the rows still decoding."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\nDescribe a cat.\nSay hi.\nName three primes.\nWhy is the sky blue?\n")
    out = tmp_path / "bench.json"
    common = ["--target", str(smollm2_dir), "--dims", "tiny", "--device", "cpu", "--rows", "5", "--max-new-tokens", "4",
              "--prompts", str(prompts), "--json", str(out)]
    printed = ok(bench("regenerate_speed.py", *common, "--batches", "2,3", "--attention", "auto,matmul"))
    results = json.loads(out.read_text())
    assert results["prompts"]["prompts"] == 5
    for batch in ("2", "3"):
        case = results["cases"][batch]
        assert case["ours"]["rows"] == 5 and case["ours"]["tokens"] == 20 and case["ours"]["slots"] == int(batch)
        for engine in ("ours", "ours-matmul", "hf-static", "hf"):
            assert case[engine]["tokens_per_s"] > 0, case
        assert case["ours-matmul"]["tokens"] == 20 and case["ours-matmul"]["attention"] == "matmul"
        assert case["ours"]["host"]["admitted"] == 5 and case["ours"]["host"]["steps"] > 0
        assert case["identical_to_hf_static"]["rows"] > 0
        line = re.search(rf"^regenerate tiny batch {batch}: ([\d,]+) tok/s \(HF generate ([\d,]+) tok/s\)$", printed, re.MULTILINE)
        assert line and float(line.group(1).replace(",", "")) == pytest.approx(case["ours"]["tokens_per_s"], rel=0.01, abs=1)
        assert case["ours"]["rows_in_flight_at_cut"] == 0  # every row ran to its end
    assert "rows in flight" not in printed

    printed = ok(bench("regenerate_speed.py", *common, "--batches", "3", "--engines", "ours", "--budget-s", "0"))
    ours = json.loads(out.read_text())["cases"]["3"]["ours"]
    assert ours["rows"] < 5 and ours["rows_in_flight_at_cut"] == ours["host"]["admitted"] - ours["rows"] > 0
    assert f"cut by --budget-s with {ours['rows_in_flight_at_cut']} rows in flight" in printed


def test_hybrid_targets_prints_its_summary_lines():
    printed = ok(bench("hybrid_targets.py", "--family", "qwen3_5", "--tiny", "--device", "cpu", "--steps", "3",
                       "--train-batch", "2", "--rows", "2", "--batch", "2", "--max-new-tokens", "4", "--max-seq-len", "64",
                       "--max-prompt", "16"))
    assert "target: qwen3_5_text (hybrid" in printed
    assert re.search(r"^train qwen3_5-shape: [\d.]+ samples/s \(limit .+\)$", printed, re.MULTILINE), printed[-800:]
    assert re.search(r"^regenerate qwen3_5-shape batch 2: [\d,]+ tok/s \(HF generate [\d,]+ tok/s\)$", printed, re.MULTILINE)


def test_head_ce_times_the_reference_on_the_cpu_and_refuses_the_fused_kernel_there(tmp_path):
    """bench/head_ce.py (the GPU numbers are in docs/PERF.md): the summary line and its JSON, and
    `--kernels fused` refused with the reason (exit 2)."""
    out = tmp_path / "head.json"
    ok(bench("head_ce.py", "--device", "cpu", "--rows", "40", "--vocab", "300", "--hidden", "16", "--kernels", "eager",
             "--iters", "1", "--warmup", "0", "--json", str(out)))
    result = json.loads(out.read_text())
    assert result["summary"].startswith("head CE 40 rows × 300: eager ") and result["ms"]["eager"] > 0
    refused = bench("head_ce.py", "--device", "cpu", "--kernels", "fused")
    assert refused.returncode == 2 and "not a CUDA device" in refused.stderr, refused.stderr


def test_master_weights_update_follows_torchs_fused_adamw_and_skips_a_non_finite_step(tmp_path):
    """bench/master_weights.py, compiled, on the CPU: its master-weight AdamW against torch's fused
    AdamW on float32 parameters from the same bf16 gradients (the script exits 1 when the weights
    differ by more than rounding, or when a non-finite step changed either), and its summary line."""
    out = tmp_path / "master.json"
    printed = ok(bench("master_weights.py", "--device", "cpu", "--tiny", "--iters", "3", "--json", str(out)))
    result = json.loads(out.read_text())
    assert result["non_finite_step_skipped"] and result["compile"] == "on"
    assert result["largest_difference"] <= 1e-4 * result["largest_update"], result
    assert re.search(r"^master weights tiny: today [\d.]+ ms, master [\d.]+ ms \(-?[\d.]+ ms saved a step\), "
                     r"0\.1M parameters$", printed, re.MULTILINE), printed


def test_render_speed_renders_each_way_and_reads_the_rows_back(smollm2_dir, tmp_path):
    """bench/render_speed.py on the 64-row smoke file: one line per worker count, then the read-back
    line (the script itself checks every case and the read-back give the same samples)."""
    out = tmp_path / "render.json"
    printed = ok(bench("render_speed.py", "--target", str(smollm2_dir), "--data", str(SMOKE_DATA), "--workers", "1",
                       "--json", str(out)))
    assert re.search(r"^render 64 rows, 1 worker\(s\): [\d.]+ s \([\d,]+ rows/s\)$", printed, re.MULTILINE)
    assert re.search(r"^render 64 rows read back from rows.cache: [\d.]+ s \(\d+ MB on disk\)$", printed, re.MULTILINE)
    assert json.loads(out.read_text())[-1]["read_back_seconds"] >= 0


def test_render_speed_times_regenerates_prompt_rendering_each_way(smollm2_dir, tmp_path):
    """bench/render_speed.py --prompts: in this process and in two workers (threshold lowered),
    the script itself checks both give the same jobs."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}: why?"}]}) + "\n"
                               for i in range(12)))
    out = tmp_path / "prompts.json"
    printed = ok(bench("render_speed.py", "--target", str(smollm2_dir), "--prompts", str(prompts), "--limit", "10",
                       "--workers", "1,2", "--parallel-min", "2", "--json", str(out)))
    for workers in (1, 2):
        assert re.search(rf"^render 10 prompts for regenerate, {workers} worker\(s\): [\d.]+ s \([\d,]+ prompts/s\)$",
                         printed, re.MULTILINE), printed
    assert [case["jobs"] for case in json.loads(out.read_text())] == [10, 10]


def test_sampling_cost_times_every_part_and_prints_its_summary_line(tmp_path):
    out = tmp_path / "sampling.json"
    printed = ok(bench("sampling_cost.py", "--rows", "8", "--vocab", "2048", "--repeats", "2", "--device", "cpu",
                       "--json", str(out)))
    assert re.search(r"^sampling SmolLM2 8 rows: top-p [0-9.]+ ms, greedy [0-9.]+ ms \(sort [0-9.]+ ms\) on cpu$",
                     printed, re.M), printed
    recorded = json.loads(out.read_text())
    assert set(recorded["ms"]) == {"top-p", "temperature only", "greedy", "softmax", "sort", "float64 cumsum"}
    assert all(value > 0 for value in recorded["ms"].values()) and recorded["top_p"] == 0.99


def test_selector_top_k_checks_the_values_and_prints_its_summary_line(tmp_path):
    """bench/selector_top_k.py at small sizes: it checks row_top_k against torch.topk before
    timing (so a wrong result is exit 1, not a number), and its JSON holds every slice width."""
    out = tmp_path / "top_k.json"
    printed = ok(bench("selector_top_k.py", "--device", "cpu", "--rows", "50", "--vocab", "1000", "--segments", "16,64",
                       "--iters", "1", "--warmup", "0", "--json", str(out)))
    result = json.loads(out.read_text())
    assert set(result["segments"]) == {"16", "64"} and result["torch_topk_ms"] > 0
    assert re.search(r"^selector top-k 50 rows × 1000: slice maxima [\d.]+ ms, torch.topk [\d.]+ ms$", printed, re.MULTILINE)


def test_selector_cost_counts_and_times_both_greedy_paths(tmp_path):
    """bench/selector_cost.py at small sizes: both paths pick the same paths, the batched one's
    kernels do not grow with the 15 positions as the sequential walk's do, and the summary line
    is the JSON's."""
    out = tmp_path / "selector.json"
    printed = ok(bench("selector_cost.py", "--device", "cpu", "--vocab", "300", "--hidden", "16", "--rank", "8",
                       "--top-k", "4", "--iters", "2", "--warmup", "0", "--check", "5", "--json", str(out)))
    result = json.loads(out.read_text())
    assert result["paths_equal"] == [5, 5] and "paths equal on 5/5 random draws (cpu, float32)" in printed
    batched, sequential = result["paths"]["batched"], result["paths"]["sequential"]
    assert sequential["ops_by_name"]["argmax"] == 15 and batched["ops_by_name"]["argmax"] == 1
    assert batched["ops"] < sequential["ops"] / 3 and batched["ms"] > 0 and sequential["ms"] > 0
    line = re.search(r"^selector greedy path SmolLM2: (\d+) ops, ([\d.]+) ms \(sequential (\d+) ops, ([\d.]+) ms\)$",
                     printed, re.MULTILINE)
    assert line and line.group(0) == result["summary"]
    assert (int(line.group(1)), int(line.group(3))) == (batched["ops"], sequential["ops"])


def test_static_decode_speed_records_every_number_the_gpu_run_records(tmp_path):
    """bench/static_decode_speed.py in its tiny mode with prompts of several lengths and the
    profiler (a broken bench costs device time)."""
    out = tmp_path / "speed.json"
    ok(bench("static_decode_speed.py", "--dims", "tiny", "--device", "cpu", "--dtype", "float32", "--repeats", "2",
             "--new-tokens", "6", "--decoders", "static", "--lengths", "20,33,70", "--length-new-tokens", "6",
             "--profile", str(tmp_path / "prof"), "--json", str(out)))
    static = json.loads(out.read_text())["static"]
    assert static["greedy_step_ms"] > 0 and static["break_even_tau"] > 0
    varied = static["varied_prompts"]
    assert all(varied[f"{kind}_{what}"] > 0 for kind in ("target_only", "speculative")
               for what in ("prefill_ms", "decode_ms_per_step")) and varied["eager_prefill_new_length_ms"] > 0
    assert static["profile"]["speculative_steps"] > 0 and static["profile"]["target_only_steps"] == 5
    for kind in ("target_only", "speculative"):
        assert "Self CPU" in (tmp_path / f"prof.static.{kind}.txt").read_text()


def test_static_decode_speed_times_a_dflash2_drafter(tmp_path):
    """--arch dflash2: the same numbers for a DFlash2 drafter of train's default sizes."""
    out = tmp_path / "speed.json"
    ok(bench("static_decode_speed.py", "--dims", "tiny", "--device", "cpu", "--dtype", "float32", "--repeats", "2",
             "--new-tokens", "6", "--decoders", "static", "--arch", "dflash2", "--json", str(out)))
    result = json.loads(out.read_text())
    assert result["arch"] == "dflash2" and result["static"]["draft_step_ms"] > 0 and result["static"]["greedy_step_ms"] > 0


def test_static_decode_speed_with_the_draft_forward_compiled(tmp_path):
    """--compile-draft: the drafter's forward through torch.compile (inductor) before the timed steps."""
    out = tmp_path / "speed.json"
    ok(bench("static_decode_speed.py", "--dims", "tiny", "--device", "cpu", "--dtype", "float32", "--repeats", "2",
             "--new-tokens", "6", "--decoders", "static", "--arch", "dflash2", "--compile-draft", "--json", str(out)))
    result = json.loads(out.read_text())
    assert result["compile_draft"] is True and result["static"]["draft_step_ms"] > 0


def test_drafter_step_times_the_recipe_step_of_both_drafters_and_profiles_it(tmp_path):
    """bench/drafter_step.py at the tiny shape: config S (the smollm2-quality recipe's batch) for
    DFlash and DFlash2, one training step each timed, the kernel table written per drafter."""
    out = tmp_path / "step.json"
    stdout = ok(bench("drafter_step.py", "--device", "cpu", "--tiny", "--configs", "S", "--arch", "dflash,dflash2",
                      "--compile", "off", "--warmup", "1", "--steps", "2", "--profile", "S", "--profile-dir",
                      str(tmp_path), "--json", str(out)))
    results = json.loads(out.read_text())["results"]
    assert [(r["config"], r["arch"]) for r in results] == [("S", "dflash"), ("S", "dflash2")], results
    for r in results:
        assert r["ms_per_step"] > 0 and r["last_loss"] == r["last_loss"] and "speedup_vs_specforge" not in r
        assert "Self CPU" in (tmp_path / f"profile_S{'' if r['arch'] == 'dflash' else '_dflash2'}.txt").read_text()
    assert "drafter-step S dflash2 (8b): " not in stdout and re.search(r"drafter-step S dflash2 \(tiny\): [0-9.]+ ms", stdout)


@pytest.mark.parametrize("flag,values,rows", [
    ("--gradients", ["handed-over", "buffers"], r"^A +dflash +off +off +handed- .*\n^A +dflash +off +off +buffers "),
    ("--master-weights", ["off", "on"], r"^A +dflash +off +off +handed- +sdpa +off .*\n^A +dflash +off +off +handed- +sdpa +on "),
    ("--pack-anchors", ["off", "on"], r"^A +dflash +off +off +handed- +sdpa +off +off .*\n^A +dflash +off +off +handed- +sdpa +off +on "),
])
def test_drafter_step_times_each_way_of_a_step_option_in_its_own_row(tmp_path, flag, values, rows):
    """bench/drafter_step.py with both values of --gradients (the backward's own gradient tensors
    or persistent buffers), of --master-weights (float32 parameters, or bf16 ones with float32
    masters) or of --pack-anchors (padded or packed anchor slots) at the tiny Qwen3-8B-shaped config A: a row each, recorded under its value, each
    step clipped on a real gradient norm (a zero norm is an update that saw no gradients), the
    table naming each run's value; a value the flag does not know stops it."""
    out = tmp_path / "step.json"
    stdout = ok(bench("drafter_step.py", "--device", "cpu", "--tiny", "--configs", "A", flag, ",".join(values),
                      "--compile", "off", "--warmup", "1", "--steps", "2", "--json", str(out)))
    results = json.loads(out.read_text())["results"]
    assert [r[flag[2:].replace("-", "_")] for r in results] == values, results
    assert all(r["last_grad_norm"] > 0 for r in results), results
    assert re.search(rows, stdout, re.M), stdout
    assert bench("drafter_step.py", "--device", "cpu", "--tiny", flag, "maybe").returncode == 2


def test_drafter_step_runs_the_attention_train_runs_and_refuses_flash_without_its_package(tmp_path):
    """bench/drafter_step.py --attention: a row per backend, each recorded as the step ran it (auto =
    sdpa on the CPU); an unknown backend, and flash without the flash-attn-4 package, stop it
    before any model is built."""
    out = tmp_path / "step.json"
    stdout = ok(bench("drafter_step.py", "--device", "cpu", "--tiny", "--configs", "A", "--attention", "auto,sdpa",
                      "--compile", "off", "--warmup", "1", "--steps", "1", "--json", str(out)))
    assert [r["attention"] for r in json.loads(out.read_text())["results"]] == ["sdpa", "sdpa"]
    assert len(re.findall(r"^A +dflash +off +off +handed- +sdpa ", stdout, re.M)) == 2, stdout
    assert bench("drafter_step.py", "--device", "cpu", "--tiny", "--attention", "flex,cudnn").returncode == 2
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn-4 is installed here")
    refused = bench("drafter_step.py", "--device", "cpu", "--tiny", "--configs", "A", "--attention", "flash")
    assert refused.returncode == 2 and "--attention flash: the flash-attn-4 package is not installed" in refused.stderr


def test_flex_tuning_checks_each_candidate_against_the_default_and_picks_only_what_matches(tmp_path):
    """bench/flex_tuning.py on the CPU (forward only): each candidate's output compared with the
    default's; `--pick` merges Triton's fastest forward and backward tiles, takes another backend
    only when it beats that merge, and never a candidate whose result differs from the default's."""
    out = tmp_path / "flex.json"
    ok(bench("flex_tuning.py", "--device", "cpu", "--tiny", "--repeats", "1", "--only", "fwd 128/64 s3 w8", "--json", str(out)))
    results = json.loads(out.read_text())["results"]
    assert [r["name"] for r in results] == ["default", "fwd 128/64 s3 w8"], results
    assert all(r["forward_ms"] > 0 and r["relative_error"] < 1e-6 for r in results), results
    assert bench("flex_tuning.py", "--device", "cpu", "--only", "flesh").returncode == 2

    def pick(flash_ms: float, flash_error: float) -> dict:
        rows = [("default", None, 1.0, 3.0, 0.0), ("fwd", {"fwd_BLOCK_M": 64}, 0.9, 3.1, 0.0),
                ("bwd", {"bwd_BLOCK_M1": 32}, 1.1, 2.0, 0.0), ("flash", {"BACKEND": "FLASH"}, 0.5, flash_ms - 0.5, flash_error)]
        picked = tmp_path / "pick.json"
        picked.write_text(json.dumps({"results": [
            {"name": n, "options": o, "forward_ms": f, "backward_ms": b, "fwd_bwd_ms": f + b, "relative_error": e}
            for n, o, f, b, e in rows]}))
        return json.loads(ok(bench("flex_tuning.py", "--pick", str(picked))) or "{}")

    assert pick(flash_ms=2.5, flash_error=1e-3) == {"BACKEND": "FLASH"}  # beats 0.9 + 2.0 by more than 3 %
    assert pick(flash_ms=2.85, flash_error=1e-3) == {"fwd_BLOCK_M": 64, "bwd_BLOCK_M1": 32}
    assert pick(flash_ms=2.5, flash_error=0.5) == {"fwd_BLOCK_M": 64, "bwd_BLOCK_M1": 32}

@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    from test_decode_loop import write_chat_pair

    return write_chat_pair(tmp_path_factory.mktemp("chat"))


def test_spec_decode_compares_ours_with_target_only_and_the_reference(chat_pair, tmp_path):
    pytest.importorskip("dflash.model", reason="reference package: pip install --no-deps dflash")
    out = tmp_path / "bench.json"
    ok(bench("spec_decode.py", "--target", str(chat_pair / "target"), "--drafter", str(chat_pair / "drafter"),
             "--bench", "mtbench", "--limit", "2", "--max-new-tokens", "10", "--device", "cpu", "--json", str(out)))
    summary = json.loads(out.read_text())["benchmarks"]["mtbench"]["summary"]
    assert summary["errors"] == 0
    assert summary["same_as_reference"] == "2/2" and summary["same_acceptance_as_reference"] == "2/2"
    assert summary["same_as_baseline"] == "2/2"


def test_feature_compile_error_compares_both_forwards_with_float32(chat_pair, tmp_path):
    """bench/feature_compile_error.py on a tiny target: the summary line is the JSON's, and a
    forward compared with itself would read 0 (each figure is a real difference)."""
    out = tmp_path / "error.json"
    printed = ok(bench("feature_compile_error.py", "--target", str(chat_pair / "target"), "--device", "cpu",
                       "--batch", "1", "--length", "16", "--layers", "1", "--json", str(out)))
    result = json.loads(out.read_text())
    assert result["summary"] in printed and result["summary"].startswith("feature compile error target: compiled ")
    assert 0 < result["eager_vs_float32"]["max"] < 0.1 and 0 < result["compiled_vs_float32"]["max"] < 0.1
    assert 0 <= result["compiled_vs_eager"]["norm"] < 0.1 and result["tolerance"] == 2e-2


# --- bench/graphed_step.py (CPU smoke mode on the shared 64-row file) --------------------------

def graphed_step(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return bench("graphed_step.py", "--smoke", "--device", "cpu", "--data", str(SMOKE_DATA), *flags, timeout=timeout)


def test_graphed_step_reports_a_run_past_its_box_and_still_prints_the_others(tmp_path):
    """A run killed by --run-timeout is a FAILED line, not a traceback that loses the rest."""
    out = tmp_path / "graphed.json"
    done = graphed_step("--steps", "2", "--run-timeout", "0.5", "--fp8", "head", "--json", str(out), timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    for label in ("start 1", "start 2", "eager", "graphed, --fp8 head"):
        assert f"\n{label}:\n" in done.stdout, done.stdout
    assert done.stdout.count("FAILED (timed out after 0.5s (--run-timeout))") == 4, done.stdout
    assert "--fp8 head: FAILED" in done.stdout
    results = json.loads(out.read_text())
    assert {key: run["error"] for key, run in results.items()} == {
        key: "timed out after 0.5s (--run-timeout)" for key in ("first_start", "second_start", "eager", "fp8")}


def test_graphed_step_run_dumps_every_threads_stack_before_its_box_ends(tmp_path):
    """A run that is still going 3 s before --run-timeout writes every thread's stack to stderr
    (where a hung run is stuck), then carries on until it is killed."""
    try:
        done = graphed_step("--child", "off", "--out", str(tmp_path / "run"), "--result", str(tmp_path / "result.json"),
                            "--steps", "1000", "--run-timeout", "5.5", timeout=5)
    except subprocess.TimeoutExpired as stopped:
        stderr = stopped.stderr or ""
        stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
        assert "every thread's stack at 2.5 s:" in stderr, stderr[-2000:]
        assert "Thread MainThread (most recent call last):" in stderr, stderr[-2000:]
    else:  # it must still be running at 5 s: 1,000 steps take minutes
        pytest.fail(f"the run ended within 5 s (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def test_graphed_step_runs_the_chosen_runs_on_the_chosen_buckets_and_profiles_a_window(tmp_path):
    """--runs picks the runs (here start 1 alone), --buckets auto trains on train's automatic
    buckets (128, 192, 256 at the smoke length; the recipe's default is one 768 bucket), and
    --profile-steps profiles a window of steps of the run."""
    out = tmp_path / "graphed.json"
    done = graphed_step("--steps", "6", "--runs", "start1", "--buckets", "auto", "--profile-steps", "2",
                        "--work", str(tmp_path / "work"), "--json", str(out))
    printed = ok(done)
    results = json.loads(out.read_text())
    assert list(results) == ["first_start"], results.keys()
    assert results["first_start"]["buckets"] == "auto" and results["first_start"]["steps"] == 6
    assert "buckets [128, 192, 256]" in printed, printed[-3000:]
    # The window's report (a CPU has no kernels: an empty table, written when the window closed).
    assert json.loads((tmp_path / "work" / "run-graphed" / "kernels.json").read_text()) == {}


def test_graphed_step_refuses_an_unknown_run():
    done = graphed_step("--runs", "start1,warm", timeout=60)
    assert done.returncode == 2 and "unknown run(s) warm" in done.stderr, done.stderr


def test_profiling_splits_a_trace_per_stream_in_ms_per_step(tmp_path):
    """`bench/profiling.py kernels TRACE --steps N` on a trace in the format torch's profiler
    exports: kernel events only (a CPU op and a memcpy are not kernels), per stream, per step,
    largest first."""
    def kernel(name, stream, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "dur": dur, "ts": 0, "args": {"stream": stream}}

    events = [kernel("gemm", 7, 3000), kernel("gemm", 7, 1000), kernel("norm", 7, 500), kernel("flash", 13, 9000),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 99999, "ts": 0, "args": {}},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 88888, "ts": 0, "args": {"stream": 7}}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    report = json.loads(ok(bench("profiling.py", "kernels", str(trace), "--steps", "2")))
    assert list(report) == ["13", "7"]
    assert report["7"] == {"ms_per_step": 2.25, "kernels_per_step": 1.5, "top": [["gemm", 2.0], ["norm", 0.25]]}
    assert report["13"]["ms_per_step"] == 4.5
