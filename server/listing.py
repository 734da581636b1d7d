"""OpenAI's list endpoints: the page object and the ``limit`` / ``order`` query parameters."""
from __future__ import annotations

from tandem.server.errors import bad_request


def page(data: list[dict], more: bool) -> dict:
    """A list page: its items, the first and last ids (``after`` cursors) and whether more follow."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


def query_limit(query, default: int, most: int) -> int:
    try:
        limit = int(query.get("limit", str(default)))
    except ValueError:
        raise bad_request("'limit' must be an integer", param="limit") from None
    if not 1 <= limit <= most:
        raise bad_request(f"'limit' must be in [1, {most}]", param="limit")
    return limit


def newest_first(query) -> bool:
    """``order``: ``desc`` (the default) or ``asc``."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'", param="order")
    return order == "desc"
