"""Client-server split on tiny float64 targets over loopback: output identical to in-process
generation (greedy and seeded sampling), for MoA (with and without TLI), EAGLE-2 and n-gram."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import make_random_drafter_net, make_tiny_target
from drafter_checks import favour_row

from moaspec.config import GenerationConfig, SamplingConfig, TreeConfig
from moaspec.drafters.eagle import EagleDrafter
from moaspec.drafters.moa import MoADrafter
from moaspec.drafters.ngram import NgramDrafter
from moaspec.engine import Engine
from moaspec.errors import MoaspecError
from moaspec.nn.eagle import EagleConfig, EagleDrafterNet
from moaspec.nn.moa import MoAConfig, MoADrafterNet
from moaspec.split import protocol as wire
from moaspec.split.client import ServerRefused, SplitClient
from moaspec.split.generator import SplitGenerator, SplitOptions, SplitResult
from moaspec.split.server import ServerLimits, ServerThread, SplitServer

PROMPT = [5, 17, 33, 2, 71, 5, 17, 33, 2]
KEY = "test-key"


def make_drafter(method: str, target, tree: TreeConfig | None = None):
    """A drafter of the given kind for `target` (same weights for every call with the same args);
    a model drafter's name may end in "+ngram" (prompt lookup first, as `--drafter moa+ngram`)."""
    tree = tree or TreeConfig(depth=3, top_k=2, budget=5)
    if method == "ngram":
        return NgramDrafter()
    base = method.removesuffix("+ngram")
    if base.startswith("moa"):
        config = MoAConfig.for_target(target.config, tli_layers=1 if base == "moa-tli1" else 0)
        drafter = MoADrafter(make_random_drafter_net(MoADrafterNet, config, target), target, tree)
    else:
        net = make_random_drafter_net(EagleDrafterNet, EagleConfig.for_target(target.config), target)
        drafter = EagleDrafter(net, target, tree)
    if base != method:
        drafter.enable_lookup()
    return drafter


class SplitPair:
    """A server (own target + drafter copy) and a client drafter (own target copy for its parts)."""

    def __init__(self, method: str, tree: TreeConfig | None = None, limits: ServerLimits = ServerLimits(), port: int = 0) -> None:
        self.method, self.tree, self.limits = method, tree, limits
        self.client_target = make_tiny_target("llama", num_hidden_layers=3)
        self.client_drafter = make_drafter(method, self.client_target, tree)
        self.server = self.start_server(port)

    def start_server(self, port: int = 0) -> ServerThread:
        target = make_tiny_target("llama", num_hidden_layers=3)
        return ServerThread(SplitServer(target, make_drafter(self.method, target, self.tree), [KEY], self.limits), port=port).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def generator(self, url: str | None = None, timeout_s: float = 10.0, **options) -> SplitGenerator:
        return SplitGenerator(SplitClient(url or self.url, KEY, timeout_s=timeout_s), self.client_drafter, SplitOptions(**options))

    def reference(self, sampling: SamplingConfig, generation: GenerationConfig, prompt: list[int] = PROMPT) -> list[int]:
        target = make_tiny_target("llama", num_hidden_layers=3)
        return Engine(target, make_drafter(self.method, target, self.tree)).generate(prompt, sampling, generation, frozenset()).token_ids


@pytest.fixture
def pair(request):
    made = SplitPair(*request.param) if isinstance(request.param, tuple) else SplitPair(request.param)
    yield made
    made.server.stop()


@pytest.mark.parametrize("pair", ["moa", "moa-tli1", "eagle", "ngram"], indirect=True)
@pytest.mark.parametrize("context_dtype", ["f16", "i8"])
def test_greedy_split_equals_in_process(pair: SplitPair, context_dtype: str) -> None:
    generation = GenerationConfig(max_new_tokens=24)
    expected = pair.reference(SamplingConfig(), generation)
    result = pair.generator(context_dtype=context_dtype).generate(PROMPT, SamplingConfig(), generation)
    assert result.token_ids == expected
    assert result.stop_reason == "length" and result.stats.target_forwards == result.stats.num_verifications + 1


def test_a_server_runtime_with_a_leaf_limit_gets_trees_within_it() -> None:
    """A server whose runtime verifies at most max_tree_leaves leaves per tree (llama.cpp: 62)
    says so in its info; the client keeps the longest prefix of its tree within it (output
    unchanged), and a tree with more is a 400, not a model failure."""
    tree = TreeConfig(depth=2, top_k=4, budget=12)
    made = SplitPair("moa", tree)
    made.server.stop()
    target = make_tiny_target("llama", num_hidden_layers=3)
    target.max_tree_leaves = 3
    made.server = ServerThread(SplitServer(target, make_drafter("moa", target, tree), [KEY], made.limits)).start()
    try:
        generation = GenerationConfig(max_new_tokens=16)
        result = made.generator().generate(PROMPT, SamplingConfig(), generation)
        assert result.token_ids == made.reference(SamplingConfig(), generation)
        assert 0 < result.stats.to_dict()["mean_drafted_nodes"] <= 6  # within 3 leaves of depth <= 2
        client = SplitClient(made.url, KEY)
        opened = client.open(wire.OpenRequest(PROMPT))
        with pytest.raises(ServerRefused, match="at most 3 leaves"):
            client.verify(opened["session_id"], wire.VerifyRequest(0, [opened["next_token"], 1, 2, 3, 4], [-1, 0, 0, 0, 0]))
    finally:
        made.server.stop()


def test_max_tree_nodes_may_be_up_to_what_the_runtime_verifies() -> None:
    """--max-tree-nodes up to the runtime's own limit (llama.cpp: 128) is served; one more is
    refused at start."""
    target = make_tiny_target("llama", num_hidden_layers=3)
    target.max_tree_nodes = 8
    SplitServer(target, NgramDrafter(), [KEY], ServerLimits(max_tree_nodes=8))
    with pytest.raises(MoaspecError, match="--max-tree-nodes 9 is more than"):
        SplitServer(target, NgramDrafter(), [KEY], ServerLimits(max_tree_nodes=9))


@pytest.mark.parametrize("pair", ["moa", "moa-tli1", "eagle"], indirect=True)
def test_exact_context_reproduces_in_process_drafts(pair: SplitPair) -> None:
    """With f32 context on a float64 tiny model the drafter sees what it sees in-process up to
    rounding of the memory, so acceptance (tau) matches too, not just the output."""
    generation = GenerationConfig(max_new_tokens=20)
    target = make_tiny_target("llama", num_hidden_layers=3)
    local = Engine(target, make_drafter(pair.method, target)).generate(PROMPT, SamplingConfig(), generation, frozenset())
    result = pair.generator(context_dtype="f32").generate(PROMPT, SamplingConfig(), generation)
    assert result.token_ids == local.token_ids
    assert result.stats.num_verifications == local.stats.num_verifications


@pytest.mark.parametrize(
    "pair", [("moa", TreeConfig(depth=3, top_k=2, budget=5, sampled=True)), ("eagle", None), ("ngram", None)], indirect=True
)
def test_seeded_sampling_split_equals_in_process(pair: SplitPair) -> None:
    """Drafter and verifier draw from separate seeded streams, so the split run reproduces the
    in-process run token for token; the sampled MoA tree sends its exact sparse draft rows."""
    sampling = SamplingConfig(temperature=0.9, top_p=0.95)
    for seed in (7, -3):  # a negative seed was a 400 (the wire takes 0..2^64-1): sent modulo 2^64, as torch takes it
        generation = GenerationConfig(max_new_tokens=24, seed=seed)
        expected = pair.reference(sampling, generation)
        result = pair.generator(context_dtype="f32").generate(PROMPT, sampling, generation)
        assert result.token_ids == expected


@pytest.mark.parametrize("pair", [("moa+ngram", TreeConfig(depth=2, top_k=2, budget=4))], indirect=True)
def test_seeded_sampling_split_equals_in_process_with_prompt_lookup(pair: SplitPair, monkeypatch) -> None:
    """The same with prompt lookup first and a branching model tree (an audit found a local
    `moaspec generate` different: its calibration had chosen another lookup trie, docs/protocol.md).
    The repeating prompt makes the lookup propose (counted: the test would not see it otherwise)."""
    proposals = []
    lookup_proposal = pair.client_drafter._lookup_proposal
    monkeypatch.setattr(
        pair.client_drafter, "_lookup_proposal", lambda *args: proposals.append(lookup_proposal(*args)) or proposals[-1]
    )
    sampling, prompt = SamplingConfig(temperature=0.9, top_p=0.95), [5, 17, 33, 2, 71] * 4
    for seed in (7, -3, 11):
        generation = GenerationConfig(max_new_tokens=24, seed=seed)
        expected = pair.reference(sampling, generation, prompt)
        assert pair.generator(context_dtype="f32").generate(prompt, sampling, generation).token_ids == expected
    assert sum(tree is not None for tree in proposals) > 0


@pytest.mark.parametrize("pair", [("moa", TreeConfig(depth=3, top_k=2, budget=5, sampled=True))], indirect=True)
def test_the_server_verifies_sampled_trees_with_the_clients_laws(pair: SplitPair, monkeypatch) -> None:
    """A sampled tree reaches the verifier with the rows its drafter drew from, exactly (a server
    verifying them as point masses would be lossy, and the seeded test above cannot see it: the
    in-process run it compares with shares the verifier)."""
    sent, verified = [], []
    parse_tree = wire.parse_tree
    monkeypatch.setattr(wire, "parse_tree", lambda *args: verified.append(parse_tree(*args)) or verified[-1])
    propose = pair.client_drafter.propose
    monkeypatch.setattr(pair.client_drafter, "propose", lambda *args: sent.append(propose(*args)) or sent[-1])
    generation = GenerationConfig(max_new_tokens=16, seed=3)
    pair.generator(context_dtype="f32").generate(PROMPT, SamplingConfig(temperature=0.9), generation)
    assert len(verified) == len(sent) > 0
    for drafted, checked in zip(sent, verified):
        nodes = checked.num_nodes  # the last tree may be cut to the tokens still allowed
        assert np.array_equal(checked.token_ids, drafted.token_ids[:nodes]) and checked.draft_probs is not None
        assert torch.equal(checked.draft_probs, drafted.draft_probs[:nodes].double())


@pytest.mark.parametrize("pair", ["ngram"], indirect=True)
def test_the_client_drafter_is_handed_the_accepted_path(pair: SplitPair, monkeypatch) -> None:
    """Trees with a wrong sibling before each right node: the accepted path is not nodes 0..k, and
    the client's drafter must be handed the path's tokens (its context is the verified text)."""
    from moaspec.tree import DraftTree

    generation = GenerationConfig(max_new_tokens=20)
    expected = pair.reference(SamplingConfig(), generation)
    drafter, vocab, handed = pair.client_drafter, pair.client_target.vocab_size, []
    accept_context = drafter.accept_context
    monkeypatch.setattr(drafter, "accept_context", lambda ids, start, context: handed.append(np.array(ids)) or accept_context(ids, start, context))

    def propose(root_id: int, sampling: SamplingConfig, generator: torch.Generator) -> DraftTree:
        emitted = sum(len(ids) for ids in handed) - len(PROMPT) + 1  # the root included
        token_ids, parents, node = [root_id], [-1], 0
        for right in expected[emitted : emitted + 2]:
            token_ids += [(right + 1) % vocab, right]
            parents += [node, node]
            node = len(token_ids) - 1
        return DraftTree(torch.tensor(token_ids), torch.tensor(parents))

    monkeypatch.setattr(drafter, "propose", propose)
    result = pair.generator().generate(PROMPT, SamplingConfig(), generation)
    assert result.token_ids == expected and result.stats.target_forwards < len(expected)  # drafts were accepted
    verified = np.concatenate(handed).tolist()
    assert verified == PROMPT + expected[: len(verified) - len(PROMPT)]


@pytest.mark.parametrize("pair", ["ngram"], indirect=True)
def test_events_stream_the_verified_tokens(pair: SplitPair) -> None:
    generation = GenerationConfig(max_new_tokens=12)
    events = list(pair.generator().stream(PROMPT, SamplingConfig(), generation))
    assert {e.kind for e in events} == {"verified"}
    assert [t for e in events for t in e.token_ids] == pair.reference(SamplingConfig(), generation)


@pytest.mark.parametrize("pair", ["ngram"], indirect=True)
def test_a_result_holding_tokens_is_refused(pair: SplitPair) -> None:
    with pytest.raises(MoaspecError, match="fills an empty result"):
        pair.generator().stream(PROMPT, result=SplitResult(token_ids=[1, 2]))


def test_mismatched_drafter_is_refused() -> None:
    made = SplitPair("moa")
    try:
        other_target = make_tiny_target("llama", num_hidden_layers=3)
        config = MoAConfig.for_target(other_target.config)
        other = MoADrafter(make_random_drafter_net(MoADrafterNet, config, other_target, seed=5), other_target)
        with pytest.raises(MoaspecError, match=r"is not this client's \(moa, [0-9a-f]{16}\): both sides need the same drafter"):
            SplitGenerator(SplitClient(made.url, KEY), other)
    finally:
        made.server.stop()


def drafters_after_a_cut(method: str):
    """Two identical `method` drafters in the same state after 16 greedy tokens of the tiny target
    (one to draft alone, one to probe) -> (drafter, probe, target, root: the last emitted token)."""
    prepared = []
    for _ in range(2):
        target = make_tiny_target("llama", num_hidden_layers=3)
        drafter = make_drafter(method, target)
        generation = GenerationConfig(max_new_tokens=16)
        emitted = Engine(target, drafter).generate([*PROMPT, 71, 5, 17, 33], SamplingConfig(), generation).token_ids
        prepared.append(drafter)
    return *prepared, target, emitted[-1]


@pytest.mark.parametrize("method", ["moa", "eagle", "moa+ngram"])
def test_drafting_alone_reports_the_probability_of_its_token(method: str) -> None:
    """A model drafter's token drafted alone comes with the model's own probability of it (its
    top choice, greedy); a prompt-lookup copy beside a model comes with the copy's precision where
    the model agrees or disputes (the tiny target's answer to this prompt turns periodic from its
    7th token, so after 16 `moa+ngram` copies)."""
    from moaspec.drafters.base import AloneDraft
    from moaspec.drafters.ngram import LOOKUP_PRECISION_AGREED, LOOKUP_PRECISION_DISPUTED

    drafter, probe, _, root = drafters_after_a_cut(method)
    draft = drafter.draft_alone(root, SamplingConfig(), None)
    assert isinstance(draft, AloneDraft)
    with torch.inference_mode():  # as draft_alone runs it
        log_probs = probe.start(root)[0]
    vocab = probe.draft_vocab_ids
    best = int(log_probs.argmax())
    model_choice = best if vocab is None else int(vocab[best])
    if method.endswith("+ngram"):
        agreed = model_choice == draft.token_id
        assert draft[1:] == ((LOOKUP_PRECISION_AGREED, "lookup+model") if agreed else (LOOKUP_PRECISION_DISPUTED, "lookup"))
        return
    assert draft.token_id == model_choice and draft.source == "model"
    assert draft.probability == pytest.approx(float(log_probs[best].exp()), rel=1e-9)


@pytest.mark.parametrize("model_agrees", [True, False])
def test_a_copy_drafted_alone_reports_whether_the_model_agrees(model_agrees: bool) -> None:
    """Beside a model, the lookup's copy is drafted alone whatever the model's first choice is; its
    probability is LOOKUP_PRECISION_AGREED when that choice is the copy, else
    LOOKUP_PRECISION_DISPUTED. The model's distribution is forced to put its top on the copy or
    on another token."""
    from moaspec.drafters.ngram import LOOKUP_PRECISION_AGREED, LOOKUP_PRECISION_DISPUTED

    drafter, probe, target, root = drafters_after_a_cut("moa+ngram")
    copy = int(probe._lookup_proposal(root, SamplingConfig(), None).token_ids[1])
    ids = drafter.draft_vocab_ids  # rows of the model's distribution -> token ids
    vocab = list(range(target.vocab_size)) if ids is None else ids.tolist()
    favour_row(drafter, vocab.index(copy) if model_agrees else next(row for row, token in enumerate(vocab) if token != copy))
    draft = drafter.draft_alone(root, SamplingConfig(), None)
    expected = (LOOKUP_PRECISION_AGREED, "lookup+model") if model_agrees else (LOOKUP_PRECISION_DISPUTED, "lookup")
    assert draft == (copy, *expected)


class CountingClient(SplitClient):
    """A SplitClient that records every request's method and path."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str]] = []

    def request(self, method: str, path: str, message: dict | None = None, timeout_s: float | None = None) -> dict:
        self.calls.append((method, path.rsplit("/", 1)[-1] if method == "POST" else path.split("/")[3]))
        return super().request(method, path, message, timeout_s)


@pytest.mark.parametrize("pair", ["moa", "ngram"], indirect=True)
@pytest.mark.parametrize("ending", ["length", "stop_token"])
def test_the_last_verify_closes_the_session(pair: SplitPair, ending: str) -> None:
    """The server closes a session whose verify finishes the generation (the client's limit or one
    of its stop tokens reached): no DELETE round trip, nothing left on the server, the output
    unchanged, and no earlier verify closed it (no reconnect)."""
    generation = GenerationConfig(max_new_tokens=24)
    full = pair.reference(SamplingConfig(), generation)
    stop_ids = frozenset({full[13]}) if ending == "stop_token" else frozenset()
    expected = full[: full.index(full[13]) + 1] if stop_ids else full
    client = CountingClient(pair.url, KEY)
    result = SplitGenerator(client, pair.client_drafter).generate(PROMPT, SamplingConfig(), generation, stop_ids)
    assert result.token_ids == expected
    assert result.stop_reason == ending and result.num_reconnects == 0
    kinds = [kind for _, kind in client.calls]
    assert kinds[:2] == ["info", "sessions"] and set(kinds[2:]) == {"verify"}
    assert pair.server.server.sessions == {} and len(pair.server.server.finished) == 1


@pytest.mark.parametrize("pair", ["ngram"], indirect=True)
@pytest.mark.parametrize("ending", ["length", "stop_token"])
def test_the_last_verify_leaves_the_context_plain_decoding_would(pair: SplitPair, ending: str) -> None:
    """Bug: the verify that finished a session left the tokens its accepted path held past the
    client's limit or stop token in the target's context, which the server keeps for the key's next
    session (IdleTargets): the next turn then started from a state that depended on what was
    drafted, unlike Engine.stream's, which rolls back to what plain decoding would hold."""
    generation = GenerationConfig(max_new_tokens=12)
    full = pair.reference(SamplingConfig(), generation)
    client = SplitClient(pair.url, KEY)
    stop_ids = [full[2]] if ending == "stop_token" else []
    answer = full.index(full[2]) + 1 if stop_ids else 3  # tokens, the open's first included
    assert answer > 1  # the stop token is not the open's own
    opened = client.open(wire.OpenRequest(PROMPT, max_new_tokens=12, stop_ids=stop_ids))
    assert opened["next_token"] == full[0]
    target = pair.server.server.sessions[opened["session_id"]].target_session.target
    chain = wire.VerifyRequest(0, full[:6], list(range(-1, 5)), remaining=2 if ending == "length" else 11)
    reply = client.verify(opened["session_id"], chain)  # accepts 5 tokens past the root, emits 6
    assert reply["closed"] is True and reply["path_node_idx"] == list(range(6))
    assert target.num_cached == len(PROMPT) + answer - 1  # the answer's last token is not decoded yet


@pytest.mark.parametrize("pair", ["ngram"], indirect=True)
def test_a_closed_sessions_last_verify_is_replayed_and_nothing_else(pair: SplitPair) -> None:
    """A retry of the verify that closed a session (its reply lost) gets the same reply; any other
    verify is a 404 and a DELETE is answered; a client that sends no `remaining` closes the session
    itself, as before."""
    from moaspec.split import protocol as wire

    client = SplitClient(pair.url, KEY)
    opened = client.open(wire.OpenRequest(PROMPT, max_new_tokens=8, stop_ids=[]))
    session_id, root = opened["session_id"], opened["next_token"]
    kept = client.verify(session_id, wire.VerifyRequest(0, [root], [-1], remaining=7))
    assert "closed" not in kept and session_id in pair.server.server.sessions
    last = client.verify(session_id, wire.VerifyRequest(1, [kept["next_token"]], [-1], remaining=1))
    assert last["closed"] is True and session_id not in pair.server.server.sessions
    assert client.verify(session_id, wire.VerifyRequest(1, [kept["next_token"]], [-1], remaining=1)) == last
    with pytest.raises(MoaspecError, match="no such session"):
        client.verify(session_id, wire.VerifyRequest(2, [last["next_token"]], [-1], remaining=1))
    assert client.request("DELETE", f"/v1/split/sessions/{session_id}") == {"closed": True}
    assert pair.server.server.finished == {}

    opened = client.open(wire.OpenRequest(PROMPT, max_new_tokens=2))
    reply = client.verify(opened["session_id"], wire.VerifyRequest(0, [opened["next_token"]], [-1]))
    assert "closed" not in reply and opened["session_id"] in pair.server.server.sessions


class _KeptTarget:
    """Just what IdleTargets reads of a target."""

    def __init__(self, keeps_shared_start: bool = True, max_positions: int = 512) -> None:
        self.keeps_shared_start, self.max_positions = keeps_shared_start, max_positions


def test_idle_targets_go_back_to_their_key_as_they_are_and_to_another_key_emptied() -> None:
    from moaspec.split.idle_targets import IdleTargets

    idle = IdleTargets(capacity=2)
    first, second, third = _KeptTarget(), _KeptTarget(), _KeptTarget()
    idle.put(0, first)
    idle.put(1, second)
    idle.put(1, third)  # beyond the capacity: the oldest (key 0's) is dropped
    idle.put(0, _KeptTarget(keeps_shared_start=False))  # nothing to reuse in it: not kept
    assert idle.take(1, 512) == (third, False)  # the key's most recent one, as it is
    assert idle.take(0, 100) == (second, True)  # another key's: emptied before use
    assert idle.take(0, 100) is None
    idle.put(2, first)
    idle.expire(released_before=time.monotonic() + 1)
    assert idle.take(2, 100) is None
    small, large = _KeptTarget(max_positions=256), _KeptTarget(max_positions=1024)
    idle.put(0, large)
    idle.put(0, small)
    assert idle.take(0, 600) == (large, False)  # its own most recent one is too small for the session
    assert idle.take(1, 600) is None and idle.take(1, 200) == (small, True)
    older, newer = _KeptTarget(), _KeptTarget()
    idle.put(0, older)
    idle.put(1, newer)
    assert idle.take(2, 100) == (older, True)  # another key's: the oldest, the newer kept for its own key


def test_drafters_are_named_as_users_name_them() -> None:
    """/health, responses' `moaspec.drafter` and /v1/split/info name the form (`--drafter`)."""
    from moaspec.drafters.none import NoDrafter
    from moaspec.serving.identity import drafter_form

    target = make_tiny_target("llama")
    assert drafter_form(NoDrafter()) == "none" and drafter_form(NgramDrafter()) == "ngram"
    drafter = MoADrafter(make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(target.config), target), target)
    assert drafter_form(drafter) == "moa"
    drafter.enable_lookup()
    assert drafter_form(drafter) == "moa+ngram"


@pytest.mark.parametrize("pair", ["moa"], indirect=True)
def test_an_abandoned_split_stream_closes_its_session(pair: SplitPair) -> None:
    """A stream closed before its generation ends (a reader that stops) DELETEs its session at
    once instead of leaving a slot and a cache held until the idle time-out."""
    stream = pair.generator().stream(PROMPT, SamplingConfig(), GenerationConfig(max_new_tokens=24))
    next(stream)
    assert len(pair.server.server.sessions) == 1
    stream.close()
    assert pair.server.server.sessions == {} and pair.server.server.budget.num_sessions == 0


def test_sampled_trees_are_cut_to_the_servers_drafter_probability_limit(monkeypatch) -> None:
    """Bug (session 24 audit): a sampled tree's sparse drafter rows beyond the server's
    max_draft_prob_entries (65,536: 8 rows of the shipped 8,192-token draft vocabulary) got a 400
    and the generation stopped, `refused`, after its first token. The client now keeps the
    longest prefix of the tree within the limit (a prefix keeps each node's first draws)."""
    vocab = make_tiny_target("llama", num_hidden_layers=3).vocab_size
    limit = 2 * vocab + 1  # about two full rows
    made = SplitPair("moa", TreeConfig(depth=3, top_k=2, budget=5, sampled=True), ServerLimits(max_draft_prob_entries=limit))
    verified = []
    parse_tree = wire.parse_tree
    monkeypatch.setattr(wire, "parse_tree", lambda *args: verified.append(parse_tree(*args)) or verified[-1])
    try:
        generation = GenerationConfig(max_new_tokens=16, seed=3)
        result = made.generator(context_dtype="f32").generate(PROMPT, SamplingConfig(temperature=0.9), generation)
    finally:
        made.server.stop()
    assert result.stop_reason == "length" and len(result.token_ids) == 16, (result.stop_reason, result.refusal)
    entries = [int((tree.draft_probs != 0).sum()) for tree in verified]
    assert max(entries) <= limit and max(tree.num_nodes for tree in verified) > 1, entries


def test_client_set_up_errors_are_one_line(tmp_path, monkeypatch) -> None:
    """Bugs: --cafile naming a missing file or one holding no certificate, an API key file that
    is not text, and a key HTTP cannot carry ended `generate --server` (or `serve`) with a
    traceback; a reply from an HTTP server that is not moaspec's was printed whole (an HTML page)."""
    from moaspec.split.client import _reason
    from moaspec.split.commands import read_api_keys

    not_a_certificate = tmp_path / "keys.txt"
    not_a_certificate.write_text("a-key\n")
    for cafile in (tmp_path / "missing.pem", not_a_certificate):
        with pytest.raises(MoaspecError, match=f"cannot load the CA bundle {cafile}: "):
            SplitClient("https://127.0.0.1:1", KEY, cafile=str(cafile))
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\n")
    with pytest.raises(MoaspecError, match="is not text"):
        read_api_keys(str(binary))
    for key in ("key\u4e2d\u6587", "two words"):
        with pytest.raises(MoaspecError, match="printable ASCII"):
            SplitClient("http://127.0.0.1:1", key)
        (tmp_path / "key").write_text(key + "\n")
        with pytest.raises(MoaspecError, match="printable ASCII"):
            read_api_keys(str(tmp_path / "key"))
        monkeypatch.setenv("MOASPEC_API_KEY", key)
        with pytest.raises(MoaspecError, match="printable ASCII"):
            read_api_keys(None)
    page = b"<!DOCTYPE HTML>\n<html><body><h1>Error response</h1>\n<p>Error code: 404</p></body></html>\n"
    assert _reason(page, "text/html") == f"not a moaspec server's reply (text/html, {len(page)} bytes)"
    assert _reason(b"Bad Gateway", "text/plain") == "Bad Gateway"
    assert _reason(b"", "text/plain") == "no reason given"
