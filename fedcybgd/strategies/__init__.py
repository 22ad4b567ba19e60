"""Strategies: FedCyBGD, its block schedules, aggregators and round record."""

from fedcybgd.strategies.aggregate import (
    Aggregator,
    AggregatorFactory,
    Upload,
    aggregator_names,
    build_aggregator,
    register_aggregator,
    unregister_aggregator,
    weighted_mean,
)
from fedcybgd.strategies.fedcybgd import FedCyBGD, RoundInFlight
from fedcybgd.strategies.plugins import check_names
from fedcybgd.strategies.record import RoundRecord, run_totals
from fedcybgd.strategies.schedule import (
    BlockSchedule,
    ObservingSchedule,
    Schedule,
    ScheduleFactory,
    build_schedule,
    register_schedule,
    schedule_names,
    unregister_schedule,
)

__all__ = [
    "Aggregator",
    "AggregatorFactory",
    "BlockSchedule",
    "FedCyBGD",
    "ObservingSchedule",
    "RoundInFlight",
    "RoundRecord",
    "Schedule",
    "ScheduleFactory",
    "Upload",
    "aggregator_names",
    "build_aggregator",
    "build_schedule",
    "check_names",
    "register_aggregator",
    "register_schedule",
    "run_totals",
    "schedule_names",
    "unregister_aggregator",
    "unregister_schedule",
    "weighted_mean",
]
