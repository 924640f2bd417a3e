"""The drafting side of the split deployment: the decode loop of engine.py with the target remote.

Online, each step is one round trip: propose a tree locally, the server verifies and commits it
and returns the accepted path, the next token and the context (per-token tensors) the drafter
needs for the newly verified tokens. Greedy output is identical to in-process generation, and
seeded sampling reproduces it (session.py: separate drafter and verifier streams).

A verify whose connection is cut (not timed out) is first retried once on a new connection with
the same `seq`: the server kept the session as it was, or replays the reply it could not deliver,
so a brief cut costs one round trip, not a re-prefill.

Offline (the server is unreachable or times out; `notify` is told once per cut), the drafter
continues alone (`draft_alone`)
and its tokens are *provisional*; with `offline_min_prob` P it stops (and waits for the server)
before a token that would bring its probability that every provisional token is the target's (the
product of what `draft_alone` reports) below P. The client retries with exponential back-off (a
server that answers 429, busy, is retried too), no attempt outlasting `offline_deadline_s`; on
reconnect it first closes the session the cut left open (so that it holds no slot of the key's),
then resynchronises a fresh server session from its verified text (re-prefill, no context sent back:
the client kept it), re-derives the drafter's state from the stored verified context, then sends
the provisional tokens as chains for verification. The agreeing prefix is confirmed; the rest is
retracted and replaced by the target's token. Verified tokens are never changed. Verifying fixed
provisional tokens as point-mass drafts keeps sampling lossless (verify.py).

A request the server refuses mid-generation (a 4xx other than 429) ends the generation with
stop_reason "refused" and the server's reason in `SplitResult.refusal`; the verified text is kept.

Events streamed to the caller: ("verified", ids), ("provisional", ids), ("confirm", ids: the
first provisional tokens, now verified), ("retract", ids: provisional tokens withdrawn), ("kept",
ids: provisional tokens kept unverified as final output, `accept_offline` at the deadline).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.decode_step import Verdict, decode_step
from moaspec.drafters.base import Context, SplitDrafter
from moaspec.engine import Engine, GenerationResult
from moaspec.errors import MoaspecError
from moaspec.exclusive import OneAtATime
from moaspec.serving.identity import drafter_fingerprint, drafter_form
from moaspec.session import draft_generator
from moaspec.split import protocol as wire
from moaspec.split.adaptive import AdaptiveTree
from moaspec.split.client import LinkDown, ServerRefused, SessionLost, SplitClient
from moaspec.tree import DraftTree

T = TypeVar("T")
BUSY = 429  # a server refusing for now (its session or token budget): retried on opening and resynchronising
# A verify that failed within this fraction of the client's time-out was cut, not timed out: retry it once.
FAST_FAILURE = 0.5


@dataclass(frozen=True)
class SplitOptions:
    """Client-side behaviour. Times in seconds."""

    context_dtype: str = "f16"  # how the server sends context: f16, i8 (per-vector scale) or f32
    retry_initial_s: float = 0.05
    retry_max_s: float = 2.0
    max_provisional: int = 64  # tokens drafted alone before waiting for the server
    offline_min_prob: float = 0.0  # stop drafting alone below this probability that all of it is right
    offline_deadline_s: float = 120.0  # give up reconnecting after this long offline
    accept_offline: bool = False  # when giving up, keep the provisional tokens as final output
    adaptive: bool = False  # size the tree from measured RTT / verify / draft costs
    notify: Callable[[str], None] | None = None  # told when a server is found down, once per cut (the CLI prints it)

    def __post_init__(self) -> None:
        if self.context_dtype not in wire.CONTEXT_DTYPES:
            raise MoaspecError(f"context dtype must be one of {', '.join(wire.CONTEXT_DTYPES)}")
        if self.max_provisional < 0 or self.offline_deadline_s < 0 or not 0 < self.retry_initial_s <= self.retry_max_s:
            raise MoaspecError("need max_provisional >= 0, offline_deadline_s >= 0, 0 < retry_initial_s <= retry_max_s")
        if not 0.0 <= self.offline_min_prob <= 1.0:
            raise MoaspecError(f"the offline minimum probability must be in [0, 1], not {self.offline_min_prob}")


@dataclass(frozen=True)
class SplitEvent:
    kind: str  # "verified" | "provisional" | "confirm" | "retract" | "kept"
    token_ids: list[int]


@dataclass
class SplitResult(GenerationResult):
    """GenerationResult + what the link did. token_ids: verified tokens (plus the provisional
    ones when the user accepted offline output, stop_reason "offline"). refusal: the server's
    reason when it refused a request mid-generation (stop_reason "refused")."""

    provisional_ids: list[int] = field(default_factory=list)  # unresolved at the end
    num_provisional: int = 0  # drafted alone, in total
    num_confirmed: int = 0
    num_retracted: int = 0
    num_reconnects: int = 0
    num_unverified: int = 0  # the last tokens of the output, kept unverified (stop_reason "offline")
    offline_s: float = 0.0
    first_token_s: float = 0.0
    refusal: str | None = None

    def split_dict(self, client: SplitClient) -> dict:
        new = max(1, len(self.token_ids))
        transport = client.stats
        return {
            "server_calls": transport.calls,
            "server_calls_per_100_tokens": round(100.0 * transport.calls / new, 3),
            "bytes_sent": transport.bytes_sent,
            "bytes_received": transport.bytes_received,
            "bytes_per_token": round((transport.bytes_sent + transport.bytes_received) / new, 1),
            "time_to_first_token_s": round(self.first_token_s, 4),
            "num_provisional": self.num_provisional,
            "num_confirmed": self.num_confirmed,
            "num_retracted": self.num_retracted,
            "num_reconnects": self.num_reconnects,
            "num_unverified": self.num_unverified,
            "offline_s": round(self.offline_s, 4),
        }


class SplitGenerator:
    """Generation with a local drafter and a remote target (see the module docstring)."""

    def __init__(self, client: SplitClient, drafter: SplitDrafter, options: SplitOptions = SplitOptions()) -> None:
        self.client, self.drafter, self.options = client, drafter, options
        info = retry_while_down(client.info, options)  # a server still starting is waited for
        if info.get("version") != wire.PROTOCOL_VERSION:
            raise MoaspecError(f"server speaks protocol {info.get('version')}, this client {wire.PROTOCOL_VERSION}")
        if info.get("drafter_fingerprint") != drafter_fingerprint(drafter):
            raise MoaspecError(
                f"the server's drafter ({info.get('drafter')}, {info.get('drafter_fingerprint')}) is not this client's "
                f"({drafter_form(drafter)}, {drafter_fingerprint(drafter)}): both sides need the same drafter "
                "(give this client the server's --drafter, or start the server with this client's)"
            )
        self.info = info
        self.vocab_size = int(info["vocab_size"])
        self.max_tree_nodes = int(info["limits"]["max_tree_nodes"])
        leaves = info.get("max_tree_leaves")  # the server runtime's limit (None: none)
        self.max_tree_leaves = None if leaves is None else int(leaves)
        # a sampled tree's drafter rows, sent sparse, are bounded too (older servers: no limit sent)
        entries = info["limits"].get("max_draft_prob_entries")
        self.max_prob_entries = None if entries is None else int(entries)
        self.adaptive = AdaptiveTree(drafter.tree_config, self.max_tree_nodes) if options.adaptive and hasattr(drafter, "tree_config") else None
        self._one_at_a_time = OneAtATime("split generator")  # one drafter state, one connection

    def generate(self, prompt_ids: list[int], sampling: SamplingConfig = SamplingConfig(),
                 generation: GenerationConfig = GenerationConfig(), stop_ids: frozenset[int] = frozenset()) -> SplitResult:
        result = SplitResult()
        for _ in self.stream(prompt_ids, sampling, generation, stop_ids, result):
            pass
        return result

    def stream(self, prompt_ids: list[int], sampling: SamplingConfig = SamplingConfig(),
               generation: GenerationConfig = GenerationConfig(), stop_ids: frozenset[int] = frozenset(),
               result: SplitResult | None = None) -> Iterator[SplitEvent]:
        """Yield events until done; fill `result` (empty: its tokens are the answer, which a
        resume after a cut sends). prompt_ids: [T] token ids, T >= 1."""
        if not prompt_ids:
            raise MoaspecError("the prompt is empty")
        if result is not None and result.token_ids:
            raise MoaspecError("a split generation fills an empty result: this one holds tokens already")
        run = _Run(self, list(prompt_ids), sampling, generation, stop_ids, result if result is not None else SplitResult())
        return self._one_at_a_time.run(run.events())


class _Run:
    """The state of one split generation."""

    def __init__(self, owner: SplitGenerator, prompt: list[int], sampling: SamplingConfig,
                 generation: GenerationConfig, stop_ids: frozenset[int], result: SplitResult) -> None:
        self.owner, self.client, self.drafter, self.options = owner, owner.client, owner.drafter, owner.options
        self.prompt, self.sampling, self.generation, self.stop_ids, self.result = prompt, sampling, generation, stop_ids, result
        self.max_new = min(generation.max_new_tokens, int(owner.info["max_positions"]) - len(prompt))
        self.generator = draft_generator(generation.seed)
        self.contexts: list[tuple[np.ndarray, int, Context]] = []  # everything verified, to replay
        self.session_id: str | None = None
        self.stale_session: str | None = None  # the session a cut left open on the server, closed on reconnect
        self.seq = 0
        self.provisional: list[int] = []
        self.provisional_prob = 1.0  # the drafter's probability that every provisional token is right
        self.drafting_alone = True  # False once offline_min_prob stopped it, until the next cut
        self.server_closed = False  # the session's last verify finished the generation and closed it
        self.done = False

    @property
    def root(self) -> int:
        return self.result.token_ids[-1]

    @property
    def remaining(self) -> int:
        """Tokens this generation may still emit (verified ones count, provisional ones do not)."""
        return self.max_new - len(self.result.token_ids)

    def events(self) -> Iterator[SplitEvent]:
        started = time.perf_counter()
        stats = self.result.stats
        try:
            yield from self._open()
            self.result.first_token_s = time.perf_counter() - started
            while not self.done:
                try:
                    if self.session_id is not None:
                        yield from self._online_step()
                    else:
                        yield from self._offline()
                except ServerRefused as exc:
                    self._refused(exc)
                stats.wall_s = time.perf_counter() - started
        finally:
            stats.wall_s = time.perf_counter() - started
            if self.session_id is not None and not self.server_closed:
                self.client.close_session(self.session_id)

    # -- online -----------------------------------------------------------------------------------
    def _open(self) -> Iterator[SplitEvent]:
        request = self._open_request(self.prompt, None, 0)
        tick = time.perf_counter()
        # nothing to draft from before the first token: wait for the server, and out a busy one
        reply = retry_while_down(lambda: self.client.open(request), self.options, retry_busy=True)
        self.result.stats.record_prefill(time.perf_counter() - tick)
        verification = wire.parse_verification(reply, self.owner.vocab_size, 0, len(self.prompt))
        self.session_id, self.seq = str(reply["session_id"]), 0
        tick = time.perf_counter()
        self.drafter.reset()
        self._accept(np.array(self.prompt, dtype=np.int64), 0, verification.context)
        self.result.stats.draft_s += time.perf_counter() - tick
        yield from self._emit_verified([verification.next_token])

    def _online_step(self) -> Iterator[SplitEvent]:
        """One decode step (decode_step.py) verified by the server: one round trip."""
        if self.owner.adaptive is not None:
            self.drafter.tree_config = self.owner.adaptive.choose()
        replies: list[wire.Verification] = []

        def verify(tree: DraftTree) -> Verdict:
            verification = self._verify(tree)[0]
            replies.append(verification)
            path_ids = tree.token_ids[verification.path_node_idx]
            accept = lambda: self._accept(path_ids, verification.start_pos, verification.context)  # noqa: E731
            return Verdict(verification.path_node_idx, verification.next_token, accept)

        try:
            step = decode_step(
                self.drafter, self.root, self.remaining, self.sampling, self.generator, self.result.stats, verify,
                limits=self.owner, vocab_size=self.owner.vocab_size,
            )
        except (LinkDown, SessionLost) as exc:
            self._go_offline(exc)
            return
        if self.owner.adaptive is not None:
            self.owner.adaptive.observe(step.verify_s, replies[0].server_s, step.draft_s, step.tree, step.num_accepted)
        yield from self._emit_verified(step.emitted)

    def _verify(self, tree: DraftTree) -> tuple[wire.Verification, float]:
        draft_probs = None
        if tree.draft_probs is not None:  # exact sparse rows: the verifier needs what was drawn from
            rows = [row.nonzero().flatten() for row in tree.draft_probs]
            draft_probs = [(ids.tolist(), row[ids].double()) for ids, row in zip(rows, tree.draft_probs)]
        request = wire.VerifyRequest(self.seq, tree.token_ids.tolist(), tree.parents.tolist(), draft_probs, self.remaining)
        tick = time.perf_counter()
        try:
            reply = self.client.verify(self.session_id, request)
        except LinkDown:
            # A connection cut under a request (not a time-out) is retried once, at once, on a
            # new connection with the same seq: the server left the session as it was, or
            # replays the reply it could not deliver, so no re-prefill is needed. A second
            # failure, or a time-out, means the link is down: drafting alone takes over.
            if time.perf_counter() - tick >= FAST_FAILURE * self.client.timeout_s:
                raise
            self.client.drop_connection()
            reply = self.client.verify(self.session_id, request)
        round_trip_s = time.perf_counter() - tick
        self.seq += 1
        verification = wire.parse_verification(reply, self.owner.vocab_size, tree.num_nodes)
        self.server_closed = verification.closed
        return verification, round_trip_s

    def _accept(self, token_ids: np.ndarray, start_pos: int, context: Context) -> None:
        self.contexts.append((token_ids, start_pos, context))
        self.drafter.accept_context(token_ids, start_pos, context)

    def _emit_verified(self, token_ids: list[int]) -> Iterator[SplitEvent]:
        num_before = len(self.result.token_ids)
        self.done = Engine._emit(token_ids, self.result, self.stop_ids, self.max_new)
        if self.done and self.result.stop_reason == "length" and self.generation.max_new_tokens > self.max_new:
            self.result.stop_reason = "context"
        yield SplitEvent("verified", self.result.token_ids[num_before:])

    # -- offline ----------------------------------------------------------------------------------
    def _go_offline(self, cause: Exception) -> None:
        self.client.drop_connection()
        if self.session_id is not None and not isinstance(cause, SessionLost):
            self.stale_session = self.session_id  # it may still hold a slot: closed before reopening
        self.session_id = None
        self.offline_since = time.monotonic()
        self.next_retry = self.offline_since + self.options.retry_initial_s
        self.retry_delay = self.options.retry_initial_s
        self.drafting_alone = True
        context_ids = self.prompt + self.result.token_ids[:-1]  # one request id per episode: idempotent retries
        # the resumed session emits at most `remaining` tokens after the root it is given
        self.resync_request = self._open_request(context_ids, self.root, len(context_ids), self.remaining + 1)
        if self.options.notify is not None:
            self.options.notify(f"{cause}; drafting alone, retrying for up to {self.options.offline_deadline_s:g} s")

    def _offline(self) -> Iterator[SplitEvent]:
        left_s = self.offline_since + self.options.offline_deadline_s - time.monotonic()
        if left_s <= 0:
            yield from self._give_up()
            return
        if time.monotonic() >= self.next_retry:
            try:
                yield from self._resync(min(self.client.timeout_s, left_s))
                return
            except (LinkDown, ServerRefused) as exc:
                if isinstance(exc, ServerRefused) and exc.status != BUSY:
                    raise
                self.client.drop_connection()
                self.retry_delay = min(2 * self.retry_delay, self.options.retry_max_s)
                self.next_retry = time.monotonic() + self.retry_delay
        token = self._draft_alone()
        if token is None:
            time.sleep(max(0.0, min(self.next_retry - time.monotonic(), 0.05)))
            return
        self.provisional.append(token)
        self.result.num_provisional += 1
        yield SplitEvent("provisional", [token])

    def _draft_alone(self) -> int | None:
        """One more provisional token, or None when the drafter cannot or should not go further."""
        count = len(self.result.token_ids) + len(self.provisional)
        if not self.drafting_alone or len(self.provisional) >= self.options.max_provisional or count >= self.max_new:
            return None
        if self.provisional and self.provisional[-1] in self.stop_ids:
            return None
        if not self.provisional:
            self.provisional_prob = 1.0
        root = self.provisional[-1] if self.provisional else self.root
        tick = time.perf_counter()
        draft = self.drafter.draft_alone(root, self.sampling, self.generator)
        self.result.stats.draft_s += time.perf_counter() - tick
        if draft is None:
            return None
        if self.provisional_prob * draft.probability < self.options.offline_min_prob:
            self.drafting_alone = False  # the drafter took the root as context: no second call until a resync
            return None
        self.provisional_prob *= draft.probability
        return draft.token_id

    def _resync(self, timeout_s: float) -> Iterator[SplitEvent]:
        """Reconnect: close the session the cut left, open a fresh one on the verified text, then
        verify the provisional tokens. Requests wait at most timeout_s (what the deadline leaves)."""
        if self.stale_session is not None:
            self.client.end_session(self.stale_session, timeout_s)
            self.stale_session = None
        reply = self.client.open(self.resync_request, timeout_s)
        self.session_id, self.seq, self.server_closed = str(reply["session_id"]), 0, False
        self.result.num_reconnects += 1
        self.result.offline_s += time.monotonic() - self.offline_since
        self.drafter.reset()  # back to exactly the verified state: replay the stored context
        stored, self.contexts = self.contexts, []
        ids = np.concatenate([ids for ids, _, _ in stored])
        self._accept(ids, 0, {name: torch.cat([c[name] for _, _, c in stored]) for name in stored[0][2]})
        while self.provisional and not self.done and self.session_id is not None:  # a new cut: offline again
            yield from self._verify_provisional()

    def _verify_provisional(self) -> Iterator[SplitEvent]:
        room = min(self.owner.max_tree_nodes - 1, self.remaining - 1)
        chunk = self.provisional[: max(room, 0)]
        tree = DraftTree.chain([self.root, *chunk])
        try:
            verification, round_trip_s = self._verify(tree)
        except (LinkDown, SessionLost) as exc:
            self._go_offline(exc)
            return
        self.result.stats.verify_s += round_trip_s
        num_agreed = len(verification.path_node_idx) - 1
        self.result.stats.record_verification(tree.num_nodes - 1, tree.num_nodes, num_agreed)
        self._accept(tree.token_ids[verification.path_node_idx], verification.start_pos, verification.context)
        next_token, rest = verification.next_token, self.provisional[num_agreed:]
        # the target's own next token may be the next provisional one: then it is confirmed too
        bonus_agrees = bool(rest) and rest[0] == next_token
        num_before = len(self.result.token_ids)
        self.done = Engine._emit([*chunk[:num_agreed], next_token], self.result, self.stop_ids, self.max_new)
        new = self.result.token_ids[num_before:]
        num_confirmed = min(len(new), num_agreed + bonus_agrees)
        self.provisional = rest[1:] if bonus_agrees else rest
        retracted = self.provisional if self.done or not bonus_agrees else []
        self.provisional = [] if retracted else self.provisional
        self.result.num_confirmed += num_confirmed
        self.result.num_retracted += len(retracted)
        if num_confirmed:
            yield SplitEvent("confirm", new[:num_confirmed])
        if retracted:
            yield SplitEvent("retract", retracted)
        if len(new) > num_confirmed:
            yield SplitEvent("verified", new[num_confirmed:])

    def _give_up(self) -> Iterator[SplitEvent]:
        self.done = True
        self.result.offline_s += time.monotonic() - self.offline_since
        if self.options.accept_offline and self.provisional:
            yield SplitEvent("kept", self.provisional)
            verified = len(self.result.token_ids)
            Engine._emit(self.provisional, self.result, self.stop_ids, self.max_new)
            self.result.num_unverified = len(self.result.token_ids) - verified
            self.provisional = []
            self.result.stop_reason = "offline"
            return
        self.result.provisional_ids = self.provisional
        self.result.stop_reason = "disconnected"

    def _refused(self, exc: ServerRefused) -> None:
        """The server refused a request mid-generation: stop, keeping what was verified."""
        self.done = True
        self.result.stop_reason, self.result.refusal = "refused", str(exc)
        self.result.provisional_ids, self.provisional = self.provisional, []
        if self.session_id is None:
            self.result.offline_s += time.monotonic() - self.offline_since

    def _open_request(
        self, prompt_ids: list[int], root_id: int | None, context_from: int, max_new: int | None = None
    ) -> wire.OpenRequest:
        s = self.sampling
        stop_ids = sorted(self.stop_ids) if len(self.stop_ids) <= wire.MAX_STOP_IDS else None  # else closed by DELETE
        return wire.OpenRequest(
            prompt_ids, s.temperature, s.top_k, s.top_p, self.generation.seed % 2**64,  # the wire takes 0..2^64-1
            self.max_new if max_new is None else max_new,
            root_id=root_id, context_from=context_from, context_dtype=self.options.context_dtype, stop_ids=stop_ids,
            prompt_len=None if root_id is None else len(self.prompt),
        )


def retry_while_down(call: Callable[[], T], options: SplitOptions, retry_busy: bool = False) -> T:
    """call() until it does not raise LinkDown (nor, with retry_busy, a 429 refusal: the server
    busy), with exponential back-off from retry_initial_s to retry_max_s; re-raises the last
    failure once offline_deadline_s would be passed."""
    deadline = time.monotonic() + options.offline_deadline_s
    delay = options.retry_initial_s
    told = False
    while True:
        try:
            return call()
        except (LinkDown, ServerRefused) as exc:
            if isinstance(exc, ServerRefused) and not (retry_busy and exc.status == BUSY):
                raise
            if time.monotonic() + delay > deadline:
                raise
            if options.notify is not None and not told:
                options.notify(f"{exc}; retrying for up to {options.offline_deadline_s:g} s")
                told = True
            time.sleep(delay)
            delay = min(2 * delay, options.retry_max_s)
