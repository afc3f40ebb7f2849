"""Request bodies of plain values, checked by hand without building the request model.

The rule: a check made here (`object_check`) takes a decoded JSON object and answers
NO or the extras the model keeps (its names that are not fields, as sent), and never
raises. An answer other than NO promises that `cls.model_validate(value)` succeeds,
holding every field the body sends exactly as sent (an int where a float is due aside:
the model holds its float), so a caller may read the body's own values in place of the
model's. NO means "not decided here": the body takes the model's own validation, which
words every error. A check accepts only what its model accepts and refuses nothing
itself. The request models state their checks beside their fields (shared/wire/
protocol.py `_PLAIN_CHAT`, `_PLAIN_COMPLETION`); a differential hypothesis test over
generated and mutated bodies holds the two to this rule
(tests/shared/wire/test_plain_body.py).

What a check decides: names it has a rule for (any other: NO, or kept as an extra where
the model keeps it, `extra="allow"`), values of JSON's exact types within the field's
bounds, as strict pydantic takes them (no "5" for 5, no 0 for false). A field's rule is
a table from a value's exact type to what a value of that type must meet: `ACCEPT`
(anything), a `_Range` (a number's), a `_Length` (a text's), a frozenset (a Literal
of strings) or a function (lists, nested objects). Plain values are decided inside the
object's loop, without a call. Lists longer than MAX_ITEMS are the model's.

Why: the model's validator costs ~1.5 us a three-field completion body and ~3.2 us a
two-message chat (timeit, pydantic-core 2.50), a dispatch over each of ~25 fields and
an object built for the request and each message; a router that routes on text reads
five of those fields. A check here reads only the names the body sends, ~0.4 us.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from types import FunctionType
from typing import Any

from pydantic import BaseModel

Rule = dict[type, Any]  # a value's exact type → what it must meet (the module says)
Check = Callable[[dict[str, Any]], Any]

NO: Any = object()  # a check's answer: not decided here (the model decides)
ACCEPT: Any = object()  # a rule's "any value of this type"
_KEEP: Any = object()  # `object_check`'s mark of a name kept as an extra
MAX_ITEMS = 256
I64_MIN, I64_MAX = -(2**63), 2**63 - 1  # "any int": beyond 64 bits, the model's


class _Range:
    """A number within [low, high], or (low, high] where `low_open`."""

    __slots__ = ("high", "low", "low_open")

    def __init__(self, low: float, high: float, low_open: bool = False) -> None:
        self.low, self.high, self.low_open = low, high, low_open


class _Length:
    """A text of [low, high] characters."""

    __slots__ = ("high", "low")

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high


def _meets(how: Any, value: Any) -> bool:
    """Whether `value` meets its rule's entry for its type (`how`)."""
    if how is ACCEPT:
        return True
    kind = type(how)
    if kind is _Range:
        return value <= how.high and (value > how.low or (value == how.low and not how.low_open))
    if kind is _Length:
        return how.low <= len(value) <= how.high
    if kind is frozenset:
        return value in how
    return how(value) is not NO


# -- rules ----------------------------------------------------------------------------
boolean: Rule = {bool: ACCEPT}


def optional(rule: Rule) -> Rule:
    return {**rule, type(None): ACCEPT}


def text(min_len: int = 0, max_len: int = I64_MAX) -> Rule:
    """A str field, its length in characters within [min_len, max_len]."""
    if min_len == 0 and max_len == I64_MAX:
        return {str: ACCEPT}
    return {str: _Length(min_len, max_len)}


def one_of(*allowed: str) -> Rule:
    """A Literal of strings."""
    return {str: frozenset(allowed)}


def integer(low: int = I64_MIN, high: int = I64_MAX) -> Rule:
    """An int field within [low, high] (a bool is not an int: its type is bool)."""
    return {int: _Range(low, high)}


def number(low: float, high: float, low_open: bool = False) -> Rule:
    """A float field within [low, high] (or (low, high]); an int is taken (strict
    pydantic takes one, as its float)."""
    bounds = _Range(low, high, low_open)
    return {int: bounds, float: bounds}


def either(*rules: Rule) -> Rule:
    """A union whose members take disjoint JSON types, so pydantic's choice is the one
    member that takes the value's type."""
    out: Rule = {}
    for rule in rules:
        if out.keys() & rule.keys():
            raise TypeError("a union's members here must take disjoint types")
        out.update(rule)
    return out


def items(item: Rule, min_len: int = 0, max_len: int = MAX_ITEMS) -> Rule:
    """A list field, each item checked."""
    max_len = min(max_len, MAX_ITEMS)

    def check(value: list[Any]) -> Any:
        if not min_len <= len(value) <= max_len:
            return NO
        try:
            for one in value:
                how = item[type(one)]  # (a type the rule does not take: KeyError, NO)
                if how is not ACCEPT and (
                    how(one) is NO if type(how) is FunctionType else not _meets(how, one)
                ):
                    return NO
        except KeyError:
            return NO
        return value

    return {list: check}


def nested(check: Check) -> Rule:
    """A nested object's rule, from its `object_check`."""
    return {dict: check}


def object_check(
    cls: type[BaseModel], rules: dict[str, Rule], kept: Collection[str] | None = None
) -> Check:
    """The check of a JSON object as `cls` (a model with no validator the rules do not
    say): each name in `rules` checked, a name in `kept` held as an extra, any other
    name NO; `kept` None: any other name passes (`extra="allow"`, none refused; a
    nested object's extras are not read, so it answers {}). A field with no rule is
    the model's (NO); a required field not sent is NO."""
    unknown = rules.keys() - cls.model_fields.keys()
    if unknown:  # the model changed: its rules must follow it
        raise TypeError(f"{cls.__name__}: no fields {sorted(unknown)}")
    required = tuple(name for name, field in cls.model_fields.items() if field.is_required())
    table: dict[str, Any] = dict.fromkeys(kept or (), _KEEP)
    table.update({name: {} for name in cls.model_fields})  # no rule: no type passes
    table.update(rules)
    fields = frozenset(table)
    lenient = kept is None

    def check(value: dict[str, Any]) -> Any:
        if lenient and not fields.issuperset(value):  # its extras pass, unread
            value = {name: item for name, item in value.items() if name in fields}
        extra = {}
        # Subscripts, not `.get` calls: a name with no rule, or a value of a type its rule
        # does not take, is a KeyError (NO).
        try:
            for name, item in value.items():
                rule = table[name]
                if rule is _KEEP:
                    extra[name] = item
                    continue
                how = rule[type(item)]
                if how is not ACCEPT:  # (the common kinds inline: a call less a field)
                    kind = type(how)
                    if kind is _Range:
                        if not item <= how.high or not (
                            item > how.low or (item == how.low and not how.low_open)
                        ):  # (NaN fails every comparison: the model's)
                            return NO
                    elif kind is _Length:
                        if not how.low <= len(item) <= how.high:
                            return NO
                    elif kind is frozenset:
                        if item not in how:
                            return NO
                    elif how(item) is NO:
                        return NO
        except KeyError:
            return NO
        for name in required:
            if name not in value:
                return NO
        return extra

    return check
