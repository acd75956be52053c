"""What a request asked, as far as follow-ups go, and which requests continue it.

A follow-up is sent to the slot that holds what it continues without rendering, tokenizing or a
lookup (``KVEngine.follow_up``); the slot table matches requests by what they asked
(``SlotTable.follow_up``, ``SlotTable.await_follow_up``).
"""

from __future__ import annotations

# What a request asked, as far as follow-ups go: a chat's message digests, or a text prompt.
Asked = tuple[int, ...] | str
# How much a follow-up may add to what its slot answered: a chat's last message, a text's end.
FOLLOW_UP_MAX_CHARS = 512


def continues(held: Asked, asked: Asked) -> bool:
    """Whether request ``asked`` differs from the one a slot answered (``held``) only in its end:

    - chats (message digests): the same earlier messages and another (or the same) last one, or
      ``held`` followed by one answer and one new message; at least one earlier message shared
      (how long the new message may be is the caller's check);
    - text prompts: all of ``asked`` but its last ``FOLLOW_UP_MAX_CHARS`` characters starts ``held``.
    """
    if isinstance(held, str) or isinstance(asked, str):
        keep = len(asked) - FOLLOW_UP_MAX_CHARS
        return isinstance(held, str) and isinstance(asked, str) and keep > 0 and held.startswith(asked[:keep])
    if len(asked) == len(held):
        return len(asked) >= 2 and asked[:-1] == held[:-1]
    return extends(held, asked)


def extends(held: Asked, asked: Asked) -> bool:
    """Whether chat ``asked`` is ``held`` followed by one answer and one new message (the next
    turn): it holds all of ``held``, so its own save stores all a save of ``held``'s answer would.
    A text prompt with more at its end may tokenize differently where ``held`` ended: only its
    tokens tell, so it never extends here."""
    return (isinstance(held, tuple) and isinstance(asked, tuple) and bool(held)
            and len(asked) == len(held) + 2 and asked[: len(held)] == held)


def follows(held: Asked, asked: Asked) -> bool:
    """Whether ``asked`` repeats ``held`` (something asked) or ``extends`` it: a request whose own save
    stores all that a save of ``held``'s answer would, so that save may be skipped for it."""
    return bool(held) and (asked == held or extends(held, asked))
