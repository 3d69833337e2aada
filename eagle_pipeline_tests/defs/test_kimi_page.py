"""docs/kimi.md runs as printed: every marked command block of the page, in order, in one temporary data root, against
the tiny model and the doubles, except the real server's launch (and what needs the real node or a trainer), each
skip with the page's own recorded reason.

The page marks its blocks with HTML comments (invisible on GitHub):

* `<!-- kimi-file -->` before a YAML block: the configuration the commands use, written to the path in its first line
  comment;
* `<!-- kimi-run[: real-model] -->` before a bash block: run it (bash -e, one environment carried from block to
  block: what a block exports, the next sees). `real-model` runs it against the page's configuration with only the
  paths replaced, so the model is the real Kimi-K2.5 `config.json` (the plan, the server command); the others run
  against the tiny setup (below);
* `<!-- kimi-prints[: figures][; except: A; B] -->` before a text block: what the run block before it prints. Each
  shown line must occur in the output, in order; `...` in a line stands for anything; `figures` compares with every
  number replaced (the tiny model's figures are not Kimi's); `except:` names substrings of shown lines the test does
  not hold the output to (figures another change is known to move: the plan's disk lines);
* `<!-- kimi-skip: REASON -->` before a bash block: not run here, for REASON (the test lists the skips it saw).

What differs on the tiny setup (`SUBSTITUTIONS`, applied to the commands and files, and back to the outputs; and
`tiny_overrides` on the configuration): the data root and the checkpoint folder are temporary folders (the
checkpoint folder holds the real Kimi `config.json` and tokenizer files from $EAGLE_KIMI_TOKENIZER_DIR, no weights),
OpenRouter is the project's simulated OpenRouter-format server (it demands the page's key), the extraction server is
the vLLM double serving the tiny model, and the datasets are cut to a few prompts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from eagle_pipeline.defs.generation import provider_token_counters
from eagle_pipeline.hidden_states.engines.vllm.vllm_command import resolved_endpoints
from eagle_pipeline.hidden_states.engines.vllm.vllm_files import SIMULATED, vllm_layer_ids
from eagle_pipeline.hidden_states.models.layers import resolve_aux_layers
from eagle_pipeline.hidden_states.models.model import describe_model_config, tiny_config
from eagle_pipeline.simulation import SimulatedOpenRouterServer
from eagle_pipeline.tokens import get_profile, resolve_tokenizer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "kimi.md"
KEY = "sk-or-v1-kimi-page-test-3c9e"
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "config.json")
# The blocks the page does not run here; the test fails when the page skips anything else.
EXPECTED_SKIPS = ("install", "UI", "server launch", "UI", "trainer")

MARK = re.compile(r"<!-- kimi-(file|run|prints|skip)(?::\s*(.*?))?\s*-->\n```(\w*)\n(.*?)```", re.S)


@dataclass
class Block:
    kind: str  # file | run | prints | skip
    arg: str
    body: str


def page_blocks(text: str) -> list[Block]:
    return [Block(m[1], (m[2] or "").strip(), m[4]) for m in MARK.finditer(text)]


def _numbers(s: str) -> str:
    """Every figure as `#`; digits inside a name (K1, float32) stay."""
    return re.sub(r"(?<![A-Za-z_])\d+(\.\d+)?", "#", s)


def assert_prints(shown: str, output: str, *, figures: bool, where: str, unchecked: tuple[str, ...] = ()) -> None:
    """Every shown line occurs in `output`, in order; `...` stands for anything within a line."""
    lines = output.splitlines()
    at = 0
    shown_lines = [w for w in shown.splitlines() if w.strip() and w.strip() != "..."]
    for want in (w for w in shown_lines if not any(u in w for u in unchecked)):
        pieces = [re.escape(_numbers(p) if figures else p) for p in want.strip().split("...")]
        pattern = re.compile(".*".join(pieces).replace(re.escape("#"), r"#"))
        for i in range(at, len(lines)):
            if pattern.search(_numbers(lines[i]) if figures else lines[i]):
                at = i + 1
                break
        else:
            raise AssertionError(f"{where}: the page shows {want!r}, not in the output (from line {at}):\n{output}")


class Journey:
    """The page's blocks run in order in `tmp`, with `subs` applied."""

    def __init__(self, tmp: Path, subs: dict[str, str], real_config: Path, *, one_way: tuple[str, ...] = ()) -> None:
        self.tmp, self.subs, self.real_config, self.one_way = tmp, subs, real_config, one_way
        self.env_file = tmp / "journey.env"
        venv_bin = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EAGLE_", "DAGSTER_", "OPENROUTER_"))}
        env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
        self.env = env
        self.env_file.write_text("")
        self.skipped: list[str] = []

    def sub(self, text: str) -> str:
        for page, here in self.subs.items():
            text = text.replace(page, here)
        return text

    def unsub(self, text: str) -> str:
        for page, here in sorted(self.subs.items(), key=lambda kv: -len(kv[1])):
            if page not in self.one_way:
                text = text.replace(here, page)
        return text

    def run(self, body: str, *, real_model: bool) -> str:
        script = f"set -eo pipefail\nsource {self.env_file}\n"
        if real_model:  # the page's configuration, paths only: the real Kimi config.json as the model
            script += f"export EAGLE_PIPELINE_CONFIG={self.real_config}\n{self.sub(body)}\n"
        else:
            script += f"{self.sub(body)}\nexport -p > {self.env_file}.new\n"
        proc = subprocess.run(
            ["bash", "-c", script],
            cwd=self.tmp,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=900,
        )
        output = proc.stdout
        assert proc.returncode == 0, f"exit {proc.returncode} for\n{body}\n{output}"
        new = Path(f"{self.env_file}.new")
        if new.exists():
            new.replace(self.env_file)
        return self.unsub(output)

    def play(self, blocks: list[Block], *, tiny_served_config: Path) -> list[str]:
        """Every block in order: write the files, run the commands (asserting exit 0), compare what they print with
        the page. Returns every output that differs from the page, to report them together."""
        last_output, last_where = None, ""
        mismatches: list[str] = []
        for i, block in enumerate(blocks):
            where = f"{PAGE.name} block {i + 1} ({block.kind}{': ' + block.arg if block.arg else ''})"
            if block.kind == "file":
                first = block.body.splitlines()[0]
                assert first.startswith("# "), f"{where}: the first line names the file (# /data/eagle/kimi.yaml)"
                raw = yaml.safe_load(self.sub(block.body))
                self.real_config.write_text(yaml.safe_dump(raw, sort_keys=False))
                tiny = yaml.safe_dump(tiny_overrides(raw, tiny_served_config), sort_keys=False)
                Path(self.sub(first[2:].split()[0])).write_text(tiny)
            elif block.kind == "skip":
                self.skipped.append(block.arg)
            elif block.kind == "run":
                last_output, last_where = self.run(block.body, real_model=block.arg == "real-model"), where
                if os.environ.get("EAGLE_KIMI_PAGE_CAPTURE"):  # to refresh the page's outputs by hand
                    print(f"\n===== {where}\n{block.body}\n----- prints\n{last_output}")
            else:
                assert last_output is not None, f"{where}: an output block with no run block before it"
                options, _, unchecked = block.arg.partition("except:")
                try:
                    assert_prints(
                        block.body,
                        last_output,
                        figures="figures" in options,
                        where=last_where,
                        unchecked=tuple(u.strip() for u in unchecked.split(";") if u.strip()),
                    )
                except AssertionError as exc:
                    mismatches.append(str(exc))
        return mismatches


def tiny_overrides(raw: dict, served_config: Path) -> dict:
    """The tiny setup: a few prompts each, short answers, the tiny model served by the double (whose config.json
    `served_config` is, as the real server's is the checkpoint's)."""
    for d in raw["datasets"]:
        d["limit"], d["max_tokens"] = 4, 512
    raw["generation"]["progress_every_s"] = 1
    raw["hidden_states"]["model"] = "tiny-random"
    raw["hidden_states"]["vllm"]["served_model_config"] = str(served_config)
    return raw


def _checkpoint_without_weights(dest: Path, tokenizer_dir: Path) -> Path:
    """The real Kimi-K2.5 folder's config.json and tokenizer files (no weights): what the page's commands read."""
    dest.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        (dest / name).symlink_to(tokenizer_dir / name)
    return dest


@pytest.mark.timeout(2400)  # eight Dagster runs, each its own process (and the merge's steps their own): minutes
def test_the_kimi_page_runs_as_printed(tmp_path):
    tok_dir = os.environ.get("EAGLE_KIMI_TOKENIZER_DIR")
    if not tok_dir or not all((Path(tok_dir) / f).is_file() for f in TOKENIZER_FILES):
        pytest.skip(
            "EAGLE_KIMI_TOKENIZER_DIR is unset or lacks tiktoken.model, tokenizer_config.json, chat_template.jinja "
            "and config.json: the Kimi page uses the real tokenizer and config.json (.ci/run sets it)"
        )
    blocks = page_blocks(PAGE.read_text())
    assert blocks, f"{PAGE}: no marked blocks"
    checkpoint = _checkpoint_without_weights(tmp_path / "Kimi-K2.5", Path(tok_dir))
    data = tmp_path / "data"
    (data / "prompts").mkdir(parents=True)
    # The user's prompt files: the bundled ones, under the page's names.
    shutil.copyfile(REPO / "data/prompts/B1_coding.jsonl", data / "prompts/coding.jsonl")
    shutil.copyfile(REPO / "data/prompts/B6_tool_use.jsonl", data / "prompts/tool_use.jsonl")

    tok = resolve_tokenizer(str(checkpoint))
    completion, prompt = provider_token_counters(tok, get_profile("kimi-k2.5"))
    tiny_hf = tiny_config(tok.vocab_size, family="deepseek_v3")
    tiny_hf.to_json_file(tmp_path / "tiny-config.json")
    tiny = describe_model_config(tiny_hf)
    layer_ids = vllm_layer_ids(resolve_aux_layers(None, int(tiny["num_layers"])), int(tiny["num_layers"]))
    connector = data / "vllm_connector"
    with (
        SimulatedOpenRouterServer(api_key=KEY, count_completion_tokens=completion, count_prompt_tokens=prompt) as srv,
        resolved_endpoints(
            [SIMULATED],
            storage_path=connector,
            model="tiny-random",
            family="deepseek_v3",
            seed=0,
            vocab_size=tok.vocab_size,
            layer_ids=layer_ids,
        ) as (double_url,),
    ):
        subs = {
            "/data/eagle": str(data),
            "/models/Kimi-K2.5": str(checkpoint),
            "https://openrouter.ai/api/v1": srv.url,
            "http://gpu-node-0:8000": double_url,
            "sk-or-v1-...": KEY,
            # The flags the page writes for Kimi's layers, for the tiny model's (its aux layers in vLLM's numbering).
            "--target-layer-ids 2 30 58": "--target-layer-ids " + " ".join(str(k) for k in layer_ids[:-1]),
        }
        # The outputs keep the tiny model's layer ids: the page shows them as the tiny setup printed them.
        journey = Journey(tmp_path, subs, data / "kimi.real.yaml", one_way=("--target-layer-ids 2 30 58",))
        mismatches = journey.play(blocks, tiny_served_config=tmp_path / "tiny-config.json")
    assert not mismatches, "\n\n".join(mismatches)
    assert [s.split(":")[0] for s in journey.skipped] == list(EXPECTED_SKIPS), journey.skipped
    assert srv.request_counts(), "generation never reached the simulated OpenRouter server"


def test_the_output_check_fails_where_the_page_and_the_output_differ():
    """The comparison the page test relies on: a missing line, a wrong order, another figure each fail it."""
    assert_prints("a ... c\n...\nz\n", "xx a b c yy\nmid\nz\n", figures=False, where="w")
    with pytest.raises(AssertionError, match=re.escape("the page shows 'a ... d'")):
        assert_prints("a ... d\n", "a b c\n", figures=False, where="w")
    with pytest.raises(AssertionError):
        assert_prints("second\nfirst\n", "first\nsecond\n", figures=False, where="w")
    assert_prints("[K1] 4/4 done, 1.5 GB\n", "[K1] 8/8 done, 12.25 GB\n", figures=True, where="w")
    with pytest.raises(AssertionError):
        assert_prints("[K1] 4/4 done\n", "[K1] 8/8 done\n", figures=False, where="w")
    with pytest.raises(AssertionError):
        assert_prints("[K1] 4/4 done\n", "[K2] 8/8 done\n", figures=True, where="w")
    assert_prints(
        "| disk | 7.94 TB |\nkept\n", "| disk | 9 TB |\nkept\n", figures=False, where="w", unchecked=("| disk |",)
    )


def test_the_page_marks_its_blocks():
    """Every output block follows a run block; the configuration comes before the first command that reads it."""
    blocks = page_blocks(PAGE.read_text())
    kinds = [b.kind for b in blocks]
    assert kinds.count("file") == 1 and kinds.count("run") >= 10
    assert all(kinds[i - 1] == "run" for i, k in enumerate(kinds) if k == "prints")
    assert kinds.index("file") < next(i for i, b in enumerate(blocks) if "EAGLE_PIPELINE_CONFIG" in b.body)
