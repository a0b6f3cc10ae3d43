"""Token ids in a request body, checked against the model's vocabulary before an engine sees them.

llama-server answers a /detokenize id past its vocabulary with a 500 (`vector::_M_range_check`),
which counted against the replica: a client could eject replicas from everyone by sending a few.
So every id a body carries is checked here: never negative or past int32 (no engine has such a
token), and below the vocabulary's size where the model's GGUF tells it
(proxy/serving/vocabulary.py). Where it does not, the engine is the only judge, and its 500 is the
client's 400 (`engine_judges`), not the replica's failure (forward.read_answer).
"""
from __future__ import annotations

from typing import Any, Callable

from proxy.errors import BadRequest

# The fields that may hold token ids, per endpoint: /detokenize's list of ids, and OpenAI's prompt
# and input, which may be a list of ids or a list of such lists (llama-server takes strings and ids
# mixed in one list too).
TOKEN_FIELDS = {"/detokenize": "tokens", "/v1/completions": "prompt", "/v1/embeddings": "input"}
# Endpoints whose answer depends on nothing but the body (no generation, no cache, no slot): a 500
# there is the engine failing on what the client sent.
PURE_ENDPOINTS = frozenset({"/tokenize", "/detokenize"})
MAX_TOKEN_ID = (1 << 31) - 1


def check_token_ids(path: str, body: dict[str, Any], vocabulary: Callable[[], int | None]) -> bool:
    """400 `invalid_token_id` naming the first id that is no token of the model; `vocabulary` gives
    the model's vocabulary size (None: unknown), asked only when the body holds ids. Returns
    whether only the engine can judge the body: a pure endpoint, or ids of an unknown vocabulary."""
    field = TOKEN_FIELDS.get(path)
    value = body.get(field) if field is not None else None
    if field is None or not isinstance(value, list) or not _holds_ids(value):
        return path in PURE_ENDPOINTS
    size = vocabulary()
    bad = _first_bad(value, size if size is not None else MAX_TOKEN_ID + 1)
    if bad is not None:
        i, token = bad
        where = f"{field}.{i}"
        raise BadRequest(f"'{where}': {token} is not a token id of this model (its vocabulary has {size} tokens: "
                         f"ids 0 to {size - 1})" if size is not None else
                         f"'{where}': {token} is not a token id (ids are from 0 to {MAX_TOKEN_ID})",
                         code="invalid_token_id", param=where)
    return size is None or path in PURE_ENDPOINTS


# JSON gives int, bool, float, str, list, dict or None: `type(x) is int` is an id, never a bool.
def _holds_ids(value: list[Any]) -> bool:
    return any(type(item) is int or (type(item) is list and any(type(t) is int for t in item)) for item in value)


def _first_bad(value: list[Any], limit: int) -> tuple[str, int] | None:
    """The place (`3`, or `1.4` in a list of lists: OpenAI's batch of token lists) and value of the
    first id outside 0..limit-1."""
    for i, item in enumerate(value):
        if type(item) is int:
            if not 0 <= item < limit:
                return str(i), item
        elif type(item) is list:
            for j, inner in enumerate(item):
                if type(inner) is int and not 0 <= inner < limit:
                    return f"{i}.{j}", inner
    return None
