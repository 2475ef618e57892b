"""The built-in functional code tasks, written for qlite: a stub (signature and docstring) or a prose
instruction, a reference solution (used only to check the task itself), and hidden tests (asserts).
Standard library only. Grouped: strings, lists, dicts, math, recursion, parsing, classes, edge
cases, prose."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from qlite.errors import QliteError
from qlite.files import read_text

MAX_TASKS_BYTES = 64 * 2**20  # a --tasks JSON Lines file


@dataclass(frozen=True)
class Task:
    name: str
    entry: str  # the function or class the tests call
    prompt: str  # a stub (signature + docstring) or, for prose tasks, an instruction
    tests: str  # Python asserts, run after the answer's code
    solution: str = ""  # stub + solution passes the tests (checked in tests/eval)
    prose: bool = False  # the prompt is an instruction, the solution a whole program

    @property
    def reference(self) -> str:
        return self.solution if self.prose else f"{self.prompt}\n{self.solution}"


def _t(name, prompt, solution, tests, entry=None, prose=False) -> Task:
    entry = entry or name
    return Task(name, entry, prompt.strip("\n"), tests.strip("\n"), solution.rstrip("\n"), prose)


TASKS = [
    # --- strings ---
    _t("reverse_words", '''
def reverse_words(sentence: str) -> str:
    """Return the words of sentence in reverse order, joined by single spaces.
    Any run of whitespace separates words; leading and trailing whitespace is ignored."""''', '''
    return " ".join(reversed(sentence.split()))''', '''
assert reverse_words("  hello   big world ") == "world big hello"
assert reverse_words("") == ""
assert reverse_words("one") == "one"
assert reverse_words("a\\tb\\nc") == "c b a"'''),
    _t("is_palindrome_phrase", '''
def is_palindrome_phrase(text: str) -> bool:
    """True if text reads the same backwards, looking only at letters and digits and ignoring case.
    An empty text (or one without letters or digits) is a palindrome."""''', '''
    chars = [c.lower() for c in text if c.isalnum()]
    return chars == chars[::-1]''', '''
assert is_palindrome_phrase("A man, a plan, a canal: Panama")
assert not is_palindrome_phrase("qlite")
assert is_palindrome_phrase("")
assert is_palindrome_phrase("!!")
assert is_palindrome_phrase("No 'x' in Nixon")
assert not is_palindrome_phrase("ab1ba2")'''),
    _t("run_length_encode", '''
def run_length_encode(text: str) -> str:
    """Encode runs of the same character as the count followed by the character, e.g.
    "aaabcc" -> "3a1b2c". The empty string encodes to the empty string."""''', '''
    out, i = [], 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{j - i}{text[i]}")
        i = j
    return "".join(out)''', '''
assert run_length_encode("aaabcc") == "3a1b2c"
assert run_length_encode("") == ""
assert run_length_encode("z") == "1z"
assert run_length_encode("aaaaaaaaaaaa") == "12a"
assert run_length_encode("abab") == "1a1b1a1b"'''),
    _t("run_length_decode", '''
def run_length_decode(encoded: str) -> str:
    """Invert run-length encoding: each run is a decimal count (one or more digits) followed by one
    character that is not a digit, e.g. "3a1b12c" -> "aaab" + "c" * 12."""''', '''
    out, count = [], ""
    for ch in encoded:
        if ch.isdigit():
            count += ch
        else:
            out.append(ch * int(count))
            count = ""
    return "".join(out)''', '''
assert run_length_decode("3a1b12c") == "aaab" + "c" * 12
assert run_length_decode("") == ""
assert run_length_decode("1 2-") == " --"'''),
    _t("caesar_shift", '''
def caesar_shift(text: str, shift: int) -> str:
    """Shift every ASCII letter by `shift` places in the alphabet, wrapping around and keeping its
    case; every other character is unchanged. shift may be negative or larger than 26."""''', '''
    out = []
    for ch in text:
        if "a" <= ch <= "z":
            out.append(chr((ord(ch) - 97 + shift) % 26 + 97))
        elif "A" <= ch <= "Z":
            out.append(chr((ord(ch) - 65 + shift) % 26 + 65))
        else:
            out.append(ch)
    return "".join(out)''', '''
assert caesar_shift("Hello, World!", 3) == "Khoor, Zruog!"
assert caesar_shift("xyz", 3) == "abc"
assert caesar_shift("abc", -1) == "zab"
assert caesar_shift("Qlite", 52) == "Qlite"
assert caesar_shift("é1", 5) == "é1"'''),
    _t("count_vowels", '''
def count_vowels(text: str) -> dict:
    """Count the vowels a, e, i, o, u in text, ignoring case. Return a dict with exactly the five
    vowels as keys (lowercase), each mapped to its count (0 if absent)."""''', '''
    low = text.lower()
    return {v: low.count(v) for v in "aeiou"}''', '''
assert count_vowels("Education IS key") == {"a": 1, "e": 2, "i": 2, "o": 1, "u": 1}
assert count_vowels("") == {"a": 0, "e": 0, "i": 0, "o": 0, "u": 0}
assert count_vowels("AAA") == {"a": 3, "e": 0, "i": 0, "o": 0, "u": 0}'''),
    _t("snake_to_camel", '''
def snake_to_camel(name: str) -> str:
    """Convert a snake_case name to lowerCamelCase: "max_new_tokens" -> "maxNewTokens". Leading and
    trailing underscores are dropped and repeated underscores count as one."""''', '''
    parts = [p for p in name.split("_") if p]
    if not parts:
        return ""
    return parts[0].lower() + "".join(p[:1].upper() + p[1:].lower() for p in parts[1:])''', '''
assert snake_to_camel("max_new_tokens") == "maxNewTokens"
assert snake_to_camel("_private__name_") == "privateName"
assert snake_to_camel("word") == "word"
assert snake_to_camel("") == ""
assert snake_to_camel("HTTP_server") == "httpServer"'''),
    _t("longest_common_prefix", '''
def longest_common_prefix(words: list) -> str:
    """The longest string that starts every word in the list; "" for an empty list."""''', '''
    if not words:
        return ""
    prefix = words[0]
    for w in words[1:]:
        while not w.startswith(prefix):
            prefix = prefix[:-1]
    return prefix''', '''
assert longest_common_prefix(["interview", "internet", "interval"]) == "inter"
assert longest_common_prefix(["dog", "cat"]) == ""
assert longest_common_prefix([]) == ""
assert longest_common_prefix(["same", "same"]) == "same"
assert longest_common_prefix(["", "abc"]) == ""'''),
    _t("wrap_text", '''
def wrap_text(text: str, width: int) -> list:
    """Break text into lines of at most `width` characters, breaking only at spaces and putting as
    many words on each line as fit (greedy). Words are separated by single spaces in the output. A
    word longer than width gets a line of its own. Returns the list of lines ([] for no words)."""''', '''
    lines, current = [], ""
    for word in text.split():
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines''', '''
assert wrap_text("the quick brown fox jumps", 10) == ["the quick", "brown fox", "jumps"]
assert wrap_text("", 5) == []
assert wrap_text("extraordinary is long", 5) == ["extraordinary", "is", "long"]
assert wrap_text("a b c", 5) == ["a b c"]'''),
    _t("anagram_groups", '''
def anagram_groups(words: list) -> list:
    """Group words that are anagrams of each other (same letters, same counts; case matters).
    Each group keeps its words in input order; the groups are ordered by their first word's position
    in the input."""''', '''
    groups = {}
    for w in words:
        groups.setdefault("".join(sorted(w)), []).append(w)
    return list(groups.values())''', '''
assert anagram_groups(["listen", "google", "silent", "enlist", "gogole"]) == [["listen", "silent", "enlist"], ["google", "gogole"]]
assert anagram_groups([]) == []
assert anagram_groups(["a", "A"]) == [["a"], ["A"]]'''),
    # --- lists ---
    _t("chunk_list", '''
def chunk_list(items: list, size: int) -> list:
    """Split items into consecutive chunks of `size` items; the last chunk may be shorter.
    Raise ValueError if size < 1."""''', '''
    if size < 1:
        raise ValueError("size must be >= 1")
    return [items[i:i + size] for i in range(0, len(items), size)]''', '''
assert chunk_list([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
assert chunk_list([], 3) == []
assert chunk_list([1], 5) == [[1]]
try:
    chunk_list([1], 0)
    assert False
except ValueError:
    pass'''),
    _t("flatten", '''
def flatten(nested) -> list:
    """Flatten arbitrarily nested lists and tuples into one flat list, keeping order. Other values
    (strings included) are leaves."""''', '''
    out = []
    for x in nested:
        if isinstance(x, (list, tuple)):
            out.extend(flatten(x))
        else:
            out.append(x)
    return out''', '''
assert flatten([1, [2, [3, (4, 5)]], "ab", []]) == [1, 2, 3, 4, 5, "ab"]
assert flatten([]) == []
assert flatten([[[[]]]]) == []'''),
    _t("rotate_list", '''
def rotate_list(items: list, k: int) -> list:
    """Return a new list rotated right by k places: rotate_list([1, 2, 3, 4], 1) == [4, 1, 2, 3].
    k may be negative (rotate left) or larger than the list."""''', '''
    if not items:
        return []
    k %= len(items)
    return items[-k:] + items[:-k] if k else list(items)''', '''
assert rotate_list([1, 2, 3, 4], 1) == [4, 1, 2, 3]
assert rotate_list([1, 2, 3, 4], -1) == [2, 3, 4, 1]
assert rotate_list([1, 2, 3], 7) == [3, 1, 2]
assert rotate_list([], 3) == []
x = [1, 2]
assert rotate_list(x, 0) == [1, 2] and rotate_list(x, 0) is not x'''),
    _t("merge_sorted", '''
def merge_sorted(a: list, b: list) -> list:
    """Merge two ascending lists into one ascending list (duplicates kept) in linear time."""''', '''
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]''', '''
assert merge_sorted([1, 3, 5], [2, 3, 6, 7]) == [1, 2, 3, 3, 5, 6, 7]
assert merge_sorted([], [1]) == [1]
assert merge_sorted([], []) == []'''),
    _t("second_largest", '''
def second_largest(numbers: list):
    """The second largest distinct value in numbers, or None if there are fewer than two distinct
    values."""''', '''
    distinct = sorted(set(numbers))
    return distinct[-2] if len(distinct) >= 2 else None''', '''
assert second_largest([4, 1, 4, 3]) == 3
assert second_largest([7, 7]) is None
assert second_largest([]) is None
assert second_largest([-1, -5]) == -5'''),
    _t("moving_average", '''
def moving_average(values: list, window: int) -> list:
    """The mean of each run of `window` consecutive values, as floats: len(values) - window + 1
    results ([] if the window is longer than the list). Raise ValueError if window < 1."""''', '''
    if window < 1:
        raise ValueError("window must be >= 1")
    return [sum(values[i:i + window]) / window for i in range(len(values) - window + 1)]''', '''
assert moving_average([1, 2, 3, 4, 5], 2) == [1.5, 2.5, 3.5, 4.5]
assert moving_average([1, 2], 3) == []
assert moving_average([2, 4], 1) == [2.0, 4.0]
try:
    moving_average([1], 0)
    assert False
except ValueError:
    pass'''),
    _t("dedupe_keep_order", '''
def dedupe_keep_order(items: list) -> list:
    """Remove repeated items, keeping the first occurrence of each, in order. Items are hashable."""''', '''
    seen, out = set(), []
    for x in items:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out''', '''
assert dedupe_keep_order([3, 1, 3, 2, 1]) == [3, 1, 2]
assert dedupe_keep_order([]) == []
assert dedupe_keep_order(["a", "A", "a"]) == ["a", "A"]'''),
    _t("max_subarray_sum", '''
def max_subarray_sum(numbers: list) -> int:
    """The largest sum of a non-empty run of consecutive numbers. Raise ValueError for an empty list."""''', '''
    if not numbers:
        raise ValueError("empty")
    best = current = numbers[0]
    for x in numbers[1:]:
        current = max(x, current + x)
        best = max(best, current)
    return best''', '''
assert max_subarray_sum([-2, 1, -3, 4, -1, 2, 1, -5, 4]) == 6
assert max_subarray_sum([-3, -1, -2]) == -1
assert max_subarray_sum([5]) == 5
try:
    max_subarray_sum([])
    assert False
except ValueError:
    pass'''),
    _t("pairs_with_sum", '''
def pairs_with_sum(numbers: list, target: int) -> list:
    """All pairs (a, b) with a <= b, a + b == target, where a and b are values at two different
    positions of numbers. Each pair appears once; the list is sorted."""''', '''
    pairs = set()
    for i in range(len(numbers)):
        for j in range(i + 1, len(numbers)):
            if numbers[i] + numbers[j] == target:
                pairs.add((min(numbers[i], numbers[j]), max(numbers[i], numbers[j])))
    return sorted(pairs)''', '''
assert pairs_with_sum([1, 5, 3, 3, 4, 2], 6) == [(1, 5), (2, 4), (3, 3)]
assert pairs_with_sum([3], 6) == []
assert pairs_with_sum([0, 0, 0], 0) == [(0, 0)]'''),
    _t("transpose", '''
def transpose(matrix: list) -> list:
    """Transpose a rectangular matrix given as a list of rows; [] stays []."""''', '''
    return [list(col) for col in zip(*matrix)]''', '''
assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]
assert transpose([]) == []
assert transpose([[7]]) == [[7]]'''),
    # --- dicts ---
    _t("word_frequencies", '''
def word_frequencies(text: str, top: int) -> list:
    """The `top` most frequent words of text as (word, count) pairs. Words are runs of letters,
    compared in lowercase. Order by count descending, ties alphabetically."""''', '''
    import re
    counts = {}
    for w in re.findall(r"[A-Za-z]+", text):
        counts[w.lower()] = counts.get(w.lower(), 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]''', '''
assert word_frequencies("The cat and the hat. THE end, and cat!", 3) == [("the", 3), ("and", 2), ("cat", 2)]
assert word_frequencies("", 2) == []
assert word_frequencies("b a", 5) == [("a", 1), ("b", 1)]'''),
    _t("invert_dict", '''
def invert_dict(mapping: dict) -> dict:
    """Map each value of mapping to the sorted list of keys that had it."""''', '''
    out = {}
    for k, v in mapping.items():
        out.setdefault(v, []).append(k)
    return {v: sorted(ks) for v, ks in out.items()}''', '''
assert invert_dict({"a": 1, "c": 2, "b": 1}) == {1: ["a", "b"], 2: ["c"]}
assert invert_dict({}) == {}'''),
    _t("deep_merge", '''
def deep_merge(base: dict, override: dict) -> dict:
    """A new dict: base updated by override, recursively where both hold a dict under the same key
    (override wins otherwise). Neither input is modified."""''', '''
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out''', '''
a = {"x": 1, "n": {"p": 1, "q": {"r": 1}}}
b = {"n": {"q": {"s": 2}, "p": 3}, "y": 2}
assert deep_merge(a, b) == {"x": 1, "n": {"p": 3, "q": {"r": 1, "s": 2}}, "y": 2}
assert a == {"x": 1, "n": {"p": 1, "q": {"r": 1}}}
assert deep_merge({"k": {"a": 1}}, {"k": 5}) == {"k": 5}'''),
    _t("group_by_key", '''
def group_by_key(records: list, key: str) -> dict:
    """Group dicts by the value they hold under `key`: {value: [records in input order]}. Records
    without the key are grouped under None."""''', '''
    out = {}
    for r in records:
        out.setdefault(r.get(key), []).append(r)
    return out''', '''
rs = [{"t": "a", "v": 1}, {"v": 2}, {"t": "b", "v": 3}, {"t": "a", "v": 4}]
assert group_by_key(rs, "t") == {"a": [rs[0], rs[3]], None: [rs[1]], "b": [rs[2]]}
assert group_by_key([], "t") == {}'''),
    _t("flatten_dict", '''
def flatten_dict(nested: dict, sep: str = ".") -> dict:
    """Flatten nested dicts into one level, joining keys with sep: {"a": {"b": 1}} -> {"a.b": 1}.
    An empty nested dict disappears."""''', '''
    out = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            for k2, v2 in flatten_dict(v, sep).items():
                out[f"{k}{sep}{k2}"] = v2
        else:
            out[k] = v
    return out''', '''
assert flatten_dict({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}
assert flatten_dict({"a": {"b": 1}}, sep="/") == {"a/b": 1}
assert flatten_dict({"a": {}}) == {}'''),
    _t("most_common_letter", '''
def most_common_letter(text: str):
    """The most frequent letter of text, lowercase, ignoring case and non-letters; ties go to the
    letter earliest in the alphabet. None if text has no letters."""''', '''
    counts = {}
    for c in text.lower():
        if c.isalpha():
            counts[c] = counts.get(c, 0) + 1
    if not counts:
        return None
    return min(counts, key=lambda c: (-counts[c], c))''', '''
assert most_common_letter("Hello World") == "l"
assert most_common_letter("bbaa") == "a"
assert most_common_letter("123 !") is None'''),
    # --- math ---
    _t("is_prime", '''
def is_prime(n: int) -> bool:
    """True if n is a prime number. Numbers below 2 are not prime."""''', '''
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True''', '''
assert [n for n in range(-3, 30) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]
assert is_prime(7919) and not is_prime(7917)'''),
    _t("gcd_list", '''
def gcd_list(numbers: list) -> int:
    """The greatest common divisor of the integers in the list (positive; signs ignored). The gcd of
    an empty list, or of only zeros, is 0."""''', '''
    from math import gcd
    g = 0
    for n in numbers:
        g = gcd(g, n)
    return abs(g)''', '''
assert gcd_list([12, 18, -24]) == 6
assert gcd_list([]) == 0
assert gcd_list([0, 0]) == 0
assert gcd_list([0, 7]) == 7'''),
    _t("digit_sum_root", '''
def digit_sum_root(n: int) -> int:
    """Repeatedly replace n by the sum of its decimal digits until one digit is left; negative n is
    treated as its absolute value."""''', '''
    n = abs(n)
    while n >= 10:
        n = sum(int(d) for d in str(n))
    return n''', '''
assert digit_sum_root(9875) == 2
assert digit_sum_root(0) == 0
assert digit_sum_root(-38) == 2'''),
    _t("to_roman", '''
def to_roman(n: int) -> str:
    """The Roman numeral for 1 <= n <= 3999 (subtractive forms: IV, IX, XL, XC, CD, CM).
    Raise ValueError outside that range."""''', '''
    if not 1 <= n <= 3999:
        raise ValueError(n)
    table = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"),
             (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]
    out = ""
    for value, sym in table:
        while n >= value:
            out += sym
            n -= value
    return out''', '''
assert to_roman(1994) == "MCMXCIV"
assert to_roman(4) == "IV" and to_roman(3999) == "MMMCMXCIX" and to_roman(58) == "LVIII"
for bad in (0, 4000, -1):
    try:
        to_roman(bad)
        assert False
    except ValueError:
        pass'''),
    _t("from_roman", '''
def from_roman(numeral: str) -> int:
    """The value of a valid Roman numeral (uppercase, subtractive forms allowed), e.g. "XLII" -> 42."""''', '''
    values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    total = 0
    for i, ch in enumerate(numeral):
        v = values[ch]
        if i + 1 < len(numeral) and values[numeral[i + 1]] > v:
            total -= v
        else:
            total += v
    return total''', '''
assert from_roman("XLII") == 42
assert from_roman("MCMXCIV") == 1994
assert from_roman("I") == 1 and from_roman("MMMCMXCIX") == 3999'''),
    _t("base_convert", '''
def base_convert(n: int, base: int) -> str:
    """n written in the given base (2..36) with digits 0-9 then lowercase a-z; a leading "-" for
    negative n. Raise ValueError for a base outside 2..36."""''', '''
    if not 2 <= base <= 36:
        raise ValueError(base)
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    if n == 0:
        return "0"
    sign, n = ("-", -n) if n < 0 else ("", n)
    out = ""
    while n:
        n, r = divmod(n, base)
        out = digits[r] + out
    return sign + out''', '''
assert base_convert(255, 16) == "ff"
assert base_convert(-10, 2) == "-1010"
assert base_convert(0, 7) == "0"
assert base_convert(35, 36) == "z"
try:
    base_convert(5, 1)
    assert False
except ValueError:
    pass'''),
    _t("collatz_steps", '''
def collatz_steps(n: int) -> int:
    """How many steps the Collatz rule (n/2 if even, 3n+1 if odd) takes to reach 1 from n >= 1."""''', '''
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps''', '''
assert collatz_steps(1) == 0
assert collatz_steps(6) == 8
assert collatz_steps(27) == 111'''),
    _t("mean_median_mode", '''
def mean_median_mode(values: list) -> tuple:
    """(mean, median, mode) of a non-empty list of numbers. The median of an even count is the mean of
    the two middle values; the mode is the most frequent value, the smallest one on ties."""''', '''
    s = sorted(values)
    n = len(s)
    mean = sum(s) / n
    median = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    counts = {}
    for v in s:
        counts[v] = counts.get(v, 0) + 1
    mode = min(counts, key=lambda v: (-counts[v], v))
    return mean, median, mode''', '''
assert mean_median_mode([3, 1, 2, 2, 7]) == (3.0, 2, 2)
assert mean_median_mode([4, 1, 3, 1, 3]) == (2.4, 3, 1)
assert mean_median_mode([1, 2, 3, 4]) == (2.5, 2.5, 1)'''),
    _t("prime_factors", '''
def prime_factors(n: int) -> list:
    """The prime factors of n >= 2 in ascending order, with repetition: 60 -> [2, 2, 3, 5]."""''', '''
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out''', '''
assert prime_factors(60) == [2, 2, 3, 5]
assert prime_factors(97) == [97]
assert prime_factors(2 ** 10) == [2] * 10
assert prime_factors(9991) == [97, 103]'''),
    # --- recursion ---
    _t("permutations_of", '''
def permutations_of(items: list) -> list:
    """All orderings of items (assumed distinct) as lists, in lexicographic order of positions:
    permutations_of([1, 2, 3])[0] == [1, 2, 3] and [-1] == [3, 2, 1]. [] has one ordering, []."""''', '''
    if not items:
        return [[]]
    out = []
    for i, x in enumerate(items):
        for rest in permutations_of(items[:i] + items[i + 1:]):
            out.append([x] + rest)
    return out''', '''
assert permutations_of([1, 2, 3]) == [[1, 2, 3], [1, 3, 2], [2, 1, 3], [2, 3, 1], [3, 1, 2], [3, 2, 1]]
assert permutations_of([]) == [[]]
assert len(permutations_of(list("abcde"))) == 120'''),
    _t("power_set", '''
def power_set(items: list) -> list:
    """All subsets of items as lists keeping the input order inside each subset, ordered by size, then
    by the positions of their items (lexicographically)."""''', '''
    from itertools import combinations
    return [list(c) for k in range(len(items) + 1) for c in combinations(items, k)]''', '''
assert power_set([1, 2, 3]) == [[], [1], [2], [3], [1, 2], [1, 3], [2, 3], [1, 2, 3]]
assert power_set([]) == [[]]'''),
    _t("tower_of_hanoi", '''
def tower_of_hanoi(n: int, source: str = "A", target: str = "C", spare: str = "B") -> list:
    """The moves that carry n disks from source to target, as (from_peg, to_peg) pairs, in the order
    of the classic recursive solution (the minimum, 2**n - 1 moves)."""''', '''
    if n == 0:
        return []
    return (tower_of_hanoi(n - 1, source, spare, target) + [(source, target)]
            + tower_of_hanoi(n - 1, spare, target, source))''', '''
assert tower_of_hanoi(1) == [("A", "C")]
assert tower_of_hanoi(2) == [("A", "B"), ("A", "C"), ("B", "C")]
assert len(tower_of_hanoi(10)) == 1023
assert tower_of_hanoi(0) == []'''),
    _t("count_change", '''
def count_change(amount: int, coins: list) -> int:
    """The number of ways to make `amount` from unlimited coins of the given distinct values (order
    does not matter). There is one way to make 0."""''', '''
    ways = [1] + [0] * amount
    for c in coins:
        for a in range(c, amount + 1):
            ways[a] += ways[a - c]
    return ways[amount]''', '''
assert count_change(5, [1, 2, 5]) == 4
assert count_change(0, [3]) == 1
assert count_change(3, [2]) == 0
assert count_change(100, [1, 5, 10, 25, 50]) == 292'''),
    _t("nested_depth", '''
def nested_depth(value) -> int:
    """How deeply lists nest in value: a non-list is 0, [] is 1, [1, [2]] is 2."""''', '''
    if not isinstance(value, list):
        return 0
    return 1 + max((nested_depth(v) for v in value), default=0)''', '''
assert nested_depth(5) == 0
assert nested_depth([]) == 1
assert nested_depth([1, [2, [3]], []]) == 3
assert nested_depth("[[]]") == 0'''),
    _t("binary_search", '''
def binary_search(items: list, target) -> int:
    """The index of target in the ascending list items, or -1. With duplicates, the first index."""''', '''
    lo, hi = 0, len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < len(items) and items[lo] == target else -1''', '''
assert binary_search([1, 3, 5, 7], 5) == 2
assert binary_search([1, 3, 5, 7], 4) == -1
assert binary_search([], 1) == -1
assert binary_search([2, 2, 2, 3], 2) == 0
assert binary_search(list(range(0, 1000, 2)), 998) == 499'''),
    _t("edit_distance", '''
def edit_distance(a: str, b: str) -> int:
    """The Levenshtein distance: fewest single-character insertions, deletions and substitutions that
    turn a into b."""''', '''
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]''', '''
assert edit_distance("kitten", "sitting") == 3
assert edit_distance("", "abc") == 3
assert edit_distance("same", "same") == 0
assert edit_distance("flaw", "lawn") == 2'''),
    # --- parsing ---
    _t("parse_key_values", '''
def parse_key_values(text: str) -> dict:
    """Parse lines of "key = value" into a dict of strings. Whitespace around keys and values is
    stripped; blank lines and lines starting with "#" are skipped; a later key replaces an earlier
    one; a line without "=" raises ValueError. Only the first "=" separates."""''', '''
    out = {}
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if "=" not in s:
            raise ValueError(line)
        k, v = s.split("=", 1)
        out[k.strip()] = v.strip()
    return out''', '''
assert parse_key_values("a = 1\\n# note\\n\\n b=x=y \\na=2") == {"a": "2", "b": "x=y"}
assert parse_key_values("") == {}
try:
    parse_key_values("novalue")
    assert False
except ValueError:
    pass'''),
    _t("evaluate_rpn", '''
def evaluate_rpn(expression: str) -> float:
    """Evaluate a reverse Polish expression of numbers and + - * / separated by spaces, e.g.
    "3 4 + 2 *" -> 14.0. Raise ValueError if the expression is malformed (too few operands, or more
    than one value left)."""''', '''
    stack = []
    for tok in expression.split():
        if tok in "+-*/" and len(tok) == 1:
            if len(stack) < 2:
                raise ValueError(expression)
            b, a = stack.pop(), stack.pop()
            stack.append(a + b if tok == "+" else a - b if tok == "-" else a * b if tok == "*" else a / b)
        else:
            stack.append(float(tok))
    if len(stack) != 1:
        raise ValueError(expression)
    return stack[0]''', '''
assert evaluate_rpn("3 4 + 2 *") == 14.0
assert evaluate_rpn("5 1 2 + 4 * + 3 -") == 14.0
assert evaluate_rpn("-2.5 2 *") == -5.0
assert evaluate_rpn("7 2 /") == 3.5
for bad in ("1 +", "1 2", ""):
    try:
        evaluate_rpn(bad)
        assert False
    except ValueError:
        pass'''),
    _t("balanced_brackets", '''
def balanced_brackets(text: str) -> bool:
    """True if every (, [ and { in text is closed by its partner in the right order; other characters
    are ignored."""''', '''
    pairs = {")": "(", "]": "[", "}": "{"}
    stack = []
    for c in text:
        if c in "([{":
            stack.append(c)
        elif c in pairs:
            if not stack or stack.pop() != pairs[c]:
                return False
    return not stack''', '''
assert balanced_brackets("f(a[1], {b: (c)})")
assert not balanced_brackets("(]")
assert not balanced_brackets("((")
assert not balanced_brackets(")(")
assert balanced_brackets("")'''),
    _t("parse_duration", '''
def parse_duration(text: str) -> int:
    """Seconds in a duration like "1h30m", "45s", "2d4h" or "1h 5m 10s": numbers each followed by
    d, h, m or s (days, hours, minutes, seconds), spaces allowed between parts, each unit at most once.
    Raise ValueError for anything else (including an empty string)."""''', '''
    import re
    s = text.replace(" ", "")
    if not s or not re.fullmatch(r"(\\d+[dhms])+", s):
        raise ValueError(text)
    seen, total = set(), 0
    for num, unit in re.findall(r"(\\d+)([dhms])", s):
        if unit in seen:
            raise ValueError(text)
        seen.add(unit)
        total += int(num) * {"d": 86400, "h": 3600, "m": 60, "s": 1}[unit]
    return total''', '''
assert parse_duration("1h30m") == 5400
assert parse_duration("45s") == 45
assert parse_duration("2d4h") == 187200
assert parse_duration("1h 5m 10s") == 3910
for bad in ("", "5", "1x", "1h1h", "h"):
    try:
        parse_duration(bad)
        assert False, bad
    except ValueError:
        pass'''),
    _t("csv_column_sums", '''
def csv_column_sums(text: str) -> dict:
    """Text is CSV with a header row. Return {column name: sum} for every column whose values (all
    non-header rows) parse as numbers; other columns are left out. Quoted fields may hold commas.
    Sums are floats."""''', '''
    import csv
    import io
    rows = list(csv.reader(io.StringIO(text)))
    header, body = rows[0], rows[1:]
    out = {}
    for i, name in enumerate(header):
        try:
            out[name] = float(sum(float(r[i]) for r in body))
        except ValueError:
            pass
    return out''', '''
text = 'name,qty,price\\n"Smith, J",2,1.5\\nLee,3,2\\n'
assert csv_column_sums(text) == {"qty": 5.0, "price": 3.5}
assert csv_column_sums("a,b\\n") == {"a": 0.0, "b": 0.0}'''),
    _t("parse_query_string", '''
def parse_query_string(query: str) -> dict:
    """Parse a URL query string like "a=1&b=x%20y&a=2" into {name: [values]} in order of appearance,
    with percent-escapes and "+" decoded. A name without "=" gets the value ""."""''', '''
    from urllib.parse import unquote_plus
    out = {}
    for part in query.split("&"):
        if not part:
            continue
        name, _, value = part.partition("=")
        out.setdefault(unquote_plus(name), []).append(unquote_plus(value))
    return out''', '''
assert parse_query_string("a=1&b=x%20y&a=2") == {"a": ["1", "2"], "b": ["x y"]}
assert parse_query_string("flag&q=a+b") == {"flag": [""], "q": ["a b"]}
assert parse_query_string("") == {}'''),
    _t("tokenize_arithmetic", '''
def tokenize_arithmetic(expression: str) -> list:
    """Split an arithmetic expression into tokens: integers (as int), and the strings "+", "-", "*",
    "/", "(", ")". Spaces are skipped; any other character raises ValueError."""''', '''
    out, i = [], 0
    while i < len(expression):
        c = expression[i]
        if c.isspace():
            i += 1
        elif c.isdigit():
            j = i
            while j < len(expression) and expression[j].isdigit():
                j += 1
            out.append(int(expression[i:j]))
            i = j
        elif c in "+-*/()":
            out.append(c)
            i += 1
        else:
            raise ValueError(c)
    return out''', '''
assert tokenize_arithmetic("12+(3 * 45)") == [12, "+", "(", 3, "*", 45, ")"]
assert tokenize_arithmetic("") == []
try:
    tokenize_arithmetic("2 ^ 3")
    assert False
except ValueError:
    pass'''),
    _t("semver_compare", '''
def semver_compare(a: str, b: str) -> int:
    """Compare version strings "MAJOR.MINOR.PATCH" (non-negative integers) numerically: -1 if a < b,
    0 if equal, 1 if a > b."""''', '''
    x, y = [int(p) for p in a.split(".")], [int(p) for p in b.split(".")]
    return (x > y) - (x < y)''', '''
assert semver_compare("1.10.0", "1.9.9") == 1
assert semver_compare("2.0.0", "2.0.0") == 0
assert semver_compare("0.1.2", "0.1.10") == -1'''),
    # --- classes ---
    _t("Stack", '''
class Stack:
    """A last-in first-out stack with push(item), pop() (raises IndexError when empty), peek()
    (the top item, IndexError when empty), is_empty() and len(stack)."""''', '''
    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("empty")
        return self._items.pop()

    def peek(self):
        if not self._items:
            raise IndexError("empty")
        return self._items[-1]

    def is_empty(self):
        return not self._items

    def __len__(self):
        return len(self._items)''', '''
s = Stack()
assert s.is_empty() and len(s) == 0
s.push(1); s.push("two")
assert s.peek() == "two" and len(s) == 2
assert s.pop() == "two" and s.pop() == 1 and s.is_empty()
for op in (s.pop, s.peek):
    try:
        op()
        assert False
    except IndexError:
        pass''', entry="Stack"),
    _t("LRUCache", '''
class LRUCache:
    """A cache of at most `capacity` items: get(key) returns the value or None and marks the key as
    recently used; put(key, value) stores it (marking it recently used) and, when over capacity,
    evicts the least recently used key."""

    def __init__(self, capacity: int):''', '''
        from collections import OrderedDict
        self.capacity = capacity
        self.data = OrderedDict()

    def get(self, key):
        if key not in self.data:
            return None
        self.data.move_to_end(key)
        return self.data[key]

    def put(self, key, value):
        self.data[key] = value
        self.data.move_to_end(key)
        if len(self.data) > self.capacity:
            self.data.popitem(last=False)''', '''
c = LRUCache(2)
c.put("a", 1); c.put("b", 2)
assert c.get("a") == 1
c.put("c", 3)
assert c.get("b") is None and c.get("a") == 1 and c.get("c") == 3
c.put("a", 10); c.put("d", 4)
assert c.get("c") is None and c.get("a") == 10 and c.get("d") == 4''', entry="LRUCache"),
    _t("Vector2", '''
class Vector2:
    """A 2-D vector with attributes x and y; supports v + w, v - w, v * number (scaling), v == w,
    abs(v) (the Euclidean length) and repr(v) == "Vector2(x, y)" with the values' own reprs."""

    def __init__(self, x, y):''', '''
        self.x, self.y = x, y

    def __add__(self, other):
        return Vector2(self.x + other.x, self.y + other.y)

    def __sub__(self, other):
        return Vector2(self.x - other.x, self.y - other.y)

    def __mul__(self, k):
        return Vector2(self.x * k, self.y * k)

    def __eq__(self, other):
        return isinstance(other, Vector2) and (self.x, self.y) == (other.x, other.y)

    def __abs__(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5

    def __repr__(self):
        return f"Vector2({self.x!r}, {self.y!r})"''', '''
v, w = Vector2(3, 4), Vector2(1, -1)
assert v + w == Vector2(4, 3) and v - w == Vector2(2, 5) and v * 2 == Vector2(6, 8)
assert abs(v) == 5.0
assert repr(Vector2(1, 2.5)) == "Vector2(1, 2.5)"
assert v != w''', entry="Vector2"),
    _t("BankAccount", '''
class BankAccount:
    """An account with a balance (starting at `opening`, default 0): deposit(amount) and
    withdraw(amount) change it and return the new balance; a non-positive amount raises ValueError,
    and so does a withdrawal larger than the balance (the balance is then unchanged). history() is
    the list of ("deposit" | "withdraw", amount) of successful operations, in order."""

    def __init__(self, opening=0):''', '''
        self.balance = opening
        self._history = []

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError(amount)
        self.balance += amount
        self._history.append(("deposit", amount))
        return self.balance

    def withdraw(self, amount):
        if amount <= 0 or amount > self.balance:
            raise ValueError(amount)
        self.balance -= amount
        self._history.append(("withdraw", amount))
        return self.balance

    def history(self):
        return list(self._history)''', '''
a = BankAccount(10)
assert a.deposit(5) == 15 and a.withdraw(15) == 0
for bad in (lambda: a.withdraw(1), lambda: a.deposit(0), lambda: a.deposit(-3)):
    try:
        bad()
        assert False
    except ValueError:
        pass
assert a.balance == 0 and a.history() == [("deposit", 5), ("withdraw", 15)]
assert BankAccount().balance == 0''', entry="BankAccount"),
    _t("Matrix", '''
class Matrix:
    """An immutable matrix built from a list of rows (all the same length). m.shape is (rows, cols);
    m @ other is the matrix product (ValueError when the shapes do not fit); m.transpose() a new
    Matrix; m.rows() the rows as a list of lists; m1 == m2 compares entries."""

    def __init__(self, rows):''', '''
        self._rows = [list(r) for r in rows]
        self.shape = (len(self._rows), len(self._rows[0]) if self._rows else 0)

    def rows(self):
        return [list(r) for r in self._rows]

    def transpose(self):
        return Matrix([list(c) for c in zip(*self._rows)])

    def __matmul__(self, other):
        if self.shape[1] != other.shape[0]:
            raise ValueError("shapes")
        cols = other.transpose().rows()
        return Matrix([[sum(a * b for a, b in zip(r, c)) for c in cols] for r in self._rows])

    def __eq__(self, other):
        return isinstance(other, Matrix) and self._rows == other._rows''', '''
a = Matrix([[1, 2], [3, 4], [5, 6]])
b = Matrix([[1, 0, 2], [0, 1, 3]])
assert a.shape == (3, 2)
assert (a @ b).rows() == [[1, 2, 8], [3, 4, 18], [5, 6, 28]]
assert a.transpose() == Matrix([[1, 3, 5], [2, 4, 6]])
try:
    a @ a
    assert False
except ValueError:
    pass''', entry="Matrix"),
    _t("EventCounter", '''
class EventCounter:
    """Counts named events: record(name, n=1); count(name) (0 if never recorded); top(k) the k most
    recorded names as (name, count), most first, ties by name; reset(name=None) forgets one name or
    all of them."""''', '''
    def __init__(self):
        self.counts = {}

    def record(self, name, n=1):
        self.counts[name] = self.counts.get(name, 0) + n

    def count(self, name):
        return self.counts.get(name, 0)

    def top(self, k):
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]

    def reset(self, name=None):
        if name is None:
            self.counts.clear()
        else:
            self.counts.pop(name, None)''', '''
c = EventCounter()
c.record("b"); c.record("a", 3); c.record("b", 2); c.record("c")
assert c.count("a") == 3 and c.count("zz") == 0
assert c.top(2) == [("a", 3), ("b", 3)]
c.reset("a")
assert c.top(5) == [("b", 3), ("c", 1)]
c.reset()
assert c.top(1) == []''', entry="EventCounter"),
    # --- edge cases ---
    _t("safe_divide", '''
def safe_divide(a, b, default=None):
    """a / b as a float, or default when b is zero or either operand is not a number (int or float;
    bool does not count as a number)."""''', '''
    ok = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
    if not ok(a) or not ok(b) or b == 0:
        return default
    return a / b''', '''
assert safe_divide(1, 4) == 0.25
assert safe_divide(1, 0) is None
assert safe_divide(1, 0, default=0) == 0
assert safe_divide("1", 2) is None
assert safe_divide(True, 2) is None
assert safe_divide(-3.0, 2) == -1.5'''),
    _t("clamp", '''
def clamp(value, low, high):
    """value limited to [low, high]. Raise ValueError if low > high."""''', '''
    if low > high:
        raise ValueError("low > high")
    return max(low, min(high, value))''', '''
assert clamp(5, 0, 10) == 5 and clamp(-1, 0, 10) == 0 and clamp(11, 0, 10) == 10
assert clamp(3, 3, 3) == 3
try:
    clamp(1, 2, 1)
    assert False
except ValueError:
    pass'''),
    _t("format_bytes", '''
def format_bytes(n: int) -> str:
    """A byte count in binary units with one decimal: 0 -> "0 B", 1023 -> "1023 B", 1024 ->
    "1.0 KiB", 1536 -> "1.5 KiB", then MiB, GiB, TiB (TiB is the largest unit). Negative n raises
    ValueError."""''', '''
    if n < 0:
        raise ValueError(n)
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"''', '''
assert format_bytes(0) == "0 B" and format_bytes(1023) == "1023 B"
assert format_bytes(1024) == "1.0 KiB" and format_bytes(1536) == "1.5 KiB"
assert format_bytes(5 * 1024 ** 3) == "5.0 GiB"
assert format_bytes(2048 * 1024 ** 4) == "2048.0 TiB"
try:
    format_bytes(-1)
    assert False
except ValueError:
    pass'''),
    _t("nth_weekday", '''
def nth_weekday(year: int, month: int, weekday: int, n: int):
    """The date (datetime.date) of the n-th given weekday (0 = Monday ... 6 = Sunday) of the month;
    n = -1 means the last one. None if the month has no such n-th weekday."""''', '''
    import calendar
    import datetime
    days = [d for d in range(1, calendar.monthrange(year, month)[1] + 1)
            if datetime.date(year, month, d).weekday() == weekday]
    if n == -1:
        return datetime.date(year, month, days[-1])
    return datetime.date(year, month, days[n - 1]) if 1 <= n <= len(days) else None''', '''
import datetime
assert nth_weekday(2026, 11, 3, 4) == datetime.date(2026, 11, 26)
assert nth_weekday(2026, 11, 0, -1) == datetime.date(2026, 11, 30)
assert nth_weekday(2026, 2, 6, 5) is None
assert nth_weekday(2024, 2, 3, 5) == datetime.date(2024, 2, 29)'''),
    _t("split_evenly", '''
def split_evenly(total: int, parts: int) -> list:
    """Split the integer total into `parts` integers as equal as possible, the larger ones first, that
    sum to total: split_evenly(10, 3) == [4, 3, 3]. parts must be >= 1 (else ValueError); total >= 0."""''', '''
    if parts < 1:
        raise ValueError(parts)
    q, r = divmod(total, parts)
    return [q + 1] * r + [q] * (parts - r)''', '''
assert split_evenly(10, 3) == [4, 3, 3]
assert split_evenly(2, 4) == [1, 1, 0, 0]
assert split_evenly(0, 1) == [0]
try:
    split_evenly(5, 0)
    assert False
except ValueError:
    pass'''),
    _t("interval_merge", '''
def interval_merge(intervals: list) -> list:
    """Merge overlapping or touching closed intervals [start, end] (given in any order) and return
    them sorted by start, as lists."""''', '''
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out''', '''
assert interval_merge([[8, 10], [1, 3], [2, 6], [15, 18]]) == [[1, 6], [8, 10], [15, 18]]
assert interval_merge([[1, 4], [4, 5]]) == [[1, 5]]
assert interval_merge([]) == []
assert interval_merge([[1, 10], [2, 3]]) == [[1, 10]]'''),
    _t("truncate_middle", '''
def truncate_middle(text: str, limit: int) -> str:
    """Shorten text to at most `limit` characters by replacing its middle with "...", keeping as many
    characters as possible from the start and the end (the start gets the extra one when the kept
    count is odd). Text within the limit is returned as is; limit < 5 raises ValueError."""''', '''
    if limit < 5:
        raise ValueError(limit)
    if len(text) <= limit:
        return text
    keep = limit - 3
    head = (keep + 1) // 2
    tail = keep - head
    return text[:head] + "..." + (text[-tail:] if tail else "")''', '''
assert truncate_middle("abcdefghij", 7) == "ab...ij"
assert truncate_middle("abcdefghij", 8) == "abc...ij"
assert truncate_middle("short", 10) == "short"
try:
    truncate_middle("abcdef", 4)
    assert False
except ValueError:
    pass'''),
    _t("matrix_spiral", '''
def matrix_spiral(matrix: list) -> list:
    """The entries of a rectangular matrix (list of rows) read in a clockwise spiral from the top-left
    corner."""''', '''
    out = []
    m = [list(r) for r in matrix]
    while m:
        out += m.pop(0)
        m = [list(r) for r in zip(*m)][::-1]
    return out''', '''
assert matrix_spiral([[1, 2, 3], [4, 5, 6], [7, 8, 9]]) == [1, 2, 3, 6, 9, 8, 7, 4, 5]
assert matrix_spiral([[1, 2, 3, 4]]) == [1, 2, 3, 4]
assert matrix_spiral([[1], [2], [3]]) == [1, 2, 3]
assert matrix_spiral([]) == []'''),
    # --- prose instructions answered in code ---
    _t("fizzbuzz_list", '''
Write a Python function `fizzbuzz_list(n)` that returns a list of strings for the numbers 1 to n: "Fizz"
for multiples of 3, "Buzz" for multiples of 5, "FizzBuzz" for multiples of both, and the number
itself (as a string) otherwise. For n < 1 it returns an empty list.''', '''
def fizzbuzz_list(n):
    out = []
    for i in range(1, n + 1):
        s = ("Fizz" if i % 3 == 0 else "") + ("Buzz" if i % 5 == 0 else "")
        out.append(s or str(i))
    return out''', '''
assert fizzbuzz_list(15)[-5:] == ["11", "Fizz", "13", "14", "FizzBuzz"]
assert fizzbuzz_list(0) == []
assert fizzbuzz_list(5) == ["1", "2", "Fizz", "4", "Buzz"]''', prose=True),
    _t("validate_email", '''
Write a Python function `is_valid_email(address)` that returns True for addresses of the form
local@domain where: the local part is 1 to 64 characters of letters, digits, dots, underscores,
hyphens or plus signs, not starting or ending with a dot; the domain is two or more labels separated
by dots, each label 1 to 63 letters, digits or hyphens, not starting or ending with a hyphen, and the
last label is at least two letters. Everything else is False.''', '''
import re

def is_valid_email(address):
    if address.count("@") != 1:
        return False
    local, domain = address.split("@")
    if not re.fullmatch(r"[A-Za-z0-9._+-]{1,64}", local) or local[0] == "." or local[-1] == ".":
        return False
    labels = domain.split(".")
    if len(labels) < 2:
        return False
    for label in labels:
        if not re.fullmatch(r"[A-Za-z0-9-]{1,63}", label) or label[0] == "-" or label[-1] == "-":
            return False
    return bool(re.fullmatch(r"[A-Za-z]{2,}", labels[-1]))''', '''
assert is_valid_email("ada.lovelace+notes@math.example.org")
assert not is_valid_email("no-at-sign.example.com")
assert not is_valid_email("two@@example.com")
assert not is_valid_email(".dot@example.com")
assert not is_valid_email("a@-bad.com")
assert not is_valid_email("a@example.c")
assert not is_valid_email("a@localhost")
assert is_valid_email("x_y-z@sub-domain.co")''', entry="is_valid_email", prose=True),
    _t("running_totals_by_day", '''
Write a Python function `daily_totals(entries)` that takes a list of (iso_timestamp, amount) pairs,
where iso_timestamp is a string like "2026-11-30T14:05:00", and returns a list of (date_string,
total) pairs, one per calendar day that appears, sorted by date, where date_string is "YYYY-MM-DD" and
total is the sum of that day's amounts.''', '''
def daily_totals(entries):
    totals = {}
    for stamp, amount in entries:
        day = stamp[:10]
        totals[day] = totals.get(day, 0) + amount
    return sorted(totals.items())''', '''
entries = [("2026-11-30T14:05:00", 5), ("2026-11-29T23:59:59", 1.5), ("2026-11-30T00:00:00", 2)]
assert daily_totals(entries) == [("2026-11-29", 1.5), ("2026-11-30", 7)]
assert daily_totals([]) == []''', entry="daily_totals", prose=True),
    _t("temperature_table", '''
Write a Python function `celsius_table(start, stop, step)` that returns a list of strings, one per
Celsius value from start to stop inclusive in steps of step (integers, step > 0), each formatted as
"<celsius> C = <fahrenheit> F" with the Fahrenheit value rounded to one decimal place, for example
"100 C = 212.0 F". If start > stop the list is empty.''', '''
def celsius_table(start, stop, step):
    return [f"{c} C = {c * 9 / 5 + 32:.1f} F" for c in range(start, stop + 1, step)]''', '''
assert celsius_table(0, 100, 50) == ["0 C = 32.0 F", "50 C = 122.0 F", "100 C = 212.0 F"]
assert celsius_table(-40, -40, 1) == ["-40 C = -40.0 F"]
assert celsius_table(5, 1, 1) == []
assert celsius_table(1, 2, 1) == ["1 C = 33.8 F", "2 C = 35.6 F"]''', entry="celsius_table", prose=True),
    _t("shopping_cart_total", '''
Write a Python function `cart_total(items, discounts)` for a shop. items is a list of dicts with keys
"name", "price" (per unit) and "qty". discounts maps an item name to a percentage off that item's
price (0 to 100). Return the total cost rounded to 2 decimal places. Items with a quantity of zero or
less are ignored.''', '''
def cart_total(items, discounts):
    total = 0.0
    for item in items:
        if item["qty"] <= 0:
            continue
        off = discounts.get(item["name"], 0)
        total += item["price"] * (1 - off / 100) * item["qty"]
    return round(total, 2)''', '''
items = [{"name": "pen", "price": 1.2, "qty": 3}, {"name": "pad", "price": 4.0, "qty": 2},
         {"name": "ink", "price": 9.99, "qty": 0}]
assert cart_total(items, {"pad": 25}) == 9.6
assert cart_total([], {}) == 0
assert cart_total(items, {"pen": 100, "pad": 100}) == 0''', entry="cart_total", prose=True),
]


def load_tasks(source: str) -> list[Task]:
    """`builtin`, or a JSON Lines file of tasks (name, entry, prompt, tests; optional prose)."""
    if source == "builtin":
        return list(TASKS)
    path = Path(source).expanduser()
    try:
        lines = read_text(path, limit=MAX_TASKS_BYTES).splitlines()
    except QliteError as e:
        raise QliteError(f"--tasks {e}") from None
    tasks = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            tasks.append(Task(str(d["name"]), str(d["entry"]), str(d["prompt"]), str(d["tests"]),
                              str(d.get("solution", "")), bool(d.get("prose", False))))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise QliteError(f"{path}:{i}: not a task (a JSON object with name, entry, prompt, tests: {e})") from None
    if not tasks:
        raise QliteError(f"{path}: holds no tasks")
    return tasks


def dump_tasks(tasks: list[Task], path: Path) -> None:
    """Write tasks as JSON Lines (the --tasks FILE format)."""
    Path(path).write_text("".join(json.dumps(asdict(t)) + "\n" for t in tasks), encoding="utf-8")
