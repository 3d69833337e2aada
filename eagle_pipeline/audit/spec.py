"""The gate registry (one table: every gate's name, what it catches, its default action and its implementation) and
the settings that choose what each gate's failure does, with their one validation (`audit_settings_problems`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from eagle_pipeline.audit import gates as g
from eagle_pipeline.audit.context import ORIGINS, AuditContext
from eagle_pipeline.audit.tool_sections import gate_tool_sections_valid

ACTIONS = ("block", "filter", "warn")


class AuditSettingsError(ValueError):
    """Audit settings name an unknown gate, origin or action, or hold an invalid number; lists every problem."""


@dataclass(frozen=True)
class GateSpec:
    """One gate: stable name, what it catches, and what its failure does by default.

    `origin_defaults` overrides `default_action` for rows of one ids origin ('reconstructed' | 'returned'):
    a server's own ids can legitimately differ from what our tokenizer would produce, ours cannot.
    """

    name: str
    title: str
    description: str
    default_action: str
    run: Callable[[AuditContext, Any], g.Outcome]  # (context, AuditSettings) -> Outcome
    origin_defaults: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


def _spec(
    name: str,
    title: str,
    description: str,
    default_action: str,
    run: Callable[[AuditContext, Any], g.Outcome],
    **origin_defaults: str,
) -> GateSpec:
    return GateSpec(name, title, description, default_action, run, MappingProxyType(dict(origin_defaults)))


GATES: tuple[GateSpec, ...] = (
    _spec(
        "ids_in_vocab",
        "Every id is a real, output-legal token",
        "Ids outside [0, vocab_size), reserved/unnamed special slots, and named special ids that never belong in a "
        "model output (e.g. [PAD], <|im_user|>). Catches a wrong tokenizer, id arithmetic bugs and corrupt buffers; "
        "such ids crash or silently poison embedding lookups in training.",
        "block",
        g.gate_ids_in_vocab,
    ),
    _spec(
        "ends_with_eot",
        "A complete output ends with the end-of-turn id",
        "Complete rows (finish_reason stop/tool_calls) whose last id is not the end-of-turn id: a lost <|im_end|> or a "
        "cut tail. The drafter must learn where turns end.",
        "block",
        g.gate_ends_with_eot,
    ),
    _spec(
        "single_eot",
        "Exactly one end-of-turn id",
        "Complete rows with zero or several end-of-turn ids (incomplete rows: more than one). Catches doubled or "
        "concatenated turns.",
        "block",
        g.gate_single_eot,
    ),
    _spec(
        "single_think_close",
        "Exactly one </think> with thinking on, none with thinking off",
        "With thinking on a complete output holds exactly one think-close id (incomplete rows: at most one); with "
        "thinking off it holds none (the prompt already closed the think block). Catches dropped or doubled </think> "
        "and a wrong `thinking` flag.",
        "block",
        g.gate_single_think_close,
    ),
    _spec(
        "think_close_before_eot",
        "</think> comes before the end of turn",
        "Rows holding both ids where a think-close id follows the first end-of-turn id: swapped or misplaced "
        "structure.",
        "block",
        g.gate_think_close_before_eot,
    ),
    _spec(
        "no_think_open",
        "No <think> in outputs",
        "The think-open id belongs to the prompt (the generation prompt ends with it), never to the output. Catches "
        "prompt/output boundary mistakes and a template that double-opens the think block.",
        "block",
        g.gate_no_think_open,
    ),
    _spec(
        "reasoning_nonempty",
        "Thinking rows carry reasoning",
        "Thinking-on rows whose think-close id is the very first output id: the provider dropped the reasoning (or "
        "it was never requested). The ids would teach the drafter a turn the target never produced.",
        "filter",
        g.gate_reasoning_nonempty,
    ),
    _spec(
        "tool_tokens_declared",
        "Tool-call ids only in tool datasets",
        "Tool-section or tool-call special ids in a row whose dataset declares no tools. For reconstructed rows this "
        "means tools were sent for a dataset not flagged as a tool dataset (a configuration bug); for returned ids it "
        "is the model calling tools it was never given.",
        "block",
        g.gate_tool_tokens_declared,
        returned="filter",
    ),
    _spec(
        "tool_sections_valid",
        "Tool sections are balanced, ordered and parseable",
        "section_begin (call_begin ID arg_begin ARGS call_end)+ section_end, once, after </think>, directly before "
        "the end of turn; ID is non-empty without whitespace (and `functions.NAME:INDEX` when it starts with "
        "'functions.'); ARGS decode to a JSON object; the number of calls equals n_tool_calls.",
        "filter",
        gate_tool_sections_valid,
    ),
    _spec(
        "round_trip",
        "Ordinary spans are canonical BPE",
        "Each run of ordinary ids between special ids is decoded to bytes and re-encoded; the result must equal the "
        "run. Catches non-canonical ids, off-by-one ids that change the BPE, and runs that split a UTF-8 character. "
        "A server's returned ids can legitimately be non-canonical (the model sampled an unusual split), so "
        "returned rows only warn by default.",
        "block",
        g.gate_round_trip,
        returned="warn",
    ),
    _spec(
        "text_agreement",
        "Output ids decode to exactly the source text",
        "Rows carrying output_text_hash (reconstructed rows: a 64-bit hash of the API text laid out as reasoning "
        "</think> content [tool section] <|im_end|>, computed from the text, not the ids, when the row was built) "
        "must decode (specials as their strings) to bytes with that hash. Catches every id that changes the "
        "decoded text, including an ordinary or special id off by one that is itself canonical BPE (which "
        "round_trip misses), shifted vocabularies, and ids mixed up between rows. Rows without a hash (returned "
        "ids) are not checked.",
        "block",
        g.gate_text_agreement,
    ),
    _spec(
        "billing_agreement",
        "Token counts agree with the provider's bill",
        "Per row |len(output_ids) - usage_completion_tokens| must be within max(abs, rel*usage); in aggregate the "
        "relative difference of the sums must be within the bound. Rows without usage are not checked. The "
        "aggregate decides pass/fail; failing rows are listed (and excluded). Catches dropped reasoning, a "
        "tokenizer other than the target's and template tokens counted twice.",
        "block",
        g.gate_billing_agreement,
    ),
    _spec(
        "prompt_agreement",
        "Prompt ids agree with the prompt the target answered",
        "Rows whose prompt ids came from the server (vLLM's prompt_token_ids): those ids must equal the project's "
        "render of the same messages (the chat template with the target's tokenizer); a failure names the first "
        "differing position and both tokens. Rows with usage_prompt_tokens: |usage_prompt_tokens - "
        "len(prompt_ids)| must be within prompt_row_abs_tolerance (default 0). A difference means the target "
        "answered another prompt than the one rendered here: a provider that injects a system prompt, another chat "
        "template, or tool declarations rendered differently. Rows reconstructed from text carry the project's "
        "render, so the hidden states would be extracted under a prompt the target never saw. Warns by default: "
        "providers are known to count prompts their own way.",
        "warn",
        g.gate_prompt_agreement,
    ),
    _spec(
        "not_truncated",
        "The generation finished on its own",
        "finish_reason other than stop/tool_calls (length, content_filter, error, abort, missing): the output may be "
        "cut short. Such rows are excluded and counted, never silently kept.",
        "filter",
        g.gate_not_truncated,
    ),
)

GATE_NAMES: tuple[str, ...] = tuple(g.name for g in GATES)
GATES_BY_NAME: dict[str, GateSpec] = {g.name: g for g in GATES}


@dataclass
class AuditSettings:
    """What each gate's failure does, and the gates' numeric thresholds.

    `actions` keys are a gate name ("round_trip") or a gate name and an ids origin ("round_trip@returned");
    resolution order: "gate@origin", then "gate", then the gate's own origin default, then its default action.
    """

    actions: dict[str, str] = field(default_factory=dict)
    billing_row_abs_tolerance: int = 2
    billing_row_rel_tolerance: float = 0.01
    billing_aggregate_bound: float = 0.005
    prompt_row_abs_tolerance: int = 0
    max_examples: int = 5
    excerpt_tokens: int = 24

    def __post_init__(self) -> None:
        problems = _value_problems(vars(self))
        if problems:
            raise AuditSettingsError(_message(problems))
        self.actions = dict(self.actions)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> AuditSettings:
        """Settings from plain data (YAML/JSON); unknown keys, gates, origins or actions are errors, all listed in
        one AuditSettingsError (the problems of `audit_settings_problems`)."""
        problems = audit_settings_problems(data)
        if problems:
            raise AuditSettingsError(_message(problems))
        kwargs = dict(data or {})
        if kwargs.get("actions") is None:
            kwargs.pop("actions", None)
        return cls(**kwargs)

    def action_for(self, gate: str, origin: str | None = None) -> str:
        """The effective action of `gate` for rows of `origin` (None: the gate-level action)."""
        spec = GATES_BY_NAME[gate]
        if origin is not None and f"{gate}@{origin}" in self.actions:
            return self.actions[f"{gate}@{origin}"]
        if gate in self.actions:
            return self.actions[gate]
        if origin is not None and origin in spec.origin_defaults:
            return spec.origin_defaults[origin]
        return spec.default_action

    def row_filter_gates(self) -> list[str]:
        """The gates whose failing rows must be excluded downstream once no gate blocks.

        A 'block' gate that failed stops the pipeline, so a filter pass after a passed audit only needs the gates
        with a 'filter' action for some origin, plus billing, whose rows fail individually under an aggregate pass.
        """
        out = []
        for name in GATE_NAMES:
            acts = {self.action_for(name, o) for o in ORIGINS}
            if "filter" in acts or (name == "billing_agreement" and acts & {"block", "filter"}):
                out.append(name)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SettingsProblem:
    """One problem of audit settings. `path` says where, within the audit section: `("actions", "round_trip@returned")`,
    `("billing_aggregate_bound",)`, `("actions",)`, or `()` for the section as a whole; str() is the message."""

    path: tuple[Any, ...]
    message: str

    def __str__(self) -> str:
        return self.message


_FIELDS = tuple(f.name for f in dataclasses.fields(AuditSettings))
# Type, lower and upper bound of each numeric setting.
_NUMBERS: dict[str, tuple[type, float, float | None]] = {
    "billing_row_abs_tolerance": (int, 0, None),
    "billing_row_rel_tolerance": (float, 0, 1),
    "billing_aggregate_bound": (float, 0, 1),
    "prompt_row_abs_tolerance": (int, 0, None),
    "max_examples": (int, 0, None),
    "excerpt_tokens": (int, 1, None),
}


def audit_settings_problems(data: Mapping[str, Any] | None) -> list[SettingsProblem]:
    """Every problem of plain audit settings (as `AuditSettings.from_dict` takes them): unknown keys, gates, origins
    or actions, and numbers of the wrong type or out of range. [] when valid. This is the one validation of audit
    settings: `AuditSettings` raises with exactly these problems, and the configuration loader reports them."""
    if data is None:
        return []
    if not isinstance(data, Mapping):
        return [SettingsProblem((), f"audit settings must be a mapping, got {type(data).__name__}")]
    problems = []
    unknown = sorted(set(data) - set(_FIELDS), key=str)
    if unknown:
        problems.append(SettingsProblem((), f"unknown key(s) {unknown}; known: {sorted(_FIELDS)}"))
    defaults = dataclasses.asdict(AuditSettings())
    values = {k: data.get(k, defaults[k]) for k in _FIELDS}
    if values["actions"] is None:
        values["actions"] = {}
    return problems + _value_problems(values)


def _message(problems: list[SettingsProblem]) -> str:
    return "invalid audit settings:\n  - " + "\n  - ".join(map(str, problems))


def _value_problems(values: Mapping[str, Any]) -> list[SettingsProblem]:
    problems = []
    actions = values["actions"]
    if not isinstance(actions, Mapping):
        problems.append(
            SettingsProblem(("actions",), f"actions must be a mapping of gate -> action, got {type(actions).__name__}")
        )
    else:
        for key, action in actions.items():
            problems.extend(_check_action_key(key, action))
    for name, (kind, lo, hi) in _NUMBERS.items():
        problems.extend(_check_number(name, values[name], kind, lo, hi))
    return problems


def _check_action_key(key: Any, action: Any) -> list[SettingsProblem]:
    where = ("actions", key)
    if not isinstance(key, str):
        return [SettingsProblem(where, f"action key {key!r} is not a string")]
    problems = []
    gate, _, origin = key.partition("@")
    if gate not in GATES_BY_NAME:
        problems.append(SettingsProblem(where, f"unknown gate {gate!r} in actions; gates: {', '.join(GATE_NAMES)}"))
    if "@" in key and origin not in ORIGINS:
        problems.append(
            SettingsProblem(
                where, f"unknown ids origin {origin!r} in actions key {key!r}; origins: {', '.join(ORIGINS)}"
            )
        )
    if action not in ACTIONS:
        problems.append(SettingsProblem(where, f"action {action!r} for {key!r} is not one of {', '.join(ACTIONS)}"))
    return problems


def _check_number(name: str, value: Any, kind: type, lo: float, hi: float | None) -> list[SettingsProblem]:
    # bool is an int subclass; True as a tolerance is surely a mistake.
    ok_types = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        return [
            SettingsProblem((name,), f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        ]
    if value < lo or (hi is not None and value > hi):
        return [SettingsProblem((name,), f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {value!r}")]
    return []
