"""Split server refusals, limits and clean-up at their boundaries (docs/protocol.md): the paths
the mutation audit of session 23 found untested (an older seq verified again, a wrong root, a
tree overflowing the context, another key's session, a failed prefill's reservation, stale
sessions by recency, kept replies expiring, the server-wide session cap), and those of the next
audit (context_from, --max-new-tokens, the cap on kept replies, a failed verify's session, a
session over the server's whole budget, stale sessions on a full server, ended opens), and an
open's prefill cut by the shutdown time-out."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import make_tiny_target
from test_split import KEY, PROMPT, SplitPair, make_drafter

from moaspec.split import protocol as wire
from moaspec.split.client import LinkDown, ServerRefused, SessionLost, SplitClient
from moaspec.split.server import STALE_SESSION_S, ServerLimits, ServerThread, SplitServer


def two_key_server(limits: ServerLimits) -> tuple[ServerThread, tuple[SplitClient, SplitClient]]:
    """A split server (n-gram) accepting two API keys, and a client for each."""
    target = make_tiny_target("llama", num_hidden_layers=3)
    started = ServerThread(SplitServer(target, make_drafter("ngram", target), [KEY, "other-key"], limits)).start()
    url = f"http://127.0.0.1:{started.port}"
    return started, (SplitClient(url, KEY), SplitClient(url, "other-key"))


@pytest.fixture
def pair():
    made = SplitPair("ngram")
    yield made
    made.server.stop()


def test_a_stale_seq_is_out_of_order(pair: SplitPair) -> None:
    """docs/protocol.md: a repeated seq (the last one) is replayed, any other gap is a 409, an
    older seq included: it must not be verified again."""
    client = SplitClient(pair.url, KEY)
    opened = client.open(wire.OpenRequest(PROMPT, max_new_tokens=16))
    session_id, root = opened["session_id"], opened["next_token"]
    for seq in range(2):
        root = client.verify(session_id, wire.VerifyRequest(seq, [root], [-1]))["next_token"]
    with pytest.raises(ServerRefused, match=r"\(409\).*expected request seq 2, got 0"):
        client.verify(session_id, wire.VerifyRequest(0, [root], [-1]))
    assert pair.server.server.sessions[session_id].next_seq == 2


def test_a_tree_whose_root_is_not_the_last_token_is_refused(pair: SplitPair) -> None:
    """docs/protocol.md: node 0 must equal the session's last next_token, else 409 wrong_root."""
    client = SplitClient(pair.url, KEY)
    opened = client.open(wire.OpenRequest(PROMPT, max_new_tokens=16))
    wrong = (opened["next_token"] + 1) % pair.server.server.target.vocab_size
    with pytest.raises(ServerRefused, match=r"\(409\).*root is not the last token"):
        client.verify(opened["session_id"], wire.VerifyRequest(0, [wrong], [-1]))
    assert client.verify(opened["session_id"], wire.VerifyRequest(0, [opened["next_token"]], [-1]))["seq"] == 0


def test_a_tree_that_would_overflow_the_context_is_refused(pair: SplitPair) -> None:
    """The target's context holds max_positions: a prompt of max_positions - 1 tokens leaves room
    for a root-only tree, not for a depth-1 one (400 context_full, not a model failure)."""
    client = SplitClient(pair.url, KEY)
    room = pair.server.server.target.max_positions
    opened = client.open(wire.OpenRequest([5] * (room - 1), max_new_tokens=16))
    session_id, root = opened["session_id"], opened["next_token"]
    with pytest.raises(ServerRefused, match=r"\(400\).*does not fit in the target's context"):
        client.verify(session_id, wire.VerifyRequest(0, [root, 5], [-1, 0]))
    assert client.verify(session_id, wire.VerifyRequest(0, [root], [-1]))["path_node_idx"] == [0]


def test_a_prompt_that_fills_the_context_is_413_context_length_exceeded(pair: SplitPair) -> None:
    """As the OpenAI routes answer it: a prompt of max_positions tokens (no room for the answer's
    first token) is a 413 context_length_exceeded, not a generic 400."""
    client = SplitClient(pair.url, KEY)
    room = pair.server.server.target.max_positions
    with pytest.raises(ServerRefused, match=r"\(413\).*at most") as refused:
        client.open(wire.OpenRequest([5] * room, max_new_tokens=4))
    assert refused.value.status == 413
    client.open(wire.OpenRequest([5] * (room - 1), max_new_tokens=4))


def test_a_session_is_only_visible_to_the_key_that_opened_it() -> None:
    """docs/protocol.md: another key's verify or DELETE of a session (open or closed by its last
    verify, whose reply is kept) is a 404, exactly as a missing session, and changes nothing."""
    started, (owner, other) = two_key_server(ServerLimits())
    try:
        opened = owner.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
        session_id, root = opened["session_id"], opened["next_token"]
        with pytest.raises(SessionLost, match="no such session"):
            other.verify(session_id, wire.VerifyRequest(0, [root], [-1]))
        with pytest.raises(SessionLost, match="no such session"):
            other.request("DELETE", f"/v1/split/sessions/{session_id}")
        last = owner.verify(session_id, wire.VerifyRequest(0, [root], [-1], remaining=1))
        assert last["closed"] is True
        with pytest.raises(SessionLost, match="no such session"):  # the kept last reply is the owner's only
            other.verify(session_id, wire.VerifyRequest(0, [root], [-1], remaining=1))
        with pytest.raises(SessionLost, match="no such session"):
            other.request("DELETE", f"/v1/split/sessions/{session_id}")
        assert owner.verify(session_id, wire.VerifyRequest(0, [root], [-1], remaining=1)) == last
    finally:
        started.stop()


def test_an_open_whose_prefill_fails_gives_its_reservation_back(monkeypatch) -> None:
    """budget.py: the reservation is released when the session's open fails, so a model failure
    on a prefill (500) does not hold one of the key's sessions and its tokens."""
    made = SplitPair("ngram", limits=ServerLimits(max_sessions_per_key=1))
    try:
        server = made.server.server
        encode = server.encoder.encode

        def fail_once(update):
            monkeypatch.setattr(server.encoder, "encode", encode)
            raise RuntimeError("out of memory")

        monkeypatch.setattr(server.encoder, "encode", fail_once)
        client = SplitClient(made.url, KEY)
        with pytest.raises(LinkDown, match="500"):
            client.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
        assert server.budget.num_sessions == 0 and server.budget.num_tokens == 0
        client.open(wire.OpenRequest(PROMPT, max_new_tokens=8))  # the key's one slot is free
    finally:
        made.server.stop()


def test_stale_sessions_make_room_least_recently_used_first() -> None:
    """docs/protocol.md: a key at its session limit gets room from its own sessions idle 10 s or
    more, least recently used first: one is ended, the other, used later, keeps working."""
    made = SplitPair("ngram", limits=ServerLimits(max_sessions_per_key=2))
    try:
        client = SplitClient(made.url, KEY)
        older, newer = (client.open(wire.OpenRequest(PROMPT, max_new_tokens=8)) for _ in range(2))
        sessions = made.server.server.sessions
        sessions[older["session_id"]].last_used -= STALE_SESSION_S + 20
        sessions[newer["session_id"]].last_used -= STALE_SESSION_S + 10
        client.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
        with pytest.raises(SessionLost):
            client.verify(older["session_id"], wire.VerifyRequest(0, [older["next_token"]], [-1]))
        assert client.verify(newer["session_id"], wire.VerifyRequest(0, [newer["next_token"]], [-1]))["seq"] == 0
    finally:
        made.server.stop()


def test_a_closed_sessions_last_reply_is_kept_until_the_idle_time_out() -> None:
    """docs/protocol.md: the last reply of a session its verify closed is kept until the idle
    time-out, then a retry of it is a 404 like any unknown session."""
    made = SplitPair("ngram", limits=ServerLimits(idle_timeout_s=0.3))
    try:
        client = SplitClient(made.url, KEY)
        opened = client.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
        last = wire.VerifyRequest(0, [opened["next_token"]], [-1], remaining=1)
        assert client.verify(opened["session_id"], last)["closed"] is True
        deadline = time.monotonic() + 5.0
        while made.server.server.finished and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(SessionLost):
            client.verify(opened["session_id"], last)
    finally:
        made.server.stop()


def test_the_servers_session_slots_are_capped_with_503() -> None:
    """docs/protocol.md: --max-sessions bounds the server's sessions (all keys): one more is a 503
    busy (another key holds the room), and a closed session gives its slot back."""
    started, (first, second) = two_key_server(ServerLimits(max_sessions=2, max_sessions_per_key=2))
    try:
        held = [first.open(wire.OpenRequest(PROMPT, max_new_tokens=8)) for _ in range(2)]
        with pytest.raises(LinkDown, match=r"503.*no free session slot"):
            second.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
        first.close_session(held[0]["session_id"])
        second.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
    finally:
        started.stop()


def test_the_shutdown_time_out_stops_an_open_mid_prefill() -> None:
    """Bug: a split open cut by the server's shutdown time-out left its prefill running on the
    model thread to its end (a long prompt: tens of seconds on 2 cores, and the process waits
    for that thread before it exits). Now the cut stops it at the next decoder layer
    (`Target.cancellable`), as the OpenAI routes' prefill. Deterministic: each of the tiny
    target's three layers sleeps 1 s in a prefill, the server stops 0.2 s after the first began,
    so only the first may run."""
    pair = SplitPair("ngram", limits=ServerLimits(shutdown_timeout_s=0.2))
    slept: list[int] = []

    def slow_prefill(module, args) -> None:
        if args[0].shape[1] > 1:  # a prefill, not a one-token step
            slept.append(1)
            time.sleep(1.0)

    layers = pair.server.server.target.decoder_layers
    handles = [layer.register_forward_pre_hook(slow_prefill) for layer in layers]
    outcome: list = []

    def open_session() -> None:
        try:
            outcome.append(SplitClient(pair.url, KEY, timeout_s=30).open(wire.OpenRequest(PROMPT, max_new_tokens=4)))
        except (LinkDown, ServerRefused) as exc:
            outcome.append(exc)

    opener = threading.Thread(target=open_session, daemon=True)
    try:
        opener.start()
        deadline = time.monotonic() + 10
        while not slept and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slept, "the open never reached the prefill"
        pair.server.stop()
        pair.server.server.worker.submit(lambda: None).result(timeout=10)  # the model thread is free
        opener.join(timeout=10)
    finally:
        for handle in handles:
            handle.remove()
    assert len(slept) == 1, f"{len(slept)} of {len(layers)} layers ran after the shutdown"
    assert outcome and not isinstance(outcome[0], dict), outcome  # no session was handed out


def test_an_open_returns_the_context_from_context_from_on() -> None:
    """docs/protocol.md: an open's reply holds context for prompt positions >= context_from only
    (a resuming client has the rest): T - context_from rows, the tail of the whole prompt's."""
    made = SplitPair("moa")  # a drafter whose context is per-token hidden states
    try:
        client = SplitClient(made.url, KEY)
        replies = {
            start: client.open(wire.OpenRequest(PROMPT, max_new_tokens=4, context_from=start))
            for start in (0, 4, len(PROMPT))
        }
        whole = wire.decode_context(replies[0]["context"], len(PROMPT))
        assert whole
        for start, reply in replies.items():
            assert reply["start_pos"] == start
            part = wire.decode_context(reply["context"], len(PROMPT) - start)
            assert part.keys() == whole.keys()
            assert all(torch.equal(part[name], whole[name][start:]) for name in whole)
    finally:
        made.server.stop()


def test_prompt_len_is_for_a_resume_within_its_prompt(monkeypatch) -> None:
    """docs/protocol.md: an open's prompt_len (the resumed session's prompt length) comes with
    root_id and is in 1..T, else a 400; a resume with it rebuilds the context from that prompt
    (TargetSession.resume) and continues from the given root."""
    from moaspec.session import TargetSession

    resumed = []
    resume = TargetSession.resume

    def recording(self, context_ids, prompt_len=None):
        resumed.append((context_ids.numel(), prompt_len))
        return resume(self, context_ids, prompt_len)

    monkeypatch.setattr(TargetSession, "resume", recording)
    made = SplitPair("moa")
    try:
        client = SplitClient(made.url, KEY)
        with pytest.raises(ServerRefused, match=r"\(400\).*'prompt_len' is only for a resume \(with 'root_id'\)"):
            client.open(wire.OpenRequest(PROMPT, max_new_tokens=4, prompt_len=2))
        with pytest.raises(ServerRefused, match=rf"\(400\).*'prompt_len' must be an integer in \[1, {len(PROMPT)}\]"):
            client.open(wire.OpenRequest(PROMPT, max_new_tokens=4, root_id=5, prompt_len=len(PROMPT) + 1))
        whole = client.open(wire.OpenRequest(PROMPT, max_new_tokens=4, root_id=5))
        split = client.open(wire.OpenRequest(PROMPT, max_new_tokens=4, root_id=5, prompt_len=3))
        assert whole["next_token"] == split["next_token"] == 5
        assert resumed == [(len(PROMPT), None), (len(PROMPT), 3)]
        contexts = [wire.decode_context(reply["context"], len(PROMPT)) for reply in (whole, split)]
        assert contexts[0].keys() == contexts[1].keys()
        assert all(torch.allclose(contexts[0][name].float(), contexts[1][name].float(), atol=1e-2) for name in contexts[0])
    finally:
        made.server.stop()


def test_max_new_tokens_beyond_the_servers_limit_is_refused() -> None:
    """--max-new-tokens bounds an open's max_new_tokens (400), whatever room the token budget has."""
    made = SplitPair("ngram", limits=ServerLimits(max_new_tokens=8))
    try:
        client = SplitClient(made.url, KEY)
        with pytest.raises(ServerRefused, match=r"\(400\).*'max_new_tokens' must be an integer in \[1, 8\]"):
            client.open(wire.OpenRequest(PROMPT, max_new_tokens=9))
        client.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
    finally:
        made.server.stop()


def test_kept_last_replies_are_capped_at_max_sessions() -> None:
    """The last replies of sessions their verify closed are kept for retries, at most
    --max-sessions of them (the oldest dropped first): closed sessions cannot grow the memory."""
    made = SplitPair("ngram", limits=ServerLimits(max_sessions=2))
    try:
        client = SplitClient(made.url, KEY)
        finished = []
        for _ in range(3):
            opened = client.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
            last = wire.VerifyRequest(0, [opened["next_token"]], [-1], remaining=1)
            finished.append((opened["session_id"], last, client.verify(opened["session_id"], last)))
        assert list(made.server.server.finished) == [session_id for session_id, _, _ in finished[1:]]
        with pytest.raises(SessionLost):
            client.verify(finished[0][0], finished[0][1])
        assert client.verify(finished[2][0], finished[2][1]) == finished[2][2]
    finally:
        made.server.stop()


def test_a_verify_whose_model_work_fails_drops_its_session(monkeypatch) -> None:
    """docs/protocol.md: a failed model call is a 500 and its session is dropped (its cache may be
    half-updated): the retry is a 404, not a verify on that cache, and its slot is free again."""
    made = SplitPair("ngram", limits=ServerLimits(max_sessions_per_key=1))
    try:
        server = made.server.server
        client = SplitClient(made.url, KEY)
        opened = client.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
        encode = server.encoder.encode

        def fail_once(update):
            monkeypatch.setattr(server.encoder, "encode", encode)
            raise RuntimeError("out of memory")

        monkeypatch.setattr(server.encoder, "encode", fail_once)
        verify = wire.VerifyRequest(0, [opened["next_token"]], [-1])
        with pytest.raises(LinkDown, match="500"):
            client.verify(opened["session_id"], verify)
        assert server.sessions == {} and server.budget.num_sessions == 0 and server.budget.num_tokens == 0
        with pytest.raises(SessionLost):
            client.verify(opened["session_id"], verify)
        client.open(wire.OpenRequest(PROMPT, max_new_tokens=8))  # the key's one slot is free
    finally:
        made.server.stop()


def test_a_session_larger_than_the_servers_whole_budget_is_413() -> None:
    """budget.py: a session that could never fit is a 413 (no retry helps), also when the server's
    total (60 here) is below the key's share: not a 503 the client would retry; at the total it fits."""
    made = SplitPair("ngram", limits=ServerLimits(max_cached_tokens_per_key=100, max_cached_tokens=60))
    try:
        client = SplitClient(made.url, KEY)
        with pytest.raises(ServerRefused, match=r"\(413\).*ask for fewer tokens"):
            client.open(wire.OpenRequest(PROMPT, max_new_tokens=60 - len(PROMPT) + 1))
        client.open(wire.OpenRequest(PROMPT, max_new_tokens=60 - len(PROMPT)))
        assert made.server.server.budget.num_tokens == 60
    finally:
        made.server.stop()


def test_a_full_server_ends_none_of_a_keys_stale_sessions() -> None:
    """docs/protocol.md: a key at its own limit (429) gets room from its own stale sessions; a key
    refused because the server is full (503: other keys hold the room) ends none of them."""
    started, (first, second) = two_key_server(ServerLimits(max_sessions=2, max_sessions_per_key=2))
    try:
        stale = first.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
        second.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
        started.server.sessions[stale["session_id"]].last_used -= STALE_SESSION_S + 10
        with pytest.raises(LinkDown, match=r"503.*no free session slot"):
            first.open(wire.OpenRequest(PROMPT, max_new_tokens=8))
        assert first.verify(stale["session_id"], wire.VerifyRequest(0, [stale["next_token"]], [-1]))["seq"] == 0
    finally:
        started.stop()


def test_ended_opens_are_remembered_until_the_idle_time_out() -> None:
    """docs/protocol.md: a late duplicate of an open whose session was closed is refused for as
    long as the idle time-out, then the open is forgotten (it opens a session again)."""
    made = SplitPair("ngram", limits=ServerLimits(idle_timeout_s=0.3))
    try:
        client = SplitClient(made.url, KEY)
        request = wire.OpenRequest(PROMPT, max_new_tokens=8)
        client.close_session(client.open(request)["session_id"])
        with pytest.raises(ServerRefused, match="opened a session that was closed"):
            client.open(request)
        deadline = time.monotonic() + 5.0
        while made.server.server.ended_opens and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.open(request)["session_id"] in made.server.server.sessions
    finally:
        made.server.stop()


def test_at_most_ENDED_OPENS_ended_opens_are_remembered(monkeypatch) -> None:
    """The ended opens remembered for late duplicates are capped (ENDED_OPENS, 2 here), the oldest
    forgotten first: its duplicate opens again, a newer one's is still refused."""
    monkeypatch.setattr("moaspec.split.server.ENDED_OPENS", 2)
    made = SplitPair("ngram")
    try:
        client = SplitClient(made.url, KEY)
        requests = [wire.OpenRequest(PROMPT, max_new_tokens=8) for _ in range(3)]
        for request in requests:
            client.close_session(client.open(request)["session_id"])
        assert len(made.server.server.ended_opens) == 2
        with pytest.raises(ServerRefused, match="opened a session that was closed"):
            client.open(requests[1])
        assert client.open(requests[0])["session_id"] in made.server.server.sessions
    finally:
        made.server.stop()
