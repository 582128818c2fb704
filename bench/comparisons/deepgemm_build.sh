#!/bin/bash
# DeepGEMM for bench/comparisons/moe_deepgemm.py (the yardstick, not a dependency of the product), in two steps:
#   here:       bash bench/comparisons/deepgemm_build.sh pack DEEPGEMM_GIT CUTLASS_GIT FMT_GIT .dgwhl/dgsrc.tgz
#               (the three git directories as `fetch github:deepseek-ai/DeepGEMM`, `github:NVIDIA/cutlass` and
#               `github:fmtlib/fmt` give them; the tarball is ~5 MB: carry its folder)
#   on the GPU: eval "$(bash bench/comparisons/deepgemm_build.sh build .dgwhl/dgsrc.tgz)"   # ~60-90 s; sets PYTHONPATH
# Pinned to what session 48 measured: DeepGEMM 54e2261 (2.6.1), cutlass f3fde58 and fmt 553ec11 (its submodules).
# The build uses /usr/bin/g++-13: the device image's /opt/gcc/bin/g++ links libstdc++ statically into `_C.so`, which
# then crashed beside the libstdc++ torch loads (session 48, cuda-gdb: std::regex, then an ostream, at the first JIT
# compile). Session 48's measured build also had DeepGEMM's three std::regex uses replaced by string scans; that
# this is still needed with g++-13 was not checked: a crash in `IncludeParser::get_includes` would say it is.
set -eu
DEEPGEMM=54e2261 CUTLASS=f3fde58372d33e9a5650ba7b80fc48b3b49d40c8 FMT=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28
case ${1:-} in
pack)
  [ $# -eq 5 ] || { echo "usage: $0 pack DEEPGEMM_GIT CUTLASS_GIT FMT_GIT OUT.tgz" >&2; exit 2; }
  work=$(mktemp -d) && src=$work/DeepGEMM && mkdir -p $src/third-party/cutlass $src/third-party/fmt
  git -C "$2" archive $DEEPGEMM | tar x -C $src
  rm -rf $src/third-party/cutlass/* $src/third-party/fmt/*
  git -C "$3" archive $CUTLASS include 2>/dev/null | tar x -C $src/third-party/cutlass  # (a partial mirror may
  # lack blobs outside include/ and say so: the count below checks that include/ came whole)
  want=$(git -C "$3" ls-tree -r --name-only $CUTLASS include | wc -l)
  got=$(find $src/third-party/cutlass/include -type f | wc -l)
  [ "$want" -eq "$got" ] || { echo "cutlass include/: $got of $want files" >&2; exit 1; }
  git -C "$4" archive $FMT include | tar x -C $src/third-party/fmt
  cp -r $src/third-party/cutlass/include/cute $src/third-party/cutlass/include/cutlass $src/deep_gemm/include/
  mkdir -p "$(dirname "$5")" && tar czf "$5" -C $work DeepGEMM && rm -rf $work
  echo "packed $5 ($(du -h "$5" | cut -f1))" >&2 ;;
build)
  [ $# -eq 2 ] || { echo "usage: $0 build SRC.tgz" >&2; exit 2; }
  tar xzf "$2" -C /tmp
  cxx=/usr/bin/g++-13; [ -x $cxx ] || cxx=/usr/bin/g++
  (cd /tmp/DeepGEMM && CC=$cxx CXX=$cxx LDSHARED="$cxx -shared" DG_USE_LOCAL_VERSION=0 MAX_JOBS=16 \
    python3 setup.py build_ext --inplace >/tmp/deepgemm_build.log 2>&1) || {
    echo "DeepGEMM build failed: /tmp/deepgemm_build.log" >&2; tail -5 /tmp/deepgemm_build.log >&2; exit 1; }
  echo "export PYTHONPATH=/tmp/DeepGEMM:\${PYTHONPATH:-}" ;;
*)
  echo "usage: $0 pack DEEPGEMM_GIT CUTLASS_GIT FMT_GIT OUT.tgz | build SRC.tgz" >&2; exit 2 ;;
esac
