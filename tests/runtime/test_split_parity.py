"""The split model (attention ranks + FFN ranks over loopback) equals transformers and our monolith."""

import itertools

import pytest

from afd.config import AFDConfig
from afd.local.group_threads import generate_in_threads
from tests.conftest import NEW_TOKENS, PROMPTS, max_relative_error

TOPOLOGIES = ["1A1F", "2A1F", "2A2F", "4A2F", "3A2F"]
CASES = list(itertools.product(["deepseek_v2", "qwen3_moe"], TOPOLOGIES, [1, 2], ["ffn", "attention"]))


def loopback_config(path, topology, stages, gate, tag=""):
    return AFDConfig(
        num_attention_ranks=int(topology[0]),
        num_ffn_ranks=int(topology[2]),
        connector="loopback",
        stages=stages,
        gate_on_attention=gate == "attention",
        model=str(path),
        ffn_address_template=f"test-{tag}{topology}-{stages}-{gate}-{{rank}}",
    )


@pytest.mark.parametrize("name, topology, stages, gate", CASES)
def test_loopback_split_equals_transformers(name, topology, stages, gate, checkpoints, hf_reference):
    tokens, logits = hf_reference(name)
    result = generate_in_threads(loopback_config(checkpoints[name], topology, stages, gate), PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4


# DeepSeek-V3 (query LoRA, expert groups, a dense first layer, YaRN, an MTP layer in the files) in float32
# and as an FP8 checkpoint (transformers runs its dequantized copy): 1A1F, 2A1F, 3A2F, both stage counts,
# the gate on either side; zmq and expert parallelism in test_expert_parallel's group cases
V3_CASES = list(itertools.product(["deepseek_v3", "deepseek_v3_fp8"], ["1A1F", "2A1F", "3A2F"], [1, 2],
                                  ["ffn", "attention"]))


@pytest.mark.parametrize("name, topology, stages, gate", V3_CASES)
def test_deepseek_v3_split_equals_transformers(name, topology, stages, gate, checkpoints, hf_reference):
    tokens, logits = hf_reference(name)
    config = loopback_config(checkpoints[name], topology, stages, gate, tag=f"{name}-")
    result = generate_in_threads(config, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4


# GLM-4.x (partial rotary, q/k norms and biases, noaux_tc groups, a dense first layer, an MTP layer in the files):
# 1A1F, 2A1F, 3A2F, both stage counts, the gate on either side; without q/k norms or biases at 2A1F; as an FP8
# checkpoint (transformers runs its dequantized copy) at 3A2F
GLM_CASES = [*itertools.product(["glm4_moe"], ["1A1F", "2A1F", "3A2F"], [1, 2], ["ffn", "attention"]),
             ("glm4_moe_plain", "2A1F", 2, "attention"), ("glm4_moe_fp8", "3A2F", 2, "ffn")]


@pytest.mark.parametrize("name, topology, stages, gate", GLM_CASES)
def test_glm4_moe_split_equals_transformers(name, topology, stages, gate, checkpoints, hf_reference):
    tokens, logits = hf_reference(name)
    config = loopback_config(checkpoints[name], topology, stages, gate, tag=f"{name}-")
    result = generate_in_threads(config, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert result.tokens == tokens
    assert max_relative_error(result.last_logits, logits) < 1e-4


@pytest.mark.parametrize("stages", [1, 2])
def test_split_equals_our_monolithic_model(stages, checkpoints):
    from tests.runtime.test_models import monolithic_generate

    reference = monolithic_generate(checkpoints["deepseek_v2_full"])
    config = loopback_config(checkpoints["deepseek_v2_full"], "3A2F", stages, "attention", tag="full-")
    result = generate_in_threads(config, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert result.tokens == reference.tokens
    assert max_relative_error(result.last_logits, reference.last_logits) < 1e-5


def test_fewer_prompts_than_attention_ranks(checkpoints, hf_reference):
    """Idle attention ranks connect and leave without stalling the busy one."""
    tokens, _ = hf_reference("qwen3_moe")
    result = generate_in_threads(loopback_config(checkpoints["qwen3_moe"], "4A2F", 2, "ffn", tag="idle-"), PROMPTS[:1], NEW_TOKENS, ignore_eos=True)
    assert result.tokens == tokens[:1]


def test_small_steps_under_dbo_min_tokens_run_as_one_micro_batch(checkpoints, hf_reference):
    """stages=2 with a threshold above every step: the same tokens, and no plan ever fills stage 1."""
    from afd.runners import attention_runner

    tokens, _ = hf_reference("qwen3_moe")
    plans = []
    original = attention_runner.AttentionRunner._send_plan

    def recording(self, stage_tokens, mode="eager", profile=False):
        plans.append(stage_tokens)
        return original(self, stage_tokens, mode, profile)

    config = loopback_config(checkpoints["qwen3_moe"], "1A1F", 2, "ffn", tag="dbo-min-").replace(dbo_min_tokens=10_000)
    attention_runner.AttentionRunner._send_plan = recording
    try:
        result = generate_in_threads(config, PROMPTS, NEW_TOKENS, ignore_eos=True)
    finally:
        attention_runner.AttentionRunner._send_plan = original
    assert result.tokens == tokens
    assert plans and all(len(p) == 2 and p[1] == 0 for p in plans)
