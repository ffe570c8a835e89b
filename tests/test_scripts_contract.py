"""Every Lua script's header is its contract; these tests keep header, body and host in step.

A header (the opening ``--[[ ... ]]`` block) has a purpose line ``<name>: ...``,
an ``Input:`` section listing each ``KEYS[i]`` / ``ARGV[i]``, and an ``Output:``
section listing the return codes by their ``Code`` name. BullMQ's headers
drifted from their code; this file is what stops ours from drifting.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from celery_leases import Code, LeaseStore
from celery_leases.direct import DirectCaller
from celery_leases.fencing import fenced_set
from celery_leases import scripts as scripts_module
from celery_leases.scripts import SCRIPT_NAMES, Script, source

SCRIPT_DIR = Path(scripts_module.__file__).resolve().parent / "scripts"
LUA_FILES = sorted(p for p in SCRIPT_DIR.glob("*.lua") if p.name != "_prelude.lua")
#: Upper-case words an Output section may use that are not return codes.
PROSE_WORDS = {"NOT", "JSON", "TTL", "ID", "KEYS", "ARGV", "TIME"}

#: Where a script hands back a return code as a numeric literal.
CODE_LITERALS = [
    re.compile(r"\breturn\s*\{\s*(\d+)\s*[,}]"),                        # return {4, ...}
    re.compile(r"table\.insert\(\s*\w+\s*,\s*(\d+)\s*\)"),               # table.insert(out, 7)
    re.compile(r"table\.insert\(\s*\w+\s*,\s*\{\s*[\w.]+\s*,\s*(\d+)\s*,"),  # {task_id, 6, ...}
    re.compile(r"\bcode\s*=\s*(\d+)"),                                   # code = 2 -- TAKEN_OVER
]
#: Prelude helpers whose reply is CORRUPT when what they check is corrupt: a body
#: that returns one of their answers returns CORRUPT.
CORRUPT_HELPERS = re.compile(r"\b(check_type|corrupt|load)\(|\bCORRUPT\b")
FIXED_INDEX = re.compile(r"^\s*(KEYS|ARGV)\[(\d+)\]\s", re.M)
OPTIONAL_INDEX = re.compile(r"^\s*(KEYS|ARGV)\[(\d+)\]\s+optional\b", re.M)
RANGE_INDEX = re.compile(r"^\s*(KEYS|ARGV)\[(\d+)\.\.", re.M)
PAIRED_INDEX = re.compile(r"^\s*(KEYS|ARGV)\[\d*k", re.M)


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

    def returned_codes(self) -> list[tuple[int, str]]:
        """(numeric code, source line) of every literal the body returns as a code."""
        found = []
        for line in self.body.splitlines():
            code_part = line.split("--", 1)[0]
            for pattern in CODE_LITERALS:
                found += [(int(n), line.strip()) for n in pattern.findall(code_part)]
            if CORRUPT_HELPERS.search(code_part):
                found.append((int(Code.CORRUPT), line.strip()))
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
def test_every_code_the_body_returns_is_listed_in_the_output_section(contract):
    # Given the numeric codes the body returns
    documented = contract.named_words()
    for number, line in contract.returned_codes():
        # Then each is a Code member that the Output section lists
        assert number in Code._value2member_map_, f"{contract.name}: {number} is no Code: {line}"
        name = Code(number).name
        assert name in documented, f"{contract.name}: returns {name} ({number}) not in Output: {line}"
        # And a trailing "-- NAME" comment, if any, agrees with the number
        comment = re.search(r"--\s*([A-Z][A-Z_]+)\b", line)
        if comment and comment.group(1) in Code.__members__:
            assert comment.group(1) == name, f"{contract.name}: {line}"


@pytest.mark.parametrize("contract", CONTRACTS, ids=IDS)
def test_every_code_listed_in_the_output_section_is_returned_by_the_body(contract):
    returned = {Code(n).name for n, _ in contract.returned_codes()
                if n in Code._value2member_map_}
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


def test_every_script_on_disk_is_a_known_script_name():
    on_disk = {p.stem for p in LUA_FILES}
    assert on_disk - set(SCRIPT_NAMES) == set()


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_script_loads_on_the_real_server(redis_client, name):
    # Given a script named by the loader
    if not (SCRIPT_DIR / f"{name}.lua").exists():
        pytest.skip(f"{name}.lua is named in SCRIPT_NAMES but not written yet")

    # When its full source (prelude + file) is loaded
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
    real_call, real_direct = Script.__call__, DirectCaller.call
    names = {getattr(scripts_module.scripts, name).sha: name for name in SCRIPT_NAMES}

    def spy(self, client, keys, args):
        calls.append((self.name, len(keys), len(args)))
        return real_call(self, client, keys, args)

    def spy_direct(self, sha, keys, args):
        calls.append((names[sha], len(keys), len(args)))
        return real_direct(self, sha, keys, args)

    monkeypatch.setattr(Script, "__call__", spy)
    monkeypatch.setattr(DirectCaller, "call", spy_direct)
    store = LeaseStore(redis.Redis.from_url(redis_server_url), prefix=key_prefix, ttl=0.05)

    # When the store runs every transition
    acq = store.acquire("t1", "w", body=b"b", envelope={})
    store.renew_many("w", {"t1": acq.token})
    store.mark_started("w", {"t1": acq.token})
    store.progress("t1", "w", acq.token)
    store.release("w", {"t1": acq.token})
    store.recover(publish=lambda claim: None)
    again = store.acquire("t1", "w", generation=1)
    store.complete_step("t1", "w", again.token, "step")
    fenced_set(store.client, store.keys, "r", again.token, "v")
    store.finish("t1", "w", again.token, "succeeded")
    other = store.acquire("t2", "w")
    store.finish("t2", "w", other.token, "succeeded", write=(f"{key_prefix}:result:t2", "r", 0))
    store.revoke("t3", name="proj.add")
    store.purge()
    store.park("t3", "corrupt", body=b"b", envelope={"x": 1}, key="k", field="f")
    store.unpark("t3")
    store.client.close()

    # Then each got exactly its documented keys and arguments, or more for variadic ones
    contracts = {c.name: c for c in CONTRACTS}
    seen = set()
    for name, n_keys, n_args in calls:
        contract, seen = contracts[name], seen | {name}
        for kind, n in (("KEYS", n_keys), ("ARGV", n_args)):
            fixed = len(contract.fixed(kind))
            if contract.variadic(kind):
                assert n >= fixed, (name, kind, n, fixed)
            else:
                assert fixed - len(contract.optional(kind)) <= n <= fixed, (name, kind, n, fixed)
    assert seen == set(SCRIPT_NAMES)


def test_the_prelude_names_codes_by_the_values_of_the_python_enum():
    # Given the named code constants the prelude defines (local NAME = number)
    prelude = (SCRIPT_DIR / "_prelude.lua").read_text("utf-8")
    constants = dict(re.findall(r"^local ([A-Z_]+) = (\d+)", prelude, re.M))
    # Then each is a Code member with that value
    assert constants, "the prelude defines no code constants"
    assert {name: int(v) for name, v in constants.items()} == \
        {name: int(Code[name]) for name in constants}
