"""Which contiguous layers each pipeline stage owns."""

from __future__ import annotations

from ppserve.engine.model.model_config import ConfigError


def partition_layers(num_layers: int, pp_size: int, spec: str | None = None) -> tuple[range, ...]:
    """Layer ranges per stage: an even split with the remainder on the later stages, or `spec`
    ("3,3,4"), which must name one positive count per stage summing to `num_layers`.

    Later stages get the extra layers because the last stage also runs the norm, lm_head and sampling
    only for the sampled tokens, while stage 0's embedding is nearly free; in practice the remainder
    placement matters little and this keeps the rule simple to state.
    """
    if pp_size < 1:
        raise ConfigError(f"pp_size must be >= 1, got {pp_size}")
    if pp_size > num_layers:
        raise ConfigError(f"pp_size {pp_size} is larger than the model's {num_layers} layers")
    if spec is None or spec.strip() == "":
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (1 if i >= pp_size - extra else 0) for i in range(pp_size)]
    else:
        counts = _parse_counts(spec)
        if len(counts) != pp_size:
            raise ConfigError(f"layer partition {spec!r} has {len(counts)} stages but pp_size is {pp_size}")
        if any(c <= 0 for c in counts):
            raise ConfigError(f"layer partition {spec!r}: every stage needs at least one layer")
        if sum(counts) != num_layers:
            raise ConfigError(f"layer partition {spec!r} sums to {sum(counts)} but the model has {num_layers} layers")
    ranges: list[range] = []
    start = 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return tuple(ranges)


def _parse_counts(spec: str) -> list[int]:
    try:
        return [int(part) for part in spec.split(",")]
    except ValueError:
        raise ConfigError(
            f"malformed layer partition {spec!r}: expected comma-separated integers such as '3,3,4'"
        ) from None
