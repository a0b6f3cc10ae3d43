"""What of a secret may be shown: URLs lose their userinfo, and no run of 8 characters of a key
survives in a provider's message, wherever and however often it appears."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.masking import MASK, MIN_PART, masked, shown_url

KEY = "sk-proj-9f3a71c2d4e5b6a7"


@pytest.mark.parametrize("url, shown", [
    ("http://user:pass@host/v1", "http://host/v1"),
    ("https://user:p%40ss@api.example.com:8443/v1?x=1#f", "https://api.example.com:8443/v1?x=1#f"),
    ("http://only-user@127.0.0.1:9/v1", "http://127.0.0.1:9/v1"),
    ("http://a@b:c@[::1]:8080", "http://[::1]:8080"),       # the last @ ends the userinfo, as urllib reads it
    ("http://host/v1/models/a@b", "http://host/v1/models/a@b"),   # an @ after the authority is the path's
    ("http://host?to=a@b", "http://host?to=a@b"),
    ("http://host:8080/v1", "http://host:8080/v1"),
    ("unix:///run/supervisor.sock", "unix:///run/supervisor.sock"),
    ("not a url", "not a url"),
])
def test_shown_urls_keep_everything_but_the_userinfo(url: str, shown: str) -> None:
    assert shown_url(url) == shown


def test_a_prefix_a_middle_and_the_whole_key_are_masked() -> None:
    text = f"key {KEY[:10]}... ({KEY[9:18]}) is not {KEY}, nor {KEY.upper()}"
    assert masked(text, [KEY]) == f"key {MASK}... ({MASK}) is not {MASK}, nor {KEY.upper()}"


def test_runs_shorter_than_min_part_stay() -> None:
    text = f"{KEY[:MIN_PART - 1]} and {KEY[-(MIN_PART - 1):]}"
    assert masked(text, [KEY]) == text


def test_overlapping_and_touching_runs_become_one_mask() -> None:
    assert masked(KEY[:12] + KEY[4:20] + "!", [KEY]) == MASK + "!"
    assert masked(f"{KEY}{KEY}", [KEY]) == MASK


def test_short_secrets_are_masked_only_whole_and_empty_ones_not_at_all() -> None:
    assert masked("user bob, bobby, bo", ["bob"]) == f"user {MASK}, {MASK}by, bo"
    assert masked("anything", ["", ""]) == "anything"
    assert masked("", [KEY]) == ""


def test_every_secret_is_masked() -> None:
    password = "pw-SECRET-51b7e0c3"
    assert masked(f"{KEY[2:11]} / {password[3:]}", [KEY, password]) == f"{MASK} / {MASK}"


# Small alphabets, MASK's own character among them: keys and messages that overlap in every way,
# masks that could join the text beside them into a run of the key.
SECRETS = st.text(alphabet="ab*-", min_size=MIN_PART, max_size=24)
FILLER = st.text(alphabet="ab*- x", max_size=12)


@given(SECRETS, st.lists(st.tuples(FILLER, st.integers(0, 23), st.integers(MIN_PART, 24)), max_size=6))
def test_no_run_of_the_key_survives(key: str, parts: list[tuple[str, int, int]]) -> None:
    # A message of filler and runs of the key, each at least MIN_PART long where the key allows.
    text = "".join(filler + key[start % len(key):][:length] for filler, start, length in parts)
    out = masked(text, [key])
    assert not any(key[i:i + MIN_PART] in out for i in range(len(key) - MIN_PART + 1)), (key, text, out)


@given(SECRETS, FILLER)
def test_text_without_a_run_of_the_key_is_left_as_it_is(key: str, text: str) -> None:
    if not any(key[i:i + MIN_PART] in text for i in range(len(key) - MIN_PART + 1)):
        assert masked(text, [key]) == text
