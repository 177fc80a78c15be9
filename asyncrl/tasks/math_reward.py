"""A verifiable math-answer reward (GSM8K and friends): extract the final answer, normalise, compare.

Extraction (`reward.extract`):
- `hash`: the text after the last `####` (GSM8K's reference format; verl's "strict" mode);
- `boxed`: the content of the last `\\boxed{...}` / `\\fbox{...}` (balanced braces);
- `last_number`: the last number in the text (verl's "flexible" mode);
- `auto`: `hash`, then `boxed`, then "the answer is X", then the last number.

Normalisation strips what does not change the value: thousands separators, `$`, `%`, units and
other trailing words, `\\text{}`, trailing `.` and `.0`. Two answers that both parse as numbers
(integers, decimals, `a/b`, `\\frac{a}{b}`) are compared exactly as fractions; anything else is
compared as a normalised string and, when `math-verify` is installed, by its symbolic checker.

Score (verl's convention): 1.0 when correct; `reward.format_bonus` when an answer was found in the
required format but is wrong; 0.0 otherwise.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction

log = logging.getLogger(__name__)

EXTRACT_MODES = ("auto", "hash", "boxed", "last_number")

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:|=)\s*(.+)", re.IGNORECASE)
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def _last_braced(text: str, command: str) -> str | None:
    """The content of the last `\\command{...}`, with nested braces balanced."""
    start = text.rfind("\\" + command)
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: the completion was cut off inside the box


def extract_hash(text: str) -> str | None:
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    line = tail.splitlines()[0].strip() if tail else ""
    return line or None


def extract_boxed(text: str) -> str | None:
    for command in ("boxed", "fbox"):
        if (inner := _last_braced(text, command)) is not None:
            return inner.strip()
    return None


def extract_last_number(text: str) -> str | None:
    matches = _NUMBER.findall(text)
    return matches[-1].strip() if matches else None


def extract_answer(text: str, mode: str = "auto") -> str | None:
    """The final answer as written in `text` (not yet normalised), or None when there is none."""
    if mode == "hash":
        return extract_hash(text)
    if mode == "boxed":
        return extract_boxed(text)
    if mode == "last_number":
        return extract_last_number(text)
    if mode != "auto":
        raise ValueError(f"reward.extract={mode!r} is not one of {list(EXTRACT_MODES)}")
    for fn in (extract_hash, extract_boxed):
        if (found := fn(text)) is not None:
            return found
    if matches := _ANSWER_IS.findall(text):
        # The first number after the last "the answer is", not whatever checking follows it.
        if numbers := _NUMBER.findall(matches[-1].split("\n")[0]):
            return numbers[0].strip()
    return extract_last_number(text)


def normalize_answer(answer: str) -> str:
    """A canonical string for an answer: `$1,234.50` -> `1234.5`, `18 dollars` -> `18`, `50%` -> `50`."""
    s = answer.strip()
    s = _TEXT.sub(r"\1", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "").replace("\\!", "")
    s = s.replace("\\left", "").replace("\\right", "").strip()
    s = s.lstrip("=").strip().rstrip(".").strip()
    s = _FRAC.sub(r"\1/\2", s)
    # A number followed by units or words ("18 dollars", "5 cm.", "3 apples per box"): keep the number.
    m = re.match(r"^(-?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+)(?:\s*[a-zA-Z].*)?$", s)
    if m:
        s = m.group(1)
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s).replace(" ", "")
    value = parse_number(s)
    if value is not None:
        return format_number(value)
    return s


def parse_number(s: str) -> Fraction | None:
    """An exact value for `12`, `-3.50`, `1/4`, `1,000`; None when `s` is not a plain number."""
    s = s.replace(",", "").replace(" ", "")
    if not s:
        return None
    try:
        if s.count("/") == 1:
            num, den = s.split("/")
            return Fraction(num) / Fraction(den) if Fraction(den) != 0 else None
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    # Finite decimals print as decimals (0.5, 2.25); others as a fraction (1/3).
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den == 1:
        text = f"{float(value):.12f}".rstrip("0").rstrip(".")
        return text
    return f"{value.numerator}/{value.denominator}"


def _math_verify(gold: str, pred: str) -> bool | None:
    """math-verify's symbolic comparison, or None when it is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    try:
        return bool(verify(parse(f"${gold}$"), parse(f"${pred}$")))
    except Exception as e:  # its parser raises many types on odd input; that answer is simply not equal
        log.debug("math-verify failed on %r vs %r: %r", gold, pred, e)
        return False


def answers_match(pred: str, gold: str, use_math_verify: bool = True) -> bool:
    a, b = normalize_answer(pred), normalize_answer(gold)
    if a == b:
        return True
    va, vb = parse_number(a), parse_number(b)
    if va is not None and vb is not None:
        return va == vb
    if use_math_verify:
        return bool(_math_verify(gold, pred))
    return False


class MathReward:
    """`reward(completion, answer) -> float`, configured from `reward.*`; `correct()` for evaluation."""

    def __init__(self, extract: str = "auto", format_bonus: float = 0.0, use_math_verify: bool = True):
        if extract not in EXTRACT_MODES:
            raise ValueError(f"reward.extract={extract!r} is not one of {list(EXTRACT_MODES)}")
        self.extract = extract
        self.format_bonus = format_bonus
        self.use_math_verify = use_math_verify

    def correct(self, completion: str, answer: str) -> bool:
        found = extract_answer(completion, self.extract)
        return found is not None and answers_match(found, answer, self.use_math_verify)

    def __call__(self, completion: str, answer: str) -> float:
        found = extract_answer(completion, self.extract)
        if found is None:
            return 0.0
        if answers_match(found, answer, self.use_math_verify):
            return 1.0
        return self.format_bonus


def gsm8k_reward(completion: str, answer: str) -> float:
    """The default-configured math reward (auto extraction, no format bonus)."""
    return _DEFAULT(completion, answer)


_DEFAULT = MathReward()
