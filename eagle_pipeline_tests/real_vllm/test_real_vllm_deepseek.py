"""`engine: vllm` on a tiny DeepSeek-V3 (Kimi-K2's architecture: MLA attention, one dense layer then routed experts
with a shared one, sigmoid routing with a correction bias, Kimi's vocabulary of 163,840) against a real vLLM 0.32
in fp32, compared with the in-process extraction of the same checkpoint.

Why not one tolerance for every position: vLLM and transformers compute the router and the experts with other
kernels, so a router score differs in its last bits; where a token's k-th and (k+1)-th expert scores are that close,
the two paths may pick different experts, and the token's state then moves by a routed expert's output, not by
rounding (issue 25 measured 228 of 6,018 positions over 1e-3 on such a model). A position's state depends only on
the tokens up to it (causal attention), so:

* every position before a sample's first *near-tied* routing decision (in any MoE layer) takes the same discrete
  path on both sides and must equal in process within the summation-order bound (tolerances.py), as Llama does;
* a decision is near-tied when its margin (k-th minus (k+1)-th choice score) is within twice the most the two paths'
  scores can differ: a sigmoid score moves by at most 1/4 of its logit's error, a logit `w_e · h` by at most
  `|w_e| · |δh|`, and `|δh|` is bounded by the summation-order bound of the router's input (twice: the margins are
  measured on a per-sample forward, a third path);
* positions from the first near-tie on are not compared tightly; the test requires most positions to be compared
  tightly (it would prove nothing otherwise), and few of the others to move beyond the tight bound (a flip is
  rare; an MoE computed wrongly would move nearly all), and prints how far they moved.

A wrong layer id, a post-norm final state, a missing correction bias or misaligned ids move every position by
far more than the bound, near-ties or not, so they fail here.
"""

from __future__ import annotations

import math

import pytest
import torch

from eagle_pipeline_tests.hidden_states.conftest import make_rows

from ..tolerances import assert_forwards_close, reorder_tolerance
from .server import DEEPSEEK_VOCAB
from .test_real_vllm_extraction import engine_and_in_process

pytestmark = pytest.mark.real_vllm

# At least this share of all positions is compared within the summation-order bound (measured 390 of 1,013: which
# positions are near-tied is computed in process, so it does not vary between runs on one machine).
TIGHT_SHARE = 0.3
MOVED_SHARE = 0.05  # at most this share moves beyond it after a near-tie (measured 15 of 1,013; issue 25: 3.8%)


@torch.inference_mode()
def first_near_tie(model, ids: list[int]) -> tuple[int, int]:
    """(the first position of `ids` with a near-tied top-k routing decision in any MoE layer, or len(ids); the
    number of near-tied decisions), from a forward of the sample alone with the routers' inputs captured."""
    cfg = model.config
    assert cfg.n_group == 1 and cfg.topk_group == 1  # no group-limited routing: the top-k of all experts
    k = cfg.num_experts_per_tok
    captured: list[tuple[torch.nn.Module, torch.Tensor]] = []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [g.register_forward_hook(lambda mod, inp, out: captured.append((mod, inp[0]))) for g in gates]
    try:
        model.model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    rel = reorder_tolerance(cfg, tokens=len(ids))
    tied = torch.zeros(len(ids), dtype=torch.bool)
    n_tied = 0
    for gate, h in captured:
        h = h.reshape(len(ids), -1).float()
        w = gate.weight.float()
        scores = (h @ w.T).sigmoid() + gate.e_score_correction_bias.float()
        top = scores.topk(k + 1, dim=-1)
        margin = top.values[:, k - 1] - top.values[:, k]
        # |δh| per token: rtol·|h| plus the absolute part, atol = rel·rms(h) per element
        dh = rel * (h.norm(dim=-1) + h.pow(2).mean().sqrt() * math.sqrt(h.shape[-1]))
        wn = w.norm(dim=-1)
        err = 0.25 * dh * (wn[top.indices[:, k - 1]] + wn[top.indices[:, k]])
        near = margin <= 2 * err
        n_tied += int(near.sum())
        tied |= near
    first = int(tied.nonzero()[0, 0]) if tied.any() else len(ids)
    return first, n_tied


def test_deepseek_engine_shard_equals_in_process_up_to_routing_near_ties(real_vllm_deepseek, tmp_path):
    # Many short rows: a near-tie is about 1 in 70 decisions, so a sample's tight prefix is some 5-15 positions;
    # ids over all of Kimi's range.
    rows = make_rows(64, seed=21, min_len=2, max_len=32, vocab=DEEPSEEK_VOCAB)
    x = engine_and_in_process(real_vllm_deepseek, tmp_path, rows, vocab=DEEPSEEK_VOCAB)
    assert x.model.config.vocab_size == DEEPSEEK_VOCAB and x.model.config.kv_lora_rank == 512
    total = tight = ties = 0
    worst_tight = worst_after = 0.0
    moved = 0  # positions after a near-tie that moved by more than the tight bound
    for r in rows:
        sid, n = r["sample_id"], len(r["input_ids"])
        first, n_tied = first_near_tie(x.model, r["input_ids"])
        total, tight, ties = total + n, tight + first, ties + n_tied
        for name in ("aux_hidden_states", "final_hidden_state"):
            eng, inp = x.engine[f"{sid}/{name}"], x.in_process[f"{sid}/{name}"]
            assert eng.dtype == inp.dtype == torch.float32
            if first:
                assert_forwards_close(eng[:first], inp[:first], x.model.config, what=f"{sid}/{name}[:{first}]")
                worst_tight = max(worst_tight, float((eng[:first] - inp[:first]).abs().max()))
            if first < n:
                diff = (eng[first:] - inp[first:]).abs().flatten(1).amax(-1)
                worst_after = max(worst_after, float(diff.max()))
                if name == "final_hidden_state":
                    bound = reorder_tolerance(x.model.config, tokens=n) * (1 + float(inp.pow(2).mean().sqrt()))
                    moved += int((diff > bound).sum())
    print(
        f"\nreal vLLM vs in process (deepseek_v3 fp32): {total} positions in {len(rows)} samples, {tight} before "
        f"the first near-tied routing decision of their sample (max |diff| {worst_tight:.2e}), {ties} near-tied "
        f"decisions; after them {moved} final states moved beyond the summation-order bound, max |diff| "
        f"{worst_after:.2e}"
    )
    assert tight >= TIGHT_SHARE * total, f"only {tight} of {total} positions compared tightly"
    assert moved <= MOVED_SHARE * total, f"{moved} of {total} final states moved after a routing near-tie"
