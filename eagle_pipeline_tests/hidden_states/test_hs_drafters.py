"""Every drafter type the trainers train offline, read from the exports with code written from the trainers' contracts
(shared/reference/drafter_formats.md: SpecForge a6b6b02, speculators c05b95b), not with the project's writer, and
compared tensor by tensor with the shards; the layer guard (`check-drafter`); the combinations refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle_pipeline.cli import main
from eagle_pipeline.config import DEFAULT_CONFIG, ConfigError, load_config
from eagle_pipeline.drafter_types import SPECFORGE, SPECULATORS
from eagle_pipeline.hidden_states.layouts.trainer_exports import StatesExport
from eagle_pipeline.hidden_states.layouts.trainer_layouts import LAYOUTS, load_sample
from eagle_pipeline.hidden_states.models.layers import get_backbone
from eagle_pipeline.hidden_states.run import extract_shard
from eagle_pipeline_tests.test_config import _with_hidden_states

from .conftest import VOCAB, make_rows

H, L = 64, 8  # the tiny model's width and depth
ALL = ["eagle3", "eagle3.1", "p-eagle", "dflash", "domino", "dspark"]


def spread(n: int, num_layers: int) -> list[int]:
    """SpecForge's target layers for an n-layer DFlash, as drafter_formats.md states it: [L//2] for one layer,
    else round(1 + i·(L-4)/(n-1))."""
    return [num_layers // 2] if n == 1 else [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]


def test_the_spread_rule_gives_the_trainers_own_ids():
    assert spread(5, 61) == [1, 15, 30, 44, 58]  # drafter_formats.md, K2.5
    assert spread(5, 36) == [1, 9, 17, 25, 33]  # SpecForge's configs/qwen3-8b-dflash.json for Qwen3-8B (36 layers)
    assert spread(1, 61) == [30]


def _extract(model, merged, hs, aux_layers):
    for shard in range(2):
        extract_shard(
            model, merged, shard_index=shard, shard_size=6, out_dir=hs, max_tokens_per_batch=96, aux_layers=aux_layers
        )


@pytest.fixture(params=[None, 5], ids=["3-layers", "5-layers"])
def extracted(request, normed_model, merged_factory, tmp_path):
    rows = make_rows(10, seed=21)
    for i in (1, 6):
        rows[i]["split"] = "eval"
    merged = merged_factory(rows, [5, 5])
    hs = tmp_path / "hs"
    _extract(normed_model, merged, hs, request.param)
    aux = [1, L // 2 - 1, L - 4] if request.param is None else spread(request.param, L)
    return rows, merged, hs, aux


def _specforge_files(folder: Path) -> dict[str, tuple[str, dict]]:
    """SpecForge's reader: every *.ckpt under the folder, recursively, torch.load(mmap=True), one sample a file."""
    found = {}
    for split in ("train", "eval"):
        for root, _dirs, names in os.walk(folder / split):
            for name in sorted(names):
                if name.endswith(".ckpt"):
                    found[name[: -len(".ckpt")]] = (split, torch.load(os.path.join(root, name), mmap=True))
    return found


def test_specforge_serves_each_type_from_one_ckpt_without_a_second_copy(extracted, normed_model, tmp_path):
    rows, merged, hs, aux = extracted
    n = len(aux)
    LAYOUTS[SPECFORGE].export(
        StatesExport(hs, merged, tmp_path / "plain", drafters=["eagle3"] if n == 3 else ["dflash"])
    )
    s = LAYOUTS[SPECFORGE].export(StatesExport(hs, merged, tmp_path / "sf", drafters=ALL))
    served = {e["type"]: e for e in s.extra["drafters"]}
    # What each type reads (drafter_formats.md), and which it cannot have offline.
    assert not served["p-eagle"]["served"] and "online only" in served["p-eagle"]["reason"]
    assert served["eagle3"]["served"] == served["eagle3.1"]["served"] == (n == 3)
    assert all(served[t]["served"] for t in ("dflash", "domino", "dspark"))
    want_keys = {
        "input_ids",
        "loss_mask",
        "aux_hidden_state",
        "hidden_state",
        "hidden_states",
        "target_last_hidden_states",
    }
    norm = get_backbone(normed_model).norm
    files, plain_files = _specforge_files(tmp_path / "sf"), _specforge_files(tmp_path / "plain")
    assert set(files) == {r["sample_id"] for r in rows}
    for r in rows:
        split, rec = files[r["sample_id"]]
        t = r["n_tokens"]
        assert split == r["split"] and set(rec) == want_keys
        assert rec["input_ids"].dtype == torch.int64 and rec["input_ids"].tolist() == r["input_ids"]
        assert rec["loss_mask"].dtype == torch.int64 and rec["loss_mask"].tolist() == r["loss_mask"]
        shard = load_sample(hs, r["sample_id"])
        # DFlash / Domino: hidden_states [1, T, n·H] = the captured layers in order.
        assert (
            rec["hidden_states"].shape == (1, t, n * H)
            and rec["hidden_states"].dtype == shard["aux_hidden_states"].dtype
        )
        assert torch.equal(rec["hidden_states"][0], shard["aux_hidden_states"])
        # DSpark: target_last_hidden_states [1, T, H], post-norm (lm_head only is applied to it).
        with torch.no_grad():
            post = norm(shard["final_hidden_state"])
        assert rec["target_last_hidden_states"].shape == (1, t, H)
        assert torch.equal(rec["target_last_hidden_states"][0], post)
        assert torch.equal(rec["aux_hidden_state"], rec["hidden_states"])
        # One storage under two names: written once. The bound: a key name and a pickle reference per alias plus
        # the zip's 64-byte alignment, well under the smallest aliased tensor (2 tokens x n x 64 x 4 B >= 1,536 B).
        assert rec["hidden_states"].untyped_storage().data_ptr() == rec["aux_hidden_state"].untyped_storage().data_ptr()
        path = tmp_path / "sf" / split / f"{r['sample_id']}.ckpt"
        plain_path = tmp_path / "plain" / split / f"{r['sample_id']}.ckpt"
        extra = path.stat().st_size - plain_path.stat().st_size
        assert 0 < extra <= 512 < rec["hidden_states"].nbytes
        assert "hidden_states" not in plain_files[r["sample_id"]][1] or n != 3
    record = s.extra["capture"]
    assert record["aux_layers"] == aux and record["trainer_layer_ids"] == aux  # SpecForge reads layer outputs
    assert record["layer_ids_by_convention"]["speculators"] == [x + 1 for x in aux]
    assert (record["hidden_size"], record["num_layers"], record["final_state"]) == (H, L, "post_norm")
    dflash = served["dflash"]["draft_config_fragment"]
    assert dflash == {"hidden_size": H, "num_target_layers": L, "dflash_config": {"target_layer_ids": aux}}
    assert served["dspark"]["training_config"]["training.strategy"] == "dspark"
    readme = (tmp_path / "sf" / "README.md").read_text()
    assert all(f"### {t}" in readme for t in ALL) and "specforge train --config" in readme
    assert json.loads((tmp_path / "sf" / "export.json").read_text())["extra"]["capture"] == record


def test_speculators_files_serve_each_type_with_its_flags(extracted, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows, merged, hs, aux = extracted
    n = len(aux)
    s = LAYOUTS[SPECULATORS].export(StatesExport(hs, merged, tmp_path / "sp", drafters=ALL, verifier="/models/target"))
    by_type = {e["type"]: e for e in s.extra["drafters"]}
    assert not by_type["domino"]["served"] and "no Domino" in by_type["domino"]["reason"]
    names = {"eagle3": "eagle3", "eagle3.1": "eagle3", "p-eagle": "peagle", "dflash": "dflash", "dspark": "dspark"}
    vllm_ids = [str(x + 1) for x in aux]  # speculators names the residual entering layer k + 1
    for kind, name in names.items():
        flags = by_type[kind]["flags"]
        assert flags[flags.index("--speculator-type") + 1] == name
        i = flags.index("--target-layer-ids")
        assert flags[i + 1 : i + 1 + n] == vllm_ids and flags[i + 1 + n].startswith("--")
        assert flags[flags.index("--on-missing") + 1] == "raise"
        assert "--verifier-name-or-path /models/target" in by_type[kind]["command"]
    assert {"--fc-norm", "--no-norm-before-fc"} <= set(by_type["eagle3.1"]["flags"])
    # The files as speculators' ArrowDataset reads them: [T, n+1, H]; slots [:, :-1] -> [T, n·H]; slot -1 pre-norm.
    data = datasets.load_from_disk(str(tmp_path / "sp"))
    order = [r for r in rows if r["split"] == "train"] + [r for r in rows if r["split"] == "eval"]
    ratio = float(by_type["dflash"]["flags"][by_type["dflash"]["flags"].index("--train-data-ratio") + 1])
    assert int(len(data) * ratio) == len(order) - 2
    for i, r in enumerate(order):
        f = load_file(tmp_path / "sp" / "hidden_states" / f"hs_{i}.safetensors")
        states = f["hidden_states"]
        assert states.shape == (r["n_tokens"], n + 1, H)
        assert torch.equal(f["token_ids"], data[i]["input_ids"])
        shard = load_sample(hs, r["sample_id"])
        assert states.dtype == shard["aux_hidden_states"].dtype and f["token_ids"].dtype == torch.int64
        assert torch.equal(states[:, :-1].flatten(1), shard["aux_hidden_states"])
        assert torch.equal(states[:, -1], shard["final_hidden_state"])  # pre-norm: speculators norms it itself
    assert s.extra["capture"]["trainer_layer_ids"] == [x + 1 for x in aux]
    assert "--speculator-type dspark" in (tmp_path / "sp" / "README.md").read_text()


def test_the_readmes_state_the_files_shape_and_name_only_a_vocabulary_copied_beside(extracted, tmp_path):
    pytest.importorskip("datasets")
    _rows, merged, hs, aux = extracted
    vocab = tmp_path / "vocab"
    vocab.mkdir()
    np.save(vocab / "d2t.npy", np.arange(4, dtype=np.int64))
    np.save(vocab / "t2d.npy", np.arange(VOCAB) < 4)
    torch.save({"d2t": torch.arange(4), "t2d": torch.arange(VOCAB) < 4}, vocab / "draft_vocab.pt")
    sp, sf = tmp_path / "sp", tmp_path / "sf"
    LAYOUTS[SPECULATORS].export(StatesExport(hs, merged, sp, draft_vocab_dir=vocab))
    copied = LAYOUTS[SPECFORGE].export(StatesExport(hs, merged, sf, draft_vocab_dir=vocab))
    slots = load_file(sp / "hidden_states" / "hs_0.safetensors")["hidden_states"].shape[1]
    assert slots == len(aux) + 1  # the aux layers, then the final state
    readme = (sp / "README.md").read_text()
    assert f"`hidden_states` [T, {slots}, H] = aux layers {aux}" in readme
    assert f"--d2t-path {sp / 'd2t.npy'} --t2d-path {sp / 't2d.npy'}" in readme
    assert copied.extra["config"]["model.vocab_mapping_path"] == str(sf / "draft_vocab.pt")
    # Exported again without a draft vocabulary: the earlier copies go, and nothing names them.
    s = LAYOUTS[SPECULATORS].export(StatesExport(hs, merged, sp))
    f = LAYOUTS[SPECFORGE].export(StatesExport(hs, merged, sf))
    for folder, summary in ((sp, s), (sf, f)):
        text = (folder / "README.md").read_text() + (folder / "export.json").read_text()
        assert "--d2t-path" not in text and "--t2d-path" not in text and str(folder / "d2t.npy") not in text
        assert str(folder / "draft_vocab.pt") not in text
        assert all(e.get("vocab_mapping") != str(folder / "draft_vocab.pt") for e in summary.extra["drafters"])
    assert f"python scripts/train.py {s.extra['args']} ..." in (sp / "README.md").read_text()
    assert f.extra["config"]["model.vocab_mapping_path"] is None
    assert not any((sp / n).exists() for n in ("d2t.npy", "t2d.npy")) and not (sf / "draft_vocab.pt").exists()


@pytest.fixture
def exports(normed_model, merged_factory, tmp_path):
    rows = make_rows(8, seed=22)
    rows[2]["split"] = "eval"
    merged = merged_factory(rows, [4, 4])
    hs = tmp_path / "hs"
    _extract(normed_model, merged, hs, None)
    out = tmp_path / "exports"
    LAYOUTS[SPECFORGE].export(StatesExport(hs, merged, out / "specforge", drafters=["eagle3", "dflash"]))
    LAYOUTS[SPECULATORS].export(StatesExport(hs, merged, out / "speculators", drafters=["dflash"]))
    return out, [1, L // 2 - 1, L - 4]


def _check(export: Path, draft: Path, capsys) -> tuple[int, str]:
    rc = main(["check-drafter", "--export", str(export), "--draft-config", str(draft)])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def _json_file(tmp_path: Path, obj: dict) -> Path:
    p = tmp_path / f"draft-{abs(hash(json.dumps(obj, sort_keys=True)))}.json"
    p.write_text(json.dumps(obj))
    return p


def test_check_drafter_passes_a_matching_config_and_names_both_values_of_each_mismatch(exports, tmp_path, capsys):
    out, aux = exports
    sf = out / "specforge"

    def dflash(ids, hidden=H):
        return _json_file(
            tmp_path, {"hidden_size": hidden, "num_target_layers": L, "dflash_config": {"target_layer_ids": ids}}
        )

    assert _check(sf, dflash(aux), capsys)[0] == 0
    rc, msg = _check(sf, dflash([aux[0], aux[1] + 1, aux[2]]), capsys)  # same count, one wrong layer
    assert rc == 1 and f"{[aux[0], aux[1] + 1, aux[2]]}" in msg and f"captured {aux}" in msg
    five = spread(5, L)
    rc, msg = _check(sf, dflash(five), capsys)
    assert rc == 1 and "reads 5 target layers" in msg and str(five) in msg and f"captured 3 ({aux})" in msg
    rc, msg = _check(sf, dflash(aux, hidden=2 * H), capsys)
    assert rc == 1 and f"hidden size {2 * H}" in msg and f"captured H {H}" in msg
    # SpecForge's EAGLE-3 JSON without ids takes its default [1, L//2-1, L-4]: the captured layers.
    assert (
        _check(sf, _json_file(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H}), capsys)[0]
        == 0
    )
    eagle3 = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 4 * H, "target_hidden_size": H}
    assert _check(sf, _json_file(tmp_path, eagle3), capsys)[0] == 0  # fc is 3 x target_hidden_size
    rc, msg = _check(sf, _json_file(tmp_path, {**eagle3, "target_hidden_size": 2 * H}), capsys)
    assert rc == 1 and f"hidden size {2 * H}" in msg and f"captured H {H}" in msg
    # What the export hands over passes its own guard: each served type's fragment, merged into a draft JSON.
    for e in json.loads((sf / "export.json").read_text())["extra"]["drafters"]:
        draft = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": H, **e["draft_config_fragment"]}
        assert _check(sf, _json_file(tmp_path, draft), capsys)[0] == 0, e["type"]
    # The exports folder: the draft config's trainer picks the export.
    assert _check(out, dflash(aux), capsys)[0] == 0


def test_check_drafter_reads_speculators_flags_in_vllm_ids(exports, tmp_path, capsys):
    out, aux = exports
    sp = out / "speculators"
    flags = tmp_path / "flags.txt"
    flags.write_text("--speculator-type dflash \\\n  --target-layer-ids " + " ".join(str(x + 1) for x in aux) + "\n")
    assert _check(sp, flags, capsys)[0] == 0
    (handed,) = json.loads((sp / "export.json").read_text())["extra"]["drafters"]
    flags.write_text(handed["command"])  # the command the export prints passes its own guard
    assert _check(sp, flags, capsys)[0] == 0
    flags.write_text("--speculator-type dflash --target-layer-ids " + " ".join(map(str, aux)))  # the off-by-one
    rc, msg = _check(sp, flags, capsys)
    assert rc == 1 and f"--target-layer-ids {aux}" in msg and f"captured {[x + 1 for x in aux]}" in msg
    flags.write_text("--speculator-type eagle3")  # speculators' default [2, L//2, L-3] = the project's default + 1
    assert _check(sp, flags, capsys)[0] == 0
    saved = {
        "speculators_model_type": "dflash",
        "aux_hidden_state_layer_ids": [x + 1 for x in aux],
        "target_hidden_size": 2 * H,
    }
    rc, msg = _check(sp, _json_file(tmp_path, saved), capsys)
    assert rc == 1 and f"hidden size {2 * H}" in msg and "layer ids" not in msg
    dflash_json = _json_file(tmp_path, {"hidden_size": H, "dflash_config": {"target_layer_ids": aux}})
    rc, msg = _check(sp, dflash_json, capsys)  # a SpecForge draft config against the speculators files
    assert rc == 1 and "is specforge's, but this is the speculators export" in msg


@pytest.mark.parametrize(
    ("settings", "where", "words"),
    [
        (
            {"drafters": ["p-eagle"], "trainer_layouts": ["specforge"]},
            "drafters[0].type",
            ["online only", "add speculators"],
        ),
        (
            {"drafters": ["domino"], "trainer_layouts": ["speculators"]},
            "drafters[0].type",
            ["no Domino", "add specforge"],
        ),
        ({"drafters": [{"type": "dflash", "layers": 5}]}, "drafters[0].layers", ["captures 3", "aux_layers: 5"]),
        (
            {"drafters": ["eagle3"], "aux_layers": 5, "trainer_layouts": ["specforge"]},
            "drafters[0].type",
            ["exactly 3"],
        ),
        (
            {"drafters": [{"type": "eagle3", "trainers": ["specforge"]}], "aux_layers": [1, 2, 3, 4]},
            "drafters[0].type",
            ["exactly 3"],
        ),
        (
            {"drafters": ["dspark"], "layout": "specforge", "trainer_layouts": []},
            "drafters[0].type",
            ["layout: shards"],
        ),
        ({"drafters": ["dflash"], "trainer_layouts": []}, "drafters[0].type", ["no trainer layout is exported"]),
    ],
)
def test_unsupported_combinations_are_refused_with_the_reason_and_the_line(tmp_path, settings, where, words):
    with pytest.raises(ConfigError) as exc:
        load_config(_with_hidden_states(tmp_path, settings))
    line = next(p for p in exc.value.problems if p.startswith(f"hidden_states.{where}:"))
    assert all(w in line for w in words) and "(line " in line


def test_served_combinations_load(tmp_path):
    cfg = load_config(
        _with_hidden_states(tmp_path, {"drafters": ALL, "aux_layers": 5})
    )  # speculators serves what SpecForge can't
    assert [d.type for d in cfg.hidden_states.drafters] == ALL and cfg.hidden_states.aux_layers == 5
    assert [d.type for d in load_config(DEFAULT_CONFIG).hidden_states.drafters] == ["eagle3"]
    # The code's defaults (no trainer layout derived: each is a full copy of the states) load: EAGLE-3 is what the
    # project's own shards hold.
    bare = load_config(_with_hidden_states(tmp_path, {"trainer_layouts": []})).hidden_states
    assert bare.trainer_layouts == () and [d.type for d in bare.drafters] == ["eagle3"]


def test_the_plan_shows_the_disk_of_each_layer_choice():
    from eagle_pipeline.hidden_states.models.model import KIMI_K25_TEXT_CONFIG
    from eagle_pipeline.hidden_states.plan.estimate import ModelShape, Storage, Workload, plan_extraction

    tokens, samples = 10**6, 1000
    kimi, work = ModelShape.of_facts(KIMI_K25_TEXT_CONFIG), Workload(tokens, samples)
    p = plan_extraction(kimi, work, Storage(layer_counts=(4,)))
    hidden, depth = int(KIMI_K25_TEXT_CONFIG["hidden_size"]), int(KIMI_K25_TEXT_CONFIG["num_layers"])
    by = {c["choice"]: c for c in p.layer_choices}
    assert by["configured"] == {"choice": "configured", "aux_layers": [1, 29, 57], "bytes_on_disk": p.bytes_on_disk}
    per_layer = tokens * hidden * p.dtype_bytes
    for n in (1, 4, 5):
        c = by[f"{n} layers (SpecForge's DFlash spread)"]
        assert c["aux_layers"] == spread(n, depth)
        assert c["bytes_on_disk"] - p.bytes_on_disk == (n - 3) * per_layer
        # the same figure as planning that choice itself
        assert c["bytes_on_disk"] == plan_extraction(kimi, work, Storage(aux_layers=n)).bytes_on_disk
    assert "Disk by layer choice" in p.to_markdown() and "[1, 15, 30, 44, 58]" in p.to_markdown()
