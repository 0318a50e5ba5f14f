"""The one rule for outputs (files.py): one live process per output, released when its holder
dies however it dies; no output inside a command's inputs; variant names are plain folders;
outputs get the user's umask; what an export killed midway left is cleaned or put back.
Real processes (`python -m dflash_train.cli`), real signals, real files, a real local server."""

import http.server
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from data_files import REGENERATED_64
from tiny import pattern_samples, tiny_target, tiny_train_config

from dflash_train.cli import main
from dflash_train.config import ConfigError
from dflash_train.files import write_bytes_atomic, write_dir_atomically
from dflash_train.train.trainer import train

REPO = Path(__file__).resolve().parents[2]


def _quiet():
    return open(os.devnull, "w")


def _cli_process(*args: str, **env: str) -> subprocess.Popen:
    """`dflash-train ARGS` as its own process (this checkout's code), stdout and stderr piped."""
    environment = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env)
    return subprocess.Popen([sys.executable, "-m", "dflash_train.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environment)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=6)


@pytest.fixture(scope="module")
def tiny_dir(smollm2_dir, tmp_path_factory):
    from test_generate_regenerate import tiny_smollm_dir

    return tiny_smollm_dir(smollm2_dir, tmp_path_factory.mktemp("tiny"), layers=2)


@pytest.fixture(scope="module")
def run_dir(target, tmp_path_factory):
    """A finished two-step run with a checkpoint, to export."""
    out = tmp_path_factory.mktemp("run")
    train(tiny_train_config(out, steps=2, save_every=2, export_dtype=""), samples=pattern_samples(8), target=target,
          log=_quiet())
    return out


# --- D2: one live process per output ---------------------------------------------------------------

def _train_args(tiny_dir, out, *extra):
    return ["train", "--target", str(tiny_dir), "--data", str(REGENERATED_64), "--out", str(out), "--batch-size", "2",
            "--max-seq-len", "128", "--num-layers", "1", "--num-anchors", "8", "--block-size", "4",
            "--min-supervised-tokens", "8", "--device", "cpu", "--log-every", "1", "--export-dtype", "",
            "--tensorboard", "off", *extra]


def test_two_train_processes_never_share_a_run_folder(tiny_dir, tmp_path, capsys):
    """A second `train` on a live run folder, fresh or `--resume`, is refused naming the live
    process; once that process is killed (-9), `--resume` takes the folder and every step is
    logged once."""
    out = tmp_path / "run"
    first = _cli_process(*_train_args(tiny_dir, out, "--steps", "100000", "--save-every", "2"))
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").is_file() or len(_steps(out / "metrics.jsonl")) < 2:
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        fresh = _cli_process(*_train_args(tiny_dir, out, "--steps", "100000", "--seed", "2"))
        resumed = _cli_process(*_train_args(tiny_dir, out, "--steps", "100000", "--save-every", "2", "--resume"))
        for second in (fresh, resumed):
            try:
                _, err = second.communicate(timeout=180)
            finally:
                second.kill()
            lines = [line for line in err.splitlines() if line.strip()]
            assert second.returncode == 2, err
            assert len(lines) == 1 and f"--out {out} is in use by another live process (pid {first.pid}:" in lines[0]
        assert first.poll() is None  # the live run goes on
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        first.kill()
        first.communicate()
    logged = _steps(out / "metrics.jsonl")
    assert logged == list(range(1, len(logged) + 1))  # one run's steps, in order: nothing else wrote there
    latest = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))
    assert main(_train_args(tiny_dir, out, "--steps", str(latest + 2), "--save-every", "2", "--resume")) == 0
    assert _steps(out / "metrics.jsonl") == list(range(1, latest + 3))
    assert not list(tmp_path.glob(".run.lock"))  # released and removed at the end


class _GatedServer(http.server.ThreadingHTTPServer):
    """A local OpenAI-compatible server: one model; each chat answer waits until `gate` is set."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _GatedHandler)
        self.gate, self.asked = threading.Event(), threading.Event()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _GatedHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._answer({"object": "list", "data": [{"id": "gated", "object": "model"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.asked.set()
        self.server.gate.wait(120)
        self._answer({"choices": [{"message": {"role": "assistant", "content": "an answer"}, "finish_reason": "stop"}],
                      "usage": {"completion_tokens": 2}})


def test_two_regenerate_processes_never_share_an_output(tmp_path):
    """The second `regenerate` on one --out is refused while the first answers; the file holds
    every prompt once (the defect: both ran, and every row was written twice)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Question {i}?"}) + "\n" for i in range(6)))
    out = tmp_path / "rows.jsonl"
    server = _GatedServer()
    args = ["regenerate", "--endpoint", server.url, "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", "4", "--concurrency", "2"]
    first = _cli_process(*args)
    try:
        assert server.asked.wait(120), first.communicate()
        second = _cli_process(*args)
        try:
            _, err = second.communicate(timeout=120)
        finally:
            second.kill()
        assert second.returncode == 2, err
        assert f"--out {out} is in use by another live process (pid {first.pid}:" in err
        server.gate.set()
        _, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
    finally:
        server.gate.set()
        first.kill()
        server.shutdown()
        server.server_close()
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == [f"p{i}" for i in range(6)]


HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from dflash_train.files import hold_output
lock = hold_output(sys.argv[1], "--out")
print("held", flush=True)
time.sleep(300)
"""


@pytest.fixture
def held(tmp_path):
    """Hold an output from another live process: `held(path)` -> the process (killed at the end)."""
    processes = []

    def hold(path: Path) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(REPO)], stdout=subprocess.PIPE,
                                   text=True)
        processes.append(process)
        assert process.stdout.readline().strip() == "held"
        return process

    yield hold
    for process in processes:
        process.kill()
        process.wait()


def test_a_held_output_is_refused_and_freed_when_its_holder_is_killed(tmp_path, held):
    from dflash_train.files import OutputInUse, hold_output

    out = tmp_path / "out.jsonl"
    holder = held(out)
    with pytest.raises(OutputInUse, match=rf"--out {out} is in use by another live process \(pid {holder.pid}:"):
        hold_output(out, "--out")
    holder.kill()  # SIGKILL: no clean-up ran; the kernel dropped the lock
    holder.wait()
    assert (tmp_path / ".out.jsonl.lock").exists()
    with hold_output(out, "--out"):
        assert (tmp_path / ".out.jsonl.lock").read_text().startswith(f"pid {os.getpid()}:")
    assert not (tmp_path / ".out.jsonl.lock").exists()


def test_every_writing_command_refuses_an_output_another_process_holds(tmp_path, held, run_dir, tiny_dir, capsys):
    """Each command takes its output before it loads anything, and names the holder."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hi?"}) + "\n")
    drafter = tmp_path / "drafter"  # what eval checks of its --drafter before taking its output: a drafter's config.json
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"dflash_config": {}}))
    commands = {
        "export": ["export", str(run_dir), "--out", str(tmp_path / "exp")],
        "cache-features": ["cache-features", "--target", str(tiny_dir), "--data", str(REGENERATED_64), "--out",
                           str(tmp_path / "cache"), "--device", "cpu"],
        "regenerate": ["regenerate", "--target", str(tiny_dir), "--prompts", str(prompts), "--out",
                       str(tmp_path / "rows.jsonl"), "--device", "cpu", "--max-new-tokens", "8"],
        "prompts": ["prompts", "--out", str(tmp_path / "prompts.jsonl"), "--limit", "2"],
        "self-prompts": ["self-prompts", "--target", str(tiny_dir), "--count", "1", "--out",
                         str(tmp_path / "self.jsonl"), "--device", "cpu"],
        "quickstart": ["quickstart", "--out", str(tmp_path / "qs"), "--device", "cpu"],
        "pipeline": ["pipeline", "--target", str(tiny_dir), "--recipe", "quickstart", "--out", str(tmp_path / "work"),
                     "--device", "cpu"],
        "eval": ["eval", "--target", str(tiny_dir), "--drafter", str(drafter), "--bench", str(prompts), "--json",
                 str(tmp_path / "eval.json"), "--device", "cpu"],
    }
    for name, args in commands.items():
        output = Path(args[args.index("--json" if name == "eval" else "--out") + 1])
        holder = held(output)
        capsys.readouterr()
        assert main(args) == 2, name
        err = capsys.readouterr().err
        assert f"is in use by another live process (pid {holder.pid}:" in err, (name, err)
        assert not output.exists(), name
        holder.kill()


def test_outputs_inside_a_commands_inputs_are_refused(tmp_path, tiny_dir, run_dir, capsys):
    data = tmp_path / "data.jsonl"
    data.write_bytes(b"")
    cases = [
        (["train", "--target", str(tiny_dir), "--data", str(REGENERATED_64), "--out", str(tiny_dir / "run"), "--device", "cpu"],
         "is inside the input"),
        # (--out equal to the data file is refused for being a file: test_commands_user_errors.py)
        (["cache-features", "--target", str(tiny_dir), "--data", str(data), "--out", str(tiny_dir / "features")],
         "is inside the input"),
        (["regenerate", "--target", str(tiny_dir), "--prompts", str(data.with_suffix(".x")), "--out",
          str(tiny_dir / "rows.jsonl"), "--max-new-tokens", "8"], "is inside the input"),
        (["self-prompts", "--target", str(tiny_dir), "--count", "1", "--out", str(tiny_dir / "p.jsonl")],
         "is inside the input"),
        (["prompts", "--out", str(data / "p.jsonl")], "is a file, not a folder"),
        (["quickstart", "--out", str(data)], "is a file"),
    ]
    before = sorted(p.name for p in tiny_dir.iterdir())
    for args, message in cases:
        capsys.readouterr()
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (args, err)
    assert sorted(p.name for p in tiny_dir.iterdir()) == before and data.read_bytes() == b""


# --- D3: variant names are folders -----------------------------------------------------------------

@pytest.mark.parametrize("names,message", [
    (["../escaped"], r"variants\[0\]: name '../escaped': use a plain folder name"),
    (["/abs/victim"], r"variants\[0\]: name '/abs/victim': use a plain folder name"),
    (["a", "./a"], r"variants\[1\]: name './a': use a plain folder name"),
    (["..", "b"], r"variants\[0\]: name '..': use a plain folder name"),
    (["b8", "B8"], r"variants\[1\]: name 'B8' is used twice .*'b8' is the same folder"),
    (["x\\y"], r"use a plain folder name"),
    # The run's own files and folders beside the variants' (before: a variant named summary.json
    # trained the whole run and failed at its end, one named tensorboard trained into the event files).
    (["summary.json", "b"], r"variants\[0\]: name 'summary.json': the run writes its own summary.json there"),
    (["rows.cache", "b"], r"the run writes its own rows.cache there"),
    (["a", "TensorBoard"], r"variants\[1\]: name 'TensorBoard': the run writes its own TensorBoard there"),
])
def test_variant_names_must_be_plain_folder_names(names, message):
    with pytest.raises(ConfigError, match=message):
        tiny_train_config("runs/v", mode="variants", variants=[{"name": n} for n in names])


def test_what_a_variants_run_writes_beside_its_variants_is_no_variant_name():
    """config.RUN_FOLDER_ENTRIES holds every name the trainer writes at the top of a run's folder."""
    from dflash_train.config import RUN_FOLDER_ENTRIES
    from dflash_train.data.rows_cache import CACHE_NAME
    from dflash_train.train import tensorboard
    from dflash_train.train.build import RUN_FILES, RUN_FOLDER_FILES
    from dflash_train.train.compile_cache import CACHE_FILE

    for name in (*RUN_FOLDER_FILES, *RUN_FILES, CACHE_NAME, CACHE_FILE, tensorboard.SUBDIR):
        assert name in RUN_FOLDER_ENTRIES, name
    tiny_train_config("runs/v", mode="variants", variants=[{"name": "lr-1.5e-3"}, {"name": "b"}])  # a dot inside is fine


def test_a_variant_name_outside_out_is_refused_before_anything_is_written(tmp_path, tiny_dir, capsys):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "user.txt").write_text("keep")
    config = tmp_path / "abs.toml"
    config.write_text(f'mode = "variants"\nsteps = 2\nvariants = [{{name = "{victim}"}}, {{name = "../escaped"}}]\n')
    assert main(["train", "--config", str(config), "--target", str(tiny_dir), "--data", str(REGENERATED_64), "--device", "cpu",
                 "--out", str(tmp_path / "runs" / "v")]) == 2
    assert "variants[0]: name" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abs.toml", "victim"]
    assert [p.name for p in victim.iterdir()] == ["user.txt"]


# --- D8: the user's umask ----------------------------------------------------------------------------

@pytest.mark.parametrize("umask,folder,file", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_outputs_are_created_with_the_users_umask(tmp_path, target, run_dir, umask, folder, file):
    """The defect: the export and its weights, checkpoints, run.json, summary.json and prompt
    files were 0700 / 0600 whatever the umask (a server running as another user could not read them)."""
    from dflash_train.commands._common import write_new_prompt_file
    from dflash_train.data.readers import Prompt

    previous = os.umask(umask)
    try:
        out = tmp_path / "run"
        train(tiny_train_config(out, steps=2, save_every=2, tensorboard="off"), samples=pattern_samples(8),
              target=target, log=_quiet())
        assert main(["export", str(run_dir), "--out", str(tmp_path / "exp")]) == 0
        write_new_prompt_file(str(tmp_path / "p.jsonl"), [Prompt("a", [{"role": "user", "content": "hi"}], "t")],
                              lambda _: "test")
        write_bytes_atomic(tmp_path / "record.json", b"{}")
        write_dir_atomically(tmp_path / "folder", lambda staging: (staging / "f").write_text("x"))
    finally:
        os.umask(previous)
    written = [p for p in tmp_path.rglob("*") if not p.name.startswith(".")]
    for name in ("run/export/model.safetensors", "run/run.json", "run/summary.json", "run/metrics.jsonl",
                 "run/checkpoints/step-00000002/drafter.safetensors", "exp/model.safetensors", "exp/config.json",
                 "p.jsonl", "record.json", "folder/f"):
        assert tmp_path / name in written, name
    wrong = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in written
             if stat.S_IMODE(p.stat().st_mode) != (folder if p.is_dir() else file)}
    assert not wrong


@pytest.mark.parametrize("shared", [False, True])
def test_a_published_program_stays_executable(tmp_path, shared):
    """The engine tests publish a built llama-server with publish_dir_once: resetting the modes to
    the umask (or to the shared cache's 0644) made it a file nobody could run."""
    from dflash_train.files import publish_dir_once

    def build(staging):
        (staging / "bin").mkdir()
        (staging / "bin" / "server").write_text("#!/bin/sh\n")
        os.chmod(staging / "bin" / "server", 0o700)
        (staging / "build.json").write_text("{}")

    previous = os.umask(0o022)
    try:
        folder = publish_dir_once(tmp_path / "built", build, is_complete=lambda d: (d / "build.json").is_file(),
                                  shared=shared)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((folder / "bin" / "server").stat().st_mode) == 0o755
    assert stat.S_IMODE((folder / "build.json").stat().st_mode) == 0o644


# --- D12: an export killed at its rename --------------------------------------------------------------

def _export_killed_at_its_rename(run_dir: Path, out: Path, *extra: str) -> None:
    process = _cli_process("export", str(run_dir), "--out", str(out), *extra,
                           DFLASH_TEST_PAUSE_AT="before_final_rename:300")
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "paused at before_final_rename" not in line:
            line = process.stderr.readline()
            assert (line or process.poll() is None) and time.monotonic() < deadline, process.communicate()
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.communicate()


def _hidden(folder: Path) -> list[str]:
    """Hidden entries, less the lock file a killed process leaves (unlocked by the kernel; removed at the next release)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name != ".exp.lock")


def test_an_export_killed_before_its_rename_is_cleaned_by_the_next(tmp_path, run_dir, capsys):
    out = tmp_path / "d" / "exp"
    _export_killed_at_its_rename(run_dir, out)
    left = _hidden(out.parent)
    assert not out.exists() and len(left) == 1 and left[0].startswith(".exp.")  # the complete hidden copy
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    assert f"removed {out.parent / left[0]}" in capsys.readouterr().out
    assert sorted(p.name for p in out.parent.iterdir()) == ["exp"] and (out / "model.safetensors").is_file()


def test_a_forced_export_killed_between_its_renames_puts_the_users_folder_back(tmp_path, run_dir, capsys):
    """`--force` over a user's folder, killed after that folder was renamed aside: the next
    export puts it back, says so, and (without --force) refuses to replace it."""
    out = tmp_path / "d" / "exp"
    out.mkdir(parents=True)
    (out / "user.txt").write_text("keep")
    _export_killed_at_its_rename(run_dir, out, "--force")
    assert not out.exists() and len(_hidden(out.parent)) == 2  # the user's folder aside, the new export staged
    assert main(["export", str(run_dir), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"put back {out}" in captured.out and "--force to replace it" in captured.err
    assert [p.name for p in out.iterdir()] == ["user.txt"] and (out / "user.txt").read_text() == "keep"
    assert sorted(p.name for p in out.parent.iterdir()) == ["exp"]
