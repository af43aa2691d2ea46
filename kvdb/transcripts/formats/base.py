"""What a format module gives the reader of files, and nothing more: a name, what it reads,
an example, and how it tells its content apart. The reader (``kvdb.transcripts.files``) owns
the bytes, the size limit, the line numbers and skipping; a format sees decoded JSON values.

A format reads session objects (``claims`` and ``read``: a whole ``.json``, each element of a
top-level list, or each line of a JSONL file of sessions), logs (``opens_log`` and ``log``: a
JSONL file's records, or a top-level list's elements, that build sessions together), or both.
"""

from __future__ import annotations

from typing import ClassVar

from kvdb.transcripts.messages import Invalid, kind
from kvdb.transcripts.sessions import Transcript


class Log:
    """Records of one format added in file order; ``sessions`` builds them once all are read.

    ``add`` raises ``Invalid`` for a record it cannot take (the reader skips it or fails the
    file, and the record must leave no trace); ``sessions`` returns at least one session, or
    raises ``EmptyTranscript`` (nothing to archive) or ``Invalid`` (nothing it could read).
    ``label`` names the records in errors about an element of a JSON list (``records[3]: ...``).
    """

    label = "records"

    def add(self, record, line: int) -> None:
        raise NotImplementedError

    def sessions(self) -> list[Transcript]:
        raise NotImplementedError


class Format:
    """One shape of export, as one tool writes it.

    ``name`` is what ``kvdb formats`` lists and a session's ``metadata["format"]`` starts as;
    ``reads`` says which tool's files, in a line; ``example`` is a small file of the shape,
    verbatim, with ``suffix``; ``marks`` are the keys typical of its objects: an object no
    format reads is told which format's marks it shares most, and which of them it lacks.
    """

    name: ClassVar[str]
    reads: ClassVar[str]
    example: ClassVar[str]
    suffix: ClassVar[str] = ".json"
    marks: ClassVar[tuple[str, ...]] = ()

    def claims(self, obj) -> bool:
        """Whether a JSON value is a session object (or an object of sessions) of this format."""
        return False

    def read(self, obj: dict, name: str, source: str) -> list[Transcript]:
        """The sessions of an object ``claims`` took; ``name`` when it names none itself."""
        raise Invalid(f"the {self.name} format reads no session objects, got {kind(obj)}")

    def opens_log(self, record) -> bool:
        """Whether a record is the first of a log of this format (the first record that decides)."""
        return False

    def log(self, stem: str, shown: str) -> Log:
        raise NotImplementedError

    def to_dict(self) -> dict:
        return {"name": self.name, "reads": self.reads, "suffix": self.suffix, "example": self.example}
