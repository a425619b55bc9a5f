"""Build memtorch._C: one extension over src/*.c.

Environment switches (any non-empty value other than "0" turns one on):
  MEMTORCH_SANITIZE  build with AddressSanitizer and UBSan (run with LD_PRELOAD of libasan)
  MEMTORCH_DEBUG     -O0 -g, assertions on, MT_DEBUG defined
  MEMTORCH_COVERAGE  gcov instrumentation
  MEMTORCH_STRICT    warnings are errors (CI)
"""

import glob
import os
import sys

import numpy
from setuptools import Extension, setup


def _on(name):
    return os.environ.get(name, "") not in ("", "0")


def _sources():
    platform_file = "interpose_linux.c" if sys.platform.startswith("linux") else "interpose_other.c"
    skip = {"interpose_linux.c", "interpose_other.c"} - {platform_file}
    return sorted(p for p in glob.glob("src/*.c") if os.path.basename(p) not in skip)


compile_args = ["-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers", "-Wno-unused-parameter"]
link_args = []
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"), ("_GNU_SOURCE", "1")]

if _on("MEMTORCH_STRICT"):
    compile_args.append("-Werror")
if _on("MEMTORCH_DEBUG"):
    compile_args += ["-O0", "-g3", "-UNDEBUG"]
    macros.append(("MT_DEBUG", "1"))
if _on("MEMTORCH_SANITIZE"):
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    compile_args += san + ["-O1", "-g"]
    link_args += san
if _on("MEMTORCH_COVERAGE"):
    compile_args += ["--coverage", "-O0"]
    link_args += ["--coverage"]

setup(
    ext_modules=[
        Extension(
            "memtorch._C",
            sources=_sources(),
            include_dirs=["src", numpy.get_include()],
            define_macros=macros,
            extra_compile_args=compile_args,
            extra_link_args=link_args,
        )
    ]
)
