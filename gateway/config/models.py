"""[[models]]: the names clients ask for (aliases, weighted targets, TGI's default model)
and each model's own caps over [limits].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec
from msgspec.structs import replace

from gateway.config.constraints import Positive, PositiveFloat, rule
from gateway.config.limits import LimitsSettings


class ModelTarget(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One model an alias may send to, and its share of the alias's requests."""

    model: Annotated[str, rule("be a non-empty name", min_length=1)]
    weight: PositiveFloat = 1.0


class ModelLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One model's caps where they differ from `[limits]`; an unset key inherits it.

    A small fast model has a smaller context window than the big one next to it, and
    its users a smaller default output: the caps that are the model's own are here;
    the policy (`on_max_tokens_over`, `max_n`) stays the gateway's.
    """

    max_prompt_tokens: Positive | None = None
    default_max_tokens: Positive | None = None
    max_output_tokens: Positive | None = None
    #: The model's context window in tokens; 0: unknown (no check).
    context_window: Annotated[int, rule("be >= 0 (0: unknown)", ge=0)] | None = None

    def over(self, limits: LimitsSettings) -> LimitsSettings:
        """`limits` with the keys set here put in their place."""
        changes = {
            name: value
            for name in self.__struct_fields__
            if (value := getattr(self, name)) is not None
        }
        return replace(limits, **changes) if changes else limits


class ModelSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A name clients may ask for: an alias of one model (`target`) or of several with
    weights (`targets`, a gradual switch), and whether TGI's routes (no `model`) go there.

    An entry with neither target is the settings of a served name itself (its `limits`,
    `default`): asking for it sends the same name on."""

    name: Annotated[str, rule("be a non-empty name", min_length=1)] = ""
    #: The model the backend receives in the body's `model`. Unset: `name` itself.
    target: str | None = None
    #: Several targets, each chosen at random in proportion to its weight.
    targets: list[ModelTarget] | None = None
    #: The model of TGI's native routes (`/generate`, `/info`), which carry no model.
    default: bool = False
    #: Caps for requests asking for this name, over `[limits]` (unset keys inherit it);
    #: an alias without its own takes its target's entry's.
    limits: ModelLimits | None = None

    def weighted_targets(self) -> list[tuple[str, float]]:
        if self.targets:
            return [(t.model, t.weight) for t in self.targets]
        return [(self.target or self.name, 1.0)]


def model_limits(
    models: Sequence[ModelSettings], limits: LimitsSettings
) -> dict[tuple[str, str], LimitsSettings]:
    """The caps of each (name asked, model sent) pair that has caps of its own.

    The entry asked for, over its target's entry (an alias without caps of its own
    takes its model's), over `[limits]`; a pair not in the map has `[limits]`. Built
    once at start-up, so a request pays one dict lookup for its caps.
    """
    entries = {model.name: model for model in models}
    table: dict[tuple[str, str], LimitsSettings] = {}
    for model in models:
        for target, _ in model.weighted_targets():
            of_target = entries.get(target) if target != model.name else None
            layers = [of_target.limits if of_target else None, model.limits]
            if not any(layers):
                continue
            in_force = limits
            for layer in layers:
                in_force = layer.over(in_force) if layer else in_force
            table[(model.name, target)] = in_force
    return table
