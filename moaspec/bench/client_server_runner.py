"""Client-server benchmark (`moaspec bench --client-server`): the split deployment against
server-side generation, over emulated networks on loopback.

Cases, per network profile (moaspec/split/netem.py), for every drafter method D and the plain baseline:
- D `split`: the client drafts with D and calls the server once per verification
  (moaspec/split/generator.py): issue 6 (a) MoA, (b) EAGLE-2, and n-gram;
- `none` `server`: the server decodes plainly and streams every token to the client (OpenAI SSE,
  `/v1/completions` with `stream: true`; a server whose drafter is `none`): issue 6 (c);
- D `server`: the server decodes speculatively with D and streams the same way: issue 6 (d).
Every method has its own `SplitServer` (split and OpenAI routes on one app) on a loopback port
behind its own `NetemProxy`; all servers and client drafters share the weights of one loaded
target (each holds its own caches); the measured clients and the servers are in client_server_cases.py.

Protocol (as the single-device runner, moaspec/bench/runner.py): per profile, one warm-up
generation per case (WARMUP_TOKENS, not recorded), then for the i-th generation the cases in their
order rotated by i, all with seed + i. A prompt's later user turns (MT-bench's second) follow it,
each asked after the plain stream's answer, so every case sees the same conversation. Metrics
per (profile, case), pooled over the generations:
- tokens_per_s: new tokens / wall, wall = request sent -> last token received by the client;
- speedup: tokens_per_s / that of `none` `server` on the same profile;
- tau: tokens per target forward (moaspec/metrics.py), from the client's stats (split) or from the
  server's `moaspec` extension of the final SSE chunk (server);
- server_calls_per_100_tokens: HTTP requests per 100 new tokens (split: open and verifications,
  the last of which closes the session; server: one per generation);
- bytes_per_token: bytes through the proxy in both directions (HTTP headers and SSE framing
  included) per new token;
- time_to_first_token_s: mean of request sent -> first token (first non-empty text chunk) received.
Greedy runs compare each case's text with the plain stream's for every prompt; a difference is a
bug in a lossless path and is listed as a mismatch.

`run_disconnection` cuts the link (`lan` profile) once N tokens are verified, lets the client's
drafter continue alone (provisional tokens) for up to M tokens, and counts how many of them agree,
from the first, with the target's own greedy continuation of the verified text (and how often the
first one does). Where a prompt has reference answers (QA), it also scores the answer a user
would keep if they took the offline output as final (verified + offline text) against them with
token F1 (task_score.py), next to the target's own answer of the same length.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

from moaspec.bench.client_server_cases import (
    CLIENT_TIMEOUT_S,
    SERVER,
    Case,
    CaseRun,
    DrafterFactory,
    LoopbackServers,
    target_view,
)
from moaspec.bench.runner import BASELINE, WARMUP_TOKENS, first_divergence
from moaspec.bench.task_score import token_f1
from moaspec.chat import encode_chat_messages
from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.drafters.none import NoDrafter
from moaspec.engine import Engine
from moaspec.serving.limits import ServerLimits
from moaspec.split.client import SplitClient
from moaspec.split.generator import SplitGenerator, SplitOptions, SplitResult
from moaspec.targets.base import Target

DISCONNECTION_PROFILE = "lan"
# The experiment's servers: a session orphaned by a cut expires after DISCONNECTION_IDLE_S, and
# up to DISCONNECTION_SESSIONS may wait for that (the default 8 per key would run out).
DISCONNECTION_IDLE_S, DISCONNECTION_SESSIONS = 10.0, 1024
OFFLINE_BASE_S, OFFLINE_PER_TOKEN_S = 2.0, 0.25  # how long the client drafts alone, at most


TURN_SEPARATOR = " turn "  # a later turn's name: "category/prompt_id turn 2"


@dataclass(frozen=True)
class NamedPrompt:
    name: str  # "category/prompt_id" (+ TURN_SEPARATOR + the turn's number from the second on)
    prompt_ids: tuple[int, ...]  # [T]
    references: tuple[str, ...] = ()  # reference answers, where the set has them (task scores)
    messages: tuple[dict[str, str], ...] = ()  # the chat prompt_ids encodes (a later turn extends it)
    follow_ups: tuple[str, ...] = ()  # later user turns, each asked after the plain stream's answer


@dataclass(frozen=True)
class CaseRecord:
    profile: str
    prompt: str
    method: str
    mode: str  # SPLIT or SERVER
    run: CaseRun


@dataclass(frozen=True)
class CaseMismatch:
    profile: str
    prompt: str
    method: str
    mode: str
    first_divergence: int  # index of the first differing character of the text


@dataclass
class ClientServerData:
    records: list[CaseRecord] = field(default_factory=list)
    mismatches: list[CaseMismatch] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # later turns that did not fit the context


@dataclass(frozen=True)
class ClientServerRow:
    profile: str
    method: str
    mode: str
    num_generations: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    speedup: float
    tau: float
    server_calls_per_100_tokens: float
    bytes_per_token: float
    time_to_first_token_s: float


@dataclass(frozen=True)
class DisconnectionRow:
    drafter: str
    cut_after: int  # the link is cut once this many tokens are verified (a step may pass it)
    offline_tokens: int  # M: the most tokens the drafter may produce alone
    num_generations: int
    num_offline: int  # tokens the drafter produced alone (fewer than M when it ran out of ideas)
    num_agreeing: int  # leading offline tokens equal to the target's own continuation
    agreement: float | None  # num_agreeing / num_offline (None: nothing was drafted alone)
    first_token_agreement: float  # share of generations whose first offline token is the target's
    num_scored: int  # generations whose prompt has reference answers
    task_f1: float | None  # mean token F1 of verified + offline text (None when num_scored is 0)
    target_task_f1: float | None  # the same for the target's own answer of that length


# -- the benchmark --------------------------------------------------------------------------------
def run_client_server(
    target: Target,
    drafters: dict[str, DrafterFactory],
    prompts: list[NamedPrompt],
    profiles: tuple[str, ...],
    sampling: SamplingConfig,
    max_new_tokens: int = 64,
    seed: int = 0,
    progress: bool = False,
    adaptive: bool = False,
) -> ClientServerData:
    """The protocol of the module docstring. drafters: method label -> factory (`none` is added);
    adaptive: split clients size their trees from measured costs (SplitOptions.adaptive)."""
    data = ClientServerData()
    limits = ServerLimits(max_new_tokens=max(max_new_tokens, ServerLimits().max_new_tokens)).within_runtime(target)
    total = len(profiles) * sum(1 + len(prompt.follow_ups) for prompt in prompts) * (1 + 2 * len(drafters))
    bar = _progress_bar(total, "moaspec bench --client-server", progress)
    try:
        with LoopbackServers(target, drafters, limits) as servers:
            for profile in profiles:
                cases = servers.cases(profile, SplitOptions(adaptive=adaptive))
                try:
                    _run_profile(target, profile, cases, prompts, sampling, max_new_tokens, seed, data, bar)
                finally:
                    for case in cases:
                        case.close()
    finally:
        bar.close()
    return data


def _run_profile(
    target: Target,
    profile: str,
    cases: list[Case],
    prompts: list[NamedPrompt],
    sampling: SamplingConfig,
    max_new_tokens: int,
    seed: int,
    data: ClientServerData,
    bar,
) -> None:
    if prompts:
        for case in cases:  # warm-up: connections, allocator, first-call costs
            case.run(prompts[0].prompt_ids, sampling, min(WARMUP_TOKENS, max_new_tokens), seed)
    index = 0
    for first in prompts:
        prompt: NamedPrompt | None = first
        while prompt is not None:
            runs = _run_cases(profile, cases, prompt, sampling, max_new_tokens, seed, index, data, bar)
            index += 1
            prompt = _next_turn(target, prompt, runs[(BASELINE, SERVER)].text, profile, data, bar, len(cases))


def _run_cases(
    profile: str,
    cases: list[Case],
    prompt: NamedPrompt,
    sampling: SamplingConfig,
    max_new_tokens: int,
    seed: int,
    index: int,
    data: ClientServerData,
    bar,
) -> dict[tuple[str, str], CaseRun]:
    """The index-th generation: every case once, in their order rotated by index, seed + index."""
    shift = index % len(cases)
    runs: dict[tuple[str, str], CaseRun] = {}
    for case in cases[shift:] + cases[:shift]:
        run = case.run(prompt.prompt_ids, sampling, max_new_tokens, seed + index)
        runs[(case.method, case.mode)] = run
        data.records.append(CaseRecord(profile, prompt.name, case.method, case.mode, run))
        bar.update(1)
    if sampling.greedy:
        for mismatch in text_mismatches(profile, prompt.name, runs):
            data.mismatches.append(mismatch)
            bar.write(
                f"moaspec: MISMATCH (a lossless path changed the greedy output, this is a bug): {mismatch.method} "
                f"{mismatch.mode} differs from {BASELINE} {SERVER} on {profile} {prompt.name} at character "
                f"{mismatch.first_divergence}",
                file=sys.stderr,
            )
    return runs


def _next_turn(
    target: Target, prompt: NamedPrompt, answer: str, profile: str, data: ClientServerData, bar, num_cases: int
) -> NamedPrompt | None:
    """The prompt's next user turn after `answer`, or None when it has none or the conversation no
    longer fits the target's context (then its remaining turns are skipped, with a warning)."""
    if not prompt.follow_ups:
        return None
    conversation, _, turn = prompt.name.partition(TURN_SEPARATOR)
    messages = (*prompt.messages, {"role": "assistant", "content": answer}, {"role": "user", "content": prompt.follow_ups[0]})
    name = f"{conversation}{TURN_SEPARATOR}{int(turn or 1) + 1}"
    prompt_ids = encode_chat_messages(target.tokenizer, list(messages))
    if len(prompt_ids) >= target.max_positions - 1:
        data.skipped.append(f"{profile} {name}")
        bar.write(
            f"moaspec: warning: skipping {name} on {profile}: {len(prompt_ids)} prompt tokens do not fit the context",
            file=sys.stderr,
        )
        bar.update(num_cases * len(prompt.follow_ups))
        return None
    return NamedPrompt(name, tuple(prompt_ids), prompt.references, messages, prompt.follow_ups[1:])


def text_mismatches(profile: str, prompt: str, runs: dict[tuple[str, str], CaseRun]) -> list[CaseMismatch]:
    """Every case whose text differs from the plain stream's. runs: (method, mode) -> run."""
    expected = runs[(BASELINE, SERVER)].text
    return [
        CaseMismatch(profile, prompt, method, mode, first_divergence(expected, run.text))
        for (method, mode), run in runs.items()
        if run.text != expected
    ]


def summarize(data: ClientServerData) -> list[ClientServerRow]:
    """One row per (profile, method, mode), in the order they first ran; see the module docstring."""
    groups: dict[tuple[str, str, str], list[CaseRun]] = {}
    for record in data.records:
        groups.setdefault((record.profile, record.method, record.mode), []).append(record.run)
    rows = [_row(*key, runs) for key, runs in groups.items()]
    base = {row.profile: row.tokens_per_s for row in rows if (row.method, row.mode) == (BASELINE, SERVER)}
    return [
        replace(row, speedup=round(row.tokens_per_s / base[row.profile], 4) if base.get(row.profile) else 0.0)
        for row in rows
    ]


def _row(profile: str, method: str, mode: str, runs: list[CaseRun]) -> ClientServerRow:
    tokens = sum(run.new_tokens for run in runs)
    wall = sum(run.wall_s for run in runs)
    forwards = sum(run.target_forwards for run in runs)
    per_token = 1.0 / max(tokens, 1)
    return ClientServerRow(
        profile=profile,
        method=method,
        mode=mode,
        num_generations=len(runs),
        new_tokens=tokens,
        wall_s=round(wall, 4),
        tokens_per_s=round(tokens / wall, 3) if wall > 0 else 0.0,
        speedup=0.0,
        tau=round(sum(run.forward_tokens for run in runs) / forwards, 4) if forwards else 0.0,
        server_calls_per_100_tokens=round(100.0 * sum(run.num_calls for run in runs) * per_token, 2),
        bytes_per_token=round(sum(run.num_bytes for run in runs) * per_token, 1),
        time_to_first_token_s=round(sum(run.first_token_s for run in runs) / len(runs), 4),
    )


# -- disconnection ------------------------------------------------------------------------------------
def run_disconnection(
    target: Target,
    drafters: dict[str, DrafterFactory],
    prompts: list[NamedPrompt],
    cut_after: int = 16,
    offline_tokens: int = 16,
    offline_min_prob: float = 0.0,
    progress: bool = False,
) -> list[DisconnectionRow]:
    """Greedy; one row per drafter method, pooled over the prompts (module docstring);
    offline_min_prob: SplitOptions.offline_min_prob of the clients."""
    limits = ServerLimits(
        max_new_tokens=max(ServerLimits().max_new_tokens, _disconnection_budget(cut_after, offline_tokens)),
        max_sessions_per_key=DISCONNECTION_SESSIONS,
        max_sessions=DISCONNECTION_SESSIONS,
        idle_timeout_s=DISCONNECTION_IDLE_S,
    ).within_runtime(target)
    reference = Engine(target_view(target), NoDrafter())
    rows = []
    bar = _progress_bar(len(drafters) * len(prompts), "moaspec bench: disconnection", progress)
    with bar, LoopbackServers(target, drafters, limits) as servers:
        for method in drafters:
            num_offline = num_agreeing = num_first = 0
            scores: list[tuple[float, float]] = []  # (offline answer, target's answer) per scored prompt
            for prompt in prompts:
                verified, offline = _offline_continuation(
                    servers, method, prompt.prompt_ids, cut_after, offline_tokens, offline_min_prob
                )
                own = GenerationConfig(max_new_tokens=max(len(offline), 1))
                expected = reference.generate([*prompt.prompt_ids, *verified], generation=own).token_ids
                num_offline += len(offline)
                num_agreeing += first_divergence(expected, offline)
                num_first += bool(offline) and offline[0] == expected[0]
                if prompt.references and target.tokenizer is not None:
                    answers = ([*verified, *offline], [*verified, *expected])
                    scores.append(tuple(_answer_f1(target, ids, prompt.references) for ids in answers))
                bar.update(1)
            rows.append(
                DisconnectionRow(
                    method, cut_after, offline_tokens, len(prompts), num_offline, num_agreeing,
                    agreement=round(num_agreeing / num_offline, 4) if num_offline else None,
                    first_token_agreement=round(num_first / len(prompts), 4) if prompts else 0.0,
                    num_scored=len(scores),
                    task_f1=_mean([offline for offline, _ in scores]),
                    target_task_f1=_mean([own for _, own in scores]),
                )
            )
    return rows


def _progress_bar(total: int, desc: str, progress: bool):
    """A tqdm bar over generations on stderr (a silent one when not `progress`)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="gen", file=sys.stderr, disable=not progress, dynamic_ncols=True)


def _answer_f1(target: Target, token_ids: list[int], references: tuple[str, ...]) -> float:
    return token_f1(target.tokenizer.decode(token_ids, skip_special_tokens=True), references)


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _offline_continuation(
    servers: LoopbackServers,
    method: str,
    prompt_ids: tuple[int, ...],
    cut_after: int,
    offline_tokens: int,
    offline_min_prob: float,
) -> tuple[list[int], list[int]]:
    """Generate until `cut_after` tokens are verified, cut the link for good, collect what the
    drafter produces alone. -> (verified token ids at the cut, provisional token ids)."""
    proxy = servers.proxy(method, DISCONNECTION_PROFILE)
    client = SplitClient(f"http://127.0.0.1:{proxy.port}", servers.key, timeout_s=CLIENT_TIMEOUT_S)
    options = SplitOptions(
        max_provisional=offline_tokens,
        offline_min_prob=offline_min_prob,
        offline_deadline_s=OFFLINE_BASE_S + OFFLINE_PER_TOKEN_S * offline_tokens,
        retry_initial_s=0.05,
        retry_max_s=0.2,
    )
    generation = GenerationConfig(max_new_tokens=_disconnection_budget(cut_after, offline_tokens))
    result, verified, offline = SplitResult(), None, []
    events = SplitGenerator(client, servers.client_drafters[method], options).stream(
        list(prompt_ids), SamplingConfig(), generation, servers.target.stop_ids, result
    )
    try:
        for event in events:
            if event.kind == "provisional" and verified is not None:
                offline += event.token_ids
                if len(offline) >= offline_tokens:
                    break
            elif verified is None and len(result.token_ids) >= cut_after:
                verified = list(result.token_ids)
                proxy.cut("reset")
    finally:
        events.close()
        client.drop_connection()
        proxy.stop()
    return (list(result.token_ids) if verified is None else verified), offline


def _disconnection_budget(cut_after: int, offline_tokens: int) -> int:
    """max_new_tokens of a disconnection generation: the step that crosses cut_after (at most a
    tree's depth more) and the offline tokens must fit."""
    return cut_after + ServerLimits().max_tree_nodes + offline_tokens
