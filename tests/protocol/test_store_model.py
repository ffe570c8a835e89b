"""A model test: random interleavings of every store transition against a reference model.

Hypothesis drives acquire / renew_many / progress / finish / release / recover
and the passing of time, from several owners over a few task ids, on a real
redis-server with real (short) ttls. The reference model predicts each answer;
where the answer depends on timing too close to call, it accepts either and
follows the store. Whatever the interleaving, these must hold:

- at most one terminal outcome is ever accepted per task;
- every accepted outcome carries the newest token issued for that task;
- tokens never decrease, and each new owner's token is greater than all before;
- a lease past its deadline (nobody renewed it) is always claimed by recovery.

Time: the model keeps each deadline as a window of local monotonic time,
[call start + ttl, call end + ttl], since the store sets it from the server
clock somewhere inside the call. A lease counts as expired only when the
window ended ``MARGIN`` before a call began, and as live only when it starts
``MARGIN`` after the call returned; in between, either answer is right.

``LEASES_MODEL_EXAMPLES`` (default 60) sets how many interleavings to run;
``LEASES_MODEL_RANDOM=1`` explores new ones instead of the fixed (derandomized) set;
``LEASES_MODEL_SHRINK=1`` shrinks a failing one (slow: every replay sleeps for real).
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field

import redis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from celery_leases import Claim, Code, LeaseLost, LeaseStore
from celery_leases.protocol.codes import OUTCOMES, TERMINAL_STATES

TASKS = ("t0", "t1")
OWNERS = ("w0", "w1", "w2")
SHORT = 0.1                 #: seconds: a ttl, progress timeout and grace that runs out in a test
LONG = 2.0                  #: seconds: a ttl that outlives an example
MARGIN = 0.025              #: seconds between a deadline and a call before the model is sure
MAX_RECOVERIES = 1
MAX_SLEEPS = 4              #: "time passes" steps per example, to bound the run time
LEASE_KINDS = [(SHORT, 0.0), (LONG, 0.0), (LONG, SHORT)]   # (ttl, progress timeout)


@dataclass
class Window:
    """When (local monotonic seconds) a server-clock deadline falls: somewhere in [lo, hi]."""

    lo: float
    hi: float

    @classmethod
    def around(cls, t0: float, t1: float, plus: float = 0.0) -> "Window":
        return cls(t0 + plus, t1 + plus)

    def passed(self, t0: float, t1: float) -> bool | None:
        """True if passed for sure during a call made in [t0, t1]; False if surely not; else None."""
        if self.hi + MARGIN <= t0:
            return True
        if t1 + MARGIN <= self.lo:
            return False
        return None


@dataclass
class Task:
    """The model's copy of one task's lease record."""

    state: str | None = None        # None: no record
    token: int = 0
    owner: str = ""
    generation: int = 0
    attempt: int = 0
    recoveries: int = 0
    unstarted: bool = False
    handed_over: int = 0            # the token a retry's hand-over left the record under
    ttl: float = 0.0
    progress_timeout: float = 0.0
    deadline: Window | None = None   # set while in the deadline index
    progress_deadline: Window | None = None
    newest_attempt: int = 0          # the highest attempt any message of this task carries
    issued: list[int] = field(default_factory=list)
    accepted: set = field(default_factory=set)   # (outcome, token) of accepted terminal outcomes

    @property
    def indexed(self) -> bool:
        return self.deadline is not None


def expect(actual, allowed, what: str) -> None:
    assert actual in allowed, f"{what}: got {actual!r}, model allows {sorted(map(str, allowed))}"


def finish_code(exc: LeaseLost | None) -> Code:
    if exc is None:
        return Code.OK
    if exc.reason == "missing":
        return Code.MISSING
    if exc.reason.startswith("already finished"):
        return Code.FINISHED
    assert exc.reason == "lost", exc.reason
    return Code.LOST


class LeaseModel(RuleBasedStateMachine):
    url: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.client = redis.Redis.from_url(self.url)
        self.prefix = f"m{uuid.uuid4().hex[:12]}"
        self.store = LeaseStore(self.client, prefix=self.prefix, ttl=LONG, retention=60,
                                max_recoveries=MAX_RECOVERIES, publish_grace=SHORT)
        self.tasks = {t: Task() for t in TASKS}
        self.held: dict[str, dict[str, int]] = {o: {} for o in OWNERS}   # owner -> task -> token
        self.issued_to: dict[str, list] = {t: [] for t in TASKS}         # task -> [(owner, token)]
        self.kinds: dict[str, dict[str, tuple]] = {o: {} for o in OWNERS}  # owner -> task -> kind
        self.seen_tokens = {t: 0 for t in TASKS}
        self.sleeps = 0

    # -- helpers ---------------------------------------------------------------

    def _issue(self, task_id: str, token: int) -> None:
        m = self.tasks[task_id]
        assert all(token > t for t in m.issued), \
            f"{task_id}: token {token} not greater than earlier tokens {m.issued}"
        m.issued.append(token)

    def _accept(self, task_id: str, outcome: str, token: int) -> None:
        m = self.tasks[task_id]
        assert token == max(m.issued), \
            f"{task_id}: outcome {outcome} accepted with token {token}, newest is {max(m.issued)}"
        if outcome != "retry":
            m.accepted.add((outcome, token))
            assert len(m.accepted) <= 1, f"{task_id}: several outcomes accepted: {m.accepted}"

    # -- rules ---------------------------------------------------------------------

    @rule(task_id=st.sampled_from(TASKS), owner=st.sampled_from((*OWNERS, "holder")),
          kind=st.sampled_from(LEASE_KINDS),
          copy=st.sampled_from(["newest", "next_attempt", "old_attempt", "old_generation"]))
    def acquire(self, task_id, owner, kind, copy):
        m = self.tasks[task_id]
        if owner == "holder":   # the delivery lands on the worker already running the task
            owner = m.owner or OWNERS[0]
        ttl, progress_timeout = kind
        generation, attempt = m.generation, m.newest_attempt
        if copy == "next_attempt":
            attempt += 1
        elif copy == "old_attempt":
            attempt = max(0, attempt - 1)
        elif copy == "old_generation":
            generation = max(0, generation - 1)

        # Given the model's record, What may acquire answer?
        timed = None    # the answer when the lease turns out due, if that depends on timing
        if m.state is None:
            allowed = {Code.ACQUIRED}
        elif m.state in TERMINAL_STATES:
            allowed = {Code.FINISHED}
        elif generation < m.generation or attempt < m.attempt:
            allowed = {Code.STALE}
        elif m.state == "active" and attempt == m.attempt and generation == m.generation:
            if m.unstarted:
                timed = Code.TAKEN_OVER
            else:
                timed = Code.DEAD if m.recoveries >= MAX_RECOVERIES else Code.TAKEN_OVER
        else:
            allowed = {Code.ACQUIRED}

        t0 = time.monotonic()
        acq = self.store.acquire(task_id, owner, ttl=ttl, generation=generation, attempt=attempt,
                                 progress_timeout=progress_timeout, body=b"body", envelope={})
        if acq.owned:
            # The model's tasks start running at once (leases never marked started
            # are covered in test_heartbeat_scripts.py): the worker's start mark.
            assert self.store.mark_started(owner, {task_id: acq.token}) == 1
        t1 = time.monotonic()
        if timed is not None:
            allowed = {True: {timed}, False: {Code.BUSY}, None: {timed, Code.BUSY}}[
                m.deadline.passed(t0, t1)]
        expect(acq.code, allowed, f"acquire {task_id} by {owner} gen {generation} attempt {attempt}")

        # Then the model follows the store
        if acq.code in (Code.ACQUIRED, Code.TAKEN_OVER):
            self._issue(task_id, acq.token)
            if acq.code is Code.TAKEN_OVER and not m.unstarted:
                m.recoveries += 1
            m.state, m.token, m.owner = "active", acq.token, owner
            m.generation = max(generation, m.generation)
            m.attempt, m.newest_attempt = attempt, max(m.newest_attempt, attempt)
            m.unstarted = False
            m.ttl, m.progress_timeout = ttl, progress_timeout
            m.deadline = Window.around(t0, t1, ttl)
            m.progress_deadline = Window.around(t0, t1, progress_timeout)
            self.held[owner][task_id] = acq.token
            self.kinds[owner][task_id] = kind
            self.issued_to[task_id].append((owner, acq.token))
        elif acq.code is Code.DEAD:
            m.state, m.owner, m.deadline = "dead", "", None
        else:
            assert acq.token == m.token
        assert (acq.generation, acq.recoveries) == (m.generation, m.recoveries)

    # Every rule draws the same values whatever the model's state: which leases are held
    # depends on timing (a deadline passed or not), and hypothesis refuses a test whose
    # draws change from one run of the same choices to the next (FlakyStrategyDefinition).
    # So a choice among state-dependent candidates is an index drawn from a fixed range.

    def _pick(self, data) -> tuple[str, str, int]:
        """(task, owner, token) of a caller: the current holder, the holder with an older
        token (a stale execution on the same worker), a former holder, or anyone."""
        task_id = data.draw(st.sampled_from(TASKS), label="task")
        who = data.draw(st.sampled_from(["holder", "holder_older_token", "former", "anyone"]),
                        label="caller")
        index = data.draw(st.integers(0, 63), label="which")
        anyone = data.draw(st.sampled_from(OWNERS), label="owner")
        m = self.tasks[task_id]
        former = self.issued_to[task_id]
        older = [(o, t) for o, t in former if o == m.owner and t != m.token]
        if who == "holder" and m.owner:
            return task_id, m.owner, m.token
        if who == "holder_older_token" and older:
            return (task_id, *older[index % len(older)])
        if who != "anyone" and former:
            return (task_id, *former[index % len(former)])
        return task_id, anyone, self.held[anyone].get(task_id, m.token or 1)

    def _holder(self, data) -> str:
        """An owner, mostly one holding some lease."""
        a_holder = data.draw(st.booleans(), label="a holder")
        index = data.draw(st.integers(0, 63), label="which holder")
        anyone = data.draw(st.sampled_from(OWNERS), label="owner")
        holders = sorted(o for o, held in self.held.items() if held)
        if holders and a_holder:
            return holders[index % len(holders)]
        return anyone

    @initialize(kinds=st.tuples(*[st.sampled_from(LEASE_KINDS)] * len(TASKS)),
                owners=st.tuples(*[st.sampled_from(OWNERS)] * len(TASKS)))
    def start_tasks(self, kinds, owners):
        # Every task starts running somewhere (a record of none is covered elsewhere)
        for task_id, kind, owner in zip(TASKS, kinds, owners, strict=True):
            self.acquire(task_id, owner, kind, "newest")

    @rule(data=st.data(), outcome=st.sampled_from(OUTCOMES))
    def finish(self, data, outcome):
        self._finish(*self._pick(data), outcome)

    def _finish(self, task_id, owner, token, outcome):
        m = self.tasks[task_id]

        # Given the model's record, What may finish answer?
        reasserted = m.state is None
        if m.state is None:
            # A holder whose record is gone re-creates it under its token (finish.lua).
            allowed = Code.OK if token > 0 else Code.MISSING
        elif m.state in TERMINAL_STATES:
            same = token == m.token and outcome == m.state and owner == m.owner
            allowed = Code.OK if same else Code.FINISHED
        elif m.state != "active" or token != m.token or owner != m.owner:
            allowed = Code.LOST
        else:
            allowed = Code.OK

        t0 = time.monotonic()
        try:
            self.store.finish(task_id, owner, token, outcome,
                              next_attempt=m.attempt + 1, retry_grace=SHORT)
            code = Code.OK
        except LeaseLost as exc:
            code = finish_code(exc)
        t1 = time.monotonic()
        expect(code, {allowed}, f"finish {task_id} by {owner} token {token} {outcome}")

        if code is Code.OK:
            if reasserted:
                self._issue(task_id, token)
                m.token, m.owner = token, owner
            self._accept(task_id, outcome, token)
            if outcome == "retry":
                m.state, m.owner, m.attempt = "recovering", "", m.attempt + 1
                m.handed_over = token
                m.newest_attempt = max(m.newest_attempt, m.attempt)
                m.deadline = Window.around(t0, t1, SHORT)
            else:
                m.state, m.deadline = outcome, None

    @rule(data=st.data())
    def renew_many(self, data):
        # Like the heartbeat: one call per class of lease (ttl, progress timeout or not)
        owner = self._holder(data)
        older = data.draw(st.lists(st.tuples(st.booleans(), st.integers(0, 63)),
                                   min_size=len(TASKS), max_size=len(TASKS)), label="older tokens")
        groups: dict[tuple, dict[str, int]] = {}
        for task_id, token in self.held[owner].items():
            tokens = [t for o, t in self.issued_to[task_id] if o == owner]
            renew_older, index = older[TASKS.index(task_id)]
            if len(tokens) > 1 and renew_older:
                token = tokens[index % len(tokens)]
            ttl, progress_timeout = self.kinds[owner][task_id]
            groups.setdefault((ttl, progress_timeout > 0), {})[task_id] = token
        for (ttl, check_progress), leases in sorted(groups.items()):
            self._renew(owner, leases, ttl, check_progress)

    def _renew(self, owner, leases, ttl, check_progress):
        t0 = time.monotonic()
        lost = self.store.renew_many(owner, leases, ttl=ttl, check_progress=check_progress)
        t1 = time.monotonic()

        for task_id, token in leases.items():
            m = self.tasks[task_id]
            # Given the model's record, What may renewal say of this lease?
            if m.state is None:
                allowed = {Code.MISSING}
            elif token != m.token:
                allowed = {Code.LOST}
            elif m.state in TERMINAL_STATES:
                allowed = {Code.FINISHED}
            elif m.state == "recovering" and m.handed_over == token:
                allowed = {Code.FINISHED}  # its holder handed it to the next attempt: nothing lost
            elif m.state == "recovering" or m.owner != owner:
                allowed = {Code.LOST}
            elif check_progress and m.progress_timeout:
                allowed = {True: {Code.STALLED}, False: {None}, None: {Code.STALLED, None}}[
                    m.progress_deadline.passed(t0, t1)]
            else:
                allowed = {None}
            code = lost.get(task_id)
            expect(code, allowed, f"renew_many by {owner}: {task_id} token {token}")
            if code is None:
                assert ttl == m.ttl      # the owner renews with the ttl it acquired with
                m.deadline = Window.around(t0, t1, ttl)
            elif code is Code.STALLED:
                m.owner, m.deadline = "", Window.around(t0, t1)
        assert set(lost) <= set(leases)

    # -- the same worker, two executions of one task -------------------------------
    # (self.retry() or a redelivery lands on the worker still running the old attempt)

    @rule(task_id=st.sampled_from(TASKS))
    def same_worker_gets_the_next_attempt(self, task_id):
        m = self.tasks[task_id]
        if m.owner:
            self.acquire(task_id, m.owner, (m.ttl, m.progress_timeout), "next_attempt")

    def _older_token(self, task_id) -> tuple[str, int] | None:
        m = self.tasks[task_id]
        older = [(o, t) for o, t in self.issued_to[task_id] if o == m.owner and t != m.token]
        return older[-1] if older else None

    @rule(task_id=st.sampled_from(TASKS), outcome=st.sampled_from(OUTCOMES))
    def old_execution_on_the_same_worker_finishes(self, task_id, outcome):
        older = self._older_token(task_id)
        if older:
            self._finish(task_id, *older, outcome)

    @rule(task_id=st.sampled_from(TASKS))
    def old_execution_on_the_same_worker_is_renewed(self, task_id):
        older = self._older_token(task_id)
        if older:
            owner, token = older
            ttl, progress_timeout = self.kinds[owner][task_id]
            self._renew(owner, {task_id: token}, ttl, progress_timeout > 0)

    @rule(data=st.data())
    def progress(self, data):
        task_id, owner, token = self._pick(data)
        m = self.tasks[task_id]
        if m.state is None:
            allowed = Code.MISSING
        elif m.state in TERMINAL_STATES:
            allowed = Code.FINISHED
        elif m.state == "recovering" or token != m.token or owner != m.owner:
            allowed = Code.LOST
        else:
            allowed = Code.OK

        t0 = time.monotonic()
        try:
            self.store.progress(task_id, owner, token)
            code = Code.OK
        except LeaseLost as exc:
            code = {"missing": Code.MISSING, "finished": Code.FINISHED,
                    "lost": Code.LOST}[exc.reason]
        t1 = time.monotonic()
        expect(code, {allowed}, f"progress {task_id} by {owner} token {token}")
        if code is Code.OK:
            m.deadline = Window.around(t0, t1, m.ttl)
            m.progress_deadline = Window.around(t0, t1, m.progress_timeout)

    @rule(data=st.data(), hand_back=st.booleans())
    def release(self, data, hand_back):
        owner = self._holder(data)
        leases = dict(self.held[owner])
        mine = [t for t, token in leases.items()
                if self.tasks[t].state == "active" and self.tasks[t].token == token
                and self.tasks[t].owner == owner]
        t0 = time.monotonic()
        # (The model's leases are all marked started: only a hand-back costs no recovery.)
        released = self.store.release(owner, leases, hand_back=hand_back)
        t1 = time.monotonic()
        assert released == len(mine), f"release by {owner}: {released} released, model {mine}"
        for task_id in mine:
            m = self.tasks[task_id]
            m.owner, m.unstarted, m.deadline = "", hand_back, Window.around(t0, t1)

    @rule(task_id=st.sampled_from(TASKS))
    def holder_crashes_then_recovery_runs(self, task_id):
        # The pool child running the task dies: its worker releases the lease, a pass recovers it
        m = self.tasks[task_id]
        if m.state == "active" and m.owner:
            t0 = time.monotonic()
            assert self.store.release(m.owner, {task_id: m.token}) == 1
            m.owner, m.unstarted, m.deadline = "", False, Window.around(t0, time.monotonic())
        self._recover(broker_down=False)

    @rule(broker_down=st.booleans())
    def recover(self, broker_down):
        self._recover(broker_down)

    @precondition(lambda self: self.sleeps < MAX_SLEEPS)
    @rule()
    def time_passes(self):
        self.sleeps += 1
        time.sleep(SHORT + 2 * MARGIN)

    # -- recovery ------------------------------------------------------------

    def _recover(self, broker_down: bool) -> None:
        published: list[Claim] = []
        dead: list[Claim] = []

        def publish(claim: Claim) -> None:
            if broker_down:
                raise ConnectionError("broker down")
            published.append(claim)

        before = {t: (m.state, m.indexed and m.deadline) for t, m in self.tasks.items()}
        t0 = time.monotonic()
        report = self.store.recover(publish=publish, on_dead=dead.append)
        t1 = time.monotonic()
        claimed = {c.task_id: c for c in published + dead}
        failed = {task_id for task_id, _ in report.errors}
        claimed.update({t: None for t in failed})
        assert report.dead == len(dead)

        for task_id, m in self.tasks.items():
            state, deadline = before[task_id]
            # A lease surely past its deadline must be claimed; one surely not, must not
            if state in ("active", "recovering") and deadline:
                verdict = deadline.passed(t0, t0)
                if verdict:
                    assert task_id in claimed, f"{task_id} is past its deadline but was not recovered"
                if deadline.passed(t1, t1) is False:
                    assert task_id not in claimed, f"{task_id} was recovered before its deadline"
            else:
                assert task_id not in claimed, f"{task_id} ({state}, unindexed) was recovered"
            if task_id not in claimed:
                continue
            counted = state == "active" and not m.unstarted
            claim = next((c for c in published + dead if c.task_id == task_id), None)
            if counted and m.recoveries >= MAX_RECOVERIES:
                assert claim is not None and claim.code is Code.DEAD, (task_id, claim)
                assert (claim.generation, claim.recoveries) == (m.generation, m.recoveries)
                m.state, m.owner, m.deadline = "dead", "", None
                continue
            m.generation += 1
            m.recoveries += 1 if counted else 0
            m.state, m.owner, m.attempt = "recovering", "", 0
            if task_id in failed:
                m.deadline = Window.around(t0, t1, SHORT)
            else:
                assert claim.code is Code.RECOVERED
                assert (claim.generation, claim.recoveries) == (m.generation, m.recoveries)
                m.deadline = None

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def records_match_the_model(self):
        for task_id, m in self.tasks.items():
            rec = self.store.get(task_id)
            if m.state is None:
                assert rec is None
                continue
            got = (rec.state, rec.token, rec.owner, rec.generation, rec.recoveries, rec.attempt)
            want = (m.state, m.token, m.owner, m.generation, m.recoveries, m.attempt)
            assert got == want, f"{task_id}: store {got} != model {want}"
            # Tokens never decrease
            assert rec.token >= self.seen_tokens[task_id]
            self.seen_tokens[task_id] = rec.token
            # Active records never expire on their own; finished ones are kept for retention
            ttl = self.client.pttl(self.store.keys.record(task_id))
            if m.state == "active":
                assert ttl == -1, f"{task_id}: active record has a TTL ({ttl} ms)"
            if m.state in TERMINAL_STATES:
                assert 0 < ttl <= 60_000 and not rec.has_message
        index = dict(self.store.active())
        assert set(index) == {t for t, m in self.tasks.items() if m.indexed}

    def teardown(self):
        try:
            # A lease that nobody renewed and whose deadline surely passed is recoverable
            self._recover(broker_down=False)
        finally:
            keys = [self.store.keys.record(t) for t in TASKS]
            self.client.delete(*keys, self.store.keys.deadlines, self.store.keys.sequence,
                               self.store.keys.stats)
            self.client.close()


def new_lease_model() -> LeaseModel:
    """The machine's factory. Hypothesis digests the factory's source: for a class,
    inspect parses the whole module with ast, which CPython 3.11.7 may fail with
    "AST constructor recursion depth mismatch" while other threads run (cpython#106905);
    a function's source is found without ast."""
    return LeaseModel()


def test_the_store_follows_the_model_in_any_interleaving(redis_server_url):
    LeaseModel.url = redis_server_url
    run_state_machine_as_test(new_lease_model, settings=settings(
        max_examples=int(os.environ.get("LEASES_MODEL_EXAMPLES", "60")),
        stateful_step_count=30,
        deadline=None,
        derandomize=os.environ.get("LEASES_MODEL_RANDOM", "") != "1",
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        # Shrinking replays examples with real sleeps for minutes: opt in when debugging
        phases=[Phase.explicit, Phase.reuse, Phase.generate]
        + ([Phase.shrink] if os.environ.get("LEASES_MODEL_SHRINK") == "1" else []),
    ))


def test_the_model_judges_a_deadline_only_with_a_margin():
    # Given a deadline somewhere in [10.0, 10.1] (local seconds)
    window = Window(10.0, 10.1)
    # Then it has surely passed for a call starting MARGIN after 10.1, surely not for
    # one ending MARGIN before 10.0, and in between the model accepts either answer
    assert window.passed(10.1 + MARGIN, 10.2) is True
    assert window.passed(9.0, 10.0 - MARGIN) is False
    assert window.passed(10.05, 10.06) is None
