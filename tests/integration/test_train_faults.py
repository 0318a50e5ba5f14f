"""What the trainer promises under faults (docs/FAULTS.md): runs that go wrong stop with exit 1
and say why, interrupted runs save and exit 130/143, a run folder is never mixed or silently
resumed with other settings, a failing coordinator takes its workers down with it, and no step
report is lost. Real tiny models, real threads, real signals, real files."""

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from data_files import REGENERATED_64
from tiny import pattern_samples, tiny_target, tiny_train_config

from dflash_train.cli import main
from dflash_train.config import ConfigError
from dflash_train.core.attention import flash_kernels_missing
from dflash_train.errors import RunFailed
from dflash_train.train.checkpoint import latest_checkpoint
from dflash_train.train.trainer import train

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second intra-op thread only spins



@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=6, head_scale=20)


def _config(out, **overrides):
    return tiny_train_config(out, **{**dict(steps=12, num_anchors=8, lr=5e-3, log_every=5, save_every=4), **overrides})


def _quiet():
    return open(os.devnull, "w")


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _pipeline_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("drafter-", "target-")) and t.is_alive()]


# --- runs that go wrong ----------------------------------------------------------------------------

def test_a_diverged_run_stops_with_its_reason_and_is_not_exported(tmp_path, target):
    """lr 1e30: the first update throws the weights to ~1e31, every later step is non-finite and
    skipped (29 of 30 in the report that found it). The run stops after K of them in a row."""
    with pytest.raises(RunFailed, match=r"4 steps in a row \(up to step 5\) had non-finite gradients") as failure:
        train(_config(tmp_path, steps=40, lr=1e30, stop_after_bad_steps=4), samples=pattern_samples(16),
              target=target, log=_quiet())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"].startswith("failed: 4 steps in a row")
    assert summary["steps_done"]["drafter"] < 10 and summary["drafters"]["drafter"]["skipped_steps"] >= 4
    assert "export" not in summary["drafters"]["drafter"] and not (tmp_path / "export").exists()
    assert "kept: " + summary["drafters"]["drafter"]["checkpoint"] in str(failure.value)


def test_mostly_skipped_short_run_fails_at_its_end(tmp_path, target):
    with pytest.raises(RunFailed, match="of 5 steps had non-finite gradients"):
        train(_config(tmp_path, steps=5, lr=1e30, stop_after_bad_steps=10), samples=pattern_samples(16),
              target=target, log=_quiet())
    assert not (tmp_path / "export").exists()


def test_a_collapsed_gradient_stops_the_run(tmp_path):
    """A target whose LM head is zero (e.g. saved without it) sends no gradient to the drafter:
    every gradient norm is exactly 0."""
    target = tiny_target("llama", layers=6)
    with torch.no_grad():
        target.model.get_output_embeddings().weight.zero_()
    with pytest.raises(RunFailed, match="gradient norm was 0 for 3 steps in a row"):
        train(_config(tmp_path, steps=40, stop_after_bad_steps=3), samples=pattern_samples(16), target=target,
              log=_quiet())
    steps = _steps(tmp_path / "metrics.jsonl")
    # Steps already under way when the report loop sees the third still finish: a few on a busy
    # host (8 were seen under a full parallel suite), never the 40 asked.
    assert steps[:3] == [1, 2, 3] and len(steps) < 20


def test_health_watch_can_be_turned_off(tmp_path, target):
    summary = train(_config(tmp_path, steps=6, lr=1e30, stop_after_bad_steps=0, export_dtype=""),
                    samples=pattern_samples(16), target=target, log=_quiet())
    assert summary["stop_reason"] == "finished" and summary["drafters"]["drafter"]["skipped_steps"] >= 4


def test_non_finite_weights_are_not_exported(tmp_path, target):
    def poison(worker, step):
        if step == 3:
            with torch.no_grad():
                next(worker.replica.drafter.parameters()).fill_(float("inf"))

    with pytest.raises(RunFailed, match="weights are not finite after step 4"):
        train(_config(tmp_path, steps=4), samples=pattern_samples(16), target=target, log=_quiet(), step_hook=poison)
    assert not (tmp_path / "export").exists()


# --- the coordinator and its reports -----------------------------------------------------------

class FailingSink:
    def __init__(self, at_step: int):
        self.at_step = at_step

    def write_step(self, drafter, record):
        if record["step"] == self.at_step:
            raise OSError(28, "No space left on device")

    def write_pipeline(self, record):
        pass

    def close(self):
        pass


def test_a_failing_coordinator_stops_its_workers(tmp_path, target):
    with pytest.raises(OSError, match="No space left on device"):
        train(_config(tmp_path, steps=400, save_every=2, drafter_devices=["cpu", "cpu"]), samples=pattern_samples(32),
              target=target, log=_quiet(), sinks=[FailingSink(at_step=3)])
    assert not _pipeline_threads()  # nobody trains on after train() failed
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    time.sleep(1.0)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == checkpoints
    assert int(checkpoints[-1].removeprefix("step-")) < 40


class SlowSink:
    def __init__(self):
        self.steps = []

    def write_step(self, drafter, record):
        time.sleep(0.25)  # the workers finish long before the coordinator has read their reports
        self.steps.append(record["step"])

    def write_pipeline(self, record):
        pass

    def close(self):
        pass


def test_reports_queued_when_the_workers_exit_are_all_logged(tmp_path, target):
    sink = SlowSink()
    summary = train(_config(tmp_path, steps=8, export_dtype=""), samples=pattern_samples(16), target=target,
                    log=_quiet(), sinks=[sink])
    assert sink.steps == list(range(1, 9))
    assert _steps(tmp_path / "metrics.jsonl") == list(range(1, 9))
    assert summary["steps_done"]["drafter"] == 8


# --- run folders and resume -------------------------------------------------------------------------

def test_an_existing_run_is_not_mixed_with_a_new_one(tmp_path, target):
    train(_config(tmp_path, steps=4), samples=pattern_samples(16), target=target, log=_quiet())
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match="already holds a training run .*pass --resume to continue it"):
        train(_config(tmp_path, steps=4), samples=pattern_samples(16), target=target, log=_quiet())
    assert (tmp_path / "metrics.jsonl").read_text() == before


def test_resume_refuses_a_setting_its_checkpoint_fixes(tmp_path, target):
    train(_config(tmp_path, steps=8), samples=pattern_samples(16), target=target, log=_quiet(), stop_at=4)
    run = (tmp_path / "run.json").read_text()
    with pytest.raises(ConfigError, match=r"--lr 5.0 differs from 0.005 in its checkpoint step-00000004"):
        train(_config(tmp_path, steps=8, lr=5.0, resume=True), samples=pattern_samples(16), target=target, log=_quiet())
    for changed, message in ((dict(block_size=6), r"--block-size 6 differs from 4 .*, and its drafter has that shape"),
                             (dict(seed=7), r"would train other batches at each step \(--seed: 0 in the checkpoint, 7 now\)")):
        with pytest.raises(ConfigError, match=message):
            train(_config(tmp_path, steps=8, resume=True, **changed), samples=pattern_samples(16), target=target,
                  log=_quiet())
    assert (tmp_path / "run.json").read_text() == run  # refused before anything was rewritten
    # a setting the checkpoint does not fix is applied: the run goes on to the new end
    summary = train(_config(tmp_path, steps=10, resume=True), samples=pattern_samples(16), target=target, log=_quiet())
    assert summary["steps_done"]["drafter"] == 10
    assert json.loads((tmp_path / "run.json").read_text())["train_config"]["steps"] == 10


def test_resume_after_kill_9_logs_each_step_once_and_cleans_staging(tmp_path, target):
    samples = pattern_samples(16)
    train(_config(tmp_path, steps=12, save_every=4), samples=samples, target=target, log=_quiet(), stop_at=7)
    # What kill -9 after step 7's line, before its checkpoint, leaves: metrics up to step 7, the
    # newest complete checkpoint at step 4, a half-written staging folder, a torn last line.
    checkpoints = tmp_path / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000007")
    (checkpoints / "latest").write_text("step-00000004\n")
    staging = Path(tempfile.mkdtemp(prefix=".step-00000008.", dir=checkpoints))
    (staging / "drafter.safetensors").write_bytes(b"partial")
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 8, "loss": 1.')
    assert _steps_tolerant(tmp_path / "metrics.jsonl") == list(range(1, 8))

    train(_config(tmp_path, steps=12, save_every=4, resume=True), samples=samples, target=target, log=_quiet())
    assert _steps(tmp_path / "metrics.jsonl") == list(range(1, 13))
    assert not staging.exists()
    assert latest_checkpoint(tmp_path).name == "step-00000012"
    pipeline = _steps(tmp_path / "pipeline.jsonl")
    assert pipeline == sorted(set(pipeline))


def test_a_checkpoint_is_never_on_disk_before_its_steps_metrics_lines(tmp_path, target, monkeypatch):
    """The coordinator writes metrics.jsonl in its own thread and may fall behind the drafter's
    (seen on a busy CI machine: a kill -9 after the checkpoint of step 336 left lines only up to
    288, and the resumed run's log had a hole). With its lines written slowly here, every periodic
    checkpoint must still find its step's line on disk, so a kill at any moment resumes with
    every step logged once."""
    from dflash_train.train import reporting

    write_step = reporting.JsonlSink.write_step

    def slowly(self, drafter, record):
        time.sleep(0.05)
        write_step(self, drafter, record)

    monkeypatch.setattr(reporting.JsonlSink, "write_step", slowly)
    behind = []

    def check_the_log_reaches_the_newest_checkpoint(worker, step):
        saved = latest_checkpoint(tmp_path)
        if saved is not None:
            newest = int(saved.name.removeprefix("step-"))
            logged = _steps_tolerant(tmp_path / "metrics.jsonl")
            if not logged or logged[-1] < newest:
                behind.append((newest, logged[-1] if logged else 0))

    train(_config(tmp_path, steps=12, save_every=2), samples=pattern_samples(16), target=target, log=_quiet(),
          step_hook=check_the_log_reaches_the_newest_checkpoint)
    assert not behind, f"(checkpoint step, last logged step) when a checkpoint was ahead of the log: {behind}"
    assert _steps(tmp_path / "metrics.jsonl") == list(range(1, 13))


def test_variants_stopped_at_different_steps_resume_from_their_common_step(tmp_path, target):
    """A stop ends each drafter after its own current step, so a slower variant stops a few steps
    behind (on the H200, after a time box: 2,793 against 2,790). --resume continues all of them
    from the newest step each has a checkpoint of, sets the later ones aside, and ends with the
    weights of a run that was never stopped."""
    from safetensors.torch import load_file

    variants = [{"name": "fast"}, {"name": "slow", "lr": 3e-3}]
    config = dict(mode="variants", drafter_devices=["cpu", "cpu"], variants=variants, steps=8, save_every=2)
    slow_at_its_second_step, slow_may_go_on = threading.Event(), threading.Event()

    def stop_with_slow_behind(worker, step):
        # Each waits for the other, so on a busy machine too the stop comes when fast has done 4
        # steps and slow exactly 2 (without the first wait slow could still be in its second).
        if worker.replica.name == "slow" and step == 1:
            slow_at_its_second_step.set()
            assert slow_may_go_on.wait(60), "the fast variant never reached step 3"
        if worker.replica.name == "fast" and step == 3:
            assert slow_at_its_second_step.wait(60), "the slow variant never finished its second step"
            worker.stop_signal.stop("stopped by the test")
            slow_may_go_on.set()

    stopped = tmp_path / "stopped"
    train(_config(stopped, **config), samples=pattern_samples(16), target=target, log=_quiet(),
          step_hook=stop_with_slow_behind)
    assert latest_checkpoint(stopped / "fast").name == "step-00000004"
    assert latest_checkpoint(stopped / "slow").name == "step-00000002"

    log = tempfile.TemporaryFile("w+")
    train(_config(stopped, resume=True, **config), samples=pattern_samples(16), target=target, log=log)
    log.seek(0)
    said = log.read()
    assert "the drafters stopped at different steps {'fast': 4, 'slow': 2}; all resume from step 2" in said
    assert "superseded/step-00000004 (the steps after 2 are trained again)" in said
    assert (stopped / "fast" / "checkpoints" / "superseded" / "step-00000004" / "drafter.safetensors").is_file()

    straight = tmp_path / "straight"
    train(_config(straight, **config), samples=pattern_samples(16), target=target, log=_quiet())
    for name in ("fast", "slow"):
        assert latest_checkpoint(stopped / name).name == "step-00000008"
        assert _steps(stopped / name / "metrics.jsonl") == list(range(1, 9))  # fast's steps 3-4 logged once
        resumed = load_file(str(latest_checkpoint(stopped / name) / "drafter.safetensors"))
        expected = load_file(str(latest_checkpoint(straight / name) / "drafter.safetensors"))
        for key in expected:
            torch.testing.assert_close(resumed[key], expected[key], rtol=1e-5, atol=1e-6)


def test_variants_with_no_checkpointed_step_in_common_are_refused(tmp_path, target):
    variants = [{"name": "a"}, {"name": "b", "lr": 3e-3}]
    config = dict(mode="variants", drafter_devices=["cpu", "cpu"], variants=variants, steps=8, save_every=2)
    train(_config(tmp_path, **config), samples=pattern_samples(16), target=target, log=_quiet(), stop_at=4)
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-00000004")  # a keeps 2 and 4, b only 2 ...
    shutil.rmtree(tmp_path / "a" / "checkpoints" / "step-00000002")  # ... and a no longer 2
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=r"no checkpointed step in common \(steps \{'a': \[4\], 'b': \[2\]\}\)"):
        train(_config(tmp_path, resume=True, **config), samples=pattern_samples(16), target=target, log=_quiet())
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def _steps_tolerant(path: Path) -> list[int]:
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            pass
    return steps


# --- inputs refused before training ----------------------------------------------------------------

def test_batch_size_larger_than_the_usable_rows(tmp_path, target):
    with pytest.raises(ConfigError, match=r"--batch-size 4 is more than the 3 usable rows .*pass --batch-size 3 or less"):
        train(_config(tmp_path), samples=pattern_samples(3), target=target, log=_quiet())


def test_flex_attention_on_the_cpu_is_refused(tmp_path, target):
    with pytest.raises(ConfigError, match="--attention flex: flex attention has no backward pass on cpu"):
        train(_config(tmp_path, attention="flex"), samples=pattern_samples(8), target=target, log=_quiet())
    assert not (tmp_path / "run.json").exists()


@pytest.mark.skipif(flash_kernels_missing() is None, reason="flash-attn-4 is installed here")
def test_flashattention_kernels_without_their_package_are_refused(tmp_path, target):
    with pytest.raises(ConfigError, match=r"--attention flash: the flash-attn-4 package is not installed \(pip install flash-attn-4"):
        train(_config(tmp_path, attention="flash"), samples=pattern_samples(8), target=target, log=_quiet())
    assert not (tmp_path / "run.json").exists()


def test_anchor_slots_beyond_the_sequence_are_not_allocated(tmp_path, target):
    """--num-anchors 100000 tried to allocate hundreds of GB; a sequence of --max-seq-len tokens
    has fewer anchor positions than that, so the run trains max_seq_len slots, says so, and
    computes the loss of exactly that many."""
    samples = pattern_samples(16)
    log = tmp_path / "huge.log"
    with open(log, "w") as handle:
        train(_config(tmp_path / "huge", steps=3, num_anchors=100_000), samples=samples, target=target, log=handle)
    train(_config(tmp_path / "exact", steps=3, num_anchors=128), samples=samples, target=target, log=_quiet())
    text = log.read_text()
    assert "--num-anchors 100000 is more than --max-seq-len 128: training 128 anchor slots" in text and "N=128" in text
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("huge", "exact")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert json.loads((tmp_path / "huge" / "run.json").read_text())["train_config"]["num_anchors"] == 100_000


def test_buckets_shorter_than_a_row_are_refused(tmp_path, target):
    with pytest.raises(ConfigError, match="exceeds the largest bucket 64.*--seq-buckets"):
        train(_config(tmp_path, seq_buckets=[32, 64]), samples=pattern_samples(8, min_len=80, max_len=90),
              target=target, log=_quiet())


# --- the command: exit codes ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(smollm2_dir, tmp_path_factory):
    from test_generate_regenerate import tiny_smollm_dir

    return tiny_smollm_dir(smollm2_dir, tmp_path_factory.mktemp("tiny"), layers=2)


def _cli(tiny_dir, out, *extra):
    return ["train", "--target", str(tiny_dir), "--data", str(REGENERATED_64), "--out", str(out), "--batch-size", "2",
            "--max-seq-len", "128", "--num-layers", "1", "--num-anchors", "8", "--block-size", "4",
            "--min-supervised-tokens", "8", "--device", "cpu", "--log-every", "1", "--export-dtype", "", *extra]


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_and_exits_128_plus_its_number(tiny_dir, tmp_path, signum, code):
    metrics = tmp_path / "metrics.jsonl"

    def send_when_training():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.05)
        os.kill(os.getpid(), signum)

    sender = threading.Thread(target=send_when_training)
    sender.start()
    try:
        assert main(_cli(tiny_dir, tmp_path, "--steps", "100000", "--save-every", "100000")) == code
    finally:
        sender.join()
    done = json.loads((tmp_path / "summary.json").read_text())["steps_done"]["drafter"]
    assert 2 <= done < 100000 and latest_checkpoint(tmp_path).name == f"step-{done:08d}"


def test_one_ctrl_c_delivered_twice_is_one_and_a_later_one_aborts(monkeypatch):
    """`timeout -s INT` signals the process and then its process group, so the trainer may see one
    interrupt twice, a moment apart (a time-boxed run on the GPU machine was aborted so, 2 of 6
    times on this CPU). The copy must not count as the second Ctrl-C, which aborts without a
    checkpoint; a Ctrl-C after the echo window still does. Real signals, the real handler."""
    from dflash_train.parallel.threads import StopSignal
    from dflash_train.train import coordinator

    stop = StopSignal()
    with coordinator.InterruptHandler(stop) as handler:
        signal.raise_signal(signal.SIGINT)
        assert stop.stopped and handler.signal_name == "SIGINT" and stop.reason == "interrupted by SIGINT"
        signal.raise_signal(signal.SIGINT)  # the echo: ignored
        monkeypatch.setattr(coordinator, "SIGNAL_ECHO_SECONDS", 0.0)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_cli_exit_codes_for_a_diverged_run_and_a_reused_folder(tiny_dir, tmp_path, capsys):
    assert main(_cli(tiny_dir, tmp_path, "--steps", "30", "--lr", "1e30", "--stop-after-bad-steps", "3")) == 1
    assert "steps in a row" in capsys.readouterr().err
    assert main(_cli(tiny_dir, tmp_path, "--steps", "30")) == 2
    assert "already holds a training run" in capsys.readouterr().err


def test_feature_cache_target_goes_where_the_evaluator_decodes():
    """With --features the target only lends its embedding and head (CPU is enough), unless
    --eval-every decodes with it: on GPUs that must not be the CPU inside a drafter thread."""
    from dflash_train.train.layout import Layout
    from dflash_train.train.supply import feature_target_device

    cuda0, cuda1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    with_eval, without = tiny_train_config("r", eval_every=50), tiny_train_config("r")
    assert feature_target_device(without, Layout([cuda0], [cuda1])) == cpu
    assert feature_target_device(with_eval, Layout([cuda0], [cuda1])) == cuda0
    assert feature_target_device(with_eval, Layout([cpu], [cuda1])) == cuda1
    assert feature_target_device(with_eval, Layout([cpu], [cpu])) == cpu


def test_leftover_staging_is_removed_and_a_folder_renamed_aside_is_put_back(tmp_path):
    """What each kill point of files.write_dir_atomically / write_bytes_atomic leaves, cleaned."""
    from dflash_train.files import remove_leftover_staging

    staging = Path(tempfile.mkdtemp(prefix=".step-00000009.", dir=tmp_path))
    (staging / "drafter.safetensors").write_bytes(b"partial")
    temp_file = Path(tempfile.mkstemp(prefix=".latest.", suffix=".tmp", dir=tmp_path)[1])
    aside = Path(tempfile.mkdtemp(prefix=".export.old.", dir=tmp_path))
    (aside / "export").mkdir()
    (aside / "export" / "config.json").write_text("{}")  # killed after the old folder moved aside
    kept = tmp_path / "step-00000008"
    kept.mkdir()
    (tmp_path / ".hidden-notes").write_text("mine")  # not a name our writers use
    assert sorted(remove_leftover_staging(tmp_path)) == sorted([staging, temp_file, aside])
    assert (tmp_path / "export" / "config.json").read_text() == "{}"
    assert kept.is_dir() and (tmp_path / ".hidden-notes").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden-notes", "export", "step-00000008"]
