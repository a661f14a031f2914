"""`specbus bench structured`: constrained decoding, plain against speculative (issue 46).

In process, on the real embedded SmolLM2 with the product's default weights (`--weights`), one
core (`os.sched_setaffinity(0, {0})`) and one torch thread. Three workloads:

- extraction: fill a JSON schema from a given text (6 texts, each its own schema);
- tool calls: a fixed tool set (weather, calendar, email, search, unit conversion),
  `tool_choice` required, one call per answer: the gateway's grammar and tool prompt
  (`nodes.gateway.tools`);
- agent: the suffix work's agent trace (tools/traces/agent_tools.json, 14 turns) with its tool
  schema (`AGENT_SCHEMA`: the one `{"tool", "arguments"}` object its system prompt asks for),
  counted after its first `AGENT_AFTER` requests.

Configurations, rounds interleaved (round r runs every request under every configuration):
free plain (no constraint), constrained plain, constrained with the grammar's forced tokens as the
only drafts, grammar + ngram drafts, grammar + suffix drafts (one index over the round's requests,
fresh each round). Requests are served one after another as a verifier serves them: each
configuration's prefix cache (the verifier's default size, fresh each round) lets a request
reuse the earlier ones' prompts. Reports per configuration the median tok/s over requests, the
median and the worst request's speedup over constrained plain end to end and after the first
block (where the first block was drafted with the prompt it carries more than the first token),
time to the first block, acceptance; the mask and matcher cost per token
(`GrammarMatcher.seconds / tokens`) against the decode step; schema compile time p50/p99 (a
fresh compile each time); constrained plain against free plain; and invalid outputs (every
constrained output parsed and checked against its schema: must be 0; an answer cut by
max_tokens is counted apart, not judged). Greedy: every speculative output must equal
constrained plain's token for token. `--gateway` adds the same workloads through the gateway as
an app sends them (tools/bench_structured_gateway.py: real processes, the openai client).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from typing import Any

EXTRACTION: list[tuple[str, dict[str, Any]]] = [
    ("Dr. Maria Lopez, 42, joined Acme Robotics in March 2019 as head of research. She lives in "
     "Valencia and can be reached at maria.lopez@acme.example.",
     {"type": "object", "properties": {
         "name": {"type": "string"}, "age": {"type": "integer"},
         "company": {"type": "string"}, "role": {"type": "string"},
         "city": {"type": "string"}, "email": {"type": "string"}},
      "required": ["name", "age", "company", "role", "city", "email"],
      "additionalProperties": False}),
    ("Invoice 2024-0117 from Northwind Supplies: 3 boxes of printer paper at 24.50 each, 1 "
     "stapler at 12.00, shipping 8.90. Total due 94.40 EUR by 15 February.",
     {"type": "object", "properties": {
         "invoice_number": {"type": "string"}, "vendor": {"type": "string"},
         "items": {"type": "array", "maxItems": 4, "items": {
             "type": "object", "properties": {"description": {"type": "string"},
                                              "quantity": {"type": "integer"},
                                              "unit_price": {"type": "number"}},
             "required": ["description", "quantity", "unit_price"],
             "additionalProperties": False}},
         "total": {"type": "number"}, "currency": {"enum": ["EUR", "USD", "GBP"]}},
      "required": ["invoice_number", "vendor", "items", "total", "currency"],
      "additionalProperties": False}),
    ("The flight BA 2490 from London Gatwick to Pisa leaves at 07:15 on 2 June and lands at "
     "10:30 local time. Gate closes 30 minutes before departure. Seat 14C, economy.",
     {"type": "object", "properties": {
         "flight": {"type": "string"}, "from": {"type": "string"}, "to": {"type": "string"},
         "departure": {"type": "string"}, "arrival": {"type": "string"},
         "seat": {"type": "string"},
         "cabin": {"enum": ["economy", "premium", "business", "first"]}},
      "required": ["flight", "from", "to", "departure", "arrival", "seat", "cabin"],
      "additionalProperties": False}),
    ("I bought the X200 headphones last week. The sound is great and the battery lasts two "
     "days, but the ear cushions hurt after an hour. Three stars out of five.",
     {"type": "object", "properties": {
         "product": {"type": "string"},
         "sentiment": {"enum": ["positive", "mixed", "negative"]},
         "rating": {"type": "integer", "minimum": 1, "maximum": 5},
         "pros": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
         "cons": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
      "required": ["product", "sentiment", "rating", "pros", "cons"],
      "additionalProperties": False}),
    ("Recipe: pancakes for four. Mix 200 g flour, 2 eggs, 300 ml milk and a pinch of salt. "
     "Rest the batter 20 minutes, then cook each pancake 2 minutes per side.",
     {"type": "object", "properties": {
         "dish": {"type": "string"}, "servings": {"type": "integer"},
         "ingredients": {"type": "array", "maxItems": 6, "items": {
             "type": "object", "properties": {"name": {"type": "string"},
                                              "amount": {"type": "string"}},
             "required": ["name", "amount"], "additionalProperties": False}},
         "rest_minutes": {"type": "integer"}},
      "required": ["dish", "servings", "ingredients", "rest_minutes"],
      "additionalProperties": False}),
    ("Server web-3 in eu-west reported 97% CPU at 14:02 UTC; the on-call engineer Sam restarted "
     "the nginx service and the alert cleared at 14:09. Severity: high.",
     {"type": "object", "properties": {
         "host": {"type": "string"}, "region": {"type": "string"},
         "metric": {"enum": ["cpu", "memory", "disk", "network"]},
         "value_percent": {"type": "integer", "minimum": 0, "maximum": 100},
         "action": {"type": "string"}, "resolved": {"type": "boolean"},
         "severity": {"enum": ["low", "medium", "high", "critical"]}},
      "required": ["host", "region", "metric", "value_percent", "action", "resolved",
                   "severity"], "additionalProperties": False}),
]

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "create_event", "description": "Add an event to the calendar",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string"}, "date": {"type": "string"},
            "time": {"type": "string"}, "duration_minutes": {"type": "integer"}},
            "required": ["title", "date", "time", "duration_minutes"],
            "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "send_email", "description": "Send an email",
        "parameters": {"type": "object", "properties": {
            "to": {"type": "string"}, "subject": {"type": "string"},
            "body": {"type": "string"}},
            "required": ["to", "subject", "body"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_web", "description": "Search the web",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1,
                                                         "maximum": 10}},
            "required": ["query", "max_results"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "convert_units", "description": "Convert a value between units",
        "parameters": {"type": "object", "properties": {
            "value": {"type": "number"}, "from_unit": {"type": "string"},
            "to_unit": {"type": "string"}},
            "required": ["value", "from_unit", "to_unit"], "additionalProperties": False}}},
]
TOOL_ASKS = [
    "What's the weather like in Lisbon right now, in celsius?",
    "Put a dentist appointment in my calendar for 12 March at 09:30, one hour.",
    "Email bob@example.com to say the report is late, subject 'Report'.",
    "Search the web for the best hiking trails near Innsbruck, five results.",
    "How many kilometres is 26.2 miles?",
    "Is it going to be cold in Oslo today? Use fahrenheit.",
]

#: the agent trace of the suffix work (tools/traces/agent_tools.json) with its tool schema: the
#: one JSON object its system prompt asks for, `{"tool": NAME, "arguments": {...}}`, each tool's
#: arguments as the prompt lists them
_IATA = {"type": "string", "pattern": "^[A-Z]{3}$"}
_DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
_COUNT = {"type": "integer", "minimum": 1, "maximum": 99}
AGENT_TOOLS: dict[str, dict[str, Any]] = {
    "search_flights": {"origin": _IATA, "destination": _IATA, "date": _DATE,
                       "passengers": _COUNT},
    "get_weather": {"city": {"type": "string"}, "date": _DATE},
    "book_hotel": {"city": {"type": "string"}, "check_in": _DATE, "nights": _COUNT,
                   "guests": _COUNT},
    "convert_currency": {"amount": {"type": "number"}, "from": _IATA, "to": _IATA},
}
AGENT_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "object", "properties": {
        "tool": {"const": name},
        "arguments": {"type": "object", "properties": args, "required": list(args),
                      "additionalProperties": False}},
     "required": ["tool", "arguments"], "additionalProperties": False}
    for name, args in AGENT_TOOLS.items()]}
#: the agent trace's figures are its requests after the first few (the suffix index fills)
AGENT_AFTER = 3

CONFIGS = ("free", "plain", "grammar", "grammar+ngram", "grammar+suffix")
WORKLOADS = ("extraction", "tools", "agent")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from nodes.backends.weights import CHOICES, default_weights

    parser.add_argument("--weights", default=default_weights(), choices=CHOICES,
                        help="the verifier's weights (default: the product's, "
                             f"{default_weights()})")
    parser.add_argument("--model", default=None, help="default: the embedded smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--quick", action="store_true",
                        help="3 texts and 3 tool asks, 2 rounds")
    parser.add_argument("--prefix-cache-mb", type=int, default=None,
                        help="each configuration's prefix cache, fresh every round (default: "
                             "the verifier's, as served; 0: off, every prompt prefilled whole)")
    parser.add_argument("--no-agent", action="store_true",
                        help="leave out the agent trace with its tool schema")
    parser.add_argument("--gateway", action="store_true",
                        help="also through the gateway: a verifier per configuration, "
                             "proposers (--proposers) and a gateway as processes, the openai "
                             "client, plain vs speculative (tools/bench_structured_gateway.py)")
    parser.add_argument("--gateway-only", action="store_true",
                        help="only the gateway's figures (no in-process rows)")
    parser.add_argument("--proposers", default="ngram", metavar="DRAFTER[,DRAFTER...]",
                        help="--gateway: one proposer process per drafter (default: ngram; "
                             "a model drafter such as int8 takes the grammar)")
    parser.add_argument("--verifier-drafter", default="none", metavar="DRAFTER",
                        help="--gateway: the speculative verifier's own drafter (`specbus "
                             "node --drafter`, default none); a verifier drafts with it where "
                             "no proposer is up, so with --proposers '' (its suffix index: "
                             "its own earlier answers)")
    parser.add_argument("--no-ceiling", action="store_true",
                        help="leave out the oracle ceilings (tools/structured_ceiling.py)")
    parser.add_argument("--compiles", type=int, default=20,
                        help="fresh compiles per constraint for the compile-time figures")
    parser.add_argument("--json", metavar="PATH", default=None, help="write results as JSON")


# ---- validation --------------------------------------------------------------------------------
def conforms(value: Any, schema: Any) -> bool:
    """`value` valid against `schema` (the keywords this benchmark's schemas use)."""
    if schema is True or schema == {}:
        return True
    if "const" in schema:
        return value == schema["const"]
    if "enum" in schema:
        return value in schema["enum"]
    if "oneOf" in schema:
        return sum(conforms(value, s) for s in schema["oneOf"]) == 1
    if "anyOf" in schema:
        return any(conforms(value, s) for s in schema["anyOf"])
    kind = schema.get("type")
    if kind == "boolean":
        return isinstance(value, bool)
    if kind in ("integer", "number"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if kind == "integer" and not float(value).is_integer():
            return False
        return math.isfinite(value) and schema.get("minimum", -math.inf) <= value <= \
            schema.get("maximum", math.inf)
    if kind == "string":
        return isinstance(value, str) and schema.get("minLength", 0) <= len(value) <= \
            schema.get("maxLength", math.inf) and (
                "pattern" not in schema or re.search(schema["pattern"], value) is not None)
    if kind == "array":
        return isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= \
            schema.get("maxItems", math.inf) and all(conforms(v, schema.get("items", {}))
                                                     for v in value)
    if kind == "object":
        props = schema.get("properties", {})
        if not isinstance(value, dict) or not set(schema.get("required", ())) <= set(value):
            return False
        if schema.get("additionalProperties", True) is False and set(value) - set(props):
            return False
        return all(conforms(v, props.get(k, {})) for k, v in value.items())
    raise ValueError(f"keyword not known to this validator: {schema}")


def _valid_json(text: str, schema: dict) -> bool:
    try:
        return conforms(json.loads(text), schema)
    except ValueError:
        return False


def _valid_calls(text: str) -> bool:
    from nodes.gateway.tools import parse_calls

    calls = parse_calls(text)
    if not calls:
        return False
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in calls:
        fn = c.get("function", c)
        name, args = fn.get("name"), fn.get("arguments")
        if name not in params:
            return False
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            return False
        if not conforms(args, params[name]):
            return False
    return True


# ---- the workload ------------------------------------------------------------------------------
def _requests(tokenizer, quick: bool, agent: bool = True) -> list[dict[str, Any]]:
    """Each request: workload, prompt ids, constraint, validity check."""
    from nodes.engine.grammar import Constraint
    from nodes.gateway.tools import parse_tools, tool_grammar, tools_message

    out = []
    for text, schema in EXTRACTION[: 3 if quick else None]:
        msgs = [{"role": "system", "content": "Extract the facts of the user's text as JSON "
                 "matching this schema: " + json.dumps(schema)},
                {"role": "user", "content": text}]
        out.append({"workload": "extraction", "ids": tokenizer.encode_messages(msgs),
                    "constraint": Constraint.json_schema(schema),
                    "valid": lambda t, s=schema: _valid_json(t, s)})
    tools = parse_tools(TOOLS, "required", False)  # one call per answer
    g = tool_grammar(tools)
    for ask in TOOL_ASKS[: 3 if quick else None]:
        msgs = [tools_message(tools), {"role": "user", "content": ask}]
        out.append({"workload": "tools", "ids": tokenizer.encode_messages(msgs),
                    "constraint": Constraint(g["kind"], g["text"]), "valid": _valid_calls})
    if agent:
        from tools.bench_suffix import load_trace

        trace = load_trace("agent_tools")[: 6 if quick else None]
        for t in trace:
            out.append({"workload": "agent", "ids": tokenizer.encode_messages(t["messages"]),
                        "constraint": Constraint.json_schema(AGENT_SCHEMA),
                        "valid": lambda t: _valid_json(t, AGENT_SCHEMA)})
    return out


def gateway_requests(quick: bool, agent: bool) -> list[dict[str, Any]]:
    """`--gateway`'s requests: workload, the chat call's keyword arguments (as an app sends
    them), validity check of the answer's message."""
    out = []
    for text, schema in EXTRACTION[: 3 if quick else None]:
        msgs = [{"role": "system", "content": "Extract the facts of the user's text as JSON "
                 "matching this schema: " + json.dumps(schema)},
                {"role": "user", "content": text}]
        out.append({"workload": "extraction", "kw": {"messages": msgs, "response_format": {
            "type": "json_schema", "json_schema": {"name": "facts", "schema": schema,
                                                   "strict": True}}},
                    "valid": lambda m, s=schema: _valid_json(m.content or "", s)})
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    def calls_valid(m) -> bool:
        calls = m.tool_calls or []
        return bool(calls) and all(
            c.function.name in params and conforms(json.loads(c.function.arguments),
                                                   params[c.function.name]) for c in calls)

    for ask in TOOL_ASKS[: 3 if quick else None]:
        out.append({"workload": "tools", "kw": {
            "messages": [{"role": "user", "content": ask}], "tools": TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False}, "valid": calls_valid})
    if agent:
        from tools.bench_suffix import load_trace

        for t in load_trace("agent_tools")[: 6 if quick else None]:
            out.append({"workload": "agent", "kw": {"messages": t["messages"],
                                                    "response_format": {
                "type": "json_schema", "json_schema": {"name": "call", "schema": AGENT_SCHEMA,
                                                       "strict": True}}},
                        "valid": lambda m: _valid_json(m.content or "", AGENT_SCHEMA)})
    return out


def run(args: argparse.Namespace) -> int:
    if args.gateway_only:
        from tools.bench_structured_gateway import print_gateway, run_gateway

        report = {"gateway": _gateway(args, run_gateway)}
        print_gateway(report["gateway"])
        _write(args.json, report)
        g = report["gateway"]
        return 1 if g["invalid_outputs"] or g["speculative_not_equal_plain"] else 0
    import torch

    from nodes.assemble import DEFAULT_PREFIX_CACHE_MB
    from nodes.backends.torch_backend import TorchBackend
    from nodes.drafters.ngram import NgramDrafter
    from nodes.drafters.suffix import SuffixDrafter
    from nodes.engine import Engine, GenerationParams
    from nodes.engine.grammar import Grammars
    from nodes.engine.prefix_cache import PrefixCache
    from nodes.engine.state import Stats

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    backend = TorchBackend.load(args.model, device="cpu", weights=args.weights)
    print(f"loaded {args.model or 'smollm2-135m'} ({args.weights}) in "
          f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    prefix_mb = DEFAULT_PREFIX_CACHE_MB if args.prefix_cache_mb is None else \
        args.prefix_cache_mb
    engines = {"free": Engine(backend, None, grammar_drafts=False),
               "plain": Engine(backend, None, grammar_drafts=False),
               "grammar": Engine(backend, None),
               "grammar+ngram": Engine(backend, NgramDrafter()),
               "grammar+suffix": Engine(backend, SuffixDrafter())}
    matchers: list = []
    for e in engines.values():  # record each run's matcher (its mask and matcher seconds)
        orig = e.grammars.matcher

        def record(c, orig=orig):
            m = orig(c)
            matchers.append(m)
            return m

        e.grammars.matcher = record
    reqs = _requests(backend.tokenizer, args.quick, not args.no_agent)
    rounds = 2 if args.quick else args.rounds
    # runs[config][i]: list of (seconds, tokens, drafted, accepted, mask s, masks, first s,
    # tokens in the first block)
    runs: dict[str, list[list[tuple]]] = {c: [[] for _ in reqs] for c in CONFIGS}
    outputs: dict[str, list] = {c: [None] * len(reqs) for c in CONFIGS}
    invalid = 0
    cut = 0
    mismatched = 0
    for e in engines.values():  # warm: the first forwards, llguidance's tokenizer
        e.generate(reqs[0]["ids"], GenerationParams(max_tokens=4, constraint=reqs[0][
            "constraint"]))
    for r in range(rounds):
        # as a verifier serves them, one after another: each round from a fresh prefix cache
        # (a request reuses the earlier requests' prompts: an agent's tool list) and a fresh
        # suffix index (it drafts from the earlier requests' answers, never from this
        # request's own answer in an earlier round)
        engines["grammar+suffix"].drafter = SuffixDrafter()
        for e in engines.values():
            e.prefix_cache = PrefixCache(backend, prefix_mb << 20) if prefix_mb else None
        for i, req in enumerate(reqs):
            for c in CONFIGS:
                p = GenerationParams(max_tokens=args.max_tokens,
                                     constraint=None if c == "free" else req["constraint"])
                matchers.clear()
                tokens: list[int] = []
                first = None
                t = time.perf_counter()
                gen_stats = Stats()
                last = None
                for block in engines[c].stream(req["ids"], p, stats=gen_stats):
                    if first is None:
                        first = time.perf_counter() - t
                        first_n = len(block.token_ids)  # (more than one: drafted with it)
                    tokens.extend(block.token_ids)
                    last = block
                dt = time.perf_counter() - t
                text = backend.tokenizer.decode(tokens)
                m = matchers[0] if matchers else None
                runs[c][i].append((dt, len(tokens), gen_stats.drafted, gen_stats.accepted,
                                   m.seconds if m else 0.0, m.masks if m else 0, first,
                                   first_n))
                if c != "free":
                    if r == 0 and last.finish_reason == "length":
                        cut += 1  # the model ran out of max_tokens mid-answer: not judged
                    elif r == 0 and not req["valid"](text):
                        invalid += 1
                        print(f"INVALID ({c}, {req['workload']} {i}): {text!r}",
                              file=sys.stderr)
                    if outputs["plain"][i] is not None and tokens != outputs["plain"][i]:
                        mismatched += 1
                outputs[c][i] = tokens
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)

    ceiling = None if args.no_ceiling else _ceilings(backend, engines, reqs, runs, outputs)

    # compile time: a fresh compile of each request's constraint, many times
    fresh = Grammars(backend.tokenizer, backend.vocab_size, cache_size=1)
    fresh._ll = engines["plain"].grammars.ll_tokenizer
    compile_ms = []
    for _ in range(args.compiles):
        for req in reqs:
            fresh._cache.clear()
            t = time.perf_counter()
            fresh.compile(req["constraint"])
            compile_ms.append((time.perf_counter() - t) * 1e3)

    report = _summarise(reqs, runs)
    report.update({
        "model": args.model or "smollm2-135m", "weights": args.weights, "rounds": rounds,
        "max_tokens": args.max_tokens, "requests": len(reqs), "invalid_outputs": invalid,
        "prefix_cache_mb": prefix_mb, "cut_by_max_tokens": cut,
        "speculative_not_equal_plain": mismatched,
        "compile_ms": {"p50": _pct(compile_ms, 50), "p99": _pct(compile_ms, 99),
                       "n": len(compile_ms)},
        "machine": platform.machine(), "load": os.getloadavg(),
    })
    if ceiling is not None:
        report["ceiling"] = ceiling
    if args.gateway:  # after the in-process rows (they hold core 0 in this process)
        from tools.bench_structured_gateway import print_gateway, run_gateway

        report["gateway"] = _gateway(args, run_gateway)
        invalid += report["gateway"]["invalid_outputs"]
        mismatched += report["gateway"]["speculative_not_equal_plain"]
    _print(report)
    if args.gateway:
        print_gateway(report["gateway"])
    _write(args.json, report)
    return 1 if invalid or mismatched else 0


def _gateway(args: argparse.Namespace, run_gateway) -> dict[str, Any]:
    return run_gateway(args, gateway_requests(args.quick, not args.no_agent),
                       {w: AGENT_AFTER if w == "agent" else 0 for w in WORKLOADS})


def _write(path: str | None, report: dict[str, Any]) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))
    return xs[k]


def _counted(reqs, w: str) -> list[int]:
    """The requests of workload `w` the figures count (the agent trace's after its first
    `AGENT_AFTER`)."""
    idx = [i for i, r in enumerate(reqs) if r["workload"] == w]
    return idx[AGENT_AFTER:] if w == "agent" else idx


def _ceilings(backend, engines, reqs, runs, outputs) -> dict[str, Any]:
    """Per workload and speculative configuration, the oracle ceiling of its sources over
    constrained plain's answers, end to end and after the first token, and the perfect
    drafter's (tools/structured_ceiling.py): medians over the counted requests and the lowest.
    One pass in request order, as a round runs (the suffix index over the earlier answers)."""
    from nodes.drafters.ngram import NgramDrafter
    from nodes.drafters.suffix import SuffixDrafter
    from nodes.engine.forced_lookup import continued_by_lookups
    from nodes.engine.grammar import GrammarSource
    from nodes.engine.sampling import SamplingParams
    from tools.structured_ceiling import end_to_end, perfect
    from tools.trace_ceiling import measure_costs, replay_sources

    max_k = engines["grammar"].max_draft
    drafters = {"grammar": None, "grammar+ngram": NgramDrafter(),
                "grammar+suffix": SuffixDrafter()}
    per: dict[str, list[tuple[float, float]]] = {c: [] for c in (*drafters, "perfect")}
    for i, req in enumerate(reqs):
        answer = outputs["plain"][i]
        costs = measure_costs(backend, req["ids"], max_k + 1)
        first = statistics.median(x[6] for x in runs["plain"][i])
        for c, drafter in drafters.items():
            matcher = engines["grammar"].grammars.matcher(req["constraint"])

            def advance(token: int, m=matcher) -> None:
                try:
                    m.advance(token)
                except RuntimeError:  # (the end of text past an accepting state)
                    pass

            # the engine's sources for the configuration (`Engine._slots`)
            lookups = [] if drafter is None else [drafter.open_source(req["ids"],
                                                                      SamplingParams())]
            sources = [GrammarSource(matcher), *lookups,
                       *continued_by_lookups(matcher, lookups)]
            got = replay_sources(sources, advance, req["ids"], answer, costs.verify, max_k)
            per[c].append((end_to_end(got, first), got.speedup))
        best = perfect(len(answer), costs.verify, max_k)
        per["perfect"].append((end_to_end(best, first), best.speedup))
    out: dict[str, Any] = {}
    for w in WORKLOADS:
        idx = _counted(reqs, w)
        if not idx:
            continue
        out[w] = {c: {"speedup_median": statistics.median(xs[i][0] for i in idx),
                      "speedup_lowest": min(xs[i][0] for i in idx),
                      "decode_speedup_median": statistics.median(xs[i][1] for i in idx),
                      "requests": len(idx)} for c, xs in per.items()}
    print("ceilings done", file=sys.stderr)
    return out


def _summarise(reqs, runs) -> dict[str, Any]:
    """Per workload and configuration: medians over requests of each request's median over
    rounds. `speedup`: end to end (prefill included) against constrained plain on the same
    tokens; `decode_speedup`: the tokens after the first block against the time after it
    (the prefill and its first block left out; a block drafted with the prompt carries more
    than the first token); `vs_free`: against free plain's tok/s. The
    agent trace counts its requests after the first `AGENT_AFTER`."""
    out: dict[str, Any] = {}
    for w in WORKLOADS:
        idx = _counted(reqs, w)
        if not idx:
            continue
        rows = {}
        med = lambda c, i, k: statistics.median(x[k] for x in runs[c][i])  # noqa: E731
        for c in CONFIGS:
            secs = [med(c, i, 0) for i in idx]
            toks = [runs[c][i][0][1] for i in idx]
            after = [med(c, i, 0) - med(c, i, 6) for i in idx]  # time after the first block
            base = [med("plain", i, 0) / runs["plain"][i][0][1] for i in idx]
            base_dec = [(med("plain", i, 0) - med("plain", i, 6)) / max(1, runs["plain"][i][0][1]
                                                                      - 1) for i in idx]
            # tok/s against constrained plain's (the same tokens, but for free text)
            speed = [b * t / s for b, t, s in zip(base, toks, secs, strict=True)]
            # the tokens after the first block in the time after it (a first block drafted
            # with the prompt carries more than the first token: `Engine._prefill_drafted`)
            later = [t - med(c, i, 7) for t, i in zip(toks, idx, strict=True)]
            dec = [b * max(1, n) / max(a, 1e-9)
                   for b, n, a in zip(base_dec, later, after, strict=True)]
            free_tps = [runs["free"][i][0][1] / med("free", i, 0) for i in idx]
            vs_free = [t / s / f for t, s, f in zip(toks, secs, free_tps, strict=True)]
            drafted = sum(runs[c][i][0][2] for i in idx)
            accepted = sum(runs[c][i][0][3] for i in idx)
            mask_s = sum(med(c, i, 4) for i in idx)
            rows[c] = {
                "tok_s_median": statistics.median(t / s for t, s in zip(toks, secs,
                                                                        strict=True)),
                "tokens": sum(toks), "requests": len(idx),
                "speedup_median": statistics.median(speed), "speedup_worst": min(speed),
                "speedup_per_request": [round(x, 4) for x in speed],
                "decode_speedup_median": statistics.median(dec),
                "decode_speedup_worst": min(dec),
                "vs_free_median": statistics.median(vs_free),
                "first_token_ms_median": 1e3 * statistics.median(med(c, i, 6) for i in idx),
                "acceptance": accepted / drafted if drafted else 0.0,
                "mask_ms_per_token": 1e3 * mask_s / max(1, sum(toks)),
                "step_ms_per_token": 1e3 * sum(after) / max(1, sum(later)),
            }
            rows[c]["mask_share"] = rows[c]["mask_ms_per_token"] / rows[c]["step_ms_per_token"]
        out[w] = rows
    return out


def _print(rep: dict[str, Any]) -> None:
    print(f"\nspecbus bench structured: {rep['model']} ({rep['weights']}), one core, one torch "
          f"thread, {rep['rounds']} rounds interleaved, max_tokens {rep['max_tokens']}, prefix "
          f"cache {rep['prefix_cache_mb']} MB, load "
          f"{' '.join(f'{x:.2f}' for x in rep['load'])}")
    print("x plain: end to end (prefill included) over constrained plain; decode x: after the "
          "first block; agent: its requests after the first "
          f"{AGENT_AFTER}; x free: tok/s over free plain's; ttfb: time to the first block")
    head = (f"{'workload':<10} {'config':<14} {'tok/s':>6} {'x plain':>7} {'worst':>5} "
            f"{'decode x':>8} {'worst':>5} {'x free':>6} {'ttfb ms':>7} {'accept':>6} "
            f"{'tokens':>6} {'ms/tok':>6} {'mask ms':>7} {'mask %':>6}")
    print(head)
    print("-" * len(head))
    for w in WORKLOADS:
        for c, r in rep.get(w, {}).items():
            print(f"{w:<10} {c:<14} {r['tok_s_median']:6.1f} {r['speedup_median']:7.2f} "
                  f"{r['speedup_worst']:5.2f} {r['decode_speedup_median']:8.2f} "
                  f"{r['decode_speedup_worst']:5.2f} {r['vs_free_median']:6.2f} "
                  f"{r['first_token_ms_median']:7.0f} {r['acceptance']:6.2f} "
                  f"{r['tokens']:6d} {r['step_ms_per_token']:6.2f} "
                  f"{r['mask_ms_per_token']:7.3f} {100 * r['mask_share']:6.2f}")
    print("mask ms: mask and matcher per token; mask %: of a decode step's time per token "
          "(ms/tok, after the first block)")
    print(f"constrained plain vs free plain (ms/token after the first): extraction "
          f"{rep['extraction']['plain']['step_ms_per_token']:.2f} vs "
          f"{rep['extraction']['free']['step_ms_per_token']:.2f}, tools "
          f"{rep['tools']['plain']['step_ms_per_token']:.2f} vs "
          f"{rep['tools']['free']['step_ms_per_token']:.2f} (free text differs in length)")
    print(f"schema compile: p50 {rep['compile_ms']['p50']:.2f} ms, p99 "
          f"{rep['compile_ms']['p99']:.2f} ms ({rep['compile_ms']['n']} fresh compiles)")
    if rep.get("ceiling"):
        print("oracle ceilings over constrained plain's answers (tools/structured_ceiling.py): "
              "x plain end to end (median, lowest request), decode x after the first token")
        for w, rows in rep["ceiling"].items():
            print("  " + w + ": " + "; ".join(
                f"{c} {r['speedup_median']:.2f} ({r['speedup_lowest']:.2f}), decode "
                f"{r['decode_speedup_median']:.2f}" for c, r in rows.items()))
    print(f"invalid outputs (finished answers): {rep['invalid_outputs']}; cut by max_tokens "
          f"(not judged): {rep['cut_by_max_tokens']}; speculative != constrained plain: "
          f"{rep['speculative_not_equal_plain']}")
