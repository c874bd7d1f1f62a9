#!/usr/bin/env python3
"""Clang's thread-safety analysis over kvbridge's C++ sources (CI stage "thread-safety").

Reads a build directory's compile_commands.json (CMake writes it: CMAKE_EXPORT_COMPILE_COMMANDS),
and runs `clang++ -fsyntax-only -Wthread-safety -Werror` on every src/ and tests/ translation
unit with that unit's own defines and include paths. Only the thread-safety diagnostics are
enabled (-Wno-everything first): GCC is the compiler of record for every other warning. No code
is generated, so the pass is cheap. The annotations are in kvbridge/common/thread_annotations.h.

Usage: scripts/thread_safety_check.py [BUILD_DIR] [-j N]   (BUILD_DIR defaults to build)
Exit status: 0 when every unit passes, 1 otherwise (each failure's diagnostics are printed).
"""
import argparse
import concurrent.futures
import json
import os
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clang_args(entry):
    args = entry.get("arguments") or shlex.split(entry["command"])
    out = []
    skip = False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if a in ("-c", "-MD", "-MMD") or a.startswith("-W") or a.startswith("-fsanitize"):
            continue
        out.append(a)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build_dir", nargs="?", default=os.path.join(ROOT, "build"))
    ap.add_argument("-j", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--clang", default=shutil.which("clang++-14") or shutil.which("clang++"))
    opt = ap.parse_args()
    if not opt.clang:
        print("thread-safety: no clang++ found (apt install clang-14)", file=sys.stderr)
        return 1
    db = os.path.join(opt.build_dir, "compile_commands.json")
    with open(db) as f:
        entries = json.load(f)
    units = {}
    for e in entries:
        path = os.path.realpath(os.path.join(e["directory"], e["file"]))
        rel = os.path.relpath(path, ROOT)
        if not rel.endswith(".cc") or not (rel.startswith("src/") or rel.startswith("tests/")):
            continue
        units.setdefault(rel, e)  # a source built into two targets is checked once

    def check(rel):
        e = units[rel]
        # Boost.Asio detects C++20 coroutines for GCC only; clang 14 has them too (the proxy's).
        cmd = [opt.clang] + clang_args(e) + [
            "-DBOOST_ASIO_HAS_CO_AWAIT=1", "-DBOOST_ASIO_HAS_STD_COROUTINE=1",
            "-fsyntax-only", "-Wno-everything", "-Wthread-safety", "-Werror"]
        r = subprocess.run(cmd, cwd=e["directory"], capture_output=True, text=True)
        return rel, r.returncode, r.stdout + r.stderr

    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=opt.j) as pool:
        for rel, rc, text in pool.map(check, sorted(units)):
            if rc != 0:
                failed += 1
                print(f"--- {rel}\n{text}", end="")
    print(f"thread-safety: {len(units)} translation units, {failed} failing")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
