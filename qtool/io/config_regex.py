"""Regular expressions taken from a checkpoint's config, matched in time linear in the name.

GPTQModel's `dynamic` keys ("+:REGEX", "-:REGEX") and compressed-tensors' "re:" targets and ignore entries
are regexes that loaders run with Python's backtracking `re`. A file can carry `(a+)+$` and a module name
of a few hundred characters, and `re` then runs for longer than the universe exists. qtool never hands such
a pattern to `re`: the pattern is parsed by the standard library's own regex parser, checked against the
subset below, and run as a Thompson automaton (a set of states per character, cached as a lazy DFA), so a
match costs at most O(len(name) * states) whatever the pattern.

Supported: literals, `.`, classes (`[a-z_]`, `[^.]`, `\\d`, `\\w`, `\\s` and their negations), groups
(capturing or not), `|`, the quantifiers `* + ? {m,n}` (greedy or lazy, which agree on whether a name
matches), and the anchors `^ $ \\A \\Z`. Refused with an error naming the file and key: backreferences,
lookaround, conditionals, atomic groups, possessive quantifiers, word boundaries and inline flags; patterns
over MAX_PATTERN characters or expanding to more than MAX_STATES states. The regexes of one file share a
WorkBudget of MAX_WORK automaton steps (cache hits are free): names and patterns built to defeat the cache
end with the same error, never a long run.
"""

from __future__ import annotations

import re
from collections.abc import Callable

try:
    from re import _constants as _c
    from re import _parser as _sre_parse
except ImportError:  # Python < 3.11 keeps the same parser under its old names
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

from qtool.errors import InputError

MAX_PATTERN = 4096
MAX_STATES = 5_000
MAX_WORK = 20_000_000        # automaton steps one file's regexes may take together (a few seconds)
_CACHE_LIMIT = 4096          # entries per cache
_CACHE_STATES = 1 << 20      # state ids held by both caches together (memory bound for large automata)
_ALLOWED_FLAGS = re.UNICODE | re.VERBOSE

_FIX = ("rewrite the pattern with literals, classes, groups, | and * + ? {m,n} (no backreferences, lookaround, "
        "flags or word boundaries), or list the module names literally")


class UnsupportedRegex(ValueError):
    """The pattern is outside the bounded subset; the message says which construct."""


class WorkBudget:
    """Automaton steps left to the regexes of one file; shared so that many patterns cannot multiply it."""

    def __init__(self, steps: int = MAX_WORK) -> None:
        self.steps = self.left = steps


# --- character predicates ------------------------------------------------------------------------------

def _category(code) -> Callable[[str], bool]:
    table = {
        _c.CATEGORY_DIGIT: lambda ch: ch.isdecimal(),
        _c.CATEGORY_NOT_DIGIT: lambda ch: not ch.isdecimal(),
        _c.CATEGORY_SPACE: lambda ch: ch.isspace(),
        _c.CATEGORY_NOT_SPACE: lambda ch: not ch.isspace(),
        _c.CATEGORY_WORD: lambda ch: ch.isalnum() or ch == "_",
        _c.CATEGORY_NOT_WORD: lambda ch: not (ch.isalnum() or ch == "_"),
    }
    if code not in table:
        raise UnsupportedRegex(f"character category {code} is not supported")
    return table[code]


def _class(items) -> Callable[[str], bool]:
    """A predicate for an IN set: literals, ranges, categories, optional leading NEGATE."""
    negate = False
    lits: set[str] = set()
    ranges: list[tuple[int, int]] = []
    cats: list[Callable[[str], bool]] = []
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            lits.add(chr(av))
        elif op is _c.RANGE:
            ranges.append(av)
        elif op is _c.CATEGORY:
            cats.append(_category(av))
        else:
            raise UnsupportedRegex(f"'{op}' inside a character class is not supported")

    def pred(ch: str) -> bool:
        o = ord(ch)
        hit = ch in lits or any(lo <= o <= hi for lo, hi in ranges) or any(f(ch) for f in cats)
        return hit != negate
    return pred


# --- NFA construction ----------------------------------------------------------------------------------
# Nodes: ("char", pred, out) | ("split", [outs]) | ("assert", kind, out) | ("match",)

_BEGIN, _END, _END_ABS = "begin", "end", "end_abs"


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[list] = [["match"]]

    def add(self, node: list) -> int:
        if len(self.nodes) >= MAX_STATES:
            raise UnsupportedRegex(f"pattern expands to more than {MAX_STATES} automaton states")
        self.nodes.append(node)
        return len(self.nodes) - 1

    def seq(self, items, nxt: int) -> int:
        for op, av in reversed(list(items)):
            nxt = self.one(op, av, nxt)
        return nxt

    def one(self, op, av, nxt: int) -> int:
        if op is _c.LITERAL:
            ch = chr(av)
            return self.add(["char", ch.__eq__, nxt])
        if op is _c.NOT_LITERAL:
            ch = chr(av)
            return self.add(["char", ch.__ne__, nxt])
        if op is _c.ANY:
            return self.add(["char", "\n".__ne__, nxt])
        if op is _c.IN:
            return self.add(["char", _class(av), nxt])
        if op is _c.BRANCH:
            return self.add(["split", [self.seq(alt, nxt) for alt in av[1]]])
        if op is _c.SUBPATTERN:
            _group, add_flags, del_flags, body = av
            if add_flags or del_flags:
                raise UnsupportedRegex("inline flags such as (?i) are not supported")
            return self.seq(body, nxt)
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT):
            lo, hi, body = av
            if lo > MAX_STATES or (hi != _c.MAXREPEAT and hi - lo > MAX_STATES):
                raise UnsupportedRegex(f"repeat count {{{lo},{hi}}} expands to more than {MAX_STATES} states")
            if hi == _c.MAXREPEAT:
                loop = self.add(["split", []])
                self.nodes[loop][1] = [self.seq(body, loop), nxt]
                entry = loop
            else:
                entry = nxt
                for _ in range(hi - lo):
                    entry = self.add(["split", [self.seq(body, entry), nxt]])
            for _ in range(lo):
                entry = self.seq(body, entry)
            return entry
        if op is _c.AT:
            kind = {_c.AT_BEGINNING: _BEGIN, _c.AT_BEGINNING_STRING: _BEGIN, _c.AT_END: _END,
                    _c.AT_END_STRING: _END_ABS}.get(av)
            if kind is None:
                raise UnsupportedRegex(f"anchor {av} (word boundary or multiline) is not supported")
            return self.add(["assert", kind, nxt])
        names = {_c.GROUPREF: "backreferences", _c.GROUPREF_EXISTS: "conditional groups",
                 _c.ASSERT: "lookahead/lookbehind", _c.ASSERT_NOT: "negative lookaround"}
        for name, what in (("ATOMIC_GROUP", "atomic groups"), ("POSSESSIVE_REPEAT", "possessive quantifiers")):
            if getattr(_c, name, None) is op:
                raise UnsupportedRegex(f"{what} are not supported")
        raise UnsupportedRegex(f"{names.get(op, str(op).lower())} are not supported")


class BoundedRegex:
    """A config regex, checked and compiled; `match`, `search` and `fullmatch` answer like `re` (a bool)."""

    def __init__(self, pattern: str, budget: WorkBudget | None = None, path: object = None,
                 key: str = "regex") -> None:
        self.budget = budget or WorkBudget()
        self._where = (path, key)
        if not isinstance(pattern, str):
            raise UnsupportedRegex("the pattern is not a string")
        if len(pattern) > MAX_PATTERN:
            raise UnsupportedRegex(f"the pattern has {len(pattern)} characters (at most {MAX_PATTERN})")
        try:
            parsed = _sre_parse.parse(pattern, 0)
        except re.error as e:
            raise UnsupportedRegex(f"invalid regex: {e}") from None
        except RecursionError:
            raise UnsupportedRegex("the pattern nests too deeply") from None
        if parsed.state.flags & ~_ALLOWED_FLAGS:
            raise UnsupportedRegex("inline flags such as (?i) are not supported")
        b = _Builder()
        try:
            self.entry = b.seq(parsed, 0)
        except RecursionError:
            raise UnsupportedRegex("the pattern nests too deeply") from None
        self.pattern = pattern
        self.nodes = b.nodes
        self._closure: dict[tuple[frozenset, tuple], frozenset] = {}
        self._step: dict[tuple[frozenset, str], frozenset] = {}
        self._held = 0

    # The context of a position: at the start, at the very end, just before a final "\n" (where `$` matches).
    def _close(self, raw: frozenset, ctx: tuple[bool, bool, bool]) -> frozenset:
        key = (raw, ctx)
        got = self._closure.get(key)
        if got is not None:
            return got
        at_start, at_end, before_nl = ctx
        seen: set[int] = set()
        out: set[int] = set()
        stack = list(raw)
        nodes = self.nodes
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            n = nodes[i]
            kind = n[0]
            if kind == "split":
                stack.extend(n[1])
            elif kind == "assert":
                ok = at_start if n[1] == _BEGIN else at_end if n[1] == _END_ABS else (at_end or before_nl)
                if ok:
                    stack.append(n[2])
            else:
                out.add(i)
        got = frozenset(out)
        self._spend(len(seen))
        self._remember(self._closure, key, got, len(raw) + len(got))
        return got

    def _spend(self, steps: int) -> None:
        self.budget.left -= steps
        if self.budget.left < 0:
            path, key = self._where
            raise InputError(f"{key}: regex '{_shown(self.pattern)}' took more than {self.budget.steps:,} automaton "
                             "steps against this file's module names", path=path, fix=_FIX)

    def _remember(self, cache: dict, key, value: frozenset, size: int) -> None:
        """Cache a transition; both caches are dropped once they hold too many entries or state ids, so the
        lazy DFA costs bounded memory and each character at worst one closure over the automaton."""
        self._held += size
        if len(cache) > _CACHE_LIMIT or self._held > _CACHE_STATES:
            self._closure.clear()
            self._step.clear()
            self._held = size
        cache[key] = value

    def _advance(self, states: frozenset, ch: str) -> frozenset:
        key = (states, ch)
        got = self._step.get(key)
        if got is None:
            nodes = self.nodes
            got = frozenset(nodes[i][2] for i in states if nodes[i][0] == "char" and nodes[i][1](ch))
            self._spend(len(states))
            self._remember(self._step, key, got, len(states) + len(got))
        return got

    def _run(self, s: str, anywhere: bool, whole: bool) -> bool:
        n = len(s)
        entry = frozenset((self.entry,))
        final_nl = n > 0 and s[-1] == "\n"

        def ctx(pos: int) -> tuple[bool, bool, bool]:
            return (pos == 0, pos == n, final_nl and pos == n - 1)

        states = self._close(entry, ctx(0))
        for pos in range(n + 1):
            if 0 in states and (not whole or pos == n):
                return True
            if pos == n:
                return False
            raw = self._advance(states, s[pos])
            if anywhere:
                raw = raw | entry
            elif not raw:
                return False
            states = self._close(raw, ctx(pos + 1))
        return False

    def match(self, s: str) -> bool:
        """re.match: anchored at the start, may end anywhere."""
        return self._run(s, anywhere=False, whole=False)

    def search(self, s: str) -> bool:
        """re.search: anywhere in the name."""
        return self._run(s, anywhere=True, whole=False)

    def fullmatch(self, s: str) -> bool:
        return self._run(s, anywhere=False, whole=True)


def _shown(pattern: object) -> str:
    if not isinstance(pattern, str):
        return repr(pattern)[:80]
    return pattern if len(pattern) <= 80 else pattern[:77] + "..."


def compile_config_regex(pattern: object, *, path: object, key: str,
                         budget: WorkBudget | None = None) -> BoundedRegex:
    """A regex read from a checkpoint file, or InputError naming the file, the key and the fix. Pass one
    `budget` for all the regexes of a file."""
    try:
        return BoundedRegex(pattern, budget, path, key)  # type: ignore[arg-type]
    except UnsupportedRegex as e:
        raise InputError(f"{key}: regex '{_shown(pattern)}' cannot be matched safely: {e}", path=path,
                         fix=_FIX) from None
