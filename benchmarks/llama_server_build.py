"""Build llama.cpp's own C++ server (`llama-server`), the CPU peer of the load benchmark.

The sources are the llama.cpp tree that the `llama-cpp-python` source distribution on PyPI vendors
(`vendor/llama.cpp`), at the pinned version below, so the peer is reproducible from the ordinary pip
client alone. Only the `llama-server` target is built: CPU only, Release, static libraries, no
HTTPS, no web UI (neither the UI's sources nor its prebuilt download). Everything lives under
~/.cache/shardwise/llama.cpp/<version>/ and is never part of the repository; running it again when
the binary exists does nothing.

    python benchmarks/llama_server_build.py            # prints the binary's path
    python benchmarks/serving_load.py --build-peer     # the same, from the load benchmark

It takes a while (tens of minutes on two cores); `--jobs` sets the parallel compile jobs (2).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

# The llama-cpp-python release whose vendored llama.cpp is built; bump it deliberately (figures in
# docs/worker.md name the peer by this version).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CACHE_ROOT = pathlib.Path.home() / ".cache" / "shardwise" / "llama.cpp"

CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",  # the peer is built for this machine's CPU, as a user would build it
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # no download at build time
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
)


def version_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> pathlib.Path:
    return CACHE_ROOT / version


def server_binary(version: str = LLAMA_CPP_PYTHON_VERSION) -> pathlib.Path:
    """Where the built `llama-server` lies (it may not exist yet)."""
    return version_dir(version) / "bin" / "llama-server"


def _run(cmd: list[str], log: pathlib.Path) -> None:
    with log.open("a") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"llama-server build: {cmd[0]} {cmd[1]} failed (rc {done.returncode}); see {log}")


def _sources(root: pathlib.Path, version: str, log: pathlib.Path) -> pathlib.Path:
    """The vendored llama.cpp tree of the sdist, downloaded and unpacked once."""
    src = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    sdist_dir = root / "sdist"
    sdists = sorted(sdist_dir.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not sdists:
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={version}", "-d", str(sdist_dir)], log)
        sdists = sorted(sdist_dir.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not sdists:
        raise SystemExit(f"llama-server build: no sdist of llama-cpp-python {version} in {sdist_dir}")
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdists[0]) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(root, members=members, filter="data")
    return src


def build(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2) -> pathlib.Path:
    """Build `llama-server` unless it is already built; returns its path."""
    binary = server_binary(version)
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    if shutil.which("cmake") is None:
        raise SystemExit("llama-server build: cmake is not installed")
    root = version_dir(version)
    root.mkdir(parents=True, exist_ok=True)
    log = root / "build.log"
    src = _sources(root, version, log)
    build_dir = root / "build"
    _run(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_OPTIONS], log)
    _run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], log)
    built = build_dir / "bin" / "llama-server"
    if not built.is_file():
        raise SystemExit(f"llama-server build: no binary at {built}; see {log}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, binary)
    return binary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION,
                        help="llama-cpp-python release whose vendored llama.cpp is built")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    args = parser.parse_args(argv)
    print(build(args.version, max(1, min(args.jobs, 64))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
