"""The extraction planner: formulas, Kimi-K2.5 figures, budget refusal, serialisation."""

from __future__ import annotations

import json
import math

import pytest

from eagle_pipeline.hidden_states.models.model import KIMI_K25_TEXT_CONFIG
from eagle_pipeline.hidden_states.plan.disk_plan import SHARD_FILE_BYTES
from eagle_pipeline.hidden_states.plan.estimate import Compute, ModelShape, Storage, Workload, plan_extraction
from eagle_pipeline.hidden_states.settings import HiddenStatesConfig, TorchrunConfig, VLLMEngineConfig

KIMI_TOKENS = 138_400_000
KIMI_SAMPLES = 60_000
KIMI = ModelShape.of_facts(KIMI_K25_TEXT_CONFIG)
KIMI_WORK = Workload(KIMI_TOKENS, KIMI_SAMPLES)


def test_kimi_k25_disk_and_gpu_hours_follow_the_formulas():
    p = plan_extraction(KIMI, KIMI_WORK)
    h = KIMI_K25_TEXT_CONFIG["hidden_size"]
    assert p.aux_layers == (1, 29, 57)
    assert p.bytes_per_token == 4 * h * 2 + 4 + 1  # 3 aux + final, bf16, int32 id, int8 mask
    assert p.hidden_bytes == KIMI_TOKENS * 4 * h * 2
    assert p.bytes_on_disk == KIMI_TOKENS * p.bytes_per_token + KIMI_SAMPLES * 640 + p.n_shards * SHARD_FILE_BYTES
    assert 7.8e12 < p.bytes_on_disk < 8.0e12  # the ~7.9 TB headline
    assert p.flops == 2 * KIMI_K25_TEXT_CONFIG["active_params"] * KIMI_TOKENS
    assert p.gpu_hours == pytest.approx(p.flops / (989e12 * 0.35) / 3600)
    assert p.n_shards == -(-KIMI_SAMPLES // 256)
    assert p.bytes_per_shard == pytest.approx(p.bytes_on_disk * 256 / KIMI_SAMPLES)
    assert not p.exceeds_budget
    assert p.min_gpus_for_weights == -(-int(1.04e12 * 2) // int(0.9 * 141e9))  # bf16 weights: 17 H200s
    int4 = plan_extraction(KIMI, KIMI_WORK, compute=Compute(weight_bytes_per_param=0.55))
    assert int4.min_gpus_for_weights == 5 and int4.gpu_hours == p.gpu_hours


def test_options_change_the_numbers_the_way_they_should():
    base = (ModelShape("8B", 4096, 32, 8e9, 8e9), Workload(10**6, 500))
    p = plan_extraction(*base)
    no_final = plan_extraction(*base, Storage(save_final_state=False))
    assert p.hidden_bytes - no_final.hidden_bytes == 10**6 * 4096 * 2
    fp32 = plan_extraction(*base, Storage(dtype_bytes=4))
    assert fp32.hidden_bytes == 2 * p.hidden_bytes
    eight = plan_extraction(*base, compute=Compute(n_gpus=8, mfu=0.7))
    assert eight.gpu_hours == pytest.approx(p.gpu_hours / 2)
    assert eight.wall_hours == pytest.approx(eight.gpu_hours / 8)
    five = plan_extraction(*base, Storage(aux_layers=(2, 10, 20, 25, 28)))
    assert five.bytes_per_token == 6 * 4096 * 2 + 5
    with pytest.raises(ValueError):
        plan_extraction(*base, compute=Compute(mfu=0))
    with pytest.raises(ValueError):
        Workload(-1, 500)
    with pytest.raises(ValueError):
        Storage(shard_size=0)


def test_budget_refusal_flag_and_markdown():
    over = plan_extraction(KIMI, KIMI_WORK, Storage(disk_budget_bytes=5 * 10**12))
    under = plan_extraction(KIMI, KIMI_WORK, Storage(disk_budget_bytes=10 * 10**12))
    assert over.exceeds_budget and not under.exceeds_budget
    md = over.to_markdown()
    assert "EXCEEDS" in md and "7.94 TB" in md and "GPU-hours" in md and "mfu" in md
    assert "EXCEEDS" not in under.to_markdown()
    d = json.loads(json.dumps(over.to_dict()))
    assert d["aux_layers"] == [1, 29, 57] and d["exceeds_budget"] is True
    assert "flops formula" in d["assumptions"]


def test_the_plan_knows_the_engine_and_refuses_weights_that_cannot_fit(kimi_dir):
    from eagle_pipeline.hidden_states.models.model import load_text_config
    from eagle_pipeline.hidden_states.models.world_split import rank_share, world_ep_size
    from eagle_pipeline.hidden_states.plan.run_plan import PlanRefused, plan_for_run

    def plan(model: str, **settings) -> dict:
        h = HiddenStatesConfig(model=model, family="deepseek_v3", shard_size=256, **settings)
        return plan_for_run(h, Workload(138_400_000, 60_000), target_model_config=None, vocab_size=256)

    kimi = str(kimi_dir / "config.json")  # the shape (and INT4 experts) from the real config; no weights needed
    with pytest.raises(PlanRefused, match=r"at least 17 GPUs .*engine 'in_process' holds one model on 1 GPU.*vllm"):
        plan(kimi)
    with pytest.raises(PlanRefused, match=r"at least 5 GPUs .*on 4 GPU\(s\).*gpus_per_server"):
        plan(kimi, engine="vllm", vllm=VLLMEngineConfig(endpoints=("http://a:8000",), gpus_per_server=4))
    # transformers decompresses the INT4 experts to bf16: a TP = 8 world cannot hold Kimi-K2.5 either. Every rank
    # holds whole what the installed transformers' plans leave whole (5.24: the MLA attention, routers and norms,
    # 6.3B parameters: 18 GPUs; 5.25 splits the attention: 1.1B, 17), its share of the rest.
    share = rank_share(load_text_config(kimi), 8, world_ep_size(load_text_config(kimi), 8, None))
    need = math.ceil((share.params - share.replicated) * 2 / (0.9 * 141e9 - share.replicated * 2))
    assert share.routed_experts_per_rank * 8 == share.routed_experts and need >= 17  # 17: the even split's
    with pytest.raises(
        PlanRefused, match=rf"at least {need} GPUs .*engine 'torchrun' holds one model on 8 GPU\(s\).*tp_size"
    ):
        plan(kimi, engine="torchrun", torchrun=TorchrunConfig(tp_size=8))
    world = plan("tiny-random", engine="torchrun")
    assert world["this_run"].fits_engine and world["this_run"].gpus_per_model == world["this_run"].n_gpus == 2
    two_servers = VLLMEngineConfig(endpoints=("http://a:8000", "http://b:8000"), gpus_per_server=8)
    plans = plan(kimi, engine="vllm", vllm=two_servers)
    run = plans["this_run"]
    assert run.fits_engine and run.engine == "vllm" and run.gpus_per_model == 8 and run.n_gpus == 16
    assert run.min_gpus_for_weights == 5 and run.wall_hours == pytest.approx(run.gpu_hours / 16)
    slow, fast = run.observed_tokens_per_gpu_s
    assert (slow, fast) == (2200, 3700)
    assert run.observed_wall_hours == pytest.approx((138.4e6 / (slow * 16) / 3600, 138.4e6 / (fast * 16) / 3600))
    target = plans["target"]  # the built-in Kimi-K2.5 facts: 32B active at 35% of 989 TFLOP/s
    assert target.assumed_tokens_per_gpu_s == pytest.approx(989e12 * 0.35 / (2 * 32e9))
    assert target.assumed_tokens_per_gpu_s > fast  # the assumption is more optimistic than the field
    md = run.to_markdown()
    assert "| engine | vllm: 2 x 8 GPUs |" in md and "2,200-3,700" in md and "does NOT fit" not in md
    # The tiny model in process always fits; the Kimi target plan beside it says that it would not.
    tiny = plan("tiny-random")
    assert tiny["this_run"].fits_engine and not tiny["target"].fits_engine
    assert "does NOT fit" in tiny["target"].to_markdown()
