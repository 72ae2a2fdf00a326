#!/usr/bin/env python3
"""Strip a pip-installed CUDA torch down to what a CPU-only pod loads.

PyPI's Linux torch wheel is a CUDA build: it pulls ~3 GB of nvidia-* wheels plus triton (~1 GB).
`import torch` needs only the shared libraries in the DT_NEEDED closure of torch's own extension
modules (cudart, cublas, cublasLt, cufft, cusparse, cusparseLt, nccl, nvrtc, cudnn's small dispatcher
libcudnn.so.9, nvshmem_host, cufile, cupti; ~1.7 GB for torch 2.15 on CUDA 13). Everything else under
site-packages/nvidia/ (cudnn's engine libraries, cusolver, curand, nvjitlink, ...) is only ever dlopened
for CUDA work, and triton only for GPU torch.compile; a CPU-only pod touches neither. torch's own
best-effort preload of CUDA libraries at import (torch/__init__.py, required=False) skips the gone ones.

This script reads DT_NEEDED itself (64-bit little-endian ELF, via PT_DYNAMIC; the worker image has no
binutils), walks the closure from every *.so directly in torch/ and torch/lib/ (and the cuda-bindings
extension modules, if installed), and deletes every shared library under nvidia/ outside it, plus the
triton package and its dist-info. Python files, nvidia dist-info metadata and torch/ stay untouched.

usage: python slim_torch.py SITE_PACKAGES [--dry-run]
"""
import glob
import os
import re
import shutil
import struct
import sys

# torch dlopens this one itself, on the first linear-algebra call on a CUDA tensor; it is the only
# user of cusolver (and, through it, nvjitlink), so it is not a root.
LAZY = {"libtorch_cuda_linalg.so"}
SONAME = re.compile(r".+\.so(\.[0-9]+)*")  # libfoo.so, libfoo.so.9, libfoo.so.13.2


def dt_needed(path):
    """DT_NEEDED names of a 64-bit little-endian ELF file; [] for anything else."""
    try:
        with open(path, "rb") as f:
            hdr = f.read(64)
            if len(hdr) < 64 or hdr[:4] != b"\x7fELF" or hdr[4:6] != b"\x02\x01":
                return []
            (phoff,) = struct.unpack_from("<Q", hdr, 0x20)
            phentsize, phnum = struct.unpack_from("<HH", hdr, 0x36)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            # (p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align)
            phdrs = [struct.unpack_from("<IIQQQQQQ", table, i * phentsize) for i in range(phnum)]
            dynamic = next((p for p in phdrs if p[0] == 2), None)  # PT_DYNAMIC
            if dynamic is None:
                return []
            f.seek(dynamic[2])
            entries = list(struct.iter_unpack("<qQ", f.read(dynamic[5] // 16 * 16)))
            tags = {tag: val for tag, val in entries if tag in (5, 10)}  # DT_STRTAB, DT_STRSZ
            strtab = tags[5]
            load = next(p for p in phdrs if p[0] == 1 and p[3] <= strtab < p[3] + p[5])  # PT_LOAD
            f.seek(strtab - load[3] + load[2])
            strings = f.read(tags[10])
    except (OSError, struct.error, KeyError, StopIteration):
        return []
    names = []
    for tag, val in entries:
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED
            names.append(strings[val:strings.index(b"\0", val)].decode())
    return names


def closure(site):
    """Paths (as given and resolved) of every library reachable from torch's roots."""
    roots = [p for d in ("torch", "torch/lib") for p in glob.glob(os.path.join(site, d, "*.so"))
             if os.path.basename(p) not in LAZY]
    roots += glob.glob(os.path.join(site, "cuda", "**", "*.so"), recursive=True)
    candidates = glob.glob(os.path.join(site, "torch", "lib", "*.so*"))
    candidates += glob.glob(os.path.join(site, "nvidia", "**", "lib", "*.so*"), recursive=True)
    keep, todo = set(), list(roots)
    while todo:
        path = todo.pop()
        for p in (os.path.abspath(path), os.path.realpath(path)):
            if p not in keep:
                keep.add(p)
                for name in dt_needed(p):
                    todo += [c for c in candidates
                             if os.path.basename(c) == name or os.path.basename(c).startswith(name + ".")]
    return keep


def main(argv):
    if len(argv) not in (1, 2) or (len(argv) == 2 and argv[1] != "--dry-run"):
        sys.exit("usage: slim_torch.py SITE_PACKAGES [--dry-run]")
    site, dry_run = argv[0], len(argv) == 2
    if not os.path.isdir(os.path.join(site, "torch")):
        sys.exit(f"slim_torch: no torch/ in {site}")
    keep, groups, kept = closure(site), {}, 0  # groups: "nvidia/cudnn" -> [files, bytes]
    for dirpath, _, files in os.walk(os.path.join(site, "nvidia")):
        for path in (os.path.abspath(os.path.join(dirpath, n)) for n in sorted(files) if SONAME.fullmatch(n)):
            size = os.lstat(path).st_size
            if path in keep:
                kept += 0 if os.path.islink(path) else size
                continue
            group = groups.setdefault("/".join(os.path.relpath(path, site).split(os.sep)[:2]), [0, 0])
            group[0], group[1] = group[0] + 1, group[1] + size
            if not dry_run:
                os.remove(path)
    for pkg in [os.path.join(site, "triton")] + glob.glob(os.path.join(site, "triton-*.dist-info")):
        if os.path.isdir(pkg):
            sizes = [os.lstat(os.path.join(d, n)).st_size for d, _, fs in os.walk(pkg) for n in fs]
            groups[os.path.basename(pkg)] = [len(sizes), sum(sizes)]
            if not dry_run:
                shutil.rmtree(pkg)
    if dry_run:
        print("slim_torch: dry run, nothing is deleted")
    for what, (n, size) in sorted(groups.items()):
        print(f"slim_torch: removed {what}: {n} files, {size / 1e6:.0f} MB")
    n, size = (sum(v[i] for v in groups.values()) for i in (0, 1))
    print(f"slim_torch: removed {n} files, {size / 1e6:.0f} MB; "
          f"kept {kept / 1e6:.0f} MB of CUDA libraries torch links against")


if __name__ == "__main__":
    main(sys.argv[1:])
