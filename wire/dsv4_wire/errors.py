"""The OpenAI-shaped error every dsv4 HTTP surface answers with (engines, router, bootstrap)."""

from __future__ import annotations

from typing import Optional

# The code of an engine's 503 while it drains (new generation requests refused): the router takes
# that engine out of rotation at once and sends the request elsewhere, uncounted.
SHUTTING_DOWN = "shutting_down"


class APIError(Exception):
    """An error the client caused or must hear about, rendered as an OpenAI-style body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type_: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type_, param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code if self.code is not None else self.status,
            }
        }
