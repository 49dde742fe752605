"""A document filter of your own, named in a recipe (examples/user-stage.yaml):

    stages:
      - {path: "examples.user_filter:Capitals", args: {max_share: 0.3}, version: "1", domains: [license]}

A filter has a `name` and `check(text)`, which returns None to keep the document, or a short detail to drop it:
the drop's reason is "<name>:<detail>" and `datapipe stats` counts it under the stage `name`. It is built once
from `args` and sent to Ray's workers, so keep it small and picklable.
"""


class Capitals:
    """Drops a document in which more than `max_share` of the letters are capitals (shouted disclaimers)."""

    name = "capitals"

    def __init__(self, max_share: float = 0.3, min_letters: int = 100) -> None:
        if not 0 < max_share <= 1:
            raise ValueError(f"max_share must be in (0, 1], got {max_share!r}")
        self.max_share = max_share
        self.min_letters = min_letters

    def check(self, text: str) -> str | None:
        letters = [c for c in text if c.isalpha()]
        if len(letters) < self.min_letters:  # too short to judge
            return None
        share = sum(c.isupper() for c in letters) / len(letters)
        return "too_many_capitals" if share > self.max_share else None
