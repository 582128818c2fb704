# Sourced by bench/run_gpu*.sh on the device machine (its repository root the working directory): the environment
# every GPU run needs (our packages on the path, NVLink multicast off), the carried wheels of .whl/ installed under
# /tmp/site, and unless SERVING_IMPORTS=0 a check that the serving chain imports (a missing wheel named up front).
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/runtime:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
if [[ ${SERVING_IMPORTS:-1} == 1 ]]; then
  python3 -c "import afd.engine.engine, afd.server.serve.engine_api, afd.server.api.app" || {
    echo "a package the runtime imports is missing: carry its wheel in .whl/ (docs/gpu.md)"; return 1; }
fi
