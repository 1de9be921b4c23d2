"""The one error type of audio input: a refused value of a named request field.

Owns nothing else. The API layer turns it into a 4xx naming `field`; this package must
never raise a bare ValueError for bad user input, or the field would be lost."""

from __future__ import annotations


class FieldError(ValueError):
    """A request field's value is refused; `field` names it, the message says the fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UnknownVoice(FieldError):
    """The named voice is not in the store (an API layer answers 404)."""

    def __init__(self, name: str) -> None:
        super().__init__("voice", f"no voice named {name!r}; GET /v1/voices lists the stored ones")
        self.name = name


class VoiceExists(FieldError):
    """A voice of that name is stored and the upload did not ask to replace it (409)."""

    def __init__(self, name: str) -> None:
        super().__init__("name", f"a voice named {name!r} exists; delete it first or replace it")
        self.name = name
