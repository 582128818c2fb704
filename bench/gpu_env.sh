# Sourced by bench/run_gpu*.sh on the device machine (its repository root the working directory): the environment
# every GPU run needs (our packages on the path, NVLink multicast off), the carried wheels of .whl/ installed under
# /tmp/site (where there are any), the stack printed and checked against images/tested_stack.env (torch and Triton:
# another stack stops the run unless AFD_OTHER_STACK=1), and unless SERVING_IMPORTS=0 a check that the serving chain
# imports (a missing wheel named up front).
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/runtime:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
fi
source images/tested_stack.env || return 1
python3 - "$TESTED_TORCH" "$TESTED_TRITON" <<'PY' || [[ ${AFD_OTHER_STACK:-0} == 1 ]] || return 1
import sys, torch, triton
have = {"torch": torch.__version__.split("+")[0], "triton": triton.__version__}
want = dict(zip(("torch", "triton"), sys.argv[1:]))
card = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(f"stack: torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, {card}; "
      f"tested (images/tested_stack.env): torch {want['torch']}, triton {want['triton']}", flush=True)
if have != want:
    sys.exit(f"this machine's stack {have} is not the tested one {want}: update images/tested_stack.env (and the "
             "image's base) once its tests pass here, or set AFD_OTHER_STACK=1 to run anyway")
PY
if [[ ${SERVING_IMPORTS:-1} == 1 ]]; then
  python3 -c "import afd.engine.engine, afd.server.serve.engine_api, afd.server.api.app" || {
    echo "a package the runtime imports is missing: carry its wheel in .whl/ (README, GPU path)"; return 1; }
fi
