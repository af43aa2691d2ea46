"""The tiers a session can be stored in, and the ways it can be restored: the names the CLI,
the server and the library share."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from kvdb.codecs.presets import DEFAULT_NAME as DEFAULT_KV_PRESET  # noqa: F401 (the name the CLI, server and library share)
from kvdb.errors import InvalidArgument


# StrEnum: each member is its name as a str, so comparisons with the names, f-strings and JSON
# see the plain names, as they did when these were bare strings.
class Tier(StrEnum):
    TOKENS = "tokens"
    SEARCH = "search"
    LM = "lm"
    KV = "kv"
    SEMANTIC = "semantic"


class RestoreMode(StrEnum):
    AUTO = "auto"  # resolved before the restore: a restored session names the mode it took
    EXACT = "exact"
    ARCHIVE = "archive"
    DECODE = "decode"


class Window(StrEnum):
    """How an archive restore makes the exact window: ``recompute`` runs one forward pass over
    the sinks and the 32 most recent positions; ``stored`` runs none (the sinks come from this
    machine's cache of them, every other position from tier K)."""

    STORED = "stored"
    RECOMPUTE = "recompute"


# The tiers only a forward pass makes: an ingest that asks for them runs the model at once (the
# user asked for what the model alone can give); the default tiers need the tokenizer alone, and
# queue the model's pass (log-probabilities, an exact cache) for `kvdb upkeep` (decision 0053).
MODEL_TIERS = frozenset({Tier.LM, Tier.KV})
# plain strings: click lists a Choice of enum members by their upper-case names
TIERS = tuple(t.value for t in Tier)
# the semantic tier is embedded by upkeep, not the ingest (decision 0053); tier L runs the model
# over every token (decisions 0005, 0026): opt in with --keep tokens,search,semantic,lm
DEFAULT_KEEP = "tokens,search,semantic"
RESTORE_MODES = tuple(m.value for m in RestoreMode)
WINDOWS = tuple(w.value for w in Window)
# a restore's window unless its preset says otherwise (presets.restore_window, decision 0041)
DEFAULT_WINDOW = Window.RECOMPUTE.value
# the perplexity ratio over an exact cache that ``auto`` tolerates from tier K's measured fidelity (issue 33,
# decision 0039)
DEFAULT_MAX_LOSS = 1.05


def parse_keep(keep: str | Iterable[str]) -> frozenset[Tier]:
    """The tiers of a --keep list. The tokens must survive in one of two forms: their blocks
    (``tokens``) or tier L (``lm``); the search tier is built from, and copies, the tokens."""
    tiers = {t.strip() for t in (keep.split(",") if isinstance(keep, str) else keep) if t.strip()}
    unknown = tiers - set(TIERS)
    if unknown:
        raise InvalidArgument(f"unknown tier(s) {', '.join(sorted(unknown))}; choose from {', '.join(TIERS)}")
    if not tiers & {"tokens", "lm"}:
        raise InvalidArgument(
            "keep `tokens` or `lm` (the tokens coded against the model): without either the session is lost"
        )
    if "search" in tiers and "tokens" not in tiers:
        raise InvalidArgument(
            "the search tier needs the token tier (its index is built from the tokens, and holds a copy of them)"
        )
    if "semantic" in tiers and "tokens" not in tiers:
        raise InvalidArgument(
            "the semantic tier needs the token tier (a hit's snippet, and the words its ranking counts, "
            "are read from the tokens)"
        )
    return frozenset(Tier(t) for t in tiers)


def check_max_loss(max_loss: float) -> float:
    """A tolerated perplexity ratio: an exact cache is 1.0, so a tolerance below it asks for better than exact."""
    if not max_loss >= 1.0:  # NaN too
        raise InvalidArgument(
            "max_loss is a perplexity ratio over the exact cache's, at least 1.0 (1.05: 5% more perplexed); "
            f"got {max_loss}"
        )
    return float(max_loss)
