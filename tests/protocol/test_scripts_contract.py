"""Every Lua script's header is its contract; these tests keep header, body and host in step.

A header (the opening ``--[[ ... ]]`` block) has a purpose line ``<name>: ...``,
an ``Input:`` section listing each ``KEYS[i]`` / ``ARGV[i]``, and an ``Output:``
section listing the return codes by their ``Code`` name. BullMQ's headers
drifted from their code; this file is what stops ours from drifting.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from celery_leases import Code, LeaseStore
from celery_leases.protocol.fencing import fenced_set
from celery_leases.protocol import calls as calls_module, fencing, scripts as scripts_module, unwritten
from celery_leases.protocol.scripts import SCRIPT_NAMES, Script, source
from celery_leases.protocol.queued import QueuedTask, QueuedTasks
from celery_leases.protocol.transport import DirectCaller
from celery_leases.protocol.transitions import FinishRequest

SCRIPT_DIR = Path(scripts_module.__file__).resolve().parent / "scripts"
LUA_FILES = sorted(p for p in SCRIPT_DIR.glob("*.lua") if p.name != "_helpers.lua")
#: Upper-case words an Output section may use that are not return codes.
PROSE_WORDS = {"NOT", "JSON", "TTL", "ID", "KEYS", "ARGV", "TIME"}

#: Where a script hands back a return code; group 1 is the code (a name, never a numeral:
#: the names are generated from the Code enum into every script by scripts.py).
CODE_PLACES = [
    re.compile(r"\breturn\s*\{\s*(\w+)\s*[,}]"),                        # return {FINISHED, ...}
    re.compile(r"table\.insert\(\s*\w+\s*,\s*(\w+)\s*\)"),               # table.insert(out, STALLED)
    re.compile(r"table\.insert\(\s*\w+\s*,\s*\{\s*[\w.]+\s*,\s*(\w+)\s*,"),  # {task_id, DEAD, ...}
    re.compile(r"\bcode\s*=\s*(\w+)"),                                   # code = TAKEN_OVER
]
#: Shared helpers whose reply is CORRUPT when what they check is corrupt: a body
#: that returns one of their answers returns CORRUPT.
CORRUPT_HELPERS = re.compile(r"\b(check_type|corrupt|load)\(|\bCORRUPT\b")
FIXED_INDEX = re.compile(r"^\s*(KEYS|ARGV)\[(\d+)\]\s", re.M)
OPTIONAL_INDEX = re.compile(r"^\s*(KEYS|ARGV)\[(\d+)\]\s+optional\b", re.M)
RANGE_INDEX = re.compile(r"^\s*(KEYS|ARGV)\[(\d+)\.\.", re.M)
PAIRED_INDEX = re.compile(r"^\s*(KEYS|ARGV)\[\d*k", re.M)


def _helper_replies() -> dict[str, set[str]]:
    """Helper function -> the codes it hands back as a reply (``return {CODE, ...}``): a
    script that returns what such a helper returned returns those codes too."""
    text = (SCRIPT_DIR / "_helpers.lua").read_text("utf-8")
    found: dict[str, set[str]] = {}
    for match in re.finditer(r"^local function (\w+)\((.*?)(?=^local |\Z)", text, re.S | re.M):
        codes = set(re.findall(r"return \{(\w+)", match.group(2))) & set(Code.__members__)
        if codes:
            found[match.group(1)] = codes
    return found


#: Shared helpers that answer with a reply of their own, and its codes (e.g. owner_guard).
HELPER_REPLIES = _helper_replies()


@dataclass
class Contract:
    name: str
    purpose: str
    input: str
    output: str
    body: str

    def fixed(self, kind: str) -> list[int]:
        """Indices of ``kind`` (KEYS/ARGV) documented one by one."""
        return sorted({int(i) for k, i in FIXED_INDEX.findall(self.input) if k == kind})

    def optional(self, kind: str) -> list[int]:
        """Indices of ``kind`` documented as optional (a caller may leave off that tail)."""
        return sorted({int(i) for k, i in OPTIONAL_INDEX.findall(self.input) if k == kind})

    def variadic(self, kind: str) -> bool:
        """True when the header documents a variable tail of ``kind``."""
        return any(k == kind for k, _ in RANGE_INDEX.findall(self.input)) or \
            any(k == kind for k in PAIRED_INDEX.findall(self.input))

    def used(self, kind: str) -> list[int]:
        """Literal indices of ``kind`` the body reads."""
        return sorted({int(i) for i in re.findall(rf"\b{kind}\[(\d+)\]", self.body)})

    def listed_codes(self) -> list[str]:
        """Code names that open a line of the Output section."""
        return re.findall(r"^\s+([A-Z][A-Z_]+)\s", self.output, re.M)

    def named_words(self) -> set[str]:
        return set(re.findall(r"\b([A-Z][A-Z_]+)\b", self.output)) - PROSE_WORDS

    def code_words(self) -> list[tuple[str, str]]:
        """(word, source line) in every place the body hands back a return code."""
        found = []
        for line in self.body.splitlines():
            code_part = line.split("--", 1)[0]
            for pattern in CODE_PLACES:
                found += [(word, line.strip()) for word in pattern.findall(code_part)]
        return found

    def returned_codes(self) -> list[tuple[str, str]]:
        """(code name, source line) of every code the body returns."""
        found = [(word, line) for word, line in self.code_words() if word in Code.__members__]
        for line in self.body.splitlines():
            code_part = line.split("--", 1)[0]
            if CORRUPT_HELPERS.search(code_part):
                found.append(("CORRUPT", line.strip()))
            for helper, codes in HELPER_REPLIES.items():
                if re.search(rf"\b{helper}\(", code_part):
                    found += [(code, line.strip()) for code in sorted(codes)]
        return found


def parse(path: Path) -> Contract:
    text = path.read_text("utf-8")
    match = re.match(r"\s*--\[\[(.*?)\]\]", text, re.S)
    assert match, f"{path.name}: no --[[ ... ]] header at the top"
    header, body = match.group(1), text[match.end():]
    lines = [line for line in header.splitlines() if line.strip()]
    purpose = lines[0].strip() if lines else ""
    input_match = re.search(r"^\s*Input:\s*$(.*?)(?=^\s*Output:)", header, re.S | re.M)
    output_match = re.search(r"^\s*Output:(.*)\Z", header, re.S | re.M)
    return Contract(path.stem, purpose,
                    input_match.group(1) if input_match else "",
                    output_match.group(1) if output_match else "", body)


CONTRACTS = [parse(p) for p in LUA_FILES]
IDS = [c.name for c in CONTRACTS]


def test_there_are_scripts_to_check():
    assert len(CONTRACTS) >= 8


@pytest.mark.parametrize("contract", CONTRACTS, ids=IDS)
def test_header_has_a_purpose_an_input_and_an_output_section(contract):
    # Given a script's header, Then it opens with "<name>: <purpose>"
    assert re.match(rf"^{contract.name}: \S.{{10,}}", contract.purpose), contract.purpose
    # And it has an Input: section listing at least one key, and an Output: section
    assert contract.fixed("KEYS"), f"{contract.name}: Input: lists no KEYS[i]"
    assert contract.output.strip(), f"{contract.name}: Output: section missing or empty"


@pytest.mark.parametrize("contract", CONTRACTS, ids=IDS)
def test_every_code_named_in_the_output_section_is_a_code_member(contract):
    unknown = {w for w in contract.named_words() | set(contract.listed_codes())
               if w not in Code.__members__}
    assert unknown == set(), f"{contract.name}: Output names codes not in Code: {unknown}"


@pytest.mark.parametrize("contract", CONTRACTS, ids=IDS)
def test_no_script_returns_a_numeric_code(contract):
    # Given every place the body hands back a code, Then it names the code (OK, LOST, ...):
    # a numeral would be a second copy of the Code enum, free to drift from it.
    numerals = [line for word, line in contract.code_words() if word.isdigit()]
    assert numerals == [], f"{contract.name}: numeric return codes: {numerals}"


@pytest.mark.parametrize("contract", CONTRACTS, ids=IDS)
def test_every_code_the_body_returns_is_listed_in_the_output_section(contract):
    # Given the codes the body returns, Then the Output section lists each
    documented = contract.named_words()
    for name, line in contract.returned_codes():
        assert name in documented, f"{contract.name}: returns {name} not in Output: {line}"


@pytest.mark.parametrize("contract", CONTRACTS, ids=IDS)
def test_every_code_listed_in_the_output_section_is_returned_by_the_body(contract):
    returned = {name for name, _ in contract.returned_codes()}
    missing = set(contract.listed_codes()) - returned
    assert missing == set(), f"{contract.name}: Output lists codes the body never returns: {missing}"


@pytest.mark.parametrize("contract", CONTRACTS, ids=IDS)
@pytest.mark.parametrize("kind", ["KEYS", "ARGV"])
def test_the_body_reads_no_key_or_argument_the_header_does_not_document(contract, kind):
    # Given the indices documented one by one, Then they run 1..n without gaps
    fixed = contract.fixed(kind)
    assert fixed == list(range(1, len(fixed) + 1)), f"{contract.name}: {kind} documented {fixed}"
    # And every literal index the body reads is among them
    undocumented = [i for i in contract.used(kind) if i not in fixed]
    assert undocumented == [], f"{contract.name}: body reads undocumented {kind}{undocumented}"
    # And every one documented is read (a variadic tail may be read in a loop, by offset)
    if not contract.variadic(kind):
        unused = [i for i in fixed if i not in contract.used(kind)]
        assert unused == [], f"{contract.name}: header documents {kind}{unused}, the body never reads it"


def test_every_script_on_disk_is_a_known_script_name():
    on_disk = {p.stem for p in LUA_FILES}
    assert on_disk - set(SCRIPT_NAMES) == set()


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_script_loads_on_the_real_server(redis_client, name):
    # Given a script named by the loader
    if not (SCRIPT_DIR / f"{name}.lua").exists():
        pytest.skip(f"{name}.lua is named in SCRIPT_NAMES but not written yet")

    # When its full source (helpers it uses + file) is loaded
    sha = redis_client.script_load(source(name))

    # Then the server compiled it, under the SHA the loader calls it by
    assert sha == Script(name).sha
    assert redis_client.script_exists(sha) == [True]


def test_script_load_would_catch_a_syntax_error(redis_client):
    with pytest.raises(redis.ResponseError):
        redis_client.script_load(source("expired") + "\nreturn {")


def test_the_store_passes_each_script_the_keys_and_arguments_its_header_documents(
        redis_server_url, key_prefix, monkeypatch):
    # Given every call the store makes to a script is recorded
    calls: list[tuple[str, int, int]] = []
    real_call, real_direct = calls_module.call_script, DirectCaller.call
    names = {getattr(scripts_module.scripts, name).sha: name for name in SCRIPT_NAMES}

    def spy(client, script, keys, args):
        calls.append((script.name, len(keys), len(args)))
        return real_call(client, script, keys, args)

    def spy_direct(self, sha, keys, args):
        calls.append((names[sha], len(keys), len(args)))
        return real_direct(self, sha, keys, args)

    monkeypatch.setattr(calls_module, "call_script", spy)
    monkeypatch.setattr(fencing, "call_script", spy)
    monkeypatch.setattr(DirectCaller, "call", spy_direct)
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=0.05)

    # When the store runs every transition
    acq = store.acquire("t1", "w", body=b"b", envelope={})
    store.renew_many("w", {"t1": acq.token})
    store.mark_started("w", {"t1": acq.token})
    store.acquire_many([dict(task_id="t7", owner="w")], owner="w", starts={"t1": acq.token})
    store.progress("t1", "w", acq.token)
    store.release("w", {"t1": acq.token})
    store.recover(publish=lambda claim: None)
    again = store.acquire("t1", "w", generation=1)
    store.complete_step("t1", "w", again.token, "step")
    fenced_set(store.client, store.keys, "r", again.token, "v")
    store.finish("t1", "w", again.token, "succeeded")
    store.client.delete(store.keys.record("t1"))
    store.acquire("t1", "w", reassert=again.token)
    handed = store.acquire("t4", "w")
    store.finish("t4", "w", handed.token, "retry", next_attempt=1)
    pair = {t: store.acquire(t, "w").token for t in ("t8", "t9")}
    assert store.finish_many([FinishRequest(t, "w", token, "succeeded") for t, token in pair.items()]) == [None, None]
    other = store.acquire("t2", "w")
    store.finish("t2", "w", other.token, "succeeded", write=(f"{key_prefix}:result:t2", "r", 0))
    kept = store.acquire("t6", "w")
    store.finish("t6", "w", kept.token, "failed", kept=unwritten.pack("FAILURE", "n", None, b"{}"),
                 kept_due=0.001, written=["t2"])
    time.sleep(0.01)
    unwritten.confirm(store, [c.task_id for c in unwritten.claim(store)], wrote=1)
    store.revoke("t3", name="proj.add")
    store.purge()
    store.park("t3", "corrupt", body=b"b", envelope={"x": 1}, key="k", field="f")
    store.unpark("t3")
    queued = QueuedTasks(store, 0.05)
    queued.enqueue(QueuedTask("t5", "proj.add", b"b", {}))
    time.sleep(0.1)
    queued.recover(publish=lambda item: None)
    queued.forget("t5")
    store.client.close()

    # Then each got exactly its documented keys and arguments, or more for variadic ones
    contracts = {c.name: c for c in CONTRACTS}
    seen = set()
    for name, n_keys, n_args in calls:
        contract, seen = contracts[name], seen | {name}
        for kind, n in (("KEYS", n_keys), ("ARGV", n_args)):
            fixed = len(contract.fixed(kind))
            if contract.variadic(kind):
                assert n >= fixed - len(contract.optional(kind)), (name, kind, n, fixed)
            else:
                assert fixed - len(contract.optional(kind)) <= n <= fixed, (name, kind, n, fixed)
    assert seen == set(SCRIPT_NAMES)


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_script_gets_its_codes_from_the_python_enum_and_none_of_its_own(name):
    # Given the source a script is sent as, Then each code it defines is the Code member's value
    text = source(name)
    constants = dict(re.findall(r"^local ([A-Z_]+) = (\d+)$", text, re.M))
    assert constants and all(constants[n] == str(int(Code[n])) for n in constants), constants
    # And it defines exactly the codes its code names (a code it used undefined would be nil)
    code = re.sub(r"^local [A-Z_]+ = \d+$", "", re.sub(r"--\[\[.*?\]\]|--[^\n]*", "", text, flags=re.S),
                  flags=re.M)
    used = {n for n in Code.__members__ if re.search(rf"\b{n}\b", code)}
    assert set(constants) == used, (name, set(constants) ^ used)
    # And neither the helpers nor a script file defines a code of its own
    for path in [SCRIPT_DIR / "_helpers.lua", *LUA_FILES]:
        own = re.findall(r"^local ([A-Z_]+) = \d+", path.read_text("utf-8"), re.M)
        assert not set(own) & set(Code.__members__), f"{path.name} defines codes {own}"


def test_a_script_carries_only_the_helpers_it_calls():
    # Given finish, which calls no charge_death, Then its source does not define it
    assert "local function charge_death" not in source("finish")
    # And acquire, which does, carries it and the helpers it calls in turn
    assert "local function charge_death" in source("acquire")
    assert "local function unstarted_limit" in source("acquire")


def test_terminal_states_are_tested_by_the_shared_helper_only():
    # A line comparing a state with three or four terminal states one by one is the
    # test is_terminal() holds (succeeded-or-failed alone, a finished run, is not).
    for path in LUA_FILES:
        body = path.read_text("utf-8").split("]]", 1)[1]
        for line in body.splitlines():
            named = set(re.findall(r"\bstate [=~]= '(succeeded|failed|dead|revoked)'", line))
            assert len(named) < 3, f"{path.name}: tests terminal states by hand: {line.strip()}"
