"""Split deployment under failure (loopback only; every wait bounded): link cut and restored,
server killed and restarted, offline output taken as final, wrong keys, hostile messages, limits,
concurrent clients."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
import torch
from conftest import make_tiny_target
from test_split import KEY, PROMPT, SplitPair, make_drafter

from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.drafters.ngram import NgramDrafter
from moaspec.errors import MoaspecError
from moaspec.split import protocol as wire
from moaspec.split.adaptive import AdaptiveTree
from moaspec.split.client import LinkDown, ServerRefused, SessionLost, SplitClient
from moaspec.split.generator import SplitGenerator, SplitOptions, SplitResult
from moaspec.split.netem import NetemProxy
from moaspec.split.server import STALE_SESSION_S, ServerLimits

GREEDY = SamplingConfig()


@pytest.fixture
def pair(request):
    made = SplitPair(*request.param) if isinstance(request.param, tuple) else SplitPair(request.param)
    yield made
    made.server.stop()


def run_with_cut(generator, proxy: NetemProxy, cut_after: int, restore_after: int, mode: str, generation: GenerationConfig):
    """Generate, cutting the link once `cut_after` tokens are verified and restoring it after
    `restore_after` provisional tokens (or 0.5 s offline). -> (result, events, verified-before-cut)."""
    result, events, seen_before_cut = SplitResult(), [], None
    timer = threading.Timer(0.5, proxy.restore)  # drafters with nothing to say yield no events
    for event in generator.stream(PROMPT, GREEDY, generation, frozenset(), result):
        events.append(event)
        if seen_before_cut is None and len(result.token_ids) >= cut_after:
            seen_before_cut = list(result.token_ids)
            proxy.cut(mode)
            timer.start()
        provisional = sum(len(e.token_ids) for e in events if e.kind == "provisional")
        if proxy.cut_mode and provisional >= restore_after:
            proxy.restore()
    timer.cancel()
    return result, events, seen_before_cut


@pytest.mark.parametrize("pair", ["moa", "eagle", "ngram"], indirect=True)
@pytest.mark.parametrize("mode", ["reset", "blackhole"])
def test_link_cut_mid_generation_completes_with_verified_text_unchanged(pair: SplitPair, mode: str) -> None:
    generation = GenerationConfig(max_new_tokens=30)
    expected = pair.reference(GREEDY, generation)
    proxy = NetemProxy("127.0.0.1", pair.server.port, "lan").start()
    try:
        generator = pair.generator(f"http://127.0.0.1:{proxy.port}", timeout_s=0.3, retry_initial_s=0.02, retry_max_s=0.1)
        result, events, before_cut = run_with_cut(generator, proxy, 8, 5, mode, generation)
    finally:
        proxy.stop()
    assert result.token_ids == expected  # nothing verified was lost or changed
    assert result.token_ids[: len(before_cut)] == before_cut
    assert result.num_reconnects >= 1 and result.provisional_ids == []
    # every provisional token was resolved: confirmed or retracted
    num_provisional = sum(len(e.token_ids) for e in events if e.kind == "provisional")
    assert num_provisional == result.num_provisional
    assert result.num_confirmed + result.num_retracted == num_provisional
    if pair.method != "ngram":  # model drafters always have something to say
        assert num_provisional >= 1


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
def test_server_killed_and_restarted_mid_generation(pair: SplitPair) -> None:
    generation = GenerationConfig(max_new_tokens=30)
    expected = pair.reference(GREEDY, generation)
    generator = pair.generator(timeout_s=0.5, retry_initial_s=0.02, retry_max_s=0.2)
    port, restarted = pair.server.port, False
    result = SplitResult()
    for _ in generator.stream(PROMPT, GREEDY, generation, frozenset(), result):
        if not restarted and len(result.token_ids) >= 10:
            pair.server.stop()
            pair.server = pair.start_server(port)  # a fresh process would also have no sessions
            restarted = True
    assert restarted and result.token_ids == expected and result.num_reconnects >= 1


def cut_for_good(
    pair: SplitPair, prompt: list[int], cut_after: int, max_new_tokens: int, events: list | None = None,
    stop_ids: frozenset[int] = frozenset(), **options,
) -> tuple[SplitResult, list[int]]:
    """Generate, cutting the link for good once `cut_after` tokens are verified; the client keeps
    up to 6 tokens drafted alone as final output (SplitOptions overridden by `options`; the
    events streamed go to `events`; `stop_ids` end the generation). -> (result, verified tokens
    before the cut). The cut resets connections, so every request after it fails at once: the
    time-out only has to outlast a verify on a loaded machine (0.2 s before: the likely cause of
    a failure in 1 of ~5 full test runs, a reconnect before the cut; never reproduced alone)."""
    proxy = NetemProxy("127.0.0.1", pair.server.port, "lan").start()
    try:
        generator = pair.generator(
            f"http://127.0.0.1:{proxy.port}", timeout_s=2.0, retry_initial_s=0.02, retry_max_s=0.05,
            offline_deadline_s=0.5, accept_offline=True, max_provisional=6, **options,
        )
        result, before_cut = SplitResult(), None
        generation = GenerationConfig(max_new_tokens=max_new_tokens)
        for event in generator.stream(prompt, GREEDY, generation, stop_ids, result):
            if events is not None:
                events.append(event)
            if len(result.token_ids) >= cut_after and before_cut is None:
                before_cut = list(result.token_ids)
                proxy.cut("reset")
    finally:
        proxy.stop()
    return result, before_cut


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
def test_offline_output_can_be_taken_as_final(pair: SplitPair) -> None:
    """The tokens kept unverified come as one "kept" event (not "confirm", which means verified)."""
    events: list = []
    result, before_cut = cut_for_good(pair, PROMPT, cut_after=5, max_new_tokens=30, events=events)
    assert result.stop_reason == "offline" and result.num_provisional == 6
    assert result.token_ids[: len(before_cut)] == before_cut and len(result.token_ids) == len(before_cut) + 6
    assert [e.token_ids for e in events if e.kind == "kept"] == [result.token_ids[len(before_cut):]]
    assert result.num_confirmed == 0 and not any(e.kind == "confirm" for e in events)
    # the count `generate --server --accept-offline` reports (text mode had said nothing of it)
    assert result.num_unverified == 6


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
def test_offline_drafting_stops_below_the_minimum_probability(pair: SplitPair) -> None:
    """With offline_min_prob P, drafting alone stops before the token that would bring the product
    of the reported probabilities below P, and the drafter is not asked again (it took the root as
    context); the tokens written are the drafter's own, in order."""
    drafter = pair.client_drafter
    inner, reported = drafter.draft_alone, iter([0.9, 0.8, 0.5, 0.99, 0.99])
    drafted: list[int] = []

    def scripted(root_id, sampling, generator):
        draft = inner(root_id, sampling, generator)
        drafted.append(draft.token_id)
        return draft._replace(probability=next(reported))

    drafter.draft_alone = scripted
    result, before_cut = cut_for_good(pair, PROMPT, cut_after=5, max_new_tokens=30, offline_min_prob=0.5)
    assert len(drafted) == 3  # 0.9, 0.72 kept; 0.36 < 0.5 stops
    assert result.stop_reason == "offline" and result.num_provisional == 2
    assert result.token_ids == [*before_cut, *drafted[:2]]


def test_offline_minimum_probability_is_checked() -> None:
    with pytest.raises(MoaspecError, match="offline minimum probability"):
        SplitOptions(offline_min_prob=1.5)


# The tiny target's greedy answer to this prompt turns periodic from its 7th token
# (69 66 27 21 73 45, repeated): a context prompt lookup can continue.
LOOPING_PROMPT = [5, 17, 33, 2, 71, 5, 17, 33, 2, 71, 5, 17, 33]


@pytest.mark.parametrize("pair", ["moa+ngram", "eagle+ngram"], indirect=True)
def test_offline_drafting_follows_the_prompt_lookup(pair: SplitPair) -> None:
    """Issue 19 item 7. Bug: with the link down, `X+ngram` drafted alone from the model drafter's
    top path only, even where prompt lookup had a continuation (online it proposes that alone).
    After the cut here the verified text repeats a cycle, so the offline tokens must be exactly the
    lookup's: an n-gram drafter fed the verified text, drafting alone from the same root. The
    random drafter nets do not continue the cycle (the test fails without the fix). Not flaky:
    greedy, fixed weights, the cut taken at a token count and the offline tokens counted, not timed."""
    result, before_cut = cut_for_good(pair, LOOPING_PROMPT, cut_after=16, max_new_tokens=40)
    assert result.stop_reason == "offline" and result.num_provisional == 6
    lookup = NgramDrafter()
    lookup.accept_context(torch.tensor(LOOPING_PROMPT + before_cut[:-1]), 0, {})
    expected = [before_cut[-1]]
    for _ in range(6):
        expected.append(lookup.draft_alone(expected[-1], GREEDY, torch.Generator()).token_id)
    assert result.token_ids[len(before_cut) :] == expected[1:]


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
def test_client_started_while_the_server_is_unreachable_waits_then_generates(pair: SplitPair) -> None:
    generation = GenerationConfig(max_new_tokens=12)
    expected = pair.reference(GREEDY, generation)
    proxy = NetemProxy("127.0.0.1", pair.server.port, "lan").start()
    proxy.cut("reset")
    timer = threading.Timer(0.3, proxy.restore)
    timer.start()
    try:
        started = time.monotonic()
        generator = pair.generator(f"http://127.0.0.1:{proxy.port}", timeout_s=0.2, retry_initial_s=0.02, retry_max_s=0.1)
        assert time.monotonic() - started >= 0.25  # it waited for the link instead of failing
        assert generator.generate(PROMPT, GREEDY, generation).token_ids == expected
    finally:
        timer.cancel()
        proxy.stop()


def test_client_gives_up_on_a_server_that_never_answers() -> None:
    from moaspec.split.client import LinkDown

    client_target = make_tiny_target("llama", num_hidden_layers=3)
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(LinkDown, match="unreachable"):
        SplitGenerator(SplitClient(f"http://127.0.0.1:{port}", KEY, timeout_s=0.1), make_drafter("moa", client_target),
                       SplitOptions(retry_initial_s=0.02, retry_max_s=0.05, offline_deadline_s=0.3))
    assert time.monotonic() - started < 5.0


def test_wrong_or_missing_key_is_refused_with_a_clear_message() -> None:
    made = SplitPair("ngram")
    try:
        with pytest.raises(ServerRefused, match="invalid API key"):
            SplitClient(made.url, "wrong").info()
        conn = http.client.HTTPConnection("127.0.0.1", made.server.port, timeout=5)
        conn.request("GET", "/v1/split/info")
        response = conn.getresponse()
        assert response.status == 401 and b"missing API key" in response.read()
        assert SplitClient(made.url, KEY).info()["target"] == "tiny-llama"
    finally:
        made.server.stop()


def _raw_post(port: int, path: str, body: bytes, content_type: str = wire.MSGPACK) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {KEY}", "Content-Type": content_type})
    response = conn.getresponse()
    return response.status, response.read()


def test_hostile_messages_are_rejected_and_other_sessions_keep_working() -> None:
    limits = ServerLimits(max_body_bytes=4096, max_tree_nodes=8)
    made = SplitPair("moa", limits=limits)
    try:
        generation = GenerationConfig(max_new_tokens=16)
        expected = made.reference(GREEDY, generation)
        port = made.server.port
        stream = made.generator().stream(PROMPT, GREEDY, generation)
        tokens = next(stream).token_ids  # a session is open and mid-generation
        client = SplitClient(made.url, KEY)
        session_id = client.open(wire.OpenRequest(PROMPT))["session_id"]
        hostile = [
            ("/v1/split/sessions", b"\x00" * 8192, wire.MSGPACK, 413),  # oversized
            ("/v1/split/sessions", b"\xc1\xc1garbage", wire.MSGPACK, 400),  # not msgpack
            ("/v1/split/sessions", b"[1, 2]", wire.JSON, 400),  # not an object
            ("/v1/split/sessions", b"{}", "application/python-pickle", 400),  # no pickle, ever
            ("/v1/split/sessions", wire.dumps({"version": 1, "prompt_ids": [10**9], "request_id": "r" * 12}, wire.JSON), wire.JSON, 400),
            ("/v1/split/sessions", wire.dumps({"version": 99, "prompt_ids": [1], "request_id": "r" * 12}, wire.JSON), wire.JSON, 400),
            ("/v1/split/sessions", wire.dumps({"version": 1, "prompt_ids": [1] * 300, "request_id": "r" * 12}, wire.JSON), wire.JSON, 413),
            (f"/v1/split/sessions/{session_id}/verify", wire.dumps({"seq": 0, "token_ids": [1, 2], "parents": [-1, 5]}, wire.MSGPACK), wire.MSGPACK, 400),
            (f"/v1/split/sessions/{session_id}/verify", wire.dumps({"seq": 0, "token_ids": [1] * 9, "parents": list(range(-1, 8))}, wire.MSGPACK), wire.MSGPACK, 400),
            (f"/v1/split/sessions/{session_id}/verify", wire.dumps({"seq": 3, "token_ids": [1], "parents": [-1]}, wire.MSGPACK), wire.MSGPACK, 409),
            (f"/v1/split/sessions/{session_id}/verify", wire.dumps({"seq": 0, "token_ids": [1, 2], "parents": [-1, 0], "draft_ids": [[], [2]], "draft_probs": {"dtype": "f64", "shape": [5], "data": b"x"}}, wire.MSGPACK), wire.MSGPACK, 400),
            ("/v1/split/sessions/nonexistent/verify", wire.dumps({"seq": 0}, wire.MSGPACK), wire.MSGPACK, 404),
        ]
        for path, body, content_type, status in hostile:
            got, reply = _raw_post(port, path, body, content_type)
            assert got == status, (path, body[:40], reply)
            assert b'"message"' in reply
        tokens += [t for event in stream for t in event.token_ids]  # the first session carries on
        assert tokens == expected
    finally:
        made.server.stop()


def test_session_limits_and_idle_expiry() -> None:
    made = SplitPair("ngram", limits=ServerLimits(max_sessions_per_key=2, idle_timeout_s=0.3))
    try:
        client = SplitClient(made.url, KEY)
        request = wire.OpenRequest(PROMPT)
        first = client.open(request)
        assert client.open(request)["session_id"] == first["session_id"]  # a retried open is idempotent
        with pytest.raises(ServerRefused, match="request_id was used by another open request"):
            client.open(wire.OpenRequest([*PROMPT, 7], request_id=request.request_id))
        client.open(wire.OpenRequest(PROMPT))
        with pytest.raises(ServerRefused, match="open sessions"):
            client.open(wire.OpenRequest(PROMPT))
        deadline = time.monotonic() + 5.0
        while made.server.server.sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        request = wire.VerifyRequest(0, [first["next_token"]], [-1])
        with pytest.raises(SessionLost):
            client.verify(first["session_id"], request)
        with pytest.raises(ServerRefused, match="max_new_tokens"):
            client.open(wire.OpenRequest(PROMPT, max_new_tokens=10**6))
    finally:
        made.server.stop()


def test_a_late_duplicate_of_an_open_whose_session_ended_opens_nothing() -> None:
    """Bug: an open's id was forgotten when its session ended, so a duplicate of that open arriving
    late (a retried request held up in the network) opened an orphan session holding a slot and a
    cache until the idle time-out. Ended by DELETE or by the verify that finishes it alike; an
    open whose session expired unused may still be its client's retry and opens again."""
    made = SplitPair("ngram", limits=ServerLimits(max_sessions_per_key=1))
    try:
        client = SplitClient(made.url, KEY)
        deleted = wire.OpenRequest(PROMPT)
        client.close_session(client.open(deleted)["session_id"])
        finished = wire.OpenRequest(PROMPT, max_new_tokens=2)
        opened = client.open(finished)
        reply = client.verify(opened["session_id"], wire.VerifyRequest(0, [opened["next_token"]], [-1], remaining=1))
        assert reply["closed"]
        for late in (deleted, finished):
            with pytest.raises(ServerRefused, match="opened a session that was closed") as refused:
                client.open(late)
            assert refused.value.status == 409
        assert not made.server.server.sessions
        client.open(wire.OpenRequest(PROMPT))  # the one slot is free
    finally:
        made.server.stop()
    made = SplitPair("ngram", limits=ServerLimits(idle_timeout_s=0.3))
    try:
        client = SplitClient(made.url, KEY)
        retried = wire.OpenRequest(PROMPT)
        first = client.open(retried)["session_id"]
        deadline = time.monotonic() + 5.0
        while made.server.server.sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.open(retried)["session_id"] != first
    finally:
        made.server.stop()


def test_a_key_at_its_session_limit_gets_room_from_its_own_stale_sessions() -> None:
    """Bug: a client killed mid-generation kept its session slot until the idle time-out (300 s),
    and the key's next client got an immediate 429. Now a key at its limit ends its own sessions
    idle STALE_SESSION_S or more; a fresh one still refuses, and the first open waits it out."""
    made = SplitPair("ngram", limits=ServerLimits(max_sessions_per_key=1))
    try:
        client = SplitClient(made.url, KEY)
        dead = client.open(wire.OpenRequest(PROMPT))
        with pytest.raises(ServerRefused, match="1 open sessions") as refused:
            client.open(wire.OpenRequest(PROMPT))  # the other session was used just now
        assert refused.value.status == 429
        made.server.server.sessions[dead["session_id"]].last_used -= STALE_SESSION_S + 1
        client.open(wire.OpenRequest(PROMPT))
        with pytest.raises(SessionLost):
            client.verify(dead["session_id"], wire.VerifyRequest(0, [dead["next_token"]], [-1]))
    finally:
        made.server.stop()


def test_the_first_open_waits_out_a_busy_server() -> None:
    """A generation whose key is at its session limit retries the open (429) within the offline
    deadline, saying so once, instead of failing at once."""
    made = SplitPair("ngram", limits=ServerLimits(max_sessions_per_key=1))
    try:
        holder = SplitClient(made.url, KEY)
        held = holder.open(wire.OpenRequest(PROMPT))
        told: list[str] = []
        generator = made.generator(notify=told.append, offline_deadline_s=20.0)
        greedy, generation = SamplingConfig(), GenerationConfig(max_new_tokens=6)
        releaser = threading.Timer(0.5, holder.close_session, args=(held["session_id"],))
        releaser.start()
        result = generator.generate(PROMPT, greedy, generation)
        releaser.join()
        assert result.token_ids == made.reference(greedy, generation)
        assert len(told) == 1 and "(429)" in told[0] and "retrying" in told[0], told
    finally:
        made.server.stop()


def test_a_sessions_token_budget_counts_the_opens_token() -> None:
    """Bug: a session opened for max_new_tokens N could emit N + 2 tokens (the open's token and the
    bonus of the last tree were not counted). A root-only tree emits one token, a depth-1 tree two."""
    made = SplitPair("ngram")
    try:
        client = SplitClient(made.url, KEY)
        for max_new_tokens in (1, 3):
            opened = client.open(wire.OpenRequest(PROMPT, max_new_tokens=max_new_tokens))  # its token: 1 emitted
            root = opened["next_token"]
            for seq in range(max_new_tokens - 1):
                root = client.verify(opened["session_id"], wire.VerifyRequest(seq, [root], [-1]))["next_token"]
            with pytest.raises(ServerRefused, match=f"budget of {max_new_tokens} new tokens"):
                client.verify(opened["session_id"], wire.VerifyRequest(max_new_tokens - 1, [root], [-1]))
            client.close_session(opened["session_id"])
        opened = client.open(wire.OpenRequest(PROMPT, max_new_tokens=2))
        # an audit: this said the budget "is spent" when nothing was
        with pytest.raises(ServerRefused, match="a tree 1 deep emits up to 2 tokens; the session's budget of 2 new tokens leaves 1"):
            client.verify(opened["session_id"], wire.VerifyRequest(0, [opened["next_token"], 5], [-1, 0]))
    finally:
        made.server.stop()


def test_an_open_is_the_same_request_however_it_is_encoded() -> None:
    """Bug: a retried open was compared byte for byte, so the same JSON with other spacing or key
    order was refused as a reused request_id (409). And stop_ids: null was a 400 while root_id:
    null meant absent: both mean absent now."""
    made = SplitPair("ngram")
    try:
        message = {**wire.OpenRequest(PROMPT, max_new_tokens=8).to_wire(), "stop_ids": None}
        compact = json.dumps(message, separators=(",", ":")).encode()
        spaced = json.dumps(dict(reversed(list(message.items()))), indent=2).encode()
        first_status, first = _raw_post(made.server.port, "/v1/split/sessions", compact, wire.JSON)
        second_status, second = _raw_post(made.server.port, "/v1/split/sessions", spaced, wire.JSON)
        assert first_status == second_status == 200
        assert json.loads(first)["session_id"] == json.loads(second)["session_id"]
    finally:
        made.server.stop()


def test_a_resumed_session_draws_from_a_stream_of_its_own() -> None:
    """Bug: a session resumed after a cut seeded its verifier with the request's seed again, so at
    temperature > 0 the verifications after a reconnect replayed the draws that had decided the
    generation's first tokens (the text after a cut tied to the text before it). Now it draws
    from a stream of its own, the same for every retry of that resumption."""
    made = SplitPair("ngram")
    try:
        client = SplitClient(made.url, KEY, timeout_s=10.0)
        sampled = {"temperature": 1.0, "seed": 7, "max_new_tokens": 8}
        first = client.open(wire.OpenRequest(PROMPT, **sampled))
        context = PROMPT + [first["next_token"]]
        resumed = [
            client.open(wire.OpenRequest(context, root_id=5, context_from=len(context), **sampled)) for _ in range(2)
        ]
        sessions = made.server.server.sessions
        states = [sessions[opened["session_id"]].target_session.generator.get_state() for opened in resumed]
        assert not torch.equal(states[0], torch.Generator().manual_seed(7).get_state())
        assert torch.equal(states[0], states[1])
    finally:
        made.server.stop()


def test_draft_probabilities_must_be_distributions() -> None:
    """A node's drafter distribution summing past 1 (probability 10 for one token, say) is refused:
    the stochastic verifier's acceptance test reads it as a distribution."""
    made = SplitPair("ngram")
    try:
        client = SplitClient(made.url, KEY)
        opened = client.open(wire.OpenRequest(PROMPT, temperature=1.0, max_new_tokens=8))
        root = opened["next_token"]
        def verify(probability: float):
            request = wire.VerifyRequest(0, [root, 5], [-1, 0], [([], torch.zeros(0)), ([5], torch.tensor([probability]))])
            return client.verify(opened["session_id"], request)
        with pytest.raises(ServerRefused, match="sum to more than 1"):
            verify(10.0)
        assert verify(1.0)["seq"] == 0
    finally:
        made.server.stop()


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
def test_concurrent_clients_do_not_mix_sessions(pair: SplitPair) -> None:
    prompts = [PROMPT, [3, 1, 4, 1, 5, 9, 2, 6], [44, 45, 46, 47]]
    generation = GenerationConfig(max_new_tokens=16)
    expected = [pair.reference(GREEDY, generation, prompt) for prompt in prompts]
    outputs: list[list[int] | None] = [None] * len(prompts)
    generators = [  # a drafter per client, built here: building seeds torch's global generator
        SplitGenerator(SplitClient(pair.url, KEY), make_drafter("moa", pair.client_target)) for _ in prompts
    ]

    def run(i: int) -> None:
        outputs[i] = generators[i].generate(prompts[i], GREEDY, generation).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert outputs == expected


def test_adaptive_tree_drafts_deeper_on_a_slow_link() -> None:
    from moaspec.config import TreeConfig
    from moaspec.tree import DraftTree

    def tuned(rtt_s: float) -> TreeConfig:
        adaptive = AdaptiveTree(TreeConfig(depth=4, top_k=3, budget=8), max_tree_nodes=64)
        chain = DraftTree.chain(list(range(5)))
        for nodes, accepted in [(5, 4), (5, 3), (5, 4), (5, 2)] * 4:
            adaptive.observe(rtt_s + 0.01 + 0.002 * nodes, 0.01 + 0.002 * nodes, 0.004, chain, accepted)
        return adaptive.choose()

    assert tuned(0.2).depth > tuned(0.0).depth


def test_int8_context_round_trip_is_close() -> None:
    x = torch.randn(7, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    decoded = wire.decode_tensor(wire.loads(wire.dumps(wire.encode_tensor(x, "i8"), wire.MSGPACK), wire.MSGPACK), "x")
    assert decoded.shape == x.shape
    assert float((decoded - x).abs().max()) <= float(x.abs().amax(-1).max()) / 254 + 1e-6
    assert int(wire.encode_tensor(x, "i8")["data"].__len__()) == 7 * 64


class FlakyClient(SplitClient):
    """Cuts the first verify's connection: before the request reaches the server ("request"), or
    after the server handled it, so its reply is lost ("reply")."""

    def __init__(self, *args, lose: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lose, self.cuts, self.opens = lose, 0, 0

    def open(self, request, timeout_s=None):
        self.opens += 1
        return super().open(request, timeout_s)

    def verify(self, session_id, request):
        from moaspec.split.client import LinkDown

        if self.cuts == 0:
            self.cuts += 1
            if self.lose == "reply":
                super().verify(session_id, request)
            raise LinkDown("connection reset by peer")
        return super().verify(session_id, request)


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
@pytest.mark.parametrize("lose", ["request", "reply"])
def test_a_cut_verify_is_retried_on_the_same_session(pair: SplitPair, lose: str) -> None:
    """Regression (hardening issue): a verify cut mid-request dropped the client into offline mode,
    and the reconnect re-prefilled the whole context (14 s for a 2,048-token prompt). Now the same
    `seq` is retried at once on the same session: no reconnect, no second open, same tokens.
    Not flaky: the cut is injected by the client wrapper, not by timing."""
    generation = GenerationConfig(max_new_tokens=20)
    expected = pair.reference(GREEDY, generation)
    client = FlakyClient(pair.url, KEY, timeout_s=10.0, lose=lose)
    generator = SplitGenerator(client, pair.client_drafter, SplitOptions())
    result = SplitResult()
    for _ in generator.stream(PROMPT, GREEDY, generation, frozenset(), result):
        pass
    assert client.cuts == 1 and client.opens == 1
    assert result.num_reconnects == 0 and result.num_provisional == 0
    assert result.token_ids == expected


class ScriptedFailures(SplitClient):
    """Fails requests as `fail(kind, count, request)` says (kind: "open", "resync" or "verify";
    count: how many of that kind came before), by raising what it returns; refuses to send a verify
    to no session at all (the bug these tests guard against looped on it)."""

    def __init__(self, *args, fail, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail, self.counts, self.deleted = fail, {"open": 0, "resync": 0, "verify": 0}, []

    def _maybe_fail(self, kind: str, request) -> None:
        error = self.fail(kind, self.counts[kind], request)
        self.counts[kind] += 1
        if error is not None:
            raise error

    def open(self, request, timeout_s=None):
        self._maybe_fail("resync" if request.root_id is not None else "open", request)
        return super().open(request, timeout_s)

    def verify(self, session_id, request):
        if session_id is None:
            raise AssertionError("a verify sent to no session")
        self._maybe_fail("verify", request)
        return super().verify(session_id, request)

    def end_session(self, session_id, timeout_s=None):
        self.deleted.append(session_id)
        return super().end_session(session_id, timeout_s)


def run_scripted(pair: SplitPair, fail, max_new_tokens: int = 24, **options) -> tuple[SplitResult, ScriptedFailures, list[int]]:
    generation = GenerationConfig(max_new_tokens=max_new_tokens)
    expected = pair.reference(GREEDY, generation)
    client = ScriptedFailures(pair.url, KEY, timeout_s=5.0, fail=fail)
    options = {"retry_initial_s": 0.01, "retry_max_s": 0.02, **options}
    result = SplitResult()
    for _ in SplitGenerator(client, pair.client_drafter, SplitOptions(**options)).stream(PROMPT, GREEDY, generation, frozenset(), result):
        pass
    return result, client, expected


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
def test_a_link_that_fails_again_right_after_reconnecting_goes_back_offline(pair: SplitPair) -> None:
    """Bug: when the first verify after a reconnect failed, the client kept verifying its
    provisional tokens on a session it had just dropped (`/sessions/None/verify`), hundreds of
    thousands of times, ignoring the deadline. Now it goes back offline, reconnects and finishes
    with the target's own tokens. Deterministic: failures injected by count, not by timing."""
    resyncs = []

    def fail(kind, count, request):
        # verify 3 and its immediate retry: the link is down; 5 and 6, the first verify of the
        # provisional tokens after the reconnect and its retry: down again
        if kind == "resync":
            resyncs.append(request)
        return LinkDown("connection reset by peer") if kind == "verify" and count in (3, 4, 5, 6) else None

    # 50 ms before the first reconnect attempt: the drafter writes provisional tokens meanwhile
    result, client, expected = run_scripted(pair, fail, retry_initial_s=0.05, retry_max_s=0.1)
    assert result.token_ids == expected and result.num_reconnects == 2 and result.num_provisional > 0
    assert client.counts["resync"] == 2
    # each resume names the prompt's length: the server appends the answer as it was verified
    assert [request.prompt_len for request in resyncs] == [len(PROMPT)] * 2
    assert all(len(request.prompt_ids) > len(PROMPT) for request in resyncs)


@pytest.mark.parametrize("pair", [("ngram", None, ServerLimits(max_tree_nodes=3))], indirect=True)
def test_provisional_tokens_confirmed_by_the_targets_own_token_are_not_verified_again(pair: SplitPair, monkeypatch) -> None:
    """Provisional tokens are verified a few at a time (here two: trees of 3 nodes); when the
    target's own next token is the next provisional one, that one is confirmed too and leaves the
    list. Kept in it, it was drafted under itself and retracted with everything after it (the text
    stayed right; the events and counts did not). Offline tokens all right here: none retracted."""
    from moaspec.drafters.base import AloneDraft

    drafter = pair.client_drafter
    expected = pair.reference(GREEDY, GenerationConfig(max_new_tokens=24))

    def draft_alone(root_id, sampling, generator):  # the target's own next token, as a perfect drafter would
        at = len(drafter.history) - len(PROMPT)  # the root's index in the answer
        drafter.accept_context(torch.tensor([root_id]), len(drafter.history), {})
        return AloneDraft(expected[at + 1], 0.99, "lookup") if at + 1 < len(expected) else None

    monkeypatch.setattr(drafter, "draft_alone", draft_alone)

    def fail(kind, count, request):
        return LinkDown("connection reset by peer") if kind == "verify" and count in (1, 2) else None

    result, client, expected = run_scripted(pair, fail, retry_initial_s=0.05, retry_max_s=0.1, max_provisional=7)
    assert result.token_ids == expected and result.num_reconnects == 1 and result.num_provisional >= 3
    assert result.num_retracted == 0 and result.num_confirmed == result.num_provisional


@pytest.mark.parametrize("pair", [("moa", None, ServerLimits(max_sessions_per_key=1))], indirect=True)
def test_a_reconnect_closes_the_session_the_cut_left_open(pair: SplitPair) -> None:
    """Bug: a verify that timed out left its session open on the server, holding one of the key's
    sessions; with one session per key the reconnect was refused (429) and the generation lost.
    Now the client closes that session first. Deterministic: verify 2 and its retry fail, the
    session left as it was; the deadline is short, so the bug fails fast."""
    def fail(kind, count, request):
        return LinkDown("timed out") if kind == "verify" and count in (2, 3) else None

    result, client, expected = run_scripted(pair, fail, offline_deadline_s=2.0)
    assert result.token_ids == expected and result.num_reconnects == 1
    assert len(client.deleted) == 1 and client.counts["resync"] == 1
    assert pair.server.server.sessions == {}


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
def test_a_busy_server_is_retried_while_reconnecting(pair: SplitPair) -> None:
    """A 429 (the key's sessions or tokens in use) answering a reconnect is worth waiting out; it
    used to end the generation with an error."""
    def fail(kind, count, request):
        if kind == "verify" and count in (2, 3):
            return LinkDown("connection reset by peer")
        if kind == "resync" and count < 2:
            return ServerRefused("server refused the request (429): this key already has 1 open sessions", 429)
        return None

    result, client, expected = run_scripted(pair, fail)
    assert result.token_ids == expected and client.counts["resync"] == 3


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
def test_a_request_refused_mid_generation_keeps_the_verified_text(pair: SplitPair) -> None:
    """A 4xx mid-generation used to raise out of the stream, losing what was verified (the CLI's
    --json printed nothing). Now the generation stops with stop_reason "refused" and the reason."""
    def fail(kind, count, request):
        if kind == "verify" and count == 3:
            return ServerRefused("server refused the request (400): the tree is malformed", 400)
        return None

    result, _, expected = run_scripted(pair, fail)
    assert result.stop_reason == "refused" and "malformed" in result.refusal
    assert 0 < len(result.token_ids) < len(expected) and result.token_ids == expected[: len(result.token_ids)]


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
def test_the_offline_deadline_bounds_every_reconnect_attempt(pair: SplitPair) -> None:
    """Bug: each reconnect attempt waited the whole request time-out, so giving up came up to one
    time-out after the deadline (26 s instead of 13 with --timeout 10 --offline-deadline-s 3).
    The user is told once that the link dropped. Not flaky: a 2 s time-out against a 0.4 s
    deadline, the attempts black-holed by a proxy."""
    notices: list[str] = []
    proxy = NetemProxy("127.0.0.1", pair.server.port, "lan").start()
    try:
        generator = pair.generator(
            f"http://127.0.0.1:{proxy.port}", timeout_s=2.0, retry_initial_s=0.02, retry_max_s=0.05,
            offline_deadline_s=0.4, max_provisional=0, notify=notices.append,
        )
        result = SplitResult()
        for _ in generator.stream(PROMPT, GREEDY, GenerationConfig(max_new_tokens=30), frozenset(), result):
            if len(result.token_ids) >= 5 and not proxy.cut_mode:
                proxy.cut("blackhole")
    finally:
        proxy.stop()
    assert result.stop_reason == "disconnected"
    assert 0.4 <= result.offline_s < 1.5  # before: 2.4 s or more
    assert len(notices) == 1 and "drafting alone" in notices[0]


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
def test_offline_drafting_stops_at_a_stop_token(pair: SplitPair) -> None:
    """Drafting alone ends with a stop token: nothing is drafted after it (the generation would
    end there), and with accept_offline the kept text ends with it."""
    expected = pair.reference(GREEDY, GenerationConfig(max_new_tokens=30))
    stop = next(token for token in range(pair.client_target.vocab_size) if token not in expected)
    drafter = pair.client_drafter
    inner, drafted = drafter.draft_alone, []

    def scripted(root_id, sampling, generator):
        draft = inner(root_id, sampling, generator)
        # the second token drafted alone is a stop token
        draft = draft._replace(token_id=stop if drafted else draft.token_id, probability=1.0)
        drafted.append(draft.token_id)
        return draft

    drafter.draft_alone = scripted
    result, before_cut = cut_for_good(pair, PROMPT, cut_after=5, max_new_tokens=30, stop_ids=frozenset({stop}))
    assert drafted == [drafted[0], stop] and result.num_provisional == 2
    assert result.stop_reason == "offline" and result.token_ids == [*before_cut, *drafted]
    assert result.num_unverified == 2


def test_a_session_the_server_refuses_to_close_counts_as_closed() -> None:
    """SplitClient.end_session: a DELETE the server refuses (4xx: here a key it does not know) is
    as good as closed, as a session it no longer has; only an unreachable server raises."""
    made = SplitPair("ngram")
    try:
        SplitClient(made.url, "wrong").end_session("no-such-session")
        SplitClient(made.url, KEY).end_session("no-such-session")
    finally:
        made.server.stop()
    with pytest.raises(LinkDown):
        SplitClient(made.url, KEY, timeout_s=1.0).end_session("no-such-session")


def test_a_requests_own_time_out_does_not_stay_on_the_connection() -> None:
    """A request given its own time-out (a reconnect within the offline deadline) sets it on the
    kept-alive socket for that request only: the next request has the client's time-out again."""
    made = SplitPair("ngram")
    try:
        client = SplitClient(made.url, KEY, timeout_s=10.0)
        client.request("GET", "/v1/split/info", timeout_s=0.5)
        assert client._conn.sock.gettimeout() == 0.5
        client.info()  # the same connection (keep-alive)
        assert client._conn.sock.gettimeout() == 10.0
    finally:
        made.server.stop()
