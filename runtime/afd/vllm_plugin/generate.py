"""Offline greedy generation through vLLM, monolithic or as an AFD attention rank (tests, benchmarks).

    python -m afd.vllm_plugin.generate JOB.json OUT.json

JOB: {"model": path, "prompts": [[token ids]], "max_tokens": n, "afd": bool, "dtype": "float32"}.
With "afd" the AFD_* environment names this attention rank and its FFN rank. OUT holds
the greedy tokens per prompt and, for "afd", which tensors the attention side read and
which parameters it built. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
so that the load report is readable here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from afd.vllm_plugin.serve import cpu_mla_backend, engine_overrides


def run(job: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams  # local import: after the environment above, which vLLM reads on import
    from vllm.platforms import current_platform  # local import: vLLM, after the environment above (as above)

    kwargs = dict(
        model=job["model"], dtype=job.get("dtype", "float32"), enforce_eager=job.get("enforce_eager", True),
        max_model_len=job.get("max_model_len", 512), max_num_seqs=job.get("max_num_seqs", 16), seed=0,
    )
    if job.get("afd"):
        kwargs["hf_overrides"] = engine_overrides(job["model"])
    if backend := cpu_mla_backend(job["model"], kwargs["dtype"], "cpu" if current_platform.is_cpu() else "gpu"):
        kwargs["attention_backend"] = backend
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=job.get("ignore_eos", True))
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in job["prompts"]], params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    if job.get("afd"):
        from afd.vllm_plugin.remote import LAST_LOAD  # local import: imports vLLM: after the environment set above

        result.update(LAST_LOAD)
    return result


def main(argv: list[str] | None = None) -> int:
    job_path, out_path = (argv or sys.argv[1:])[:2]
    result = run(json.loads(Path(job_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
    os._exit(0)  # vLLM's in-process engine may leave non-daemon threads behind


if __name__ == "__main__":
    sys.exit(main())
