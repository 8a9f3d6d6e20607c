"""Stored responses of the Responses API (`store`, `previous_response_id`, GET and DELETE), kept
in the serving process's memory under a bound: the least recently used go first once there are
more than `max_items` or their JSON passes `max_bytes`. A restart forgets them all, and a router
and an engine each keep their own (a conversation continues where it started). With API keys,
a stored response belongs to the key that made it: another key neither finds nor deletes it."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

MAX_ITEMS = 4096
MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class Stored:
    response: dict  # the response object, as GET returns it
    messages: list  # the conversation as chat messages, its answer included (instructions not)
    size: int
    owner: str = ""  # the API key's name that stored it: only that key finds it again


class ResponseStore:
    def __init__(self, max_items: int = MAX_ITEMS, max_bytes: int = MAX_BYTES):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, messages: list, owner: str = "") -> None:
        size = len(json.dumps(response)) + len(json.dumps(messages))
        old = self._items.pop(response["id"], None)
        if old is not None:
            self.bytes -= old.size
        if size > self.max_bytes:
            return  # larger than the whole store: not kept (a later previous_response_id is a 404)
        self._items[response["id"]] = Stored(response, messages, size, owner)
        self.bytes += size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, rid: str, owner: str = "") -> Optional[Stored]:
        found = self._items.get(rid)
        if found is not None and found.owner != owner:
            return None  # another key's: as if it were not there
        if found is not None:
            self._items.move_to_end(rid)
        return found

    def delete(self, rid: str, owner: str = "") -> bool:
        old = self._items.get(rid)
        if old is None or old.owner != owner:
            return False
        del self._items[rid]
        self.bytes -= old.size
        return True
