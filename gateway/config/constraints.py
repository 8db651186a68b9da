"""What a setting's value must be: constrained field types with the words their errors use,
and the one error a bad setting raises.

A field declares its rule next to it (`Annotated[int, rule("be > 0", gt=0)]`): msgspec
checks it, and `messages` quotes the words (`[x].y: must be > 0`).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

from msgspec import Meta


class ConfigError(ValueError):
    """Invalid settings: one line per problem, each naming the key and what is wrong.

    `problems` holds the lines (a config with three typos says all three at once, so a
    newcomer does not fix them one start-up at a time); the message is them joined.
    """

    def __init__(self, *problems: str) -> None:
        self.problems: tuple[str, ...] = problems
        super().__init__("\n".join(problems))


def rule(must: str, **constraint: Any) -> Meta:
    """A msgspec constraint with the words an error uses for it: `[x].y: must <must>`."""
    return Meta(**constraint, extra={"must": must})


# NaN fails every bound and `le=` the largest float refuses inf: a bounded float is finite.
Positive = Annotated[int, rule("be > 0", gt=0)]
NonNegative = Annotated[int, rule("be >= 0", ge=0)]
PositiveFloat = Annotated[float, rule("be finite and > 0", gt=0, le=sys.float_info.max)]
NonEmpty = Annotated[str, rule("not be empty", min_length=1)]
