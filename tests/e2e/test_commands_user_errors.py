"""What the user can fix is one line naming the file or flag, exit 2, never a traceback: unreadable
inputs (as root without CAP_DAC_OVERRIDE, through capsh), a damaged regenerate sidecar or output
file, a damaged feature cache read by `train --features`, a full disk (a real tiny tmpfs in a user
namespace) or a write past the process's file-size limit, and paths of the wrong kind. Real files, real processes, a tiny real model."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.cli import main
from processes import hidden_copies, paused_cli
from test_generate_endpoint_answers import ScriptedServer
from test_parallel_nodes import _cli_target_and_data

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1"}
CLI = [sys.executable, "-m", "dflash_train.cli"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _cli_target_and_data(tmp_path_factory.mktemp("tiny"))


def _last_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.startswith("dflash-train")]
    assert len(lines) == 1, err
    return lines[0]


# --- unreadable inputs (D10) -------------------------------------------------------------------

def _without_dac(tmp_path: Path) -> list[str] | None:
    """A command prefix that runs as root without the capabilities that read any file; None where
    it cannot be had (then a chmod 000 file is still readable, and the case cannot be made)."""
    probe = tmp_path / "probe"
    probe.write_text("x")
    probe.chmod(0)
    if os.geteuid() != 0:
        prefix: list[str] = []
    elif shutil.which("capsh"):
        prefix = ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c"]
    else:
        return None
    done = subprocess.run([*prefix, f"cat {probe}"] if prefix else ["cat", str(probe)], capture_output=True)
    return prefix if done.returncode != 0 else None


def test_unreadable_inputs_are_one_line_naming_the_file(tiny, tmp_path):
    target, data = tiny
    prefix = _without_dac(tmp_path)
    if prefix is None:
        pytest.skip("no way to make a file unreadable here (root with CAP_DAC_OVERRIDE and no capsh)")
    unreadable = tmp_path / "unread.jsonl"
    shutil.copy(data, unreadable)
    unreadable.chmod(0)
    config = tmp_path / "unread.toml"
    config.write_text("lr = 1e-3\n")
    config.chmod(0)
    drafter = _exported_drafter(tmp_path / "drafter")
    (drafter / "model.safetensors").chmod(0)
    common = ["--target", str(target), "--device", "cpu"]
    cases = {
        # Both were found only after the target loaded; the drafter's as "No such file".
        "pipeline --data": ["pipeline", "--target", str(target), "--recipe", "quickstart", "--out", str(tmp_path / "w"),
                            "--data", str(unreadable)],
        "eval --drafter weights": ["eval", *common, "--drafter", str(drafter), "--bench", "humaneval"],
        "train --data (T01)": ["train", *common, "--data", str(unreadable), "--out", str(tmp_path / "t"), "--steps", "1"],
        "cache-features --data (CF06)": ["cache-features", *common, "--data", str(unreadable), "--out", str(tmp_path / "c")],
        "regenerate --prompts (G01)": ["regenerate", *common, "--prompts", str(unreadable), "--out", str(tmp_path / "g.jsonl"),
                                       "--max-new-tokens", "8"],
        "train --config (CFG-unreadable)": ["train", "--config", str(config), "--out", str(tmp_path / "t2")],
    }
    for case, args in cases.items():
        command = " ".join(map(str, [*CLI, *args]))
        done = subprocess.run([*prefix, command] if prefix else command.split(), capture_output=True, text=True,
                              env=ENV, cwd=tmp_path, timeout=300)
        assert done.returncode == 2, (case, done.stderr[-2000:])
        line = _last_line(done.stderr)
        assert "permission denied" in line and any(name in line for name in ("unread.jsonl", "unread.toml", "model.safetensors")), (case, line)
        assert "loading target" not in done.stdout, case

    # An output in a folder this user may not write in: named by its flag, not by the lock file beside it.
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o555)
    shard = tmp_path / "shard.json"
    shard.write_text("{}")
    command = " ".join(map(str, [*CLI, "eval-merge", shard, "--json", readonly / "merged.json"]))
    done = subprocess.run([*prefix, command] if prefix else command.split(), capture_output=True, text=True,
                          env=ENV, cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and _last_line(done.stderr) == (
        f"dflash-train eval-merge: --json {readonly / 'merged.json'}: cannot write in {readonly}: permission denied "
        "(this user may not read or write it) (EACCES)"), done.stderr


def test_flags_given_oddly_are_one_line(tmp_path, capsys):
    """A value given twice (first argument and its flag: one was dropped silently), `-` as an output
    file (a file named `-` was written), a GGUF output named as a folder (a file named like the
    folder was written), an empty quickstart --out (the current folder), an output in a folder
    that cannot hold files (a traceback naming the lock file)."""
    shard = tmp_path / "shard.json"
    shard.write_text("{}")
    cases = {
        "positional and flag": (["export", "runs/a", "--checkpoint", "runs/b", "--out", "x"],
                                "CHECKPOINT is given twice, as the first argument and as --checkpoint; give it once"),
        "stdout as a file": (["eval-merge", str(shard), "--json", "-"], "--json -: standard output is not an output here"),
        "gguf into a folder": (["export", "runs/a", "--format", "gguf", "--target", "t.gguf", "--out", "newdir/"],
                               "--out newdir/ names a folder; --format gguf writes one file: name it (e.g. --out newdir/drafter.gguf)"),
        "empty quickstart out": (["quickstart", "--out", ""], "--out is empty"),
        "a folder that holds no files": (["eval-merge", str(shard), "--json", "/proc/merged.json"],
                                         "--json /proc/merged.json: /proc cannot hold files"),
    }
    for case, (args, expected) in cases.items():
        assert main(args) == 2, case
        assert expected in _last_line(capsys.readouterr().err), case
    assert not (tmp_path / "-").exists() and not Path("-").exists()


def _exported_drafter(out: Path) -> Path:
    import torch
    from tiny import tiny_target

    from dflash_train.core.drafter import DFlashDrafter, DrafterConfig
    from dflash_train.export.hf import export_model

    config = DrafterConfig.from_target(tiny_target("llama").spec, num_layers=1, block_size=4, mask_token_id=95,
                                       target_layer_ids=[1, 3])
    return export_model(DFlashDrafter(config), out, dtype=torch.float32)


# --- a damaged regenerate output (D11: G04, G05, G06) ----------------------------------------------

@pytest.fixture
def answered(tmp_path):
    server = ScriptedServer()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Count to {i}."}) + "\n" for i in range(4)))
    out = tmp_path / "rows.jsonl"
    args = ["regenerate", "--endpoint", server.url, "--prompts", str(prompts), "--out", str(out), "--retries", "0"]
    assert main(args) == 0
    yield args, out, Path(f"{out}.regenerate.json")
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("damage,expected", [
    ("truncated sidecar", "rows.jsonl.regenerate.json: damaged (not valid JSON"),
    ("sidecar without settings", "rows.jsonl.regenerate.json: damaged (no settings recorded)"),
    ("a byte that is not UTF-8 in a row", "rows.jsonl:2: not a row written by regenerate"),
])
def test_a_damaged_regenerate_output_is_one_line_naming_the_file(answered, capsys, damage, expected):
    args, out, sidecar = answered
    before = out.read_bytes()
    if damage == "truncated sidecar":
        sidecar.write_text(sidecar.read_text()[:20])
    elif damage == "sidecar without settings":
        sidecar.write_text(json.dumps({"target": "x"}))
    else:
        lines = before.split(b"\n")
        assert b'"id": "' in lines[1]
        lines[1] = lines[1].replace(b'"id": "', b'"id": "\xff', 1)
        out.write_bytes(b"\n".join(lines))
    capsys.readouterr()
    assert main(args) == 2
    assert expected in _last_line(capsys.readouterr().err)


# --- a damaged feature cache under train --features (D11: CF11, CF13) -------------------------------

@pytest.fixture(scope="module")
def feature_cache(tiny, tmp_path_factory):
    target, data = tiny
    out = tmp_path_factory.mktemp("features") / "cache"
    assert main(["cache-features", "--target", str(target), "--data", str(data), "--out", str(out), "--device", "cpu",
                 "--max-seq-len", "128", "--num-layers", "1"]) == 0
    return out


@pytest.mark.parametrize("name", ["shard-00000.json", "cache.json"])
def test_train_features_with_a_broken_cache_file_names_it(tiny, feature_cache, tmp_path, capsys, name):
    target, _ = tiny
    cache = tmp_path / "cache"
    shutil.copytree(feature_cache, cache)
    broken = cache / name
    broken.write_text(broken.read_text()[:14] + "\x01" + broken.read_text()[14:])  # a control character (CF11)
    capsys.readouterr()
    assert main(["train", "--target", str(target), "--features", str(cache), "--out", str(tmp_path / "run"),
                 "--steps", "1", "--batch-size", "2", "--max-seq-len", "128", "--num-layers", "1", "--num-anchors", "8",
                 "--block-size", "4", "--device", "cpu"]) == 2
    line = _last_line(capsys.readouterr().err)
    assert f"{broken}: damaged (not valid JSON" in line, line


def test_train_features_on_a_shard_damaged_in_place_stops_with_one_line(tiny, feature_cache, tmp_path, capsys):
    """Bytes flipped inside a shard (same size): found when a worker reads it, mid-run. The
    worker's error reaches the command line as itself: one line, exit 2 (before: exit 1 and the
    worker's traceback, wrapped as a pipeline failure)."""
    target, _ = tiny
    cache = tmp_path / "cache"
    shutil.copytree(feature_cache, cache)
    shard = cache / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[5000:5064] = bytes(b ^ 0xFF for b in data[5000:5064])
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["train", "--target", str(target), "--features", str(cache), "--out", str(tmp_path / "run"),
                 "--steps", "40", "--batch-size", "2", "--max-seq-len", "128", "--num-layers", "1", "--num-anchors", "8",
                 "--block-size", "4", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(shard) in _last_line(err), err[-2000:]


# --- a full disk (D11: DF01, X17) --------------------------------------------------------------------

def _tmpfs_prefix(tmp_path: Path, kib: int) -> tuple[Path, str]:
    mount = tmp_path / "disk"
    mount.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mount}"],
                           capture_output=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("cannot mount a tmpfs in a user namespace here: the full-disk path is untested on this machine")
    return mount, f"mount -t tmpfs -o size={kib}k tmpfs {mount} && "


def _in_namespace(command: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, env=ENV,
                          cwd=tmp_path, timeout=300)


def test_regenerate_on_a_full_disk_is_one_line_naming_the_output(tmp_path):
    mount, mount_it = _tmpfs_prefix(tmp_path, 64)
    server = ScriptedServer(content="word " * 2000, completion_tokens=60)  # 10 kB answers, 64 kB of disk
    try:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Count to {i}."}) + "\n" for i in range(20)))
        out = mount / "rows.jsonl"
        done = _in_namespace(mount_it + " ".join(map(str, [*CLI, "regenerate", "--endpoint", server.url, "--prompts",
                                                                prompts, "--out", out, "--max-new-tokens", "64",
                                                                "--flush-seconds", "0", "--concurrency", "1"])), tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{out}: no space left on the device (ENOSPC)" in _last_line(done.stderr)


def test_export_on_a_full_disk_is_one_line_naming_the_flag(tiny, tmp_path):
    target, data = tiny
    run = tmp_path / "run"
    assert main(["train", "--target", str(target), "--data", str(data), "--out", str(run), "--steps", "1",
                 "--batch-size", "2", "--max-seq-len", "128", "--num-layers", "1", "--num-anchors", "8",
                 "--block-size", "4", "--device", "cpu", "--export-dtype", ""]) == 0
    mount, mount_it = _tmpfs_prefix(tmp_path, 64)
    done = _in_namespace(mount_it + " ".join(map(str, [*CLI, "export", run, "--out", mount / "export",
                                                        "--dtype", "float32"])), tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    line = _last_line(done.stderr)
    assert f"--out {mount / 'export'}" in line and ("No space left" in line or "no space left" in line), line


def _file_size_limit(size: int):
    """A subprocess's preexec_fn: no file it writes may grow past `size` bytes. The kernel fails such a
    write with EFBIG (SIGXFSZ, which would kill the process instead, is ignored), like a full disk."""
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return limit


@pytest.fixture(scope="module")
def prompt_set_cached(default_prompt_set):
    """The default prompt set in the cache folder (tests/conftest.py): the commands below then only
    read it (building it under a file-size limit would fail on the cache, not on --out)."""
    assert main(["prompts", "--limit", "1"]) == 0


@pytest.mark.parametrize("disk", ["a full tmpfs", "a file-size limit"])
def test_prompts_out_on_a_full_disk_leaves_nothing_and_names_the_flag(disk, tmp_path, prompt_set_cached):
    """X18: `prompts --out` whose write fails midway (400 prompts, about 300 kB, into 64 KiB):
    one line naming --out, the file and the OS error, exit 2; the folder holds the user's file as
    it was and nothing else (no partial file, no hidden temporary copy, no lock file, not the
    folders `new/dir/` it made for --out)."""
    listing = "--- the folder after the run:"
    if disk == "a full tmpfs":
        folder, mount_it = _tmpfs_prefix(tmp_path, 64)
        out, expected = folder / "new" / "dir" / "prompts.jsonl", "no space left on the device (ENOSPC)"
        prompts = " ".join(map(str, [*CLI, "prompts", "--out", out, "--limit", "400"]))
        # The tmpfs lives as long as the namespace: look at what is left from inside it.
        done = _in_namespace(f"{mount_it} echo mine > {folder}/notes.txt && {prompts}; code=$?; echo '{listing}'; "
                             f"ls -A {folder}; cat {folder}/notes.txt; exit $code", tmp_path)
    else:
        folder = tmp_path / "disk"
        folder.mkdir()
        (folder / "notes.txt").write_text("mine\n")
        out, expected = folder / "new" / "dir" / "prompts.jsonl", "file too large for this file system or limit (EFBIG)"
        done = subprocess.run([*CLI, "prompts", "--out", str(out), "--limit", "400"], capture_output=True, text=True,
                              env=ENV, cwd=tmp_path, timeout=300, preexec_fn=_file_size_limit(64 * 1024), check=False)
        done.stdout += f"{listing}\n" + "".join(f"{p.name}\n" for p in sorted(folder.iterdir()))
        done.stdout += (folder / "notes.txt").read_text()
    assert done.returncode == 2, done.stderr[-2000:]
    assert _last_line(done.stderr) == f"dflash-train prompts: --out {out}: cannot write it: {expected}; nothing was written there"
    assert done.stdout.split(listing)[1].split() == ["notes.txt", "mine"]


def test_prompts_killed_while_writing_its_out_is_cleaned_by_the_next(tmp_path, prompt_set_cached):
    """`prompts --out F` killed (-9) as its file was about to take its name leaves a hidden copy
    `.F.XXXXXXXX.tmp`; the next `prompts --out F` removes it, says so, and writes F."""
    out = tmp_path / "prompts.jsonl"
    args = ["prompts", "--out", str(out), "--limit", "3"]
    with paused_cli(args, "before_final_link") as killed:
        killed.kill()
    hidden_copy = hidden_copies(tmp_path, "prompts.jsonl")
    assert len(hidden_copy) == 1 and not out.exists(), sorted(p.name for p in tmp_path.iterdir())
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"removed {tmp_path / hidden_copy[0]}: the unfinished copy a killed write left" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prompts.jsonl"]
    assert len(out.read_text().splitlines()) == 3


# Two SmolLM2 loads (~40 s on two cores): slow. The default suite keeps the guarantee through the
# same NewFileOutput in test_prompts_killed_while_writing_its_out_is_cleaned_by_the_next and
# test_prompts_out_on_a_full_disk_leaves_nothing_and_names_the_flag.
@pytest.mark.slow
def test_self_prompts_cleans_what_a_killed_one_left_and_names_out_on_a_full_disk(smollm2_dir, tmp_path,
                                                                                  prompt_set_cached):
    """`self-prompts --out F` killed (-9) as F was about to take its name leaves a hidden copy; the
    next run removes it and says so. That run's own write fails (its process may write no file past
    64 bytes: a real RLIMIT_FSIZE, like a full disk): one line naming --out, F and the OS error,
    exit 2, and the folder is left as the user had it (no copy, no lock)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    out = folder / "requests.jsonl"
    args = ["self-prompts", "--target", str(smollm2_dir), "--count", "1", "--out", str(out), "--max-new-tokens", "40",
            "--batch-size", "1", "--device", "cpu"]
    with paused_cli(args, "before_final_link") as killed:
        killed.kill()
    hidden_copy = hidden_copies(folder, out.name)
    assert len(hidden_copy) == 1 and not out.exists(), sorted(p.name for p in folder.iterdir())
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=300,
                          preexec_fn=_file_size_limit(64), check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"removed {folder / hidden_copy[0]}: the unfinished copy a killed write left" in done.stdout
    assert _last_line(done.stderr) == (f"dflash-train self-prompts: --out {out}: cannot write it: file too large for "
                                       "this file system or limit (EFBIG); nothing was written there")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"] and (folder / "notes.txt").read_text() == "mine\n"


# --- paths of the wrong kind (D11: CF01, P09, Q02, X13, EM09) --------------------------------------------

def test_paths_of_the_wrong_kind_are_refused_at_start(tiny, tmp_path, capsys, monkeypatch):
    target, data = tiny
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    run = tmp_path / "run"  # what a training run folder holds that an export does not
    (run / "checkpoints").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cases = {
        "cache-features --out the data file": (["cache-features", "--target", str(target), "--data", str(data),
                                                "--out", str(data)], f"--out {data} is a file"),
        "prompts --out below a file": (["prompts", "--out", str(a_file / "p.jsonl")], f"{a_file} is a file, not a folder"),
        "quickstart --out a file": (["quickstart", "--out", str(a_file)], f"--out {a_file} is a file"),
        "export --out .": (["export", str(tmp_path), "--out", ".", "--force"], "--out . is the current folder"),
        "eval-merge a folder": (["eval-merge", str(tmp_path)], f"{tmp_path}: a folder"),
        "export --check a folder without config.json": (["export", "--check", str(tmp_path)],
                                                         f"--check {tmp_path}: no config.json, so not a drafter folder"),
        "export --check a run": (["export", "--check", str(run)], f"a training run or checkpoint: export it first "
                                                                    f"(dflash-train export {run} --out DIR)"),
    }
    for case, (args, expected) in cases.items():
        assert main(args) == 2, case
        assert expected in _last_line(capsys.readouterr().err), case
    assert a_file.read_text() == "mine" and data.is_file()


def test_inputs_are_refused_naming_the_flag_before_any_model_loads(tiny, tmp_path, capsys):
    """train without a target, a target or --data path that is not there or not a model folder,
    data of a type train cannot read, no data at all; cache-features, eval and regenerate the same:
    one line naming the flag, before `loading target` (minutes for a big target) and before the
    output exists."""
    target, data = tiny
    toml = tmp_path / "answers.toml"
    toml.write_text("x = 1\n")
    half = tmp_path / "half.gguf"  # a download that never got its first bytes
    half.write_bytes(b"")
    empty_bench = tmp_path / "bench.jsonl"
    empty_bench.write_text("")
    untokenized = tmp_path / "untokenized"  # the model's files without its tokenizer (before: found after loading)
    untokenized.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(target / name, untokenized / name)
    declared = json.loads((target / "config.json").read_text())
    vocab, hidden = declared["vocab_size"], declared["hidden_size"]
    out = tmp_path / "run"
    common = ["train", "--out", str(out), "--steps", "2", "--device", "cpu"]
    cases = {
        "no target": ([*common, "--data", str(data)], "no target: pass --target DIR"),
        "a target not there": ([*common, "--target", str(tmp_path / "absent"), "--data", str(data)],
                               f"--target {tmp_path / 'absent'}: no such file or folder"),
        "data not there": ([*common, "--target", str(target), "--data", f"{data},{tmp_path / 'gone.jsonl'}"],
                           f"--data {tmp_path / 'gone.jsonl'}: no such file"),
        "data train cannot read": ([*common, "--target", str(target), "--data", str(toml)],
                                   f"--data {toml}: unsupported file type; expected one of .jsonl"),
        "no data": ([*common, "--target", str(target)], "no training data: pass --data FILE.jsonl"),
        "cache-features data not there": (["cache-features", "--target", str(target), "--data", str(tmp_path / "gone.jsonl"),
                                           "--out", str(out), "--device", "cpu"], f"--data {tmp_path / 'gone.jsonl'}: no such file"),
        "cache-features data it cannot read": (["cache-features", "--target", str(target), "--data", str(toml), "--out", str(out)],
                                               f"--data {toml}: unsupported file type"),
        "train on a folder that is not a model": ([*common, "--target", str(tmp_path), "--data", str(data)],
                                                  f"--target {tmp_path}: not a Hugging Face model folder (no config.json)"),
        "regenerate with a target that is not a model": (["regenerate", "--target", str(toml), "--prompts", str(data), "--out",
                                                          str(out / "rows.jsonl")], f"--target {toml}: not a Hugging Face model folder"),
        "eval with a drafter that is not an export": (["eval", "--target", str(target), "--drafter", str(tmp_path)],
                                                      f"--drafter {tmp_path}: no config.json; expected an exported DFlash drafter"),
        "eval with a target's folder as the drafter": (["eval", "--target", str(target), "--drafter", str(target)],
                                                       f"--drafter {target}: not a DFlash drafter"),
        "eval stopping on a token past the vocabulary": (
            ["eval", "--target", str(target), "--drafter", str(_exported_drafter(tmp_path / "drafter")),
             "--stop-token-ids", "2,999999"], f"--stop-token-ids 999999: past the target's vocabulary (ids 0..{vocab - 1})"),
        "train on an unfinished .gguf": ([*common, "--target", str(half), "--data", str(data)],
                                         f"--target {half}: not a GGUF file (0 bytes"),
        "train on layers the target does not have": ([*common, "--target", str(target), "--data", str(data),
                                                      "--target-layer-ids", "1,99"], "target_layer_ids [99] out of range"),
        # The tiny target's context is 512 tokens: an answer past it would be garbage training data.
        "regenerate answers longer than the context": (
            ["regenerate", "--target", str(target), "--prompts", str(data), "--out", str(out / "rows.jsonl"),
             "--max-new-tokens", "512"], "--max-new-tokens 512 leaves no room for a prompt in the target's 512-token context"),
        "regenerate prompts and answers longer than the context": (
            ["regenerate", "--target", str(target), "--prompts", str(data), "--out", str(out / "rows.jsonl"),
             "--max-new-tokens", "400", "--max-prompt-tokens", "128"],
            "--max-prompt-tokens 128 + --max-new-tokens 400 exceed the target's 512-token context"),
        # Against the target's declared sizes (before: each found once the target had loaded).
        "a mask token past the vocabulary": ([*common, "--target", str(target), "--data", str(data), "--mask-token-id", "999999"],
                                             f"--mask-token-id 999999 is outside the target's embedding table (rows 0..{vocab - 1})"),
        "a DFlash2 selector wider than the vocabulary": (
            [*common, "--target", str(target), "--data", str(data), "--arch", "dflash2", "--selector-top-k", "100000"],
            f"--arch dflash2: selector_top_k 100000: must be in 1..{vocab}"),
        "DFlash2 convolution groups that do not divide the hidden size": (
            [*common, "--target", str(target), "--data", str(data), "--arch", "dflash2", "--conv-group-size", "7"],
            f"--arch dflash2: conv_group_size 7: must divide the hidden size {hidden}"),
        "a target folder without its tokenizer": ([*common, "--target", str(untokenized), "--data", str(data)],
                                                  f"--target {untokenized}: no tokenizer next to the model"),
        "regenerate with a target folder without its tokenizer": (
            ["regenerate", "--target", str(untokenized), "--prompts", str(data), "--out", str(out / "rows.jsonl"),
             "--max-new-tokens", "8"], f"--target {untokenized}: no tokenizer next to the model"),
        "an in-training eval on a benchmark that is not there": (
            [*common, "--target", str(target), "--data", str(data), "--eval-every", "1", "--eval-bench", "nosuch"],
            "--eval-bench: unknown benchmark 'nosuch'"),
        "an in-training eval on an empty prompts file": (
            [*common, "--target", str(target), "--data", str(data), "--eval-every", "1", "--eval-bench", str(empty_bench)],
            f"--eval-bench: {empty_bench}: no prompts"),
        "self-prompts longer than the context": (
            ["self-prompts", "--target", str(target), "--count", "2", "--out", str(out / "own.jsonl"),
             "--max-new-tokens", "600"], "--max-new-tokens 600 leaves no room for a prompt in the target's 512-token context"),
    }
    for case, (args, expected) in cases.items():
        assert main(args) == 2, case
        captured = capsys.readouterr()
        assert expected in _last_line(captured.err), (case, captured.err)
        assert "loading target" not in captured.out and not out.exists(), case


def test_a_resume_that_changes_what_its_checkpoint_fixes_is_refused_before_the_target_loads(tiny, tmp_path, capsys):
    """--lr, --block-size, --seed, --batch-size, --max-seq-len, --grad-accum: read from the newest
    checkpoint's record (before: refused only once the target had loaded and the rows had rendered)."""
    target, data = tiny
    out = tmp_path / "run"
    common = ["train", "--target", str(target), "--data", str(data), "--out", str(out), "--device", "cpu",
              "--batch-size", "2", "--max-seq-len", "128", "--num-layers", "1", "--num-anchors", "8", "--block-size", "4"]
    assert main([*common, "--steps", "2", "--save-every", "1"]) == 0
    capsys.readouterr()
    for flag, value in (("--lr", "1"), ("--block-size", "8"), ("--seed", "3"), ("--batch-size", "4"), ("--max-seq-len", "96"),
                        ("--grad-accum", "2")):
        assert main([*common, "--steps", "4", "--resume", flag, value]) == 2, flag
        captured = capsys.readouterr()
        line = _last_line(captured.err)
        assert f"{flag} {value}" in line and "differs from" in line or f"{value} now" in line, line
        assert "loading target" not in captured.out, flag


def test_a_train_run_that_fails_before_writing_leaves_no_empty_run_folder(tiny, tmp_path, capsys):
    """A failure found once the data is read (here: fewer rows than one batch) ends the run before
    it writes anything: the run folder it made is gone again, and a folder that was there stays."""
    target, data = tiny
    rows = len(data.read_text().splitlines())
    out = tmp_path / "new" / "run"
    args = ["train", "--target", str(target), "--data", str(data), "--steps", "1", "--device", "cpu",
            "--batch-size", str(rows + 1), "--eval-every", "0"]
    assert main([*args, "--out", str(out)]) == 2
    assert "--batch-size" in _last_line(capsys.readouterr().err)
    assert not out.exists() and not out.parent.exists()
    kept = tmp_path / "mine"
    kept.mkdir()
    assert main([*args, "--out", str(kept)]) == 2
    capsys.readouterr()
    assert kept.is_dir() and not any(kept.iterdir())


def test_regenerate_with_no_prompt_to_answer_is_one_line_and_writes_nothing(tiny, tmp_path, capsys):
    """An empty prompts file, or one whose every row is skipped: refused before the target loads,
    with the skipped rows' reasons, instead of an empty answers file and exit 0."""
    target, _ = tiny
    empty, bad = tmp_path / "empty.jsonl", tmp_path / "bad.jsonl"
    empty.write_text("")
    bad.write_text('{"bad": 1}\n{"prompt": ""}\n')
    for prompts, expected in ((empty, "(it has no rows)"), (bad, "(see the skipped rows above)")):
        out = tmp_path / "answers.jsonl"
        assert main(["regenerate", "--target", str(target), "--prompts", str(prompts), "--out", str(out), "--device", "cpu",
                     "--max-new-tokens", "8"]) == 2
        captured = capsys.readouterr()
        assert _last_line(captured.err) == f"dflash-train regenerate: --prompts {prompts}: no prompt to answer in it {expected}"
        assert "loading target" not in captured.out and not list(tmp_path.glob("answers.jsonl*")), prompts
    assert "skipped 1: prompt: empty" in captured.out


def test_feature_cache_inputs_are_refused_before_the_target_loads(tiny, feature_cache, tmp_path, capsys):
    """train --features with a --target other than the cache's (same shape, other weights), a
    --data file named twice (its rows would be read twice), and cache-features' layers beyond the
    target, an --out that is not empty, or a cache made with other settings: one line, exit 2,
    before `loading target`."""
    from test_parallel_nodes import _noisy_copy

    target, data = tiny
    other = _noisy_copy(target, tmp_path / "fine-tune")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    twice = f"{data},{data.parent}/./{data.name}"
    learn = ["--out", str(tmp_path / "run"), "--steps", "1", "--batch-size", "2", "--max-seq-len", "128", "--num-layers", "1",
             "--num-anchors", "8", "--block-size", "4", "--device", "cpu"]
    cache = ["cache-features", "--target", str(target), "--device", "cpu", "--max-seq-len", "128", "--num-layers", "1"]
    cases = {
        "train on another target's cache": (
            ["train", "--features", str(feature_cache), "--target", str(other), *learn],
            f"--target {other} is not the target the feature cache {feature_cache} was made from ({target.resolve()}): "
            "their sampled weights differ"),
        "train on a file given twice": (["train", "--target", str(target), "--data", twice, *learn],
                                        f"--data {data.parent}/./{data.name} is given twice (the same file as {data})"),
        "cache a file given twice": ([*cache, "--data", twice, "--out", str(tmp_path / "c")], "is given twice"),
        "cache layers the target does not have": ([*cache, "--data", str(data), "--target-layer-ids", "7", "--out",
                                                   str(tmp_path / "c")], "target_layer_ids [7] out of range"),
        "cache into a folder that holds something else": ([*cache, "--data", str(data), "--out", str(busy)],
                                                          f"{busy} is not empty and holds no feature cache"),
        "cache with other settings": ([*cache, "--data", str(data), "--out", str(feature_cache), "--max-seq-len", "64"],
                                      "made with other settings (max_seq_len: 128 before, 64 now)"),
        "cache from another target": ([*cache, "--target", str(other), "--data", str(data), "--out", str(feature_cache)],
                                      "made with other settings (the target's sampled weights: "),
    }
    for case, (args, expected) in cases.items():
        capsys.readouterr()
        assert main(args) == 2, case
        captured = capsys.readouterr()
        assert expected in _last_line(captured.err), (case, captured.err)
        assert "loading target" not in captured.out and not (tmp_path / "run").exists(), case
    assert not (tmp_path / "c").exists() and sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
